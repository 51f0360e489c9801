"""megarl.bridge"""
