"""Data-parallel training with PyTorch Lightning DDP, from a laptop to a SLURM cluster."""

import os

# One intra-op thread per rank unless the user chose (app/cluster/threads.py says why). Set here, before anything
# imports torch: OpenMP reads the variable once, when torch loads it, and threads that PyTorch does not start itself
# (gloo's workers, which run PowerSGD's matrix products) keep that first value whatever `torch.set_num_threads` says
# later; two values mean two sums.
os.environ.setdefault("OMP_NUM_THREADS", "1")
