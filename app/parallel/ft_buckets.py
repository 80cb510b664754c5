"""The gradient all-reduce of a replica group (fault tolerance), in buckets overlapped with backward.

DDP does not wait for the whole backward pass before it communicates: it groups the gradients into
buckets in the order backward produces them and all-reduces a bucket as soon as its last gradient
is accumulated, while backward computes the layers below. `GradientBuckets` does the same through
torchft's Manager (`Manager.allreduce`, asynchronous): a post-accumulate-grad hook on every trained
parameter counts the gradients of its bucket; a full bucket is flattened and its all-reduce started,
in bucket order (every group starts the same all-reduces in the same order, as gloo pairs them by
order). After backward, `after_backward` starts the buckets still waiting (a parameter without a
gradient this step: its place is zeros), waits for every all-reduce and copies the averages back,
before the module's own `on_after_backward`, which sees averaged gradients as under DDP.

The result is element for element the one of a single all-reduce after backward (and DDP's): each
element is the sum of the same values from each group, divided by the number of groups present
(torchft's `ReduceOp.AVG` divides after the sum); which bucket an element travels in does not change
its sum. The buckets are fixed when training starts, the same in every group: the trained parameters
in reverse order of `module.parameters()` (the order backward usually produces them, DDP's first
guess), one dtype per bucket, DDP's sizes (1 MiB for the first bucket, then 25 MiB). A model whose
backward runs in another order is still correct, with less overlap: a bucket starts only after the
buckets before it.

In a group of several processes under DDP every process holds the group's same averaged gradients after
backward, so each sends only its part across the groups (`split`): process r of N all-reduces slice r
of each flat bucket with process r of the other groups, then the group all-gathers the N slices over
its own process group. What crosses between groups is 1/N of the gradients per process (the group's
whole gradient once, not N times); every element's sum is the one a whole-bucket all-reduce makes. Under
FSDP2 within a group each process holds only its shard already: nothing to split.

With gradient accumulation only the backward of the micro-batch that ends in an optimizer step
starts all-reduces (the micro-batches before it accumulate locally, as under DDP's `no_sync`);
Lightning's own decision, `fit_loop._should_accumulate()` (private, docs/private_apis.md), is asked
at the first gradient of each backward. A second backward before the same optimizer step (manual
optimization, a closure an optimizer calls twice) changes gradients already sent: its
`after_backward` all-reduces every bucket again from the gradients as they then are.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a tensor: its shard if sharded (strategy fsdp within a group, a DTensor), else itself.
    Process r of every group holds the same shard, so the groups all-reduce shard with shard."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


FIRST_BUCKET_BYTES = 1024 * 1024  # DDP's first bucket (`dist._DEFAULT_FIRST_BUCKET_BYTES`): starts early
BUCKET_BYTES = 25 * 1024 * 1024  # DDP's `bucket_cap_mb` default


def assign_buckets(params: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    """The trained parameters in reverse order, cut into buckets of one dtype each: a bucket closes
    once it holds its cap (the first bucket's cap for the first bucket of each dtype)."""
    buckets: list[list[torch.nn.Parameter]] = []
    open_bucket: dict[torch.dtype, tuple[list[torch.nn.Parameter], int]] = {}
    closed_per_dtype: dict[torch.dtype, int] = {}
    for param in reversed(params):
        members, size = open_bucket.get(param.dtype, ([], 0))
        if not members:
            buckets.append(members)
        members.append(param)
        size += _local(param).numel() * param.element_size()
        cap = FIRST_BUCKET_BYTES if closed_per_dtype.get(param.dtype, 0) == 0 else BUCKET_BYTES
        if size >= cap:
            closed_per_dtype[param.dtype] = closed_per_dtype.get(param.dtype, 0) + 1
            open_bucket.pop(param.dtype, None)
        else:
            open_bucket[param.dtype] = (members, size)
    return buckets


class GradientBuckets:
    """The bucketed, overlapped gradient all-reduce of one replica group's module (see the module docstring).

    Per batch: `next_batch` (at its end) makes the next backward decide anew; the first gradient of a
    backward asks whether it ends in an optimizer step (else nothing is sent: accumulation); the hooks
    start the full buckets; `after_backward` (Lightning's `on_after_backward`, callbacks before the
    module, as DDP's averaged gradients are there for the module's hook) starts the rest, waits and
    copies the averages into the gradients. A further backward before the same optimizer step sends
    everything again at its own `after_backward`, from the gradients as they then are."""

    UNDECIDED, ACCUMULATING, SENDING, SENT = "undecided", "accumulating", "sending", "sent"

    def __init__(
        self, manager: Any, module: torch.nn.Module, should_accumulate: Any, overlap: bool = True, split: bool = False
    ) -> None:
        self.manager = manager
        self.should_accumulate = should_accumulate  # Lightning's `fit_loop._should_accumulate`
        self.module = module
        self.params = [param for param in module.parameters() if param.requires_grad]
        self.buckets = assign_buckets(self.params)
        self.bucket_of = {id(param): index for index, bucket in enumerate(self.buckets) for param in bucket}
        self.state = self.UNDECIDED
        self.missing: list[int] = []  # per bucket: gradients still to come in this backward
        self.order: list[list[torch.nn.Parameter]] = []  # what is sent this step: the buckets, then the late ones
        # The flat buckets (padded to a multiple of the group's processes when split), the part each sends across
        # the groups, and its all-reduce, in order.
        self.started: list[tuple[torch.Tensor, torch.Tensor, Any]] = []
        self.started_in_backward = 0  # of the last backward that sent: the buckets its hooks started
        self.sent_bytes = 0  # of the last backward that sent: what this process all-reduced across the groups
        # split: DDP within a group of several processes (module docstring): each sends its slice of a bucket.
        self.parts, self.part = (dist.get_world_size(), dist.get_rank()) if split else (1, 0)
        # overlap=False: every bucket is started after backward (a group of several processes, whose DDP puts the
        # group's averaged gradients in `.grad` only at the end of backward).
        hooks = self.params if overlap else []
        self.handles = [param.register_post_accumulate_grad_hook(self._ready) for param in hooks]

    def next_batch(self) -> None:
        """At the end of every batch (micro-batch or not)."""
        self.state = self.UNDECIDED

    def _decide(self) -> None:
        if self.state == self.UNDECIDED:
            self.state = self.ACCUMULATING if self.should_accumulate() else self.SENDING
            self.missing = [len(bucket) for bucket in self.buckets]
            self.order, self.started, self.sent_bytes = list(self.buckets), [], 0

    def _ready(self, param: torch.nn.Parameter) -> None:
        self._decide()
        if self.state != self.SENDING:
            return
        self.missing[self.bucket_of[id(param)]] -= 1
        while len(self.started) < len(self.buckets) and self.missing[len(self.started)] == 0:
            self._start(len(self.started))

    def _start(self, index: int) -> None:
        grads = [
            _local(param.grad) if param.grad is not None else torch.zeros_like(_local(param))
            for param in self.order[index]
        ]
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        part = flat
        if self.parts > 1:  # the same gradients in every process of the group: each sends its slice
            size = -(-flat.numel() // self.parts)
            flat = torch.nn.functional.pad(flat, (0, size * self.parts - flat.numel()))
            part = flat[self.part * size : (self.part + 1) * size].clone()
        self.sent_bytes += part.numel() * part.element_size()
        self.started.append((flat, part, self.manager.allreduce(part)))

    def after_backward(self) -> bool:
        """After a backward: if it ends in an optimizer step, start what is left, wait for every
        all-reduce and put the averages in the gradients. True if it did."""
        self._decide()
        if self.state == self.ACCUMULATING:
            return False
        if self.state == self.SENT:  # another backward before the same optimizer step: everything again
            self.order, self.started, self.sent_bytes = list(self.buckets), [], 0
        # Parameters trained since the buckets were made (unfrozen during the run) go last, one dtype per
        # all-reduce: every group unfreezes them at the same step, so every group sends the same.
        late: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for param in self.module.parameters():
            if param.grad is not None and id(param) not in self.bucket_of:
                late.setdefault(param.dtype, []).append(param)
        self.order += list(late.values())
        self.started_in_backward = len(self.started)
        while len(self.started) < len(self.order):
            self._start(len(self.started))
        for (flat, part, work), bucket in zip(self.started, self.order, strict=True):
            work.wait()  # torchft: an error is recorded for `should_commit`, not raised (the group drops the step)
            if self.parts > 1:  # every process of the group issues the same all-gathers, failed step or not
                dist.all_gather(list(flat.view(self.parts, -1).unbind(0)), part)
            offset = 0
            for param in bucket:
                count = _local(param).numel()
                if param.grad is not None:
                    grad = _local(param.grad)
                    grad.copy_(flat[offset : offset + count].view_as(grad))
                offset += count
        self.state = self.SENT
        return True

    def drop(self) -> None:
        """The step is not committed: every gradient dropped (torch's optimizers skip a parameter without one)."""
        for param in [*self.params, *(param for bucket in self.order for param in bucket)]:
            param.grad = None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
