"""The plain-PyTorch DDP reference trainer (no Lightning Trainer), following the PyTorch DDP tutorials."""
