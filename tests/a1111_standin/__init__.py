"""Stand-in AUTOMATIC1111 webui for the tests (see README.md)."""
