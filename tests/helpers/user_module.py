"""A user's own model and data, written against plain Lightning: no `net` attribute, none of our classes.

The guarantees (export, logs) are tested on these too, not only on the project's own modules.
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TwoLayerRegressor(L.LightningModule):
    """Layers as direct attributes, so its state_dict keys are `hidden.*` and `output.*`.

    The dropout makes a forward pass in training mode random: an export must be in eval mode.
    """

    def __init__(self, in_features: int = 6, hidden: int = 16, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.hidden = nn.Linear(in_features, hidden)
        self.dropout = nn.Dropout(0.2)
        self.output = nn.Linear(hidden, 1)
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.dropout(torch.tanh(self.hidden(x))))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = nn.functional.mse_loss(self(inputs), targets)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class SeededRegressionData(L.LightningDataModule):
    """A fixed random linear regression problem; the same tensors in every process."""

    def __init__(self, in_features: int = 6, samples: int = 64, batch_size: int = 8, seed: int = 0) -> None:
        super().__init__()
        self.in_features = in_features
        self.samples = samples
        self.batch_size = batch_size
        self.seed = seed

    def setup(self, stage: str) -> None:
        generator = torch.Generator().manual_seed(self.seed)
        inputs = torch.randn(self.samples, self.in_features, generator=generator)
        targets = inputs.sum(dim=1, keepdim=True)
        self.dataset = TensorDataset(inputs, targets)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True)
