"""A user's plain DataModule gets our samplers; loaders with their own sharding are left alone.

Also the guard for the route `app/data/rank_loaders.py` takes: if Lightning stopped fetching loaders
through the instance's `*_dataloader` attribute, the samplers it iterates here would not be ours.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, SubsetRandomSampler, TensorDataset

from app.data.base import ResumableDataLoader
from app.data.rank_loaders import WRAPPED, reshard, shard_all_loaders
from app.data.samplers import ResumableDistributedSampler, UnpaddedDistributedSampler
from app.models.sync_check import warn_on_per_rank_means
from tests.helpers.user_modules import BlobsDataModule, MyNet


def small_trainer(**kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, **kwargs,
    )  # fmt: skip


class RecordLoaders(L.Callback):
    """The loaders Lightning actually iterates, as it exposes them during the run."""

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.val_loader = trainer.val_dataloaders


def test_lightning_iterates_our_samplers_for_a_plain_datamodule() -> None:
    data, model, recorder = BlobsDataModule(val_size=203), MyNet(), RecordLoaders()
    trainer = small_trainer(max_steps=3, limit_val_batches=0)
    shard_all_loaders(trainer, data, model)
    trainer.fit(model, data)
    train_loader = trainer.train_dataloader
    assert type(train_loader) is ResumableDataLoader
    assert type(train_loader.sampler) is ResumableDistributedSampler and train_loader.sampler.shuffle
    trainer = small_trainer(callbacks=[recorder])
    shard_all_loaders(trainer, data, model)  # a second run on the same objects: wrapped once, for this run
    assert getattr(data.val_dataloader, WRAPPED)["trainer"] is trainer
    assert getattr(data.val_dataloader.__wrapped__, WRAPPED, None) is None
    trainer.validate(model, data, verbose=False)
    assert type(recorder.val_loader.sampler) is UnpaddedDistributedSampler
    assert sum(len(batch[1]) for batch in recorder.val_loader) == 203


def test_the_rebuilt_loader_keeps_the_users_settings() -> None:
    dataset = TensorDataset(torch.arange(10.0))

    def collate(batch: list) -> str:
        return "mine"

    loader = DataLoader(dataset, batch_size=3, shuffle=True, drop_last=True, collate_fn=collate)
    trainer = SimpleNamespace(world_size=2, global_rank=1)
    rebuilt = reshard(loader, trainer, training=True)
    assert (rebuilt.batch_size, rebuilt.drop_last, rebuilt.collate_fn) == (3, True, collate)
    assert (rebuilt.sampler.num_replicas, rebuilt.sampler.rank) == (2, 1)
    evaluation = reshard(DataLoader(dataset, batch_size=4), trainer, training=False)
    assert list(evaluation.sampler) == [1, 3, 5, 7, 9]


@pytest.mark.parametrize(
    "loader",
    [
        DataLoader(TensorDataset(torch.arange(10.0)), sampler=SubsetRandomSampler([0, 1, 2])),
        DataLoader(TensorDataset(torch.arange(10.0)), sampler=DistributedSampler(range(10), num_replicas=2, rank=0)),
        DataLoader(TensorDataset(torch.arange(10.0)), batch_size=None),
    ],
    ids=["own-sampler", "own-distributed-sampler", "no-batching"],
)
def test_loaders_with_their_own_sampling_are_left_alone(loader: DataLoader) -> None:
    trainer = SimpleNamespace(world_size=2, global_rank=0)
    assert reshard(loader, trainer, training=False) is loader
    assert reshard([loader], trainer, training=True)[0] is loader


def test_a_per_rank_mean_logged_during_evaluation_is_reported_once(capsys: pytest.CaptureFixture[str]) -> None:
    model = MyNet()
    trainer = SimpleNamespace(training=False, world_size=2, is_global_zero=True)
    warn_on_per_rank_means(trainer, model)
    warn_on_per_rank_means(trainer, model)  # wrapping twice still warns once
    with warnings.catch_warnings():  # Lightning's own: no Trainer attached, nothing is logged
        warnings.simplefilter("ignore")
        model.log("val_metric", 0.5)
        model.log("val_acc", model.val_acc, sync_dist=True)  # a torchmetrics object: exact
        model.log("val_loss", torch.tensor(0.5), sync_dist=True, reduce_fx="sum")  # sums: exact
        assert capsys.readouterr().err == ""
        model.log("val_loss", torch.tensor(0.5), sync_dist=True)
        model.log("val_other", torch.tensor(0.5), sync_dist=True)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "'val_loss'" in lines[0] and "sync_dist=True" in lines[0], lines
