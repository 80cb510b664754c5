"""A user's training stream: an `IterableDataset` that shards itself over the ranks, draws random
augmentation in `__iter__` (torch's global generator) and, in its stateful form, implements
`state_dict` / `load_state_dict` (its position in this rank's shard), as torchdata expects."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Stream(IterableDataset):
    """`samples` fixed points, each rank iterating its own shard in a fixed order, with fresh noise each time."""

    def __init__(self, samples: int, sized: bool) -> None:
        generator = torch.Generator().manual_seed(0)
        self.inputs = torch.randn(samples, 4, generator=generator)
        self.targets = (self.inputs.sum(dim=1) > 0).long()
        self.sized = sized
        self.position = 0  # samples of this rank's shard yielded in the current pass

    def _shard(self) -> list[int]:
        rank, world = _rank_and_world()
        return list(range(rank, len(self.inputs), world))

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("a stream without length")
        return len(self._shard())

    def __iter__(self):  # noqa: ANN204
        shard = self._shard()
        if self.position >= len(shard):  # the previous pass ended: a new one (Lightning may not exhaust a sized loader)
            self.position = 0
        while self.position < len(shard):
            index = shard[self.position]
            self.position += 1
            yield self.inputs[index] + 0.1 * torch.randn(4), self.targets[index]


class StatefulStream(Stream):
    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


class StreamData(L.LightningDataModule):
    def __init__(self, stateful: bool = True, sized: bool = True, batch_size: int = 4, num_workers: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        kind = StatefulStream if self.hparams.stateful else Stream
        self.train_set = kind(96, self.hparams.sized)
        generator = torch.Generator().manual_seed(1)
        inputs = torch.randn(32, 4, generator=generator)
        self.val_set = TensorDataset(inputs, (inputs.sum(dim=1) > 0).long())

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, num_workers=self.hparams.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=8)


class StreamNet(L.LightningModule):
    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.body = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = nn.functional.cross_entropy(self.body(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", nn.functional.cross_entropy(self.body(batch[0]), batch[1]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
