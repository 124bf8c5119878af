"""The server's Prometheus series (/metrics) and the periodic stats line."""
