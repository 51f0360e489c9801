"""megarl.algo"""
