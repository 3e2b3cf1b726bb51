"""Stand-in for the webui's ``modules`` package (tests only)."""
