"""/v1/files and /v1/batches: the stored files, the batches, their runner and their state."""
