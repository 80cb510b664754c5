"""Count host reads of tensor values per training batch, on the CPU.

On a GPU, reading a device value on the host (`.item()`, `float(t)`, `bool(t)`, `torch.equal`, an op
whose output size depends on the data such as `nonzero`) waits for every kernel queued before it:
the CPU can no longer run ahead of the GPU. These reads show up on the CPU as the aten ops below,
so a `TorchDispatchMode` that sees every op can count them without a GPU, attribute each to the
training batch it happened in and keep the Python stack that asked for it.

Not seen on a CPU: `.cpu()`, `.tolist()` and `.numpy()` of a CPU tensor dispatch no op. The `gpu`
test tier catches those with `torch.cuda.set_sync_debug_mode("error")`.
"""

from __future__ import annotations

import traceback
import weakref
from collections import defaultdict
from typing import Any

import lightning as L
import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# The ops that make the host wait for the device on CUDA: a scalar read, or an output whose size
# depends on the values.
HOST_READ_OPS = {
    aten._local_scalar_dense.default,  # .item(), float(), int(), bool()
    aten.is_nonzero.default,
    aten.equal.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.unique_consecutive.default,
    aten._unique2.default,
    aten.repeat_interleave.Tensor,
}

# Reads of tensors that live in host memory on every device, so they never wait for a GPU:
# (the innermost Python function on the stack, the dtype read) -> why.
HOST_RESIDENT_READS = {
    # torch.optim keeps each parameter's step counter on the CPU unless `capturable` or `fused` is set,
    # precisely so that the bias correction's `.item()` does not sync (torch/optim/adam.py).
    ("_get_value", torch.float32): "an optimizer's step counter",
    # DDP's reducer marks used parameters in `local_used_map_`, an int32 tensor in (pinned) host
    # memory, and reads it back per parameter with static_graph (torch/csrc/distributed/c10d/reducer.cpp).
    ("_engine_run_backward", torch.int32): "DDP's host-side map of used parameters",
}


# Ops whose output is the input's data, a view of it or a copy of it on the same device.
SAME_PLACE_OPS = {
    aten.clone.default,
    aten.detach.default,
    aten.alias.default,
    aten.view.default,
    aten.squeeze.default,
    aten.unsqueeze.default,
    aten._to_copy.default,
}


class PerTrainingBatch(L.Callback):
    """Charges what happens between one training batch's start and the next to that batch (so a
    batch's entry includes its logging, its checkpoint hooks and the next batch's loading); put it
    first in `trainer.callbacks`. `found[batch]` lists what was recorded there."""

    def __init__(self) -> None:
        self.batch: tuple[int, int] | None = None  # (epoch, batch_idx) of the running training batch
        self.found: dict[tuple[int, int], list[str]] = defaultdict(list)
        self.global_steps: dict[tuple[int, int], int] = {}  # global step at each batch's start

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.batch = (trainer.current_epoch, batch_idx)
        self.global_steps[self.batch] = trainer.global_step

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.batch = None  # validation and epoch-end work are not a training step's

    def steady_state(self, batches_per_epoch: int, log_every: int, accumulate: int = 1) -> dict:
        """What was found in batches that are not the last of an epoch and do not end at a logging step."""
        found = {}
        for (epoch, batch_idx), steps_before in self.global_steps.items():
            steps = (batch_idx + 1) % accumulate == 0  # this batch ends with an optimizer step
            ends_a_log_step = steps and (steps_before + 1) % log_every == 0
            if batch_idx != batches_per_epoch - 1 and not ends_a_log_step and self.found.get((epoch, batch_idx)):
                found[(epoch, batch_idx)] = self.found[(epoch, batch_idx)]
        return found


class HostReadCounter(TorchDispatchMode, PerTrainingBatch):
    """Host reads per training batch: enter the mode around `fit`, put the instance first in
    `trainer.callbacks`."""

    def __init__(self) -> None:
        TorchDispatchMode.__init__(self)
        PerTrainingBatch.__init__(self)
        # Tensors copied to the host on purpose (`.to("cpu", copy=True)`, and clones and views of
        # them): on a GPU these live in host memory, so reading them waits for nothing.
        # Keyed by id (a WeakSet would compare tensors with `==`, itself an op).
        self.host_copies: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in SAME_PLACE_OPS and isinstance(result, torch.Tensor):
            to_host = func is aten._to_copy.default and kwargs.get("device") == torch.device("cpu")
            if to_host or (args and self.is_host_copy(args[0])):
                self.host_copies[id(result)] = weakref.ref(result)
        if func in HOST_READ_OPS and self.batch is not None and not (args and self.is_host_copy(args[0])):
            stack = traceback.extract_stack()[:-1]
            dtype = next((arg.dtype for arg in args if isinstance(arg, torch.Tensor)), None)
            innermost = next((frame.name for frame in reversed(stack) if "torch/_" not in frame.filename), "?")
            if (innermost, dtype) not in HOST_RESIDENT_READS:
                ours = [frame for frame in stack if "/torch/" not in frame.filename]
                caller = f"{ours[-1].filename}:{ours[-1].lineno} {ours[-1].name}" if ours else "?"
                self.found[self.batch].append(f"{func} of a {dtype} in {innermost}, called from {caller}")
        return result

    def is_host_copy(self, value: Any) -> bool:
        ref = self.host_copies.get(id(value))
        return ref is not None and ref() is value
