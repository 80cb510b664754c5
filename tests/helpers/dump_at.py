"""A callback that writes the dict a replica group would send a healing peer (`dump_checkpoint`) at
the end of a given step, as app/parallel/ft_manager.py takes it: after ExactResume's batch-end count."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch


class DumpAt(L.Callback):
    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            torch.save(trainer._checkpoint_connector.dump_checkpoint(weights_only=False), self.path)
