"""warmstart.operator"""
