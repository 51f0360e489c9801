"""megarl.config"""
