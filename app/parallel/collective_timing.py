"""FSDP2's collectives, timed: the communication of a sharded step, for the step line and `diagnose`.

Under DDP the gradient all-reduce runs at the end of the backward pass, where app/run/step_timing.py
times it. Under FSDP2 (`strategy: fsdp`, hybrid sharding included) the communication sits inside
forward and backward: each shard unit all-gathers its weights before its forward (and again before
its backward when `reshard_after_forward`), and reduce-scatters its gradients after its backward;
hybrid sharding adds an all-reduce of each unit's reduced shard across the replicas. `time_fsdp_collectives`
puts `TimedAllGather` and `TimedReduceScatter` on every unit through FSDP2's public
`set_custom_all_gather`, `set_custom_reduce_scatter` and `set_all_reduce_hook`; they call the same
`torch.distributed` functions FSDP2's defaults call, and add each call's time and bytes to a
`CollectiveClock`.

What is counted: the time the rank's CPU is held in a collective. On CPU (gloo) FSDP2 calls them
synchronously, so that is the collectives' whole time, the wait for a late rank included. On a GPU
they run on their own streams and the CPU is held only to launch them: the figure there is a lower
bound (the profiler's trace shows the streams). Bytes are what each call carries: an all-gather's
gathered output, a reduce-scatter's input, a hybrid all-reduce's shard.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule


class CollectiveClock:
    """Seconds and bytes of the collectives since the last `take`."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.bytes = 0
        # Where a hybrid unit's all-reduce began: the end of its reduce-scatter or, in a shard group of one
        # rank (FSDP2 then calls no reduce-scatter, only copies into the output), that output's allocation.
        self.all_reduce_from: float | None = None

    def add(self, started: float, tensor: torch.Tensor) -> None:
        self.seconds += time.perf_counter() - started
        self.bytes += tensor.numel() * tensor.element_size()

    def take(self) -> tuple[float, int]:
        """The seconds and bytes counted since the last call, and start counting again."""
        counted = (self.seconds, self.bytes)
        self.seconds, self.bytes = 0.0, 0
        return counted


def _allocate(size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(*size, dtype=dtype, device=device)  # FSDP2's default allocation


class TimedAllGather:
    """FSDP2's default all-gather (`dist.all_gather_single`), timed into a `CollectiveClock`."""

    def __init__(self, clock: CollectiveClock) -> None:
        self.clock = clock
        self.allocate = _allocate

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False
    ) -> Any:
        started = time.perf_counter()
        work = dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
        self.clock.add(started, output_tensor)
        return work


class TimedReduceScatter:
    """FSDP2's default reduce-scatter (`dist.reduce_scatter_single`), timed into a `CollectiveClock`."""

    def __init__(self, clock: CollectiveClock) -> None:
        self.clock = clock

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """FSDP2 allocates the input, then the output right before the reduce-scatter, or before its copy
        where the shard group is one rank: the last allocation marks where a hybrid all-reduce may begin."""
        tensor = _allocate(size, dtype=dtype, device=device)
        self.clock.all_reduce_from = time.perf_counter()
        return tensor

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
    ) -> Any:
        started = time.perf_counter()
        work = dist.reduce_scatter_single(
            output=output_tensor, input=input_tensor, group=group, op=op, async_op=async_op
        )
        self.clock.add(started, input_tensor)
        self.clock.all_reduce_from = time.perf_counter()
        return work


def _after_hybrid_all_reduce(clock: CollectiveClock, reduced: torch.Tensor) -> None:
    """FSDP2's all-reduce hook: it runs right after the unit's all-reduce across the replicas (hybrid
    sharding) or right after its reduce-scatter (full sharding: nothing to add there)."""
    if clock.all_reduce_from is not None:
        clock.add(clock.all_reduce_from, reduced)
        clock.all_reduce_from = None


def time_fsdp_collectives(module: nn.Module, clock: CollectiveClock, hybrid: bool) -> int:
    """Time the collectives of every FSDP2 unit in `module`; the number of units timed (0: not sharded).
    A unit FSDP2 refuses a custom collective for (several parameter groups) stays untimed."""
    timed = 0
    for unit in module.modules():
        if not isinstance(unit, FSDPModule):
            continue
        try:
            unit.set_custom_all_gather(TimedAllGather(clock))
            unit.set_custom_reduce_scatter(TimedReduceScatter(clock))
        except ValueError:
            continue
        if hybrid:
            unit.set_all_reduce_hook(lambda reduced: _after_hybrid_all_reduce(clock, reduced))
        timed += 1
    return timed
