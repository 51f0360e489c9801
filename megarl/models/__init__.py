"""Model assets megarl can build without a model hub (tiny configs, tokenizers, random weights)."""
