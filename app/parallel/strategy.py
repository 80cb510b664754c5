"""The one place that decides what `trainer.strategy` is.

A config names its strategy in one of several forms: a registered name (`ddp`, `ddp_spawn`, `fsdp`,
`auto`), a `class_path` (Lightning's `DDPStrategy`, ddp-app's `FSDP2Strategy`, or a user's subclass
of either), or, from Python, a strategy object. `resolve_strategy` turns any of them into a
`ResolvedStrategy`, and every other module (the launcher, the config checks, the parity tool, the
benches) asks that value instead of comparing names or classes itself.

A class is recognised by what it is (`issubclass` of Lightning's `DDPStrategy` or of ddp-app's
`FSDP2Strategy`), never by the end of its name, so a user's `class_path: mylib.MyDDP` forks its ranks
exactly like `ddp`.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import importlib
from dataclasses import dataclass
from typing import Any, Literal

from app.errors import TrainerArgumentError, UserFacingError

# `strategy: fsdp` in a ddp-app config is FSDP2 with every default (app/parallel/fsdp.py), not
# Lightning's FSDP1 strategy registered under that name.
FSDP_NAME = "fsdp"
FSDP_CLASS_PATH = "app.parallel.fsdp.FSDP2Strategy"

# Strategy names whose own launcher starts processes from inside `fit` (multiprocessing); ddp-app
# starts the ranks itself, so they run as the same DDP the script launcher starts.
SPAWNING_STRATEGIES = {
    "ddp_spawn": "ddp",
    "ddp_fork": "ddp",
    "ddp_notebook": "ddp",
    "ddp_spawn_find_unused_parameters_true": "ddp_find_unused_parameters_true",
    "ddp_fork_find_unused_parameters_true": "ddp_find_unused_parameters_true",
    "ddp_notebook_find_unused_parameters_true": "ddp_find_unused_parameters_true",
}
DDP_NAMES = ("ddp", "ddp_find_unused_parameters_true", *SPAWNING_STRATEGIES)


# `trainer.strategy.init_args.shard_group_size` of strategy fsdp: the ranks that shard the model
# between them (null: every rank; `node`: the ranks of one node; N: groups of N consecutive ranks).
ShardGroupSize = int | Literal["node"] | None


@dataclass(frozen=True)
class MeshLayout:
    """Strategy fsdp's ranks as `replicas` groups of `shards` consecutive ranks: each group holds one
    whole copy of the model, sharded over its ranks. One replica is full sharding (FSDP); more is
    hybrid sharding (HSDP): parameters are gathered and gradients reduce-scattered within a group (one
    node's fast links), and only the gradient shards are all-reduced between the groups (across nodes).
    The data is sharded over every rank either way: each rank reads its own samples."""

    replicas: int
    shards: int

    @property
    def is_hybrid(self) -> bool:
        return self.replicas > 1

    def describe(self) -> str:
        """ "2 replicas x 2 shards": the words of the run's first line and of the resume notice."""
        replicas = f"{self.replicas} replica{'s' if self.replicas != 1 else ''}"
        return f"{replicas} x {self.shards} shard{'s' if self.shards != 1 else ''}"


def check_shard_group_size(shard_group_size: Any) -> None:
    """A value that is no group size at all (0, -2, "nodes") is refused where the strategy is built."""
    if shard_group_size in (None, "node"):
        return
    if not isinstance(shard_group_size, int) or isinstance(shard_group_size, bool) or shard_group_size < 1:
        raise UserFacingError(
            f"trainer.strategy.init_args.shard_group_size={shard_group_size!r} is not a group size. Fix: a "
            "number of ranks (at least 1), `node` (the ranks of one node), or null (every rank)."
        )


def mesh_layout(shard_group_size: ShardGroupSize, world_size: int, ranks_per_node: int) -> MeshLayout:
    """The layout `shard_group_size` asks for on `world_size` ranks, `ranks_per_node` per node; a size
    that does not divide the ranks into equal groups is refused in one line, before any process group
    exists (every rank computes the same answer)."""
    check_shard_group_size(shard_group_size)
    if shard_group_size is None:
        size = world_size
    elif shard_group_size == "node":
        size = ranks_per_node
    else:
        size = int(shard_group_size)
    if size > world_size or world_size % size:
        divisors = [str(n) for n in range(1, world_size + 1) if world_size % n == 0]
        raise UserFacingError(
            f"trainer.strategy.init_args.shard_group_size={shard_group_size} ({size} ranks) does not divide the "
            f"run's {world_size} ranks into equal shard groups. Fix: one of {', '.join(divisors)}, `node`, or "
            "null (every rank)."
        )
    return MeshLayout(world_size // size, size)


class StrategyKind(enum.Enum):
    """What ddp-app does differently per strategy: DDP and FSDP fork one process per device and
    checkpoint differently (one file from rank 0; a directory of shards from every rank)."""

    DDP = "ddp"
    FSDP = "fsdp"
    SINGLE = "single"  # one process: `auto` on one device, `single_device`
    OTHER = "other"  # a strategy ddp-app does not launch itself (DeepSpeed, Lightning's FSDP1, a user's own)


@dataclass(frozen=True)
class ResolvedStrategy:
    """`trainer.strategy` as ddp-app understands it.

    `written` is the form the config used (a name or a class path, for messages); `runs_as` is the
    registered name the ranks get instead when ddp-app starts them itself (`ddp_spawn` -> `ddp`), and
    `start_method` the non-default `start_method` of a `DDPStrategy` class path that ddp-app replaces
    by `popen` for the same reason.
    """

    kind: StrategyKind
    written: str
    registered_name: str | None = None  # the StrategyRegistry name Lightning builds (`auto` -> `ddp`), if a name
    runs_as: str | None = None
    start_method: str | None = None
    shard_group_size: ShardGroupSize = None  # strategy fsdp's, as the config gives it (`mesh_layout`)

    @property
    def forks_ranks(self) -> bool:
        """ddp-app's launcher starts one process per device (else the run stays in this process)."""
        return self.kind in (StrategyKind.DDP, StrategyKind.FSDP)

    @property
    def is_sharded(self) -> bool:
        """Weights and optimizer state are sharded over the ranks; checkpoints are directories of shards."""
        return self.kind is StrategyKind.FSDP

    def mesh(self, world_size: int, ranks_per_node: int) -> MeshLayout | None:
        """How a sharded strategy lays out `world_size` ranks (None for any other strategy)."""
        return mesh_layout(self.shard_group_size, world_size, ranks_per_node) if self.is_sharded else None


def resolve_strategy(strategy: Any, world_size: int = 1) -> ResolvedStrategy:
    """`trainer.strategy` in any form (name, parsed `class_path` namespace or dict, strategy object)
    as a `ResolvedStrategy`. `auto` is `ddp` when the run has more than one process (what Lightning
    picks outside a notebook, which `ddp-app` never runs in; the kind of any other form does not
    depend on `world_size`). A name Lightning does not know is refused
    here in one line, with the nearest names ("did you mean `fsdp`?")."""
    if strategy is None or isinstance(strategy, str):
        return _resolve_name(strategy or "auto", world_size)
    if isinstance(strategy, type):
        return _resolve_class(strategy, f"{strategy.__module__}.{strategy.__qualname__}", {})
    class_path = _get(strategy, "class_path")
    if class_path is not None:
        init_args = _get(strategy, "init_args") or {}
        return _resolve_class(_import_class(str(class_path)), str(class_path), init_args)
    cls = type(strategy)  # a strategy object, given in Python: ddp-app does not rewrite it
    own = {"shard_group_size": getattr(strategy, "shard_group_size", None)}
    return _resolve_class(cls, f"{cls.__module__}.{cls.__qualname__}", own)


def expand_fsdp_name(trainer_config: Any) -> None:
    """`strategy: fsdp` becomes ddp-app's FSDP2 strategy with its defaults in the parsed trainer config,
    before Lightning reads it (its own `fsdp` name is its FSDP1 strategy)."""
    strategy = trainer_config.get("strategy")
    if isinstance(strategy, str) and resolve_strategy(strategy).is_sharded:
        from jsonargparse import Namespace

        trainer_config["strategy"] = Namespace(class_path=FSDP_CLASS_PATH, init_args=Namespace())


def _resolve_name(name: str, world_size: int) -> ResolvedStrategy:
    if name == "auto":
        if world_size > 1:
            return ResolvedStrategy(StrategyKind.DDP, name, registered_name="ddp")
        return ResolvedStrategy(StrategyKind.SINGLE, name)
    if name == FSDP_NAME:
        return ResolvedStrategy(StrategyKind.FSDP, name)
    if name in DDP_NAMES:
        return ResolvedStrategy(StrategyKind.DDP, name, registered_name=name, runs_as=SPAWNING_STRATEGIES.get(name))
    from lightning.pytorch.strategies import StrategyRegistry

    known = StrategyRegistry.available_strategies()
    if name not in known:
        choices = sorted({FSDP_NAME, "auto", *known})
        close = difflib.get_close_matches(name.lower(), choices, n=3, cutoff=0.6)
        if name.lower().startswith(FSDP_NAME):  # fsdp2, FSDP, fsdp_v2: ddp-app's fsdp is FSDP2
            close = [FSDP_NAME, *(choice for choice in close if choice != FSDP_NAME)][:1]
        hint = f"Did you mean {' or '.join(f'`{choice}`' for choice in close)}? " if close else ""
        raise TrainerArgumentError(
            f"invalid value {name!r} for trainer.strategy: not a strategy ddp-app or Lightning knows. {hint}Fix: "
            "`ddp` (data parallel), `fsdp` (sharded: FSDP2), `auto`, another of Lightning's names (python -c 'from "
            "lightning.pytorch.strategies import StrategyRegistry as r; print(r.available_strategies())'), "
            "or a class_path."
        )
    entry = StrategyRegistry[name]
    resolved = _resolve_class(entry["strategy"], name, entry["init_params"])
    return dataclasses.replace(resolved, registered_name=name)


def _resolve_class(cls: type, written: str, init_args: Any) -> ResolvedStrategy:
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy

    # By name, not `issubclass`: app/parallel/fsdp.py imports this module (no import circle).
    if any(f"{base.__module__}.{base.__qualname__}" == FSDP_CLASS_PATH for base in cls.__mro__):
        return ResolvedStrategy(StrategyKind.FSDP, written, shard_group_size=_get(init_args, "shard_group_size"))
    if issubclass(cls, DeepSpeedStrategy):  # a DDPStrategy subclass that ddp-app neither launches nor checkpoints
        return ResolvedStrategy(StrategyKind.OTHER, written)
    if issubclass(cls, DDPStrategy):
        start_method = _get(init_args, "start_method") or "popen"
        return ResolvedStrategy(
            StrategyKind.DDP, written, start_method=None if start_method == "popen" else start_method
        )
    if issubclass(cls, SingleDeviceStrategy):
        return ResolvedStrategy(StrategyKind.SINGLE, written)
    return ResolvedStrategy(StrategyKind.OTHER, written)


def _import_class(class_path: str) -> type:
    module_name, _, class_name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as error:
        raise UserFacingError(
            f"trainer.strategy.class_path {class_path} cannot be imported ({error}). Fix: a class path "
            "such as lightning.pytorch.strategies.DDPStrategy, or a strategy name (ddp, fsdp)."
        ) from error


def _get(container: Any, key: str) -> Any:
    """A key of a parsed config namespace or a plain dict (the parity tool reads the YAML itself)."""
    if isinstance(container, dict):
        return container.get(key)
    getter = getattr(container, "get", None)
    return getter(key) if callable(getter) else getattr(container, key, None)
