"""How a ddp-app run is built, top to bottom, in the order it happens.

Read this file to follow `ddp-app fit --config ...` from the command line to the first training step:

1. The launcher (app/cli/entry.py) parses the command line once with the CLI (app/cli/parser.py) in
   a parse-only pass, which returns the parsed config and its run plan (app/run/plan.py): the one
   place where `trainer.strategy` is resolved, the config checks run (app/run/config_checks.py),
   the launch is checked against the machine (app/cluster/preflight.py), `--ckpt_path` is checked
   and read, and the save mode is decided. The launcher then tries the Trainer's arguments
   (app/run/trainer_check.py) and claims the run directory (app/run/directory.py). Bad input ends
   there, in one line, before any rank exists. It then forks the ranks (app/cluster/launch.py) and
   supervises them.
2. Each rank parses the same command line once and makes its plan through the same function (a
   forked rank reuses the launcher's reading of the checkpoint); `config_for_the_ranks` below makes
   the changes every rank must make alike (the launcher's nodes, the collective timeout, DDP's static
   graph).
3. LightningCLI builds the model and the DataModule, then the Trainer through `build_trainer`: the
   plugins, every callback ddp-app installs, in their order (each with its reason), the Trainer, and
   the changes to the built Trainer in one visible block.
4. Before `fit` (or validate, test, predict), `prepare_run`: the checkpoint to resume from, the
   tracked run (fit), the loaders put on ddp-app's samplers, and the model's last changes (float64,
   torch.compile).
5. Lightning's `fit` runs; ddp-app's callbacks act at its hooks (app/resume/exact.py keeps the data
   position and random state, app/run/coordinator.py owns every exchange between ranks and the
   saves of last.ckpt, app/tracking/ the tracked run).
6. The end-of-run summary (app/run/summary.py), printed by rank 0.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary, ProgressBar, RichModelSummary
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from lightning.pytorch.plugins.precision import DoublePrecision
from lightning.pytorch.profilers import PassThroughProfiler

from app.checkpoints.io import CheckpointSummary, supply_at_load
from app.checkpoints.last import agreed_last_checkpoint
from app.checkpoints.plugin import SafeCheckpointIO
from app.checkpoints.save_mode import SavePlan
from app.cluster.ddp_stream import build_ddp_on_the_current_stream
from app.cluster.hangs import HangReport
from app.cluster.preemption import STOP_SIGNAL_FLAG, keep_lightning_off_stop_signals
from app.cluster.preflight import describe_launch, fresh_store_for_this_round, lightning_uses_slurm
from app.data.rank_loaders import shard_all_loaders
from app.errors import UserFacingError
from app.models.compiling import compile_networks
from app.models.sync_check import warn_on_per_rank_means
from app.parallel.compression import GradientCompression
from app.parallel.diloco import DiLoCoCheckpoint
from app.parallel.strategy import StrategyKind
from app.run.callbacks import (
    LogLineProgressBar,
    NonFiniteGuard,
    PlainModelSummary,
    PredictionWriter,
    ThrottledProgressBar,
)
from app.run.config_checks import apply_collective_timeout, drop_static_graph_for_accumulation
from app.run.coordinator import RunCoordinator
from app.run.plan import ResumeFrom, RunPlan, resume_from_last
from app.run.step_timing import StepTiming, serve_first_batch_again
from app.run.summary import EvaluationThroughput
from app.tracking.run import Tracking

NO_PROFILING = contextlib.nullcontext()
# Lightning 2.6's name for the training loader's `next()` in `trainer.profiler.start/stop`
# (docs/private_apis.md; tests/test_private_apis.py checks that a fit still uses it).
TRAINING_FETCH = "[_TrainingEpochLoop].train_dataloader_next"


class NoProfiler(PassThroughProfiler):
    """The Trainer's default "no profiler", without a generator-based context manager per use.

    Lightning enters `trainer.profiler.profile(...)` around every hook of every callback, about 70
    times per training step; the inherited `@contextmanager` costs about 5x a shared `nullcontext`
    (`python -m app.bench.per_call`: 3.1 vs 0.6 us on a 2-core CPU VM, so about 0.2 ms per step).
    `--trainer.profiler` still works.

    It adds up the time in the training loader's `next()` (`training_fetch_s`), the data part of
    app/run/step_timing.py: two clock reads per step.
    """

    training_fetch_s = 0.0
    _fetch_started = 0.0

    def profile(self, action_name: str) -> contextlib.AbstractContextManager:
        return NO_PROFILING

    def start(self, action_name: str) -> None:
        if action_name == TRAINING_FETCH:
            self._fetch_started = time.perf_counter()

    def stop(self, action_name: str) -> None:
        if action_name == TRAINING_FETCH:
            self.training_fetch_s += time.perf_counter() - self._fetch_started


EVALUATION_LOGS = "evaluations"


def evaluation_loggers(root_dir: str, subcommand: str) -> list[Logger]:
    """The logs of validate, test and predict: CSV metrics always (easy to read in tests and scripts),
    TensorBoard too when it is installed, in `<root>/evaluations/<subcommand>/version_N`. Not in
    `lightning_logs/`, which holds the training run's attempts: an evaluation there read as one more
    attempt of the run (`python -m app.plot` would draw it). Under SLURM the version is the job id, so a
    requeued job logs into the same directory."""
    job_id = os.environ.get("SLURM_JOB_ID")
    save_dir = str(Path(root_dir) / EVALUATION_LOGS)
    csv_logger = CSVLogger(save_dir=save_dir, name=subcommand, version=f"slurm-{job_id}" if job_id else None)
    loggers: list[Logger] = [csv_logger]
    if importlib.util.find_spec("tensorboard") is not None or importlib.util.find_spec("tensorboardX") is not None:
        loggers.append(TensorBoardLogger(save_dir=save_dir, name=subcommand, version=csv_logger.version))
    return loggers


def config_for_the_ranks(config: Any, plan: RunPlan) -> None:
    """What every rank changes in its parsed config alike, after the launcher's checks passed."""
    trainer_config = config["trainer"]
    launch, rank_zero = plan.launch, plan.rank_zero
    if launch is not None and launch.launcher == "torchrun":
        fresh_store_for_this_round(os.environ, config["collective_timeout_s"])
    # A torchrun round (--nnodes=MIN:MAX) or a requeued Slurm job may run on another number of nodes
    # than trainer.num_nodes says (app.cluster.preflight accepted it): the Trainer follows.
    configured_nodes = int(trainer_config.get("num_nodes") or 1)
    if launch is not None and launch.num_nodes != configured_nodes:
        trainer_config["num_nodes"] = launch.num_nodes
        if rank_zero:
            who = "torchrun started" if launch.launcher == "torchrun" else "the requeued job runs on"
            print(
                f"ddp-app: {who} {launch.num_nodes} node(s); trainer.num_nodes {configured_nodes} -> "
                f"{launch.num_nodes} ({launch.launcher} decides the nodes).",
                flush=True,
            )
    apply_collective_timeout(trainer_config, config["collective_timeout_s"], plan.strategy)
    notice = drop_static_graph_for_accumulation(trainer_config)
    if notice and rank_zero:  # every rank makes the same change; one line in the log is enough
        print(notice, flush=True)


