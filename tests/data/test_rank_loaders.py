"""Sharding: disjoint per-rank shards that cover the data, reshuffled every epoch by set_epoch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from app.data import DigitsDataModule
from app.data.samplers import ResumableDistributedSampler, UnpaddedDistributedSampler
from tests.helpers.run import run


def test_unpadded_sampler_covers_each_sample_exactly_once() -> None:
    dataset = TensorDataset(torch.arange(389))
    shards = [list(UnpaddedDistributedSampler(dataset, 2, rank)) for rank in range(2)]
    assert len(shards[0]) == 195 and len(shards[1]) == 194
    assert sorted(shards[0] + shards[1]) == list(range(389))


def test_unpadded_sampler_refuses_fewer_samples_than_ranks() -> None:
    with pytest.raises(ValueError, match="fewer than the 4 ranks"):
        UnpaddedDistributedSampler(TensorDataset(torch.arange(3)), 4, 0)


def test_train_sampler_reshuffles_per_epoch_and_honours_shuffle_false() -> None:
    dataset = TensorDataset(torch.arange(100))
    sampler = ResumableDistributedSampler(dataset, 2, 0, shuffle=True, seed=1, batch_size=1)
    sampler.set_epoch(0)
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != first
    ordered = ResumableDistributedSampler(dataset, 2, 1, shuffle=False, seed=1, batch_size=1)
    assert list(ordered) == list(range(1, 100, 2))


def test_digits_split_is_deterministic_and_stratified() -> None:
    first, second = DigitsDataModule(split_seed=3), DigitsDataModule(split_seed=3)
    first.setup("fit")
    second.setup("fit")
    assert torch.equal(first.train_dataset.tensors[0], second.train_dataset.tensors[0])
    sizes = [len(first.train_dataset), len(first.val_dataset), len(first.test_dataset)]
    assert sum(sizes) == 1797
    assert torch.bincount(first.val_dataset.tensors[1]).min() >= 25  # every class is in validation


@pytest.mark.distributed
@pytest.mark.parametrize("shuffle", [True, False])
def test_lightning_ranks_see_disjoint_covering_shards(tmp_path: Path, shuffle: bool) -> None:
    args = [sys.executable, "-m", "tests.helpers.record_shards", str(tmp_path)]
    result = run(args if shuffle else [*args, "--no-shuffle"], timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    train_size = len(DigitsDataModule().make_splits()[0])
    for epoch in ("epoch0", "epoch1"):
        shard0, shard1 = ranks[0][epoch], ranks[1][epoch]
        # DistributedSampler pads the odd-sized training set with one repeated sample.
        assert len(shard0) == len(shard1) == (train_size + 1) // 2
        assert set(shard0) | set(shard1) == set(range(train_size))
        assert len(set(shard0) & set(shard1)) <= train_size % 2
    if shuffle:
        assert ranks[0]["epoch0"] != ranks[0]["epoch1"], "set_epoch did not reshuffle"
    else:
        assert ranks[0]["epoch0"] == list(range(0, train_size, 2))
