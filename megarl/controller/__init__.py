"""megarl.controller"""
