"""megarl.engine"""