def build_trainer(
    config: Any, plan: RunPlan, make_trainer: Callable[..., Trainer]
) -> tuple[Trainer, EvaluationThroughput | None]:
    """The Trainer of this run (`make_trainer`: LightningCLI's own, with the keyword arguments it is
    given), and the evaluation throughput meter of validate/test/predict."""
    subcommand, launch, strategy = plan.subcommand, plan.launch, plan.strategy
    # Plugins: the config's own, with the checkpoint I/O the plan chooses (app/checkpoints/save_mode.py).
    saving: SavePlan = plan.checkpoints
    plugins = config["trainer"].get("plugins") or []
    plugins = saving.plugins(
        plugins if isinstance(plugins, list) else [plugins], timedelta(seconds=config["collective_timeout_s"])
    )
    # Not SLURMEnvironment.detect(): that is also true under torchrun inside a Slurm job. Preemption is
    # handled by ddp-app at a step boundary, not by Lightning's SIGUSR1 handler, which saves inside the
    # signal handler (Lightning #21406).
    if lightning_uses_slurm(os.environ) and not any(isinstance(plugin, ClusterEnvironment) for plugin in plugins):
        plugins.append(SLURMEnvironment(auto_requeue=False))

    # Callbacks, in this order (a user's callbacks, anywhere in their list, change nothing of what ours do):
    # - ExactResume first: at a resumed run's first hooks it restores the random state before any
    #   other callback (the user's included) draws from it, and its log flush precedes any save.
    # - StepTiming (fit, unless `step_timing.enabled: false`) next: its step window opens before
    #   every other callback's batch-start hook, so those count in the step, not between steps.
    # - Tracking second: the tracked run is open before a user's callback logs.
    # - GradientCompression (only when it compresses) registers its DDP hook at train start; it talks
    #   to other ranks only inside DDP's backward and inside saves, which every rank reaches together.
    # - DiLoCoCheckpoint (strategy diloco) puts the replicas and the outer state into every checkpoint.
    # - RunCoordinator last: the one owner of ddp-app's exchanges between ranks (app/run/coordinator.py).
    #   Lightning keeps `Checkpoint` callbacks after every other, so its hooks run after everything
    #   else of the same hook.
    # - NonFiniteGuard and HangReport (runs of more than one process) after those: they talk to no
    #   other rank during training (HangReport once, at setup, on every rank).
    user_callbacks = config["trainer"].get("callbacks") or []
    user_callbacks = user_callbacks if isinstance(user_callbacks, list) else [user_callbacks]
    compression: GradientCompression = config["gradient_compression"]
    step_timing: StepTiming = config["step_timing"]
    timed = subcommand in (None, "fit") and step_timing.enabled
    callbacks = [config["exact_resume"], *([step_timing] if timed else []), config["tracking"], *user_callbacks]
    if compression.method != "none":
        callbacks.append(compression)
    if strategy.kind is StrategyKind.DILOCO:  # its state in every checkpoint (gathered inside saves, as above)
        callbacks.append(DiLoCoCheckpoint())
    callbacks.append(NonFiniteGuard())
    if launch is None or launch.world_size > 1:  # a single process has no peer to hang on or to ask
        callbacks.append(HangReport())
    if plan.fault_tolerance is not None and plan.fault_tolerance.group is not None and subcommand == "fit":
        # A replica group's process: after ExactResume's batch-end count, so the state a peer receives
        # at the step's end is what a save there would write (app/parallel/ft_manager.py).
        callbacks.append(config["fault_tolerance"])
    saves_last = config["trainer"].get("enable_checkpointing") is not False
    coordinator = None
    if subcommand in (None, "fit"):  # no subcommand (`run=False`): the caller may fit
        coordinator = RunCoordinator(
            config["last_checkpoint"] if saves_last else None, config["tracking"], step_timing if timed else None
        )
        if saves_last:  # a Checkpoint callback: Lightning adds no default ModelCheckpoint beside it
            callbacks.append(coordinator)

    trainer = make_trainer(plugins=plugins, callbacks=callbacks)

    # Every change to the built Trainer, each with its reason (docs/private_apis.md lists the private ones).
    if coordinator is not None and not saves_last:
        # `enable_checkpointing: false` refuses any Checkpoint callback at construction, and the
        # coordinator is one (for its place in the hooks) that then saves nothing.
        trainer.callbacks.append(coordinator)
    keep_lightning_off_stop_signals(trainer)  # private: Lightning's SIGTERM handler broadcasts inside it
    build_ddp_on_the_current_stream(trainer.strategy, strategy.kind)  # private: Lightning wraps DDP on a side stream
    if subcommand not in (None, "fit") or not saves_last:
        # Only fit's coordinator acts on stop signals recorded since `run` started, and only where it
        # saves last.ckpt; otherwise a stop signal ends this process, as by default.
        STOP_SIGNAL_FLAG.release()
    environment = getattr(trainer.strategy, "cluster_environment", None)
    if launch is not None and launch.global_rank == 0 and environment is not None:
        mesh = plan.mesh.describe() if plan.mesh else None
        print(describe_launch(launch, environment, mesh=mesh), flush=True)
    if subcommand == "fit" and saves_last and trainer.is_global_zero:
        print(f"ddp-app: checkpoints: {saving.line}", flush=True)
    if config["trainer"]["logger"] in (None, True) and subcommand != "fit":
        trainer.loggers = evaluation_loggers(trainer.default_root_dir, subcommand or "run")  # fit's: `prepare_run`
    if subcommand == "predict":
        # Only here: Lightning calls every hook of every callback at every step, so a callback that does
        # nothing during fit still costs time per step.
        trainer.callbacks.append(PredictionWriter())
    evaluation_throughput = None
    if subcommand in ("validate", "test", "predict"):
        evaluation_throughput = EvaluationThroughput()
        trainer.callbacks.append(evaluation_throughput)
    bar = trainer.progress_bar_callback
    if bar is not None and not any(isinstance(callback, ProgressBar) for callback in user_callbacks):
        # The Trainer's default (TQDMProgressBar, or RichProgressBar where `rich` is installed) redraws
        # every step, and a log file (sbatch, CI, `| tee`) gets its redraws as one unreadable line.
        replacement = ThrottledProgressBar() if sys.stdout.isatty() else LogLineProgressBar()
        trainer.callbacks[trainer.callbacks.index(bar)] = replacement
    for index, callback in enumerate(trainer.callbacks):
        if type(callback) in (ModelSummary, RichModelSummary) and callback not in user_callbacks:
            # Lightning's default (RichModelSummary where `rich` is installed): the plain table a log reads
            # the same whatever the environment has installed, without a column of zero FLOPs.
            trainer.callbacks[index] = PlainModelSummary()  # max_depth=1, as Lightning's
    for callback in trainer.checkpoint_callbacks:
        # A fixed directory (not inside the versioned log dir) lets `--ckpt_path last` find the previous
        # run's last.ckpt after a crash or a requeue.
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is None:
            callback.dirpath = str(Path(trainer.default_root_dir) / "checkpoints")
    return trainer, evaluation_throughput


