"""A user's callback whose state makes every checkpoint large, so that its background write spans
several training steps: the moment "while a checkpoint is written in the background" exists for real.

`act` makes it also stop its rank at that moment, seen from the outside as it would be: last.ckpt is
on disk and the temporary file of the next write is in its directory (app/checkpoints/io.py
`atomic_write`). Before acting it writes `acted-at-step-<N>` into `trainer.default_root_dir`.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import lightning as L
import torch

ACTIONS = {"none": None, "kill": signal.SIGKILL, "sigusr1": signal.SIGUSR1, "sigterm": signal.SIGTERM}


class ReplayBuffer(L.Callback):
    """Args: megabytes: the state's size; act: what to do to rank `rank` (ACTIONS) while a write of
    last.ckpt is in flight and an earlier last.ckpt exists."""

    def __init__(self, megabytes: int = 100, act: str = "none", rank: int = 0) -> None:
        self.buffer = torch.arange(megabytes * 2**20 // 8, dtype=torch.float64)  # not all zeros: a real write
        self.act, self.rank, self._done = act, rank, False

    def state_dict(self) -> dict[str, Any]:
        return {"buffer": self.buffer}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.buffer = state_dict["buffer"]

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, index: int) -> None:
        if ACTIONS[self.act] is None or self._done or trainer.global_rank != self.rank:
            return
        directory = Path(trainer.default_root_dir) / "checkpoints"
        if (directory / "last.ckpt").exists() and any(directory.glob(".last.ckpt.*.tmp")):
            self._done = True
            (Path(trainer.default_root_dir) / f"acted-at-step-{trainer.global_step}").touch()
            os.kill(os.getpid(), ACTIONS[self.act])
