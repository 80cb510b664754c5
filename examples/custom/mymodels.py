"""Your own model and data, trained by `ddp-app` as they are: copy this directory and edit it.

    cd examples/custom && ddp-app fit --config config.yaml      # or, from the repository root:
    ddp-app fit --config examples/custom/config.yaml

`MyNet` is a plain LightningModule (its layers are its own attributes) and `BlobsDataModule` a plain
LightningDataModule (seeded synthetic data, nothing to download). Neither knows about DDP:
`ddp-app` shards their DataLoaders over the ranks itself, without padding the evaluation sets, and
makes mid-epoch resume exact. What user code must do for exact metrics: log torchmetrics objects
(as below) or sums, not a per-rank mean with `sync_dist=True`.
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy


class MyNet(L.LightningModule):
    """A two-layer classifier; `forward` takes one tensor of shape (batch, in_features)."""

    def __init__(
        self, in_features: int = 16, hidden: int = 64, num_classes: int = 4, dropout: float = 0.1, lr: float = 0.01
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.hidden = nn.Linear(in_features, hidden)
        self.dropout = nn.Dropout(dropout)
        self.output = nn.Linear(hidden, num_classes)
        self.lr = lr
        # torchmetrics keep sums (correct, seen; weighted loss) that are added up across ranks: exact.
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.val_loss = MeanMetric()
        self.test_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.output(self.dropout(torch.relu(self.hidden(inputs))))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = nn.functional.cross_entropy(self(inputs), targets)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        inputs, targets = batch
        logits = self(inputs)
        self.val_acc.update(logits, targets)
        self.val_loss.update(nn.functional.cross_entropy(logits, targets), weight=targets.shape[0])
        self.log("val_acc", self.val_acc, prog_bar=True)
        self.log("val_loss", self.val_loss)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        inputs, targets = batch
        self.test_acc.update(self(inputs), targets)
        self.log("test_acc", self.test_acc)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, _ = batch
        return self(inputs).argmax(dim=1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class BlobsDataModule(L.LightningDataModule):
    """Gaussian blobs, one per class, drawn from a seeded generator: the same data on every rank and run.

    Every loader yields (inputs, targets) tuples of tensors. 203 validation samples do not divide
    by 2 or 3 ranks, so padding them would change the metrics.
    """

    def __init__(
        self,
        batch_size: int = 32,
        train_size: int = 1024,
        val_size: int = 203,
        test_size: int = 203,
        in_features: int = 16,
        num_classes: int = 4,
        noise: float = 2.5,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.sizes = (train_size, val_size, test_size)
        self.in_features = in_features
        self.num_classes = num_classes
        self.noise = noise
        self.seed = seed

    def setup(self, stage: str | None = None) -> None:
        generator = torch.Generator().manual_seed(self.seed)
        centres = torch.randn(self.num_classes, self.in_features, generator=generator)
        splits = []
        for size in self.sizes:
            targets = torch.randint(self.num_classes, (size,), generator=generator)
            inputs = centres[targets] + self.noise * torch.randn(size, self.in_features, generator=generator)
            splits.append(TensorDataset(inputs, targets))
        self.train_set, self.val_set, self.test_set = splits

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.batch_size)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.batch_size)
