"""The run plan: every decision about a run, made once from the parsed config, read by everything after.

`make_run_plan` is the one function that turns a parsed `ddp-app` config into decisions: the
strategy (resolved once, at the run's world size), the launch (checked against the machine), the
ranks a plain launch forks, the sharding mesh, how checkpoints are written, the checkpoint a run
resumes from (validated and summarised once) and the run directory. The launcher makes the plan in
its parse-only pass, and every rank makes its own through the same function (its command line
carries the launcher's additions, its launch is its own); a rank the launcher forked inherits the
launcher's reading of the checkpoint instead of reading it again (`hand_to_forked_ranks`). Later
code (the config rewrites every rank makes, the Trainer's construction, `prepare_run`) reads the
plan instead of the raw config's `trainer.strategy` or `ckpt_path`.

`RunPlan.describe()` says a plan in a few lines.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jsonargparse import Namespace

from app.checkpoints.io import (
    CheckpointSummary,
    check_model_class,
    check_overrides,
    check_state_fits,
    forget_read_checkpoint,
    not_a_checkpoint,
    refuse_url,
)
from app.checkpoints.save_mode import SavePlan, save_plan
from app.checkpoints.sharded import is_checkpoint, is_sharded_checkpoint, summarize_any
from app.cluster.launch import RankPlan, rank_plan
from app.cluster.preflight import Launch, is_node_launcher, on_gpu, preflight
from app.errors import UserFacingError
from app.parallel.fault_tolerance import FaultTolerancePlan, plan_fault_tolerance
from app.parallel.strategy import MeshLayout, ResolvedStrategy, StrategyKind, resolve_strategy
from app.run.config_checks import check_config, command_line_model_keys

# The ckpt_path values Lightning resolves itself instead of reading a file of that name.
NAMED_CHECKPOINTS = ("last", "best", "hpc", "registry")


@dataclass(frozen=True)
class ResumeFrom:
    """The checkpoint a run starts from, as `--ckpt_path` gives it, validated once.

    `written` is the value as given (None, `last`, `best`, a path); `summary` is what the file (or
    directory of shards) says of its model, read once in the process that made the plan, for a path
    only: `last` is found when training starts (`prepare_run`), where the ranks agree on one file.
    """

    written: str | None = None
    summary: CheckpointSummary | None = None

    @property
    def is_last(self) -> bool:
        return self.written == "last"

    def check_fits(self, model: Any) -> None:
        """The built model against the checkpoint's weights: a mismatch stops before the Trainer or a
        logger writes anything, in one line, instead of in `load_state_dict` inside every rank."""
        if self.summary is not None:
            check_state_fits(self.summary, model)


@dataclass(frozen=True)
class RunPlan:
    """What a run is, decided once. `launch` is None where the launch was not checked against this
    machine (tools that only read a config) or cannot be known before the Trainer exists."""

    subcommand: str | None
    strategy: ResolvedStrategy
    launch: Launch | None
    ranks: RankPlan
    mesh: MeshLayout | None
    checkpoints: SavePlan  # how checkpoints are written, and through which checkpoint I/O
    resume: ResumeFrom
    precision: str
    run_dir: Path
    rank_zero: bool
    # Replica groups that survive each other's failures (app/parallel/fault_tolerance.py); None: off.
    fault_tolerance: FaultTolerancePlan | None = None

    @property
    def world_size(self) -> int:
        return self.launch.world_size if self.launch is not None else 1

    @property
    def num_nodes(self) -> int:
        return self.launch.num_nodes if self.launch is not None else 1

    def describe(self) -> str:
        """The plan in a few lines, for a reader (a debugger, a test's failure message)."""
        launch = self.launch
        where = (
            f"{launch.world_size} rank(s): {launch.num_nodes} node(s) x {launch.devices}, started by {launch.launcher}"
            if launch is not None
            else "launch not checked"
        )
        lines = [
            f"subcommand: {self.subcommand}",
            f"strategy: {self.strategy.written} ({self.strategy.kind.value})"
            + (f", {self.mesh.describe()}" if self.mesh else ""),
            f"launch: {where}; forks {self.ranks.processes} local rank(s)",
            f"checkpoints: {self.checkpoints.line}",
            f"resume: {self.resume.written or 'no'}",
            f"precision: {self.precision}",
            f"run directory: {self.run_dir}",
        ]
        if self.fault_tolerance is not None:
            lines.append(f"fault tolerance: {self.fault_tolerance.describe()}")
        return "\n".join(lines)


def is_global_rank_zero(launch: Launch | None, env: Mapping[str, str]) -> bool:
    """Before any process group exists: from the launch, or from the launcher's variables if unknown."""
    if launch is not None:
        return launch.global_rank == 0
    return all(env.get(name, "0") == "0" for name in ("RANK", "LOCAL_RANK", "NODE_RANK"))


def make_run_plan(
    config: Any,
    subcommand: str | None,
    command_line: Sequence[str],
    check_machine: bool = True,
    apply_checkpoint_arguments: Callable[[CheckpointSummary], Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> RunPlan:
    """The one function that decides a run from its parsed (subcommand) config; bad input stops here,
    in one line, before any rank starts. `check_machine`: check the launch against this machine (the
    launcher and every rank); off for tools that only read a config (`parse_config`).

    `apply_checkpoint_arguments` (the CLI's) gives the config the model arguments saved in a resumed
    checkpoint file, as LightningCLI does, and returns the config with them: the checks that follow
    see the model that will be built."""
    env = os.environ if env is None else env
    trainer_config = config["trainer"]
    strategy = expand_strategy_names(trainer_config)
    resume = ResumeFrom(config.get("ckpt_path"))
    launch = None
    if check_machine:
        resume = resume_from(config, strategy, command_line)
        summary = resume.summary
        if apply_checkpoint_arguments is not None and summary is not None and Path(summary.path).is_file():
            config = apply_checkpoint_arguments(summary)
            trainer_config = config["trainer"]
        check_config(config, strategy)
        # No process group exists yet: a launch that disagrees with devices/num_nodes or would hang
        # stops here in one line, and SLURMEnvironment gets our per-job MASTER_PORT.
        launch = preflight(trainer_config)
    mesh = None
    ranks = RankPlan(0)
    if launch is not None:
        strategy = strategy.at_world_size(launch.world_size)
        # A shard_group_size that does not divide the ranks stops here, in one line.
        mesh = strategy.mesh(launch.world_size, launch.devices)
        if launch.launcher == "plain":
            ranks = rank_plan(strategy, launch.devices, not on_gpu(trainer_config), trainer_config.get("devices"))
    fault_tolerance = None
    # Training only: checked in the launcher before any group starts; a group's process reads its index.
    if check_machine and subcommand == "fit":
        fault_tolerance = plan_fault_tolerance(
            config.get("fault_tolerance"),
            strategy.kind.value,
            launch.launcher if launch is not None else None,
            launch.world_size if launch is not None else None,
            env,
            launch.node_rank if launch is not None else 0,
            launch.num_nodes if launch is not None else 1,
            is_node_launcher(env),
        )
    if fault_tolerance is not None and fault_tolerance.group is None and strategy.is_sharded:
        check_group_sharding(strategy, fault_tolerance.group_size)
    rank_zero = is_global_rank_zero(launch, env)
    if fault_tolerance is not None and fault_tolerance.group is not None:
        rank_zero = rank_zero and fault_tolerance.group == 0  # group 0 speaks for the run
    return RunPlan(
        subcommand=subcommand,
        strategy=strategy,
        launch=launch,
        ranks=ranks,
        mesh=mesh,
        checkpoints=checkpoint_save_plan(config, strategy),
        resume=resume,
        precision=str(trainer_config.get("precision") or "32-true"),  # Lightning's default when unset
        run_dir=Path(trainer_config.get("default_root_dir") or os.getcwd()),
        rank_zero=rank_zero,
        fault_tolerance=fault_tolerance,
    )


def check_group_sharding(strategy: ResolvedStrategy, group_size: int) -> None:
    """Fault tolerance with `strategy: fsdp`: each replica group is a run of `group_size` processes that shards
    the model within itself, so `shard_group_size` must divide a group, not only the run (checked in the
    launcher, before any group starts)."""
    try:
        strategy.mesh(group_size, group_size)
    except UserFacingError as error:
        raise UserFacingError(
            f"fault_tolerance.group_size={group_size} with trainer.strategy fsdp: each replica group shards the model "
            f"over its own {group_size} processes, and {error}".replace("the run's", "a group's")
        ) from None


def checkpoint_save_plan(config: Any, strategy: ResolvedStrategy) -> SavePlan:
    """How this run's checkpoints are written (app/checkpoints/save_mode.py), for the plan's strategy."""
    plugins = config["trainer"].get("plugins") or []
    writes_own = strategy.kind not in (StrategyKind.DDP, StrategyKind.SINGLE, StrategyKind.FSDP, StrategyKind.DILOCO)
    return save_plan(
        config["last_checkpoint"].async_save,
        config["last_checkpoint"].overlap_copy,
        plugins if isinstance(plugins, list) else [plugins],
        sharded=strategy.is_sharded,
        own_writer=strategy.written if writes_own else None,
    )


def expand_strategy_names(trainer_config: Any) -> ResolvedStrategy:
    """`trainer.strategy` resolved, once; returns it. `strategy: fsdp` becomes ddp-app's FSDP2 strategy
    with its defaults (Lightning's own `fsdp` is its FSDP1 strategy), and a class path written as a
    plain string (`--trainer.strategy app.parallel.fsdp.FSDP2Strategy`) becomes that class with its
    defaults, before Lightning reads it; the resolution keeps the form the config wrote, for messages."""
    written = trainer_config.get("strategy")
    strategy = resolve_strategy(written)
    class_path = strategy.class_path_for_a_name if isinstance(written, str) else None
    if class_path is not None:
        trainer_config["strategy"] = Namespace(class_path=class_path, init_args=Namespace())
    return strategy


def resume_from(config: Any, strategy: ResolvedStrategy, command_line: Sequence[str]) -> ResumeFrom:
    """The one check of `--ckpt_path`: a URL, a directory that is no checkpoint, a checkpoint of the
    other strategy kind, of another model class or that contradicts a model argument given on the
    command line is refused here, in one line; a checkpoint file (or directory of shards) is read once
    for its summary. `last` is checked against `<default_root_dir>/checkpoints/last.ckpt` for the
    strategy kind only; its file is read when training starts (`resume_from_last`)."""
    ckpt_path = config.get("ckpt_path")
    if not ckpt_path:
        return ResumeFrom()
    written = str(ckpt_path)
    refuse_url(written, "ckpt_path", to_read=True)
    if written == "last":
        last = Path(config["trainer"].get("default_root_dir") or os.getcwd()) / "checkpoints" / "last.ckpt"
        if last.exists():
            check_checkpoint_fits_the_strategy(written, last, strategy)
        return ResumeFrom(written)
    handed = handed_resume(written)
    if handed is not None:  # the launcher checked and read it before forking this rank
        return handed
    if written in NAMED_CHECKPOINTS or not Path(written).exists():
        return ResumeFrom(written)  # Lightning's names, and a missing file (LightningCLI's own line names it)
    check_ckpt_path_is_a_file(written)
    check_checkpoint_fits_the_strategy(written, Path(written), strategy)
    if not is_checkpoint(written):
        return ResumeFrom(written)
    summary = summarize_any(written)
    model = config.get("model")
    if model is not None:
        check_model_class(summary, model.class_path)
        arguments = model.get("init_args") or Namespace()
        given = {key: arguments[key] for key in command_line_model_keys(list(command_line)) if key in arguments}
        check_overrides(
            summary, {key: value.as_dict() if isinstance(value, Namespace) else value for key, value in given.items()}
        )
    return ResumeFrom(written, summary)


def resume_from_last(path: str, model_class_path: str, model: Any) -> ResumeFrom:
    """`--ckpt_path last` once the ranks agreed on the file: its summary, its model class and its
    weights' shapes against the built model (its strategy kind was checked in the plan, on
    `<default_root_dir>/checkpoints/last.ckpt`; command-line model arguments are not compared)."""
    summary = summarize_any(path)
    check_model_class(summary, model_class_path)
    resume = ResumeFrom(path, summary)
    resume.check_fits(model)
    return resume


def check_ckpt_path_is_a_file(ckpt_path: str) -> None:
    """A directory at --ckpt_path is refused here, naming the checkpoint inside it if there is one:
    LightningCLI skips reading it, and every rank would fail on it later."""
    if not Path(ckpt_path).is_dir() or is_sharded_checkpoint(ckpt_path):  # fsdp's checkpoints are directories
        return
    directory = Path(ckpt_path)
    inside = (directory / "last.ckpt", directory / "checkpoints" / "last.ckpt")
    found = next((candidate for candidate in inside if candidate.is_file()), None)
    fix = (
        f"--ckpt_path {found}, the last checkpoint in it."
        if found
        else "give the path of a .ckpt file, such as <trainer.default_root_dir>/checkpoints/last.ckpt."
    )
    raise not_a_checkpoint(f"--ckpt_path {ckpt_path}", "a directory", fix)


def check_checkpoint_fits_the_strategy(ckpt_path: str, path: Path, strategy: ResolvedStrategy) -> None:
    """A checkpoint of one file (strategy ddp) resumed under strategy fsdp, or a sharded one (strategy
    fsdp) under ddp, is refused before any rank starts, the tracker counts an attempt or a model is
    built. A last.ckpt kept elsewhere (a ModelCheckpoint's own dirpath) is refused by the strategy as
    it loads."""
    sharded = is_sharded_checkpoint(path)
    if strategy.is_sharded and not sharded and path.is_file():
        raise UserFacingError(
            f"--ckpt_path {ckpt_path}: {path} is a checkpoint of one file (written under strategy ddp), and "
            f"trainer.strategy {strategy.written} resumes only from sharded checkpoints. Fix: resume with the "
            "strategy it was trained with (--trainer.strategy ddp), or start a new sharded run from its weights."
        )
    if sharded and not strategy.is_sharded:
        raise UserFacingError(
            f"--ckpt_path {ckpt_path}: {path} is a sharded checkpoint (written under strategy fsdp), and "
            f"trainer.strategy {strategy.written} reads checkpoints of one file. Fix: resume with --trainer.strategy "
            f"fsdp, or join its shards into one file: python -m app.export --ckpt {path} --out model.pt."
        )


# The checkpoint summary a plain launch's forked ranks inherit from their launcher's plan.
_HANDED_RESUME: ResumeFrom | None = None


def hand_to_forked_ranks(plan: RunPlan) -> None:
    """Keep what the launcher read for the ranks it forks next. Each rank still decides its own plan
    (its command line carries the launcher's additions, and its launch is its own), but the
    checkpoint it resumes from is read once, here, not again in every rank before its load."""
    global _HANDED_RESUME
    _HANDED_RESUME = plan.resume if plan.resume.summary is not None else None
    forget_read_checkpoint()  # each rank loads the weights itself; the launcher keeps none in memory


def handed_resume(written: str) -> ResumeFrom | None:
    """The launcher's reading of `written`, in a rank it forked; None anywhere else."""
    if _HANDED_RESUME is None or _HANDED_RESUME.written != written:
        return None
    return _HANDED_RESUME
