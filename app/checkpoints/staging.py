"""Host buffers for a background save's copy of the checkpoint, kept from one save to the next.

A save written in the background (`last_checkpoint.async_save`) first copies the checkpoint's tensors
to host memory, and training waits for that copy. Into fresh memory the copy also pays for
allocating it: the page faults of first touching it, and on a GPU pinning it (`python -m
app.bench.saves`, docs/bench_saves.json: 211 ms into fresh memory against 79 ms into kept buffers
for 384 MB in 64 MB tensors). So the buffers are kept, as DCP's stager
(`StateDictStager`'s cache) and torchtitan keep theirs: one host copy of the checkpoint stays
allocated between saves, on rank 0 under DDP and on every rank, of its shards, under strategy
fsdp. On a GPU the buffers are pinned and the copies non-blocking, with one synchronize at the end.

A tensor gets the buffer the same tensor used at the previous save: the same memory, offset, shape,
strides and dtype (an optimizer step changes the values in place, not these). Reusing is safe because
at most one write is in flight: a save starts only once the previous write is done with its buffers
(`BackgroundWriter.begin_save`). A buffer the last save did not use is released at the next save.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from app.private_apis import require

DTENSOR_REBUILD = "background saves under strategy fsdp (a DTensor rebuilt around its shard's host copy)"

Key = tuple[int, int, torch.Size, tuple[int, ...], torch.dtype, torch.device]


def storage_key(tensor: torch.Tensor) -> int:
    """Which memory a tensor lives in (0: none): a state dict's entries are views of the parameters;
    a DTensor's (FSDP2), its local shard's."""
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.untyped_storage().data_ptr()


class HostStaging:
    """Where `snapshot` and the writer thread's late copies (`LateCopy`) copy a save's tensors."""

    def __init__(self) -> None:
        self._previous: dict[Key, torch.Tensor] = {}  # the last save's buffers, for this one to reuse
        self._current: dict[Key, torch.Tensor] = {}  # this save's
        self._on_device = False  # a non-blocking copy from a device is pending (`finish` waits for it)

    def begin(self) -> None:
        """A save starts (the previous write has finished): its buffers are this save's to reuse."""
        self._previous, self._current = self._current, {}

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` copied to host memory, into the buffer it had at the last save where it fits.
        The copy is complete only after `finish`."""
        if isinstance(tensor, DTensor):
            return self._copy_dtensor(tensor)
        tensor = tensor.detach()
        if type(tensor) is not torch.Tensor or tensor.layout != torch.strided or tensor.is_quantized:
            return tensor.to("cpu", copy=True)  # not a plain dense tensor: a fresh copy, as before
        key_storage = storage_key(tensor)
        if key_storage == 0:  # no memory of its own to be keyed by (an empty tensor)
            return tensor.to("cpu", copy=True)
        key = (key_storage, tensor.storage_offset(), tensor.shape, tensor.stride(), tensor.dtype, tensor.device)
        if key in self._current:  # the same tensor twice in one checkpoint (tied weights): one copy
            return self._current[key]
        buffer = self._previous.pop(key, None)
        from_device = tensor.device.type == "cuda"
        if buffer is None:
            buffer = torch.empty_like(tensor, device="cpu", pin_memory=from_device)
        buffer.copy_(tensor, non_blocking=from_device)
        self._on_device = self._on_device or from_device
        self._current[key] = buffer
        return buffer

    def _copy_dtensor(self, tensor: DTensor) -> DTensor:
        """A DTensor (FSDP2's shards) whose local shard is copied into host memory, with the same
        mesh, placements and global shape: what DCP's planner and writer read, as from DCP's own
        stager. Rebuilt through the subclass's flatten protocol, which copies no data and runs no
        DTensor op: a DTensor op costs about 0.2 ms of dispatch on a CPU, and DCP's stager, which
        runs two per DTensor (`new_empty` of its whole local shape, then a copy), took 230 ms to
        stage 500 MB of shards per rank where the copy itself takes 100 ms (a cProfile of a 2-rank
        save, not kept). `DTensor.from_local` would move a host shard back to the mesh's device."""
        flatten = require(tensor, "__tensor_flatten__", "torch", DTENSOR_REBUILD)
        names, context = flatten()
        inner = {}
        for name in names:
            value = getattr(tensor, name)
            inner[name] = self.copy(value) if isinstance(value, torch.Tensor) else value  # the mesh is kept
        unflatten = require(type(tensor), "__tensor_unflatten__", "torch", DTENSOR_REBUILD)
        return unflatten(inner, context, tensor.shape, tensor.stride())

    def finish(self) -> None:
        """Every copy made so far is complete (a device's non-blocking copies waited for)."""
        if self._on_device:
            torch.cuda.synchronize()
            self._on_device = False
