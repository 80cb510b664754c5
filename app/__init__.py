"""Data-parallel training with PyTorch Lightning DDP, from a laptop to a SLURM cluster."""
