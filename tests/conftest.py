"""Shared fixtures: leave no distributed state or launcher variables behind."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch.distributed

from app.cluster.launch import LAUNCHER_VARIABLES


@pytest.fixture(autouse=True)
def restore_distributed_state() -> Iterator[None]:
    """Restore launcher variables (Lightning sets some in-process) and destroy a leftover process group."""
    saved = {key: os.environ.get(key) for key in (*LAUNCHER_VARIABLES, "OMP_NUM_THREADS")}
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
