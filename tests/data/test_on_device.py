"""Splits batched by indexing (`TensorBatchLoader`): the same training as a DataLoader's, whether the
split stays in host memory (a TensorDataset without workers, the default) or is kept on the device
(`data.init_args.on_device: true`).

On this machine the device is the CPU; the loader's code path is the one a GPU takes (the split is
moved to `trainer.strategy.root_device` once, batches are `index_select`s there).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, SequentialSampler, Subset, TensorDataset

from app.cli.resume_check import Case
from app.data.base import ResumableDataLoader
from app.data.datasets import default_num_workers
from app.data.on_device import TensorBatchLoader, in_memory_tensors, materialize
from app.data.samplers import UnpaddedDistributedSampler
from app.errors import InvalidConfigError
from tests.helpers.in_process import DIGITS, digits_cli
from tests.helpers.run import fit_runner


def fit(tmp_path: Path, *overrides: str) -> tuple[dict[str, torch.Tensor], dict[str, float], type]:
    cli = digits_cli(tmp_path, 2, *overrides)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    metrics = {name: float(value) for name, value in cli.trainer.callback_metrics.items()}
    return cli.model.state_dict(), metrics, type(cli.trainer.train_dataloader)


@pytest.mark.quick
def test_a_split_batched_by_indexing_trains_the_same_weights_as_the_dataloader(tmp_path: Path) -> None:
    # A worker makes ddp-app read the TensorDataset through a DataLoader, sample by sample.
    loaded, loaded_metrics, loaded_type = fit(tmp_path / "loader", "--data.init_args.num_workers=1")
    indexed, indexed_metrics, indexed_type = fit(tmp_path / "host")  # the default for a TensorDataset
    resident, resident_metrics, resident_type = fit(tmp_path / "device", "--data.init_args.on_device=true")
    assert (loaded_type, indexed_type, resident_type) == (ResumableDataLoader, TensorBatchLoader, TensorBatchLoader)
    assert loaded.keys() == indexed.keys() == resident.keys()
    for name in loaded:
        assert torch.equal(loaded[name], indexed[name]), name
        assert torch.equal(loaded[name], resident[name]), name
    # Exact evaluation, same shards.
    assert loaded_metrics["val_acc"] == indexed_metrics["val_acc"] == resident_metrics["val_acc"]


class Augmented(Dataset):
    """A sample with a random draw in it, as a random crop or flip would make."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.full((2,), float(index)) + torch.rand(2), index % 2


class Decoded(Dataset):
    """Deterministic, but not a TensorDataset: read sample by sample."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.arange(3.0) * index, index % 3


@pytest.mark.quick
def test_a_split_with_random_augmentation_is_refused_in_one_line_naming_the_fix() -> None:
    with pytest.raises(InvalidConfigError, match="random augmentation per sample.*augment=false.*on_device=false"):
        materialize(Augmented(), "train")


@pytest.mark.quick
def test_any_deterministic_map_dataset_is_read_once_into_rows_in_dataset_order() -> None:
    inputs, targets = materialize(Decoded(), "val")
    assert torch.equal(inputs, torch.stack([torch.arange(3.0) * index for index in range(6)]))
    assert targets.tolist() == [0, 1, 2, 0, 1, 2]
    # Evaluation shards: rank 1 of 2 gets samples 1, 3, 5, in batches cut on the device.
    loader = TensorBatchLoader((inputs, targets), UnpaddedDistributedSampler(Decoded(), 2, 1), batch_size=2)
    reference = DataLoader(Decoded(), batch_size=2, sampler=UnpaddedDistributedSampler(Decoded(), 2, 1))
    assert len(loader) == len(reference) == 2
    for ours, theirs in zip(loader, reference, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


@pytest.mark.quick
def test_workers_are_sized_to_the_machine_only_where_they_help() -> None:
    tensors = TensorDataset(torch.zeros(4, 2))
    assert default_num_workers(Decoded(), on_gpu=False, local_ranks=1) == 0  # the ranks use the cores
    assert default_num_workers(tensors, on_gpu=True, local_ranks=1) == 0  # nothing to decode
    cores = len(__import__("os").sched_getaffinity(0))
    assert default_num_workers(Decoded(), on_gpu=True, local_ranks=1) == max(0, min(8, cores - 1))
    assert default_num_workers(Decoded(), on_gpu=True, local_ranks=cores) == 0


@pytest.mark.distributed
@pytest.mark.fault
def test_a_split_on_the_device_resumes_exactly_after_a_kill_mid_epoch(tmp_path: Path) -> None:
    runner = fit_runner(
        ["--config", DIGITS], tmp_path, epochs=2, variants={"on-device": ["--data.init_args.on_device=true"]}
    )
    outcome = runner.run(Case("kill-rank1", "mid-epoch", "same", "on-device"))
    assert outcome.exact, outcome.detail or outcome


@pytest.mark.quick
def test_only_a_plain_tensor_dataset_is_batched_by_indexing() -> None:
    class Flipped(TensorDataset):  # a subclass may change what a sample is
        def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
            return tuple(tensor[index].flip(0) for tensor in self.tensors)

    rows = torch.arange(12.0).reshape(4, 3)
    assert in_memory_tensors(TensorDataset(rows)).tensors[0] is rows
    subset = in_memory_tensors(Subset(Subset(TensorDataset(rows), [3, 1, 2]), [2, 0]))
    assert subset.tensors[0] is rows and subset.rows.tolist() == [2, 3]  # an index, not a copy
    assert torch.equal(subset.gathered()[0], rows[[2, 3]])
    loader = TensorBatchLoader(subset.tensors, SequentialSampler(range(2)), batch_size=2, rows=subset.rows)
    assert torch.equal(next(iter(loader))[0], rows[[2, 3]])
    assert in_memory_tensors(Flipped(rows)) is None
    assert torch.equal(materialize(Flipped(rows), "train")[0], rows.flip(1))  # read as its samples are
