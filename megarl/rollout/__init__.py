"""megarl.rollout"""
