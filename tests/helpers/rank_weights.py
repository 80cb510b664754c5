"""A test-only callback: every rank saves its own weights at the end of fit, to compare the ranks."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch


class SaveRankWeights(L.Callback):
    """Writes `<dirpath>/rank<global rank>.pt` (the LightningModule's state_dict) on every rank."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = Path(dirpath)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.dirpath.mkdir(parents=True, exist_ok=True)
        torch.save(pl_module.state_dict(), self.dirpath / f"rank{trainer.global_rank}.pt")
