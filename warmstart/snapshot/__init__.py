"""warmstart.snapshot"""