def prepare_run(
    config: Any,
    plan: RunPlan,
    trainer: Trainer,
    model: L.LightningModule,
    datamodule: L.LightningDataModule | None,
    model_class_path: str,
    open_tracked_run: Callable[[str | None, bool, CheckpointSummary | None], None] | None,
) -> ResumeFrom:
    """Everything between the built Trainer and `fit` (or validate, test, predict), in order; returns
    the checkpoint the run resumes from (the plan's, or the file `--ckpt_path last` found).

    `--ckpt_path last` is ddp-app's last.ckpt (Lightning only looks in ModelCheckpoint directories);
    none yet means a first run, which starts fresh (one line says which). `open_tracked_run` (fit with
    ddp-app's logger) opens the tracked run. Any DataModule's loaders get ddp-app's samplers (exact
    evaluation, exact mid-epoch resume), and per-rank means logged during evaluation are reported once.
    """
    resume = plan.resume
    if resume.is_last:
        config["ckpt_path"] = agreed_last_checkpoint(trainer)  # rank 0's answer, on every rank
        if config["ckpt_path"]:  # the checks a given file had in the plan, on the file found
            resume = resume_from_last(config["ckpt_path"], model_class_path, model)
        if trainer.is_global_zero:  # a restarted or requeued job says where it picks up
            found = f"resuming from {config['ckpt_path']}" if config["ckpt_path"] else "none yet, starting fresh"
            print(f"ddp-app: --ckpt_path last: {found}", flush=True)
    if plan.fault_tolerance is not None and plan.fault_tolerance.group is not None and plan.subcommand == "fit":
        join_replica_groups(config, plan, trainer)
    if open_tracked_run is not None:
        ckpt_path = config.get("ckpt_path")
        open_tracked_run(ckpt_path, plan.resume.is_last and not ckpt_path, resume.summary if ckpt_path else None)
    shard_all_loaders(trainer, datamodule, model)
    if plan.subcommand == "fit" and config["step_timing"].ablation == "batch_in_memory":  # `ddp-app diagnose`
        serve_first_batch_again(datamodule if datamodule is not None else model)
    warn_on_per_rank_means(trainer, model)
    if isinstance(trainer.precision_plugin, DoublePrecision):
        # Lightning restores a checkpoint's weights before its precision plugin converts the module: a
        # float64 checkpoint loaded into the float32 module is rounded to float32 once (a resume of a
        # 64-true run was 5.6e-5 off the uninterrupted run). In float64 from the start, the weights load
        # unrounded (the plugin's own `.double()` is a no-op).
        model.double()
    if config.get("compile"):
        compiled = compile_networks(model)
        if not compiled:
            raise UserFacingError(
                f"compile: true, but {type(model).__name__} has no submodule with parameters to compile. "
                "Fix: keep its layers in attributes (self.net = ...), or set compile: false."
            )
        if trainer.is_global_zero:
            print(f"ddp-app: compile: torch.compile on {', '.join(compiled)} (the first step compiles)", flush=True)
    return resume


