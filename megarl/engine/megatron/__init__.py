"""megarl.engine.megatron"""
