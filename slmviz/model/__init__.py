"""The decoder in plain PyTorch: one silent convention per named function, one concern per file."""
