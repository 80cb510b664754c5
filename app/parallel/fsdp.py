"""`strategy: fsdp`: fully sharded data parallel (FSDP2, `torch.distributed.fsdp.fully_shard`) for a
model that no longer fits one device with DDP (docs/fsdp.md).

    trainer:
      strategy:
        class_path: app.parallel.fsdp.FSDP2Strategy
        init_args: {shard_modules: [Block], param_dtype: bfloat16, shard_group_size: node}

(`strategy: fsdp` is the same with every default.) Each rank keeps 1/world_size of every
parameter, gradient and optimizer state; a shard unit's full parameters exist only while its
forward or backward runs. Built on Lightning's `ModelParallelStrategy`, which needs the module to
shard itself in `configure_model`; this subclass shards a plain LightningModule by itself instead,
over a 1-D mesh of every rank, or, with `shard_group_size`, a 2-D mesh (replicas x shards) that
`fully_shard` replicates over its first dimension (hybrid sharding, HSDP). The mesh has an explicit
device type (gloo + `fully_shard` failed where GPUs were visible, pytorch/pytorch#132471), so the
same run works on CPU with gloo. The data is sharded over every rank under either mesh (ddp-app's
samplers, and `distributed_sampler_kwargs` below): Lightning's own would shard it over the
`data_parallel` mesh dimension only, and under HSDP every rank of a group would read the same batches.

Checkpoints are sharded: every rank writes its shards through DCP, and a save is published
atomically (app/checkpoints/sharded.py); a resume on another number of ranks reshards them.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.distributed._composable as composable
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from app.checkpoints import state as checkpoint_state
from app.checkpoints.io import CheckpointError, atomic_torch_save, safe_load
from app.checkpoints.plugin import (
    BackgroundWriter,
    CheckpointWriteError,
    changed_while_copied,
    snapshot,
    stage,
    write_failed,
)
from app.checkpoints.sharded import (
    META_NAME,
    SafeFileSystemReader,
    SafeLoadPlanner,
    is_sharded_checkpoint,
    new_shards_directory,
    publish,
    remove_sharded,
    remove_unpublished,
    sharded_write_error,
)
from app.checkpoints.staging import HostStaging
from app.errors import UserFacingError
from app.parallel.mesh import MeshLayout, ShardGroupSize, check_shard_group_size, mesh_layout
from app.private_apis import require

# The dtypes FSDP2 may gather parameters and reduce gradients in, by the names a config gives them (a
# Literal, so that a config naming another is refused by the parser in one line, naming the key).
ComputeDtype = Literal["float32", "bfloat16", "float16"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class FSDP2Strategy(ModelParallelStrategy):
    """Lightning's ModelParallelStrategy with the sharding done for the user, and safe, atomic,
    resharding checkpoints.

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
            `collective_timeout_s`).
    """

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
        # Set by app/run/build.py where saves are written in the background (`last_checkpoint.async_save`).
        self.background_writer: BackgroundWriter | None = None
        self._checkpoint_group: dist.ProcessGroup | None = None  # the background writes' own (gloo)
        self._host_staging = HostStaging()  # background saves' host copy, kept from save to save

    @property
    def device_mesh(self) -> DeviceMesh:
        """What the parameters are sharded over: one dimension, "data_parallel", of every rank; under
        hybrid sharding two, "data_parallel_replicate" x "data_parallel_shard" (`mesh_layout`)."""
        if self._data_parallel_mesh is None:
            raise RuntimeError("The device mesh exists once the processes have started (setup_environment).")
        return self._data_parallel_mesh

    @property
    def mesh_layout(self) -> MeshLayout:
        """This run's replicas x shards, from `shard_group_size` and the launch (refused in one line
        when the size does not divide the ranks)."""
        return mesh_layout(self.shard_group_size, self.world_size, self.num_processes)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every rank reads its own samples, whatever the mesh (ModelParallelStrategy's shard the data
        over the `data_parallel` dimension only)."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup_environment(self) -> None:
        """The process group and the mesh, once: ddp-app starts the environment before `fit` to agree
        on `--ckpt_path last` (app/checkpoints/last.py), and `fit` calls this again."""
        if self._data_parallel_mesh is None:
            layout = self.mesh_layout  # a bad shard_group_size stops every rank before any collective
            require(self, "_setup_distributed", "lightning", "starting the process group of strategy fsdp")
            self._setup_distributed()  # ModelParallelStrategy's: the process group with our timeout
            # An explicit device type: a mesh built for "cuda" while gloo runs on CPU failed (pytorch#132471).
            if layout.is_hybrid:  # row-major: each shard group is `shards` consecutive ranks
                self._data_parallel_mesh = init_device_mesh(
                    self.root_device.type,
                    (layout.replicas, layout.shards),
                    mesh_dim_names=("data_parallel_replicate", "data_parallel_shard"),
                )
            else:
                self._data_parallel_mesh = init_device_mesh(
                    self.root_device.type, (self.world_size,), mesh_dim_names=("data_parallel",)
                )
        if self.lightning_module is not None:
            # What `LightningModule.device_mesh` returns, for a module's own `configure_model`.
            require(self.lightning_module, "_device_mesh", "lightning", "LightningModule.device_mesh under fsdp")
            self.lightning_module._device_mesh = self._data_parallel_mesh

    def setup(self, trainer: pl.Trainer) -> None:
        """Shard the module (unless its own `configure_model` did), then build the optimizers on the
        sharded parameters, as ModelParallelStrategy does after the user's sharding."""
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
        # cpu_offload: the sharded parameters, their gradients and so the optimizer state live in host
        # memory; FSDP2 copies each unit's shard to the device for its all-gather (pinned on a GPU).
        offload = CPUOffloadPolicy(pin_memory=self.root_device.type == "cuda") if self.cpu_offload else OffloadPolicy()
        if self.activation_checkpointing:
            checkpoint = require(composable, "checkpoint", "torch", "activation_checkpointing of strategy fsdp")
            for name in blocks:
                # The composable form: the block keeps its parameter names (a wrapper module would add
                # one to every key of every checkpoint), and FSDP2 composes with it.
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

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        """Every rank writes its shards into a fresh directory; rank 0 writes meta.pt and, once every
        rank has finished, publishes it under `filepath` atomically (app/checkpoints/sharded.py).

        With `background_writer` (`last_checkpoint.async_save`, during training) the save blocks only
        while this rank's shards are copied to host memory (`snapshot`, into buffers kept from save
        to save): the writes (`dcp.save` of that copy), DCP's index and the publishing of the link
        run on the writer's thread, whose collectives go over a process group of their own (gloo:
        DCP's background collectives need a CPU group, and must not interleave with training's on the
        default group). A kill before the link moves
        leaves the previous checkpoint published; the next save removes the unpublished directory."""
        if storage_options is not None:
            raise TypeError("FSDP2Strategy.save_checkpoint takes no storage_options (checkpoints go to a path).")
        writer = self.background_writer
        in_background = writer.begin_save(Path(filepath).name) if writer is not None else False
        path = Path(self.broadcast(str(filepath)))
        shards = new_shards_directory(path) if self.is_global_zero else None
        shards = Path(self.broadcast(str(shards)))
        if self.is_global_zero:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                remove_unpublished(path)  # directories of saves a kill interrupted
                shards.mkdir()
            except OSError as error:
                raise write_failed(path, error) from error
        self.barrier()
        layout = self.mesh_layout
        checkpoint_state.put(checkpoint, "sharding", {"replicas": layout.replicas, "shards": layout.shards})
        tensors = {"state_dict": checkpoint.pop("state_dict")}
        for index, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
            tensors[f"optimizer_{index}"] = optimizer_state
        if in_background:
            assert writer is not None
            if self._checkpoint_group is None:  # every rank, at the same save: a collective call
                self._checkpoint_group = dist.new_group(backend="gloo", timeout=self._timeout)
            # The only part that blocks: this rank's shards copied into host buffers kept from the last
            # save, as a DDP save's (`snapshot`). With last_checkpoint.overlap_copy, what an optimizer
            # step changes is copied on the writer's thread instead, while the next step's forward and
            # backward run; that step's update waits for the copy (`stage`).
            late = writer.stepped_storages()  # empty unless overlap_copy
            staged = snapshot(tensors, self._host_staging, late)
            if self.is_global_zero:
                self._write_meta(checkpoint, shards, path)
            copy_late = self._copy_late if writer.copies_late else None  # alike on every rank
            writer.write_in_background(self._save_staged, staged, path, shards, stage=copy_late)
            return
        try:
            dcp.save(tensors, checkpoint_id=shards)  # returns once DCP's index is written (rank 0, after all)
        except CheckpointException as error:
            _raise_write_error(path, error)
        if self.is_global_zero:
            self._write_meta(checkpoint, shards, path)
        self.barrier()
        if self.is_global_zero:
            publish(shards, path)
        if writer is not None:
            writer.written()

    def _copy_late(self, staged: dict[str, Any], path: Path, shards: Path) -> tuple[Any, ...]:
        """On the writer's thread (`last_checkpoint.overlap_copy`): the late copies made (`stage`); a
        change seen while they were made is held for `_save_staged` to fail the save on every rank."""
        try:
            staged, *_ = stage(self._host_staging, staged, path)
        except CheckpointWriteError as torn:
            return staged, path, shards, torn
        return staged, path, shards, None

    def _save_staged(
        self, staged: dict[str, Any], path: Path, shards: Path, torn: CheckpointWriteError | None = None
    ) -> None:
        """On the writer's thread: DCP writes this rank's staged shards (a blocking `dcp.save` of the
        host copies, its collectives over the writes' own group), then rank 0 moves the link. Rank 0's
        `dcp.save` returns once every rank's shards and DCP's index are on disk (DCP gathers every
        rank's result before it writes the index).

        First every rank learns whether any rank's late copy was `torn` (one all-reduce), so that all
        of them fail that save alike instead of the others waiting in `dcp.save` for it.

        Not `dcp.async_save` from the training thread: its upload thread, started there, ran at
        training's priority and took its time from the save step (about 1 s of a 1 GB save's 5.5 s
        step on 2 busy cores, in a timed fit not kept); here, DCP's work runs at the writer's
        lower priority."""
        changed = torch.tensor([self.global_rank + 1 if torn is not None else 0], dtype=torch.int32)
        dist.all_reduce(changed, op=dist.ReduceOp.MAX, group=self._checkpoint_group)
        if changed.item():
            other = f"a parameter or optimizer state on rank {int(changed.item()) - 1}"
            raise torn or changed_while_copied(path, other)
        try:
            dcp.save(staged, checkpoint_id=shards, process_group=self._checkpoint_group)
        except CheckpointException as error:
            _raise_write_error(path, error)
        if self.is_global_zero:
            try:
                publish(shards, path)
            except OSError as error:
                raise write_failed(path, error) from error

    @staticmethod
    def _write_meta(checkpoint: dict[str, Any], shards: Path, path: Path) -> None:
        try:
            atomic_torch_save(checkpoint, shards / META_NAME)
        except OSError as error:
            raise write_failed(path, error) from error

    def remove_checkpoint(self, filepath: str | Path) -> None:
        if not self.is_global_zero:
            return
        if self.background_writer is not None:
            self.background_writer.remove(remove_sharded, Path(filepath))  # after the save before it is published
        else:
            remove_sharded(Path(filepath))

    def teardown(self) -> None:
        """The background writes finish (a failed one is said) while the process groups still exist."""
        if self.background_writer is not None:
            self.background_writer.teardown()
        self._host_staging = HostStaging()  # the last save's host copy released
        super().teardown()

    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        """Load this rank's part of the weights and optimizer state (DCP reshards them when the world
        size changed) and return the rest of the checkpoint; nothing read here can run code."""
        path = Path(self.broadcast(str(checkpoint_path)))
        if not is_sharded_checkpoint(path):
            raise CheckpointError(
                f"{path} is not a sharded checkpoint, which strategy fsdp resumes from (loading a DDP checkpoint "
                "into a sharded model is not built yet). Fix: resume it with the strategy it was trained with."
            )
        assert self.model is not None
        strict = self.lightning_module.strict_loading
        model_state = {"state_dict": get_model_state_dict(self.model)}
        dcp.load(model_state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
        set_model_state_dict(self.model, model_state["state_dict"], options=StateDictOptions(strict=strict))
        for index, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{index}"
            optimizer_state = {key: get_optimizer_state_dict(self.model, optimizer)}
            dcp.load(optimizer_state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
            set_optimizer_state_dict(self.model, optimizer, optimizer_state[key])
        checkpoint = safe_load(path / META_NAME, name=f"--ckpt_path {path}")
        saved = checkpoint_state.get(checkpoint, "sharding")  # None before hybrid sharding existed
        if saved is not None and self.is_global_zero:
            written, now = MeshLayout(**saved), self.mesh_layout
            if written != now:
                print(
                    f"ddp-app: the checkpoint's shards were written by {written.describe()} and this run is "
                    f"{now.describe()}: DCP reshards the weights and the optimizer state",
                    flush=True,
                )
        return checkpoint

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


def _raise_write_error(path: Path, error: CheckpointException) -> None:
    """Raise the one line of a sharded save the disk refused, else DCP's own error (a bug's tracebacks)."""
    one_line = sharded_write_error(path, error)
    if one_line is None:
        raise error
    raise one_line from error


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
    """The submodules `FSDP2Strategy.shard` makes shard units: (the blocks, every unit, outermost last).
    The blocks are of the `shard_modules` classes (by default those held in an `nn.ModuleList`); each
    child of the LightningModule that holds parameters outside them is a unit too."""
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

    `fully_shard` replaces every parameter with a sharded one (a DTensor) of the same name, and
    LightningCLI builds the config's `optimizer:` on the module's parameters when it parses the
    config, long before the strategy shards them: that optimizer would step parameters nothing
    uses. Nothing has stepped it yet (a resume loads its state later), so each parameter is
    replaced by its sharded successor, in place, keeping the groups and any scheduler bound to it.
    """
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [
                model.get_parameter(unsharded[id(parameter)]) if id(parameter) in unsharded else parameter
                for parameter in group["params"]
            ]
