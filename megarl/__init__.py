"""megarl: Megatron-native RL post-training for large MoE language models."""

__version__ = "0.1.0"
