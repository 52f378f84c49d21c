"""The server's options: one table from command-line flag and ``VLM_*`` variable to field."""
