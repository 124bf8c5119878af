"""The OpenAI-compatible HTTP server: schemas (protocol), serving logic (serving),
Prometheus metrics (metrics) and the FastAPI app (app)."""
