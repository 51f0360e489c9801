"""megarl.reward"""