def join_replica_groups(config: Any, plan: RunPlan, trainer: Trainer) -> None:
    """A replica group's first quorum (app/parallel/ft_manager.py). A group with a checkpoint file of its own (a
    restarted one, `--ckpt_path last`) joins when `fit` loads that file, after its setup, and resumes from a peer's
    state if it is behind; any other joins here, before `fit`, and resumes from the state a peer sent (written to
    /dev/shm) if it is behind."""
    from app.parallel.ft_manager import GroupRuntime  # here: torchft is an optional dependency

    settings = config["fault_tolerance"]
    assert plan.fault_tolerance is not None
    runtime = settings.runtime = GroupRuntime(settings, plan.fault_tolerance)
    own = config.get("ckpt_path")
    # Only SafeCheckpointIO takes a supplied checkpoint: with a config's own CheckpointIO, or under fsdp (a directory
    # of shards its ShardedCheckpointIO reads), the group joins here.
    io = trainer.strategy.checkpoint_io
    if own and Path(own).is_file() and isinstance(getattr(io, "checkpoint_io", io), SafeCheckpointIO):
        supply_at_load(own, lambda: runtime.join_for_state(trainer, own))
    else:
        healed = runtime.join(trainer, own)
        if healed is not None:  # behind the other groups: resume from the state a peer sent
            config["ckpt_path"] = healed


def open_tracked_run(
    tracking: Tracking, trainer: Trainer, config_yaml: str, ckpt_path: str | None, latest: bool, summary: Any
) -> None:
    """fit logs through the run's identity (app/tracking/run.py): a resume continues the run of its
    checkpoint, `--ckpt_path last` with no checkpoint yet the directory's latest run (`latest`)."""
    resume_state = summary.run if summary is not None else None
    logger = tracking.open(trainer, resume_state, latest, config_yaml, str(ckpt_path) if ckpt_path else None)
    trainer.loggers = [logger]
