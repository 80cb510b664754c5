"""Host buffers for a background save's copy of the checkpoint, kept from one save to the next.

Copying into fresh memory also pays for page faults (and pinning on a GPU): docs/bench_saves.json. So, as DCP's stager
and torchtitan do, one host copy stays allocated between saves (rank 0 under DDP, every rank's shards under fsdp); on a
GPU pinned, copies non-blocking.

A tensor reuses the buffer of the same tensor at the previous save (same memory, offset, shape, strides, dtype). Safe
because at most one write is in flight (`BackgroundWriter.begin_save`); unused buffers are released at the next save."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from app.private_apis import require

DTENSOR_REBUILD = "background saves under strategy fsdp (a DTensor rebuilt around its shard's host copy)"

Key = tuple[int, int, torch.Size, tuple[int, ...], torch.dtype, torch.device]


def storage_key(tensor: torch.Tensor) -> int:
    """Which memory a tensor lives in (0: none): a state dict's entries are views of the parameters; a DTensor's
    (FSDP2), its local shard's."""
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
        """`tensor` copied to host memory, into the buffer it had at the last save where it fits. The copy is complete
        only after `finish`."""
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
        """A DTensor whose local shard is copied into host memory, with the same mesh, placements and global shape.

        Rebuilt through the flatten protocol (no data copy, no DTensor op): DCP's stager's two DTensor ops per tensor
        cost more than the copy. `DTensor.from_local` would move the shard back to the device."""
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
