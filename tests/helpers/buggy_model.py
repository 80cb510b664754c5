"""A user's plain LightningModule with a bug in its training step, for the error-reporting tests."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn


class BuggyModule(L.LightningModule):
    def __init__(self, in_features: int = 64, num_classes: int = 10) -> None:
        super().__init__()
        self.layer = nn.Linear(in_features, num_classes)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return compute_my_loss(self.layer, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def compute_my_loss(layer: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    raise ValueError("bug in my model")
