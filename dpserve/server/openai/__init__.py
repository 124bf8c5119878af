"""The OpenAI API: /v1/completions, /v1/chat/completions, /v1/models, their schemas and serving."""
