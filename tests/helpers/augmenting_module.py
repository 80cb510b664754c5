"""A user's plain DataModule whose Dataset draws random augmentation in `__getitem__` (as torchvision
transforms do, from torch's global generator), a model with dropout, and a private-generator variant
that no seeding can reach (`ddp-app resume-check` must name it)."""

from __future__ import annotations

import lightning as L
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

PRIVATE_GENERATOR = np.random.default_rng()  # unseeded, created at import: outside every seeded path


class NoisyBlobs(Dataset):
    def __init__(self, samples: int, private: bool = False) -> None:
        generator = torch.Generator().manual_seed(0)
        self.inputs = torch.randn(samples, 8, generator=generator)
        self.targets = (self.inputs.sum(dim=1) > 0).long()
        self.private = private

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.private:
            noise = torch.from_numpy(PRIVATE_GENERATOR.normal(0.0, 0.1, 8).astype(np.float32))
        else:
            noise = 0.1 * torch.randn(8)  # the global generator, as torchvision's random transforms
        return self.inputs[index] + noise, self.targets[index]


class NoisyData(L.LightningDataModule):
    def __init__(self, batch_size: int = 8, num_workers: int = 0, persistent_workers: bool = False,
                 private: bool = False, two_val_loaders: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        self.train_set = NoisyBlobs(160, self.hparams.private)
        self.val_set = NoisyBlobs(40)

    def train_dataloader(self) -> DataLoader:
        workers = self.hparams.num_workers
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True, num_workers=workers,
                          persistent_workers=self.hparams.persistent_workers and workers > 0)  # fmt: skip

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        loader = DataLoader(self.val_set, batch_size=self.hparams.batch_size)
        return [loader, DataLoader(self.val_set, batch_size=4)] if self.hparams.two_val_loaders else loader


class DropoutNet(L.LightningModule):
    def __init__(self, lr: float = 0.05, step_scheduler: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 2))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = nn.functional.cross_entropy(self.body(inputs), targets)
        self.log("train_loss", loss)
        return loss

    def validation_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        inputs, targets = batch
        self.log("val_loss", nn.functional.cross_entropy(self.body(inputs), targets, reduction="sum"), reduce_fx="sum")

    def configure_optimizers(self):  # noqa: ANN201
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        if not self.hparams.step_scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
