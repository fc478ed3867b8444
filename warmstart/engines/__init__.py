"""warmstart.engines"""
