"""A checkpoint found, converted and trusted, without torch model code (below config)."""
