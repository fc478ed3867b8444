"""warmstart.worker"""
