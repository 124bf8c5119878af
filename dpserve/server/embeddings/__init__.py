"""The embeddings API: /v1/embeddings, pooled final hidden states."""
