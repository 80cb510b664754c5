"""The one place that decides what `trainer.strategy` is.

A config names its strategy in one of several forms: a registered name (`ddp`, `ddp_spawn`, `fsdp`,
`auto`, and ddp-app's `diloco`), a `class_path` (Lightning's `DDPStrategy`, ddp-app's `FSDP2Strategy`
or `DiLoCoStrategy`, or a user's subclass of one), or, from Python, a strategy object.
`resolve_strategy` turns any of them into a `ResolvedStrategy`, and every other module (the launcher,
the config checks, the parity tool, the benches) asks that value instead of comparing names or classes
itself.

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
from typing import Any

from app.errors import TrainerArgumentError, UserFacingError
from app.parallel.mesh import (  # noqa: F401 (the mesh's names, re-exported for the strategy's users)
    MeshLayout,
    ShardGroupSize,
    check_shard_group_size,
    mesh_layout,
)

# `strategy: fsdp` in a ddp-app config is FSDP2 with every default (app/parallel/fsdp.py), not
# Lightning's FSDP1 strategy registered under that name.
FSDP_NAME = "fsdp"
FSDP_CLASS_PATH = "app.parallel.fsdp.FSDP2Strategy"
# `strategy: diloco`: ddp-app's DiLoCo (app/parallel/diloco.py), a DDPStrategy subclass without DDP's
# per-step all-reduce; a name of ddp-app's, not Lightning's.
DILOCO_NAME = "diloco"
DILOCO_CLASS_PATH = "app.parallel.diloco.DiLoCoStrategy"

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


class StrategyKind(enum.Enum):
    """What ddp-app does differently per strategy: DDP and FSDP fork one process per device and
    checkpoint differently (one file from rank 0; a directory of shards from every rank)."""

    DDP = "ddp"
    FSDP = "fsdp"
    SINGLE = "single"  # one process: `auto` on one device, `single_device`
    DILOCO = "diloco"  # DDP's processes and checkpoints; the replicas sync every sync_every steps
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
        return self.kind in (StrategyKind.DDP, StrategyKind.FSDP, StrategyKind.DILOCO)

    @property
    def is_sharded(self) -> bool:
        """Weights and optimizer state are sharded over the ranks; checkpoints are directories of shards."""
        return self.kind is StrategyKind.FSDP

    def mesh(self, world_size: int, ranks_per_node: int) -> MeshLayout | None:
        """How a sharded strategy lays out `world_size` ranks (None for any other strategy)."""
        return mesh_layout(self.shard_group_size, world_size, ranks_per_node) if self.is_sharded else None

    def at_world_size(self, world_size: int) -> ResolvedStrategy:
        """This strategy on a run of `world_size` processes: `auto` is `ddp` on more than one (what
        Lightning picks outside a notebook, which `ddp-app` never runs in); any other form is unchanged."""
        if self.written == "auto" and self.registered_name is None and world_size > 1:
            return ResolvedStrategy(StrategyKind.DDP, self.written, registered_name="ddp")
        return self

    @property
    def class_path_for_a_name(self) -> str | None:
        """The class a name written as a plain string must become before Lightning reads it: ddp-app's
        FSDP2 for `fsdp` (Lightning's `fsdp` is FSDP1), the class itself for a class path given as a
        string (`--trainer.strategy app.parallel.fsdp.FSDP2Strategy`); None for Lightning's own names."""
        if self.kind is StrategyKind.FSDP and self.written == FSDP_NAME:
            return FSDP_CLASS_PATH
        if self.kind is StrategyKind.DILOCO and self.written == DILOCO_NAME:
            return DILOCO_CLASS_PATH
        return self.written if "." in self.written else None


def resolve_strategy(strategy: Any, world_size: int = 1) -> ResolvedStrategy:
    """`trainer.strategy` in any form (name, class path as a string, parsed `class_path` namespace or
    dict, strategy object) as a `ResolvedStrategy`, at `world_size` processes (`at_world_size`). A name
    Lightning does not know is refused here in one line, with the nearest names ("did you mean
    `fsdp`?"). app/run/plan.py calls it once per process; the other callers are tools with a config
    of their own (the parity tool, the benches)."""
    if strategy is None or isinstance(strategy, str):
        if strategy is not None and "." in strategy:  # a class path written as a plain string
            return _resolve_class(_import_class(strategy), strategy, {})
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


def _resolve_name(name: str, world_size: int) -> ResolvedStrategy:
    if name == "auto":
        if world_size > 1:
            return ResolvedStrategy(StrategyKind.DDP, name, registered_name="ddp")
        return ResolvedStrategy(StrategyKind.SINGLE, name)
    if name == FSDP_NAME:
        return ResolvedStrategy(StrategyKind.FSDP, name)
    if name == DILOCO_NAME:
        return ResolvedStrategy(StrategyKind.DILOCO, name)
    if name in DDP_NAMES:
        return ResolvedStrategy(StrategyKind.DDP, name, registered_name=name, runs_as=SPAWNING_STRATEGIES.get(name))
    from lightning.pytorch.strategies import StrategyRegistry

    known = StrategyRegistry.available_strategies()
    if name not in known:
        choices = sorted({FSDP_NAME, DILOCO_NAME, "auto", *known})
        close = difflib.get_close_matches(name.lower(), choices, n=3, cutoff=0.6)
        if name.lower().startswith(FSDP_NAME):  # fsdp2, FSDP, fsdp_v2: ddp-app's fsdp is FSDP2
            close = [FSDP_NAME, *(choice for choice in close if choice != FSDP_NAME)][:1]
        hint = f"Did you mean {' or '.join(f'`{choice}`' for choice in close)}? " if close else ""
        raise TrainerArgumentError(
            f"invalid value {name!r} for trainer.strategy: not a strategy ddp-app or Lightning knows. {hint}Fix: "
            "`ddp` (data parallel), `fsdp` (sharded: FSDP2), `diloco` (data parallel over slow links), `auto`, "
            "another of Lightning's names (python -c 'from lightning.pytorch.strategies import StrategyRegistry "
            "as r; print(r.available_strategies())'), "
            f"or a strategy's class path such as {FSDP_CLASS_PATH}."
        )
    entry = StrategyRegistry[name]
    resolved = _resolve_class(entry["strategy"], name, entry["init_params"])
    return dataclasses.replace(resolved, registered_name=name)


def _resolve_class(cls: type, written: str, init_args: Any) -> ResolvedStrategy:
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy

    from app.parallel.diloco import DiLoCoStrategy
    from app.parallel.fsdp import FSDP2Strategy  # here: the launcher's light imports need no FSDP

    if issubclass(cls, DiLoCoStrategy):  # a DDPStrategy subclass: asked first
        return ResolvedStrategy(StrategyKind.DILOCO, written)
    if issubclass(cls, FSDP2Strategy):
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
    from lightning.pytorch.strategies import Strategy

    module_name, _, class_name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as error:
        raise UserFacingError(
            f"trainer.strategy.class_path {class_path} cannot be imported ({error}). Fix: a class path "
            "such as lightning.pytorch.strategies.DDPStrategy, or a strategy name (ddp, fsdp)."
        ) from error
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise UserFacingError(
            f"trainer.strategy {class_path} is not a Lightning Strategy class. Fix: a class path such as "
            f"{FSDP_CLASS_PATH} or lightning.pytorch.strategies.DDPStrategy, or a strategy name (ddp, fsdp)."
        )
    return cls


def name_as_class_spec(name: str) -> dict[str, Any] | None:
    """A strategy name as the `class_path` and `init_args` it stands for, so that arguments can follow
    it (`--trainer.strategy fsdp --trainer.strategy.init_args.shard_group_size 2`): jsonargparse takes
    `init_args` only after a class. None for a name that is no class (`auto`) or that Lightning does not
    know (refused later, in one line)."""
    if name == FSDP_NAME:
        return {"class_path": FSDP_CLASS_PATH, "init_args": {}}
    if name == DILOCO_NAME:
        return {"class_path": DILOCO_CLASS_PATH, "init_args": {}}
    from lightning.pytorch.strategies import StrategyRegistry

    if name not in StrategyRegistry.available_strategies():
        return None
    entry = StrategyRegistry[name]
    cls = entry["strategy"]
    return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": dict(entry["init_params"])}


def _get(container: Any, key: str) -> Any:
    """A key of a parsed config namespace or a plain dict (the parity tool reads the YAML itself)."""
    if isinstance(container, dict):
        return container.get(key)
    getter = getattr(container, "get", None)
    return getter(key) if callable(getter) else getattr(container, key, None)
