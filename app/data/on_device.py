"""Splits held whole as tensors, batched by indexing: on the device (`data.init_args.on_device: true`) or in host memory
(`TensorBatchLoader`).

A DataLoader's per-sample work is the slowest part of a GPU step for data that fits in memory. Here each batch is one
`index_select`, by the same sampler: same samples, order, weights bit for bit, resume position and evaluation shards.
Per-sample randomness is refused (`materialize`). No Lightning here."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler, Subset, TensorDataset, default_collate

from app.data.seeding import SampleKey, generators_kept, seed_generators
from app.errors import InvalidConfigError


@dataclass(frozen=True)
class TensorRows:
    """A split's samples as rows of whole tensors: sample i is row `rows[i]` (row i without `rows`)."""

    tensors: tuple[torch.Tensor, ...]
    rows: torch.Tensor | None = None

    def gathered(self) -> tuple[torch.Tensor, ...]:
        """One tensor per field with the split's rows in sample order (a copy when `rows` is set)."""
        return self.tensors if self.rows is None else tuple(tensor[self.rows] for tensor in self.tensors)


def in_memory_tensors(dataset: Dataset | None) -> TensorRows | None:
    """A split held in memory as tensors (exactly a TensorDataset or Subsets of one) as `TensorRows`, else None; a
    subclass may override `__getitem__`. A Subset costs an index, not a copy."""
    if type(dataset) is TensorDataset:
        return TensorRows(tuple(dataset.tensors))
    if type(dataset) is Subset:
        inner = in_memory_tensors(dataset.dataset)
        if inner is not None:
            indices = torch.as_tensor(list(dataset.indices), dtype=torch.long)
            return TensorRows(inner.tensors, indices if inner.rows is None else inner.rows[indices])
    return None


def _read_with_seed(dataset: Dataset, index: int, seed: int) -> Any:
    with generators_kept():
        seed_generators(seed, 0, index)
        return dataset[index]


def _same(first: Any, second: Any) -> bool:
    if isinstance(first, torch.Tensor):
        return isinstance(second, torch.Tensor) and torch.equal(first, second)
    if isinstance(first, (list, tuple)):
        return len(first) == len(second) and all(_same(a, b) for a, b in zip(first, second, strict=True))
    return first == second


def materialize(dataset: Dataset, split: str) -> tuple[torch.Tensor, ...]:
    """The whole split as tensors, one row per sample, in host memory; a non-tensor dataset is read once, after checking
    that a sample read under two seeds is the same (no random augmentation)."""
    split = in_memory_tensors(dataset)
    if split is not None:
        return split.gathered()
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


class TensorBatchLoader:
    """Batches of `batch_size` rows in `sampler`'s order, one `index_select` per tensor: the same values as a
    DataLoader's.

    With `pin_memory`, host batches are gathered into pinned memory. `sampler` is public (Lightning calls `set_epoch`);
    `state_dict`/`load_state_dict` mark it resumable. It draws no random number."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        sampler: Sampler,
        batch_size: int,
        pin_memory: bool = False,
        rows: torch.Tensor | None = None,
    ) -> None:
        self.tensors = tuple(tensors)
        self.rows = rows  # sample i is row rows[i] of the tensors (a Subset's indices), in host memory
        self.sampler = sampler
        self.batch_sampler = None  # a DataLoader's attribute too: Lightning reads both to tell whether it shuffles
        self.batch_size = batch_size
        self.device = self.tensors[0].device
        self.pin_memory = pin_memory and self.device.type == "cpu"

    def __len__(self) -> int:
        return math.ceil(len(self.sampler) / self.batch_size)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[list[torch.Tensor]]:
        indices = [key.index if isinstance(key, SampleKey) else key for key in self.sampler]
        order = torch.tensor(indices, dtype=torch.long)
        if self.rows is not None:
            order = self.rows[order]
        if self.device.type == "cuda":
            order = order.pin_memory()
        if self.device.type != "cpu":
            order = order.to(self.device, non_blocking=True)
        for start in range(0, len(indices), self.batch_size):
            rows = order[start : start + self.batch_size]
            yield [self._gather(tensor, rows) for tensor in self.tensors]

    def _gather(self, tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        if not self.pin_memory:
            return tensor.index_select(0, rows)
        batch = torch.empty((len(rows), *tensor.shape[1:]), dtype=tensor.dtype, pin_memory=True)
        return torch.index_select(tensor, 0, rows, out=batch)

    def state_dict(self) -> dict[str, int]:
        return {}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        pass
