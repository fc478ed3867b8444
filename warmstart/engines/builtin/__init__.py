"""warmstart.engines.builtin"""
