"""User code we did not write, as users write it: the example's classes plus one common mistake."""

from __future__ import annotations

import sys

import torch
from torch import nn

from tests.helpers.run import REPO

# The example's own module, imported as `ddp-app` imports it for a run from examples/custom/.
sys.path.append(str(REPO / "examples" / "custom"))
from mymodels import BlobsDataModule, MyNet  # noqa: E402

__all__ = ["BlobsDataModule", "MyNet", "PerRankMeanNet"]


class PerRankMeanNet(MyNet):
    """Also logs its validation loss as a per-rank mean with sync_dist=True: not exact across ranks."""

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        inputs, targets = batch
        self.log("val_loss_mean", nn.functional.cross_entropy(self(inputs), targets), sync_dist=True)
