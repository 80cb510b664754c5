"""CPU threads per rank."""

from __future__ import annotations

import os

import torch


def configure_cpu_threads() -> int:
    """One intra-op thread per rank unless the user set OMP_NUM_THREADS; returns the count.

    N ranks of N threads on N cores oversubscribe the machine. The exported variable reaches Lightning's child ranks
    too; the reference trainer calls this as well, so both compute identical sums."""
    threads = int(os.environ.setdefault("OMP_NUM_THREADS", "1"))
    torch.set_num_threads(threads)
    return threads
