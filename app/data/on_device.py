"""A split kept whole on the training device, with batches built there (`data.init_args.on_device: true`).

For data sets that fit in GPU memory (the digits, MNIST, CIFAR-10 sized ones) a DataLoader is the
slowest part of a GPU step: per sample a `__getitem__` call, per batch a collate, a pinned copy and
a host-to-device transfer, all on the CPU thread that also has to queue the step's kernels. Here the
split is read once, moved to the device once, and each batch is one `index_select` per tensor on
the device, indexed by the same sampler the DataLoader would use: the same samples in the same
order on every rank (so the same weights, bit for bit, as the ordinary loader: a test checks), the
same mid-epoch position on a resume (`ResumableDistributedSampler`), and for evaluation the same
unpadded shards (exact metrics).

What it cannot keep: randomness per sample. A split whose samples change from one read to the next
(random augmentation) would be frozen at one draw; `materialize` checks that and refuses in one line.
No Lightning here.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler, Subset, TensorDataset, default_collate

from app.data.seeding import SampleKey
from app.errors import InvalidConfigError


def _indexed_tensors(dataset: Dataset) -> tuple[torch.Tensor, ...] | None:
    """The tensors of a TensorDataset, or of Subsets of one, without reading sample by sample."""
    if isinstance(dataset, TensorDataset):
        return tuple(dataset.tensors)
    if isinstance(dataset, Subset):
        inner = _indexed_tensors(dataset.dataset)
        if inner is not None:
            indices = torch.as_tensor(list(dataset.indices), dtype=torch.long)
            return tuple(tensor[indices] for tensor in inner)
    return None


def _read_with_seed(dataset: Dataset, index: int, seed: int) -> Any:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        numpy_state, python_state = np.random.get_state(), random.getstate()
        np.random.seed(seed)
        random.seed(seed)
        try:
            return dataset[index]
        finally:
            np.random.set_state(numpy_state)
            random.setstate(python_state)


def _same(first: Any, second: Any) -> bool:
    if isinstance(first, torch.Tensor):
        return isinstance(second, torch.Tensor) and torch.equal(first, second)
    if isinstance(first, (list, tuple)):
        return len(first) == len(second) and all(_same(a, b) for a, b in zip(first, second, strict=True))
    return first == second


def materialize(dataset: Dataset, split: str) -> tuple[torch.Tensor, ...]:
    """The whole split as tensors with one row per sample, in host memory.

    A TensorDataset (or a Subset of one) is taken as it is; any other map-style dataset is read
    once, sample by sample, after checking that reading a sample twice under different random seeds
    gives the same sample (no random augmentation).
    """
    tensors = _indexed_tensors(dataset)
    if tensors is not None:
        return tensors
    length = len(dataset)  # type: ignore[arg-type]
    probe = [0, length // 2, length - 1] if length else []
    if any(not _same(_read_with_seed(dataset, index, 1), _read_with_seed(dataset, index, 2)) for index in probe):
        raise InvalidConfigError(
            f"data.on_device: the {split} split draws a random augmentation per sample ({type(dataset).__name__}), "
            "which a split kept on the device would freeze at one draw. Fix: turn the augmentation off "
            "(e.g. data.init_args.augment=false) or set data.init_args.on_device=false."
        )
    batch = default_collate([dataset[index] for index in range(length)])
    if isinstance(batch, torch.Tensor):
        return (batch,)
    if not isinstance(batch, (list, tuple)) or not all(isinstance(part, torch.Tensor) for part in batch):
        raise InvalidConfigError(
            f"data.on_device: the {split} split's samples are not tensors or tuples of tensors "
            f"({type(batch).__name__}). Fix: set data.init_args.on_device=false."
        )
    return tuple(batch)


class DeviceResidentLoader:
    """Batches of `batch_size` rows, in the order `sampler` gives, cut from tensors already on the device.

    Per epoch the sampler's order is turned into one index tensor and copied to the device once;
    per batch there is one slice and one `index_select` per tensor, all queued on the device (no
    host read, no host-to-device copy). `sampler` is a public attribute, as on a DataLoader, so
    Lightning calls its `set_epoch` every epoch and sees that an evaluation loader does not
    shuffle. `state_dict`/`load_state_dict` tell Lightning it may resume mid-epoch: the position
    lives in the sampler (`ResumableDistributedSampler`).
    """

    def __init__(self, tensors: Sequence[torch.Tensor], sampler: Sampler, batch_size: int) -> None:
        self.tensors = tuple(tensors)
        self.sampler = sampler
        self.batch_sampler = None  # a DataLoader's attribute too: Lightning reads both to tell whether it shuffles
        self.batch_size = batch_size
        self.device = self.tensors[0].device

    def __len__(self) -> int:
        return math.ceil(len(self.sampler) / self.batch_size)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[list[torch.Tensor]]:
        indices = [key.index if isinstance(key, SampleKey) else key for key in self.sampler]
        order = torch.tensor(indices, dtype=torch.long)
        if self.device.type == "cuda":
            order = order.pin_memory()
        order = order.to(self.device, non_blocking=True)
        for start in range(0, len(indices), self.batch_size):
            rows = order[start : start + self.batch_size]
            yield [tensor.index_select(0, rows) for tensor in self.tensors]

    def state_dict(self) -> dict[str, int]:
        return {}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        pass
