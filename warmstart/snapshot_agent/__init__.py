"""warmstart.snapshot_agent"""
