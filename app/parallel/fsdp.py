"""`strategy: fsdp`: fully sharded data parallel (FSDP2, `fully_shard`) for a model that no longer fits one device with
DDP (docs/fsdp.md).

    trainer:
      strategy:
        class_path: app.parallel.fsdp.FSDP2Strategy
        init_args: {shard_modules: [Block], param_dtype: bfloat16, shard_group_size: node}

(`strategy: fsdp` is the same with every default.) Built on Lightning's `ModelParallelStrategy`, but shards a plain
LightningModule itself, over a 1-D mesh or, with `shard_group_size`, a 2-D (replicas x shards) mesh (HSDP). The mesh
names its device type (gloo + `fully_shard` failed with GPUs visible, pytorch/pytorch#132471). Data is sharded over
every rank (Lightning's would use the `data_parallel` dimension only). Checkpoints are sharded through
`ShardedCheckpointIO` (app/checkpoints/sharded_io.py), called on every rank; a resume on another world size reshards."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed._composable as composable
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from app.checkpoints import state as checkpoint_state
from app.checkpoints.sharded_io import ShardedCheckpointIO
from app.errors import UserFacingError
from app.parallel.ft_shards import load_received_shards
from app.parallel.mesh import MeshLayout, ShardGroupSize, check_shard_group_size, mesh_layout
from app.private_apis import require

# The dtypes FSDP2 may gather parameters and reduce gradients in, by the names a config gives them (a Literal, so that a
# config naming another is refused by the parser in one line, naming the key).
ComputeDtype = Literal["float32", "bfloat16", "float16"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class FSDP2Strategy(ModelParallelStrategy):
    """Lightning's ModelParallelStrategy with the sharding done for the user.

    Its checkpoints (safe, atomic, resharding) are its checkpoint I/O's (`ShardedCheckpointIO`).

    Args:
        shard_modules: class names of the submodules that become their own shard units (gathered
            one at a time, so peak memory is about one unit's full parameters), e.g. `[Block]`.
            None: every module held in an `nn.ModuleList` (the usual place of transformer blocks).
            Every child of the LightningModule that holds parameters is then a unit too, for the
            parameters left outside those (embeddings, the head).
        reshard_after_forward: free a unit's gathered parameters after its forward (and gather them
            again for the backward): less memory, one more all-gather per unit and step.
        activation_checkpointing: keep only the inputs of each `shard_modules` unit from the forward
            and recompute its activations in the backward: less memory, about one more forward per
            step. The gradients are the same, bit for bit.
        param_dtype: the dtype of the gathered parameters forward and backward compute in
            (`bfloat16` for mixed precision); None: the parameters' own (float32). The sharded
            parameters and the optimizer stay in their own dtype.
        reduce_dtype: the dtype gradients are reduce-scattered in; None: `param_dtype`'s.
        cpu_offload: keep the sharded parameters and gradients, and so the optimizer state and its
            step, in host memory (FSDP2's `CPUOffloadPolicy`): device memory then holds only the
            units being gathered and the activations, at the cost of a host-device copy of every
            shard per step and an optimizer step on the CPU.
        shard_group_size: the ranks that shard the model between them. None: every rank of the run
            (full sharding). `node`: the ranks of one node (`devices`): shard within each node over its
            fast links, replicate across nodes, and all-reduce only the gradient shards between nodes
            (hybrid sharding). N: groups of N consecutive ranks (nodes with many GPUs; hybrid sharding
            on one machine). Each rank then keeps 1/N of every parameter, gradient and optimizer state.
        process_group_backend, timeout: as for Lightning's strategies (ddp-app sets `timeout` from
            `collective_timeout_s`)."""

    def __init__(
        self,
        shard_modules: list[str] | None = None,
        reshard_after_forward: bool = True,
        activation_checkpointing: bool = False,
        param_dtype: ComputeDtype | None = None,
        reduce_dtype: ComputeDtype | None = None,
        cpu_offload: bool = False,
        shard_group_size: ShardGroupSize = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        for key, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if value is not None and value not in DTYPES:
                raise UserFacingError(
                    f"trainer.strategy.init_args.{key}={value} is not a dtype FSDP computes in. Fix: one of "
                    f"{', '.join(DTYPES)}, or null for the parameters' own dtype."
                )
        super().__init__(save_distributed_checkpoint=True, process_group_backend=process_group_backend, timeout=timeout)
        self.shard_modules = list(shard_modules) if shard_modules is not None else None
        self.reshard_after_forward = reshard_after_forward
        self.activation_checkpointing = activation_checkpointing
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.cpu_offload = cpu_offload
        self.shard_group_size = shard_group_size
        check_shard_group_size(shard_group_size)
        self._data_parallel_mesh: DeviceMesh | None = None

    @property
    def device_mesh(self) -> DeviceMesh:
        """What the parameters are sharded over: one dimension, "data_parallel", of every rank; under hybrid sharding
        two, "data_parallel_replicate" x "data_parallel_shard" (`mesh_layout`)."""
        if self._data_parallel_mesh is None:
            raise RuntimeError("The device mesh exists once the processes have started (setup_environment).")
        return self._data_parallel_mesh

    @property
    def mesh_layout(self) -> MeshLayout:
        """This run's replicas x shards, from `shard_group_size` and the launch (refused in one line when the size does
        not divide the ranks)."""
        return mesh_layout(self.shard_group_size, self.world_size, self.num_processes)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every rank reads its own samples, whatever the mesh (ModelParallelStrategy's shard the data over the
        `data_parallel` dimension only)."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup_environment(self) -> None:
        """The process group and the mesh, once: ddp-app starts the environment before `fit` to agree on `--ckpt_path
        last` (app/checkpoints/last.py), and `fit` calls this again."""
        if self._data_parallel_mesh is None:
            layout = self.mesh_layout  # a bad shard_group_size stops every rank before any collective
            require(self, "_setup_distributed", "lightning", "starting the process group of strategy fsdp")
            self._setup_distributed()  # ModelParallelStrategy's: the process group with our timeout
            self._data_parallel_mesh = data_parallel_mesh(self.root_device.type, layout)
        if self.lightning_module is not None:
            # What `LightningModule.device_mesh` returns, for a module's own `configure_model`.
            require(self.lightning_module, "_device_mesh", "lightning", "LightningModule.device_mesh under fsdp")
            self.lightning_module._device_mesh = self._data_parallel_mesh

    def setup(self, trainer: pl.Trainer) -> None:
        """Shard the module (unless its own `configure_model` did), then build the optimizers on the sharded parameters,
        as ModelParallelStrategy does after the user's sharding."""
        assert self.model is not None and self.accelerator is not None
        module = self.lightning_module
        if trainer.state.fn == TrainerFn.FITTING and not module.automatic_optimization:
            raise UserFacingError(
                f"{type(module).__name__} uses manual optimization (automatic_optimization = False), which "
                "strategy fsdp does not support here. Fix: use automatic optimization, or strategy ddp."
            )
        if any(isinstance(parameter, DTensor) for parameter in self.model.parameters()):
            super().setup(trainer)  # the module's own configure_model sharded it: Lightning's path
            return
        self.accelerator.setup(trainer)
        unsharded = {id(parameter): name for name, parameter in self.model.named_parameters()}
        self.shard(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            optimize_sharded_parameters(self.optimizers, self.model, unsharded)
        self.setup_precision_plugin()

    def shard(self, module: nn.Module) -> list[str]:
        """`fully_shard` the units `shard_units` names, bottom-up; returns their names, outermost last."""
        blocks, units = shard_units(module, self.shard_modules)
        mesh = self.device_mesh
        policy = MixedPrecisionPolicy(
            param_dtype=DTYPES[self.param_dtype] if self.param_dtype else None,
            reduce_dtype=DTYPES[self.reduce_dtype] if self.reduce_dtype else None,
        )
        # cpu_offload: the sharded parameters, their gradients and so the optimizer state live in host memory; FSDP2
        # copies each unit's shard to the device for its all-gather (pinned on a GPU).
        offload = CPUOffloadPolicy(pin_memory=self.root_device.type == "cuda") if self.cpu_offload else OffloadPolicy()
        if self.activation_checkpointing:
            checkpoint = require(composable, "checkpoint", "torch", "activation_checkpointing of strategy fsdp")
            for name in blocks:
                # The composable form: the block keeps its parameter names (a wrapper module would add one to every key
                # of every checkpoint), and FSDP2 composes with it.
                checkpoint(module.get_submodule(name))
        # Inner units first: fully_shard of a parent leaves the parameters its sharded children own.
        for name in sorted(units, key=lambda unit: unit.count("."), reverse=True):
            fully_shard(
                module.get_submodule(name),
                mesh=mesh,
                reshard_after_forward=self.reshard_after_forward,
                mp_policy=policy,
                offload_policy=offload,
            )
        return units

    @property
    def checkpoint_io(self) -> CheckpointIO:
        """Sharded checkpoints (app/checkpoints/sharded_io.py), also in a Trainer built without ddp-app's."""
        if self._checkpoint_io is None:
            self._checkpoint_io = ShardedCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO) -> None:
        self._checkpoint_io = io

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        """Every rank's shards through the checkpoint I/O, on every rank (Lightning's `Strategy` calls it on rank 0
        only), with the mesh they are written from."""
        layout = self.mesh_layout
        checkpoint_state.put(checkpoint, "sharding", {"replicas": layout.replicas, "shards": layout.shards})
        self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        """This rank's part of the weights and optimizer state loaded in place by the checkpoint I/O (DCP reshards them
        when the mesh changed); returns the rest of the checkpoint."""
        assert self.model is not None
        if (received := load_received_shards(checkpoint_path, self.model, self.optimizers)) is not None:
            return received  # a replica group's process healing from a peer's shards (fault tolerance)
        checkpoint = self.checkpoint_io.load_checkpoint(
            checkpoint_path, module=self.model, optimizers=self.optimizers, strict=self.lightning_module.strict_loading
        )
        saved = checkpoint_state.get(checkpoint, "sharding")  # None before hybrid sharding existed
        if saved is not None and self.is_global_zero and MeshLayout(**saved) != self.mesh_layout:
            print(
                f"ddp-app: the checkpoint's shards were written by {MeshLayout(**saved).describe()} and this run "
                f"is {self.mesh_layout.describe()}: DCP reshards the weights and the optimizer state",
                flush=True,
            )
        return checkpoint

    def teardown(self) -> None:
        """The checkpoint writes finish (a failed one is said); ModelParallelStrategy's skips them."""
        self.checkpoint_io.teardown()
        super().teardown()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's shards (DTensors), for DCP."""
        assert self.model is not None
        return get_model_state_dict(self.model)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's shards of the optimizer state, keyed by parameter name, for DCP."""
        assert self.model is not None
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        return get_optimizer_state_dict(self.model, optimizer)


