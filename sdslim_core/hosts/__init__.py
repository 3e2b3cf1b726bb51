"""Host glue: the logic of each host integration, kept importable without the host."""
