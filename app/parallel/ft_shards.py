"""What a replica group sends a healing peer under `strategy: fsdp`, sharded within a group (docs/fault_tolerance.md).

Each process of a group holds its shard of the weights and of the optimizer state (DTensors over the group's own
mesh). Every group has the same mesh, so process r of one group holds the same shard as process r of any other, and
torchft sends each process's state to the process of the same rank (app/parallel/ft_manager.py). What travels is the
Lightning checkpoint of that process with each DTensor replaced by its local shard (a plain tensor: no mesh, no
process group in the payload), marked with `LOCAL_SHARDS_KEY` (app/checkpoints/local_shards.py makes it). The
healing process puts the shards back into its own sharded module and optimizer, as DTensors of its own mesh
(`load_local_shards`): from `FSDP2Strategy.load_checkpoint` (app/parallel/fsdp.py) when it resumes from the state
before `fit`, or during `fit` when a peer at the same step committed a step this group dropped.

This module imports nothing of torchft, and nothing of app/parallel/fsdp.py (which imports it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor

from app.checkpoints.io import safe_load
from app.checkpoints.local_shards import LOCAL_SHARDS_KEY


def load_received_shards(path: str | Path, module: nn.Module, optimizers: list[Any]) -> dict[str, Any] | None:
    """If `path` is the state a peer sent this sharded process (a file with the mark): its shards put into `module`
    and `optimizers`, and the checkpoint returned; else None (a sharded checkpoint directory, loaded as usual)."""
    if not Path(path).is_file():
        return None
    checkpoint = safe_load(path)
    if not (isinstance(checkpoint, dict) and checkpoint.get(LOCAL_SHARDS_KEY)):
        return None
    load_local_shards(module, optimizers, checkpoint)
    return checkpoint


def _as_dtensor(template: torch.Tensor, local: Any) -> Any:
    """`local` (this process's shard, as sent) as a DTensor laid out as `template`, a parameter of this process."""
    if not isinstance(template, DTensor) or not isinstance(local, torch.Tensor) or local.dim() == 0:
        return local  # not sharded: a scalar such as an optimizer's step count
    shard = template.to_local()
    if local.shape != shard.shape:
        raise RuntimeError(
            f"ddp-app: fault tolerance: a peer sent a shard of shape {tuple(local.shape)} where this process holds "
            f"{tuple(shard.shape)}: the groups are not sharded alike"
        )
    local = local.to(device=shard.device, dtype=local.dtype)
    return DTensor.from_local(local, template.device_mesh, template.placements, shape=template.shape,
                              stride=template.stride())  # fmt: skip


def load_local_shards(module: nn.Module, optimizers: list[Any], checkpoint: dict[str, Any]) -> None:
    """Put the shards a peer sent (`to_local_shards`) into this process's sharded module and optimizers, in place."""
    parameters = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    model_state = {
        name: _as_dtensor(parameters[name], value) if name in parameters else value
        for name, value in checkpoint["state_dict"].items()
    }
    unknown = [name for name in model_state if name not in parameters and name not in buffers]
    if unknown:
        raise RuntimeError(f"ddp-app: fault tolerance: a peer sent weights this module does not have: {unknown[:3]}")
    set_model_state_dict(module, model_state)
    for optimizer, saved in zip(optimizers, checkpoint.get("optimizer_states", []), strict=True):
        optimizer = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer: the torch optimizer it wraps
        state = {
            name: {key: _as_dtensor(parameters[name], value) for key, value in values.items()}
            for name, values in saved["state"].items()
        }
        set_optimizer_state_dict(module, optimizer, {"state": state, "param_groups": saved["param_groups"]})
