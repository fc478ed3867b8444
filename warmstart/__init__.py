"""warmstart: start GPU inference workers in seconds by restoring them from checkpoints."""

__version__ = "0.1.0"
