"""What Megatron needs to run on CPU and only there: the compatibility patches activated when CUDA
is absent (compat), collectives through shared memory for ranks on one host (collectives) and a
TransformerEngine-free core attention with context parallelism (attention)."""