def data_parallel_mesh(device_type: str, layout: MeshLayout) -> DeviceMesh:
    """What FSDP2 shards over: one dimension, "data_parallel", of every rank; under hybrid sharding
    "data_parallel_replicate" x "data_parallel_shard", row-major (each shard group is `shards` consecutive ranks). An
    explicit device type: a mesh built for "cuda" while gloo runs on CPU failed (pytorch#132471)."""
    if layout.is_hybrid:
        names = ("data_parallel_replicate", "data_parallel_shard")
        return init_device_mesh(device_type, (layout.replicas, layout.shards), mesh_dim_names=names)
    return init_device_mesh(device_type, (layout.replicas * layout.shards,), mesh_dim_names=("data_parallel",))


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _class_names(module: nn.Module) -> set[str]:
    return {type(sub).__name__ for sub in module.modules() if _has_parameters(sub)}


def _module_list_classes(module: nn.Module) -> set[str]:
    """The default shard units: the classes of the modules held in an `nn.ModuleList`."""
    return {
        type(element).__name__
        for sub in module.modules()
        if isinstance(sub, nn.ModuleList)
        for element in sub
        if _has_parameters(element)
    }


def shard_units(module: nn.Module, shard_modules: list[str] | None) -> tuple[list[str], list[str]]:
    """The submodules `FSDP2Strategy.shard` makes shard units: (the blocks, every unit, outermost last). The blocks are
    of the `shard_modules` classes (by default those held in an `nn.ModuleList`); each child of the LightningModule that
    holds parameters outside them is a unit too."""
    own = [name for name, _ in module.named_parameters(recurse=False)]
    if own:
        raise UserFacingError(
            f"{type(module).__name__} holds parameters directly ({', '.join(own[:3])}): strategy fsdp shards "
            "submodules. Fix: keep them in a submodule (self.net = ...), or use strategy ddp."
        )
    classes = set(shard_modules) if shard_modules is not None else _module_list_classes(module)
    if shard_modules is not None and not any(type(sub).__name__ in classes for sub in module.modules()):
        raise UserFacingError(
            f"trainer.strategy.init_args.shard_modules={shard_modules}: {type(module).__name__} has no "
            f"submodule of these classes. Fix: class names of its submodules, e.g. "
            f"{sorted(_class_names(module))[:5]}, or leave it out (null) for the default."
        )
    blocks = [name for name, sub in module.named_modules() if name and type(sub).__name__ in classes]
    children = [name for name, child in module.named_children() if name not in blocks and _has_parameters(child)]
    return blocks, blocks + children


def optimize_sharded_parameters(
    optimizers: list[torch.optim.Optimizer], model: nn.Module, unsharded: dict[int, str]
) -> None:
    """Point the optimizers at the sharded parameters where they hold the unsharded ones.

    LightningCLI builds `optimizer:` before `fully_shard` replaces each parameter with a DTensor of the same name.
    Nothing has stepped it yet, so each parameter is swapped in place, keeping groups and schedulers."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [
                model.get_parameter(unsharded[id(parameter)]) if id(parameter) in unsharded else parameter
                for parameter in group["params"]
            ]
