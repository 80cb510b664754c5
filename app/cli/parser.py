"""The LightningCLI of `ddp-app`: the parser, our Trainer defaults and what happens around `fit`.

    ddp-app fit --config configs/digits.yaml [--trainer.max_epochs 5 ...]

`DDPAppCLI` parses the command line into the models in `app.models` and the data in `app.data`,
checks the config (app/run/config_checks.py) and the launch (app/cluster/preflight.py), and builds the
Trainer with safe checkpoint I/O, exact resume and the tracked run. Starting and supervising the
ranks is app/cli/entry.py's job. Everything before `fit` (parsing, building the model and data
module) runs once per rank: nothing here may download or write.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

import lightning as L
from jsonargparse import Namespace
from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary, ProgressBar, RichModelSummary
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from lightning.pytorch.plugins.precision import DoublePrecision
from lightning.pytorch.profilers import PassThroughProfiler
from lightning.pytorch.utilities import rank_zero_only

import app.data
import app.models.lightning  # noqa: F401  (registers the LightningModules for short `class_path` names)
from app.checkpoints.io import (
    CheckpointSummary,
    as_checkpoint_error,
    atomic_torch_save,
    check_model_class,
    check_overrides,
    check_state_fits,
    refuse_url,
    remove_stale_temporaries,
    safe_load,
)
from app.checkpoints.last import LastCheckpoint, agreed_last_checkpoint
from app.checkpoints.sharded import is_checkpoint, summarize_any
from app.cluster.ddp_stream import build_ddp_on_the_current_stream
from app.cluster.hangs import HangReport
from app.cluster.launch import RankPlan, rank_plan
from app.cluster.preemption import STOP_SIGNAL_FLAG, keep_lightning_off_stop_signals
from app.cluster.preflight import (
    Launch,
    describe_launch,
    fresh_store_for_this_round,
    lightning_uses_slurm,
    on_gpu,
    preflight,
)
from app.data.sharding import shard_all_loaders
from app.errors import UserFacingError, summarize_parser_error
from app.models.compiling import compile_networks
from app.models.sync_check import warn_on_per_rank_means
from app.parallel.compression import GradientCompression
from app.parallel.strategy import expand_fsdp_name, resolve_strategy
from app.private_apis import require
from app.resume.exact import ExactResume
from app.run.callbacks import (
    LogLineProgressBar,
    NonFiniteGuard,
    PlainModelSummary,
    PredictionWriter,
    ThrottledProgressBar,
)
from app.run.config_checks import (
    apply_collective_timeout,
    check_config,
    command_line_model_keys,
    drop_static_graph_for_accumulation,
)
from app.run.console import STARTED_VARIABLE
from app.run.coordinator import RunCoordinator
from app.run.directory import RunLock, acquire, refuse_if_busy, refuse_overwrite
from app.run.summary import EvaluationThroughput, evaluation_summary, fit_summary, scalar_metrics
from app.run.trainer_check import LEFT_OUT, check_trainer_arguments
from app.tracking.run import Tracking, check_remote_mlflow_answers
from app.user_code import add_user_code_directories

app.data.import_all()  # registers the DataModules for short `class_path` names

# Lightning's default collective timeout is 30 minutes: a dead peer then hangs the others that long.
DEFAULT_COLLECTIVE_TIMEOUT_S = 1800.0


class OneLineErrorParser(LightningArgumentParser):
    """Bad command-line or config input: one line on stderr and exit code 2, not a 60-line usage dump.

    Prefixes of options are refused like any unknown key: argparse's default `allow_abbrev` took
    `--trainer.max_epoch 3` for `max_epochs`, and a typo must never select another key.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:
            super().error(message, ex)
        prog = self.prog.replace(" [options]", "")
        sys.stderr.write(f"{prog}: error: {summarize_parser_error(message)} (see: {prog} --help)\n")
        self.exit(2)


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint I/O with atomic, fsynced saves and `weights_only=True` loads."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:  # as Lightning's TorchCheckpointIO: they would be ignored
            raise TypeError(
                "SafeCheckpointIO takes no storage_options: those configure fsspec's remote storage, and "
                "ddp-app writes checkpoints to a filesystem path only (docs/resume.md)."
            )
        refuse_url(path, "checkpoint path")
        remove_stale_temporaries(Path(path))
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = safe_load(path, map_location=map_location if map_location is not None else "cpu")
        # Lightning calls the callbacks' on_load_checkpoint only if the checkpoint has a "callbacks"
        # entry (`call._call_callbacks_on_load_checkpoint`); a converted one (app.parity) may not, and
        # ExactResume must see every checkpoint a run resumes from, or it counts from epoch 0.
        if isinstance(checkpoint, dict):
            checkpoint.setdefault("callbacks", {})
        return checkpoint


NO_PROFILING = contextlib.nullcontext()


class NoProfiler(PassThroughProfiler):
    """The Trainer's default "no profiler", without a generator-based context manager per use.

    Lightning enters `trainer.profiler.profile(...)` around every hook of every callback, about 70
    times per training step; the inherited `@contextmanager` costs about 5x a shared `nullcontext`
    (`python -m app.bench.per_call`: 3.1 vs 0.6 us on a 2-core CPU VM, so about 0.2 ms per step).
    `--trainer.profiler` still works.
    """

    def profile(self, action_name: str) -> contextlib.AbstractContextManager:
        return NO_PROFILING


def default_loggers(root_dir: str) -> list[Logger]:
    """CSV metrics always (easy to read in tests and scripts); TensorBoard too when it is installed.

    Under SLURM the version is the job id, so a requeued job logs into the same directory.
    """
    job_id = os.environ.get("SLURM_JOB_ID")
    csv_logger = CSVLogger(save_dir=root_dir, version=f"slurm-{job_id}" if job_id else None)
    loggers: list[Logger] = [csv_logger]
    if importlib.util.find_spec("tensorboard") is not None or importlib.util.find_spec("tensorboardX") is not None:
        loggers.append(TensorBoardLogger(save_dir=root_dir, version=csv_logger.version))
    return loggers


def is_global_rank_zero(launch: Launch | None, env: Mapping[str, str]) -> bool:
    """Before any process group exists: from the launch, or from the launcher's variables if unknown."""
    if launch is not None:
        return launch.global_rank == 0
    return all(env.get(name, "0") == "0" for name in ("RANK", "LOCAL_RANK", "NODE_RANK"))


class DDPAppCLI(LightningCLI):
    """LightningCLI with our defaults: one-line errors, input checks, CSV (+TensorBoard) logs,
    atomic and safe checkpoints in a fixed directory, exact resume, preemption at step
    boundaries, a bounded collective timeout, and the config saved next to the logs."""

    def __init__(self, parse_only: bool = False, check_machine: bool = True, **kwargs: Any) -> None:
        # parse_only: stop with ConfigParsed once the config is parsed (and, with check_machine,
        # checked against this machine and launch): `main` does that once before it starts the
        # ranks, so that bad input is reported once, quickly; `parse_config` for tools.
        # The override below is what names an unreadable --ckpt_path in one line; a LightningCLI
        # that no longer calls it would silently bypass it.
        require(LightningCLI, "_parse_ckpt_path", "lightning", "the one-line error for an unreadable ckpt_path")
        self.parse_only = parse_only
        self.check_machine = check_machine
        # The wall time the end-of-run summary reports: from the launcher's start (app/cli/entry.py), so it
        # includes the imports, the forks and every restart.
        self.started = float(os.environ.get(STARTED_VARIABLE) or time.time())
        self.run_lock: RunLock | None = None  # this fit's hold on its directory (app/run/directory.py)
        self.evaluation_throughput: EvaluationThroughput | None = None
        self.command_line: list[str] = []
        self.checkpoint: CheckpointSummary | None = None  # the --ckpt_path file, when it is one
        self.resume_checkpoint: CheckpointSummary | None = None  # that, or the one `--ckpt_path last` finds
        # Before parsing: a user's `class_path: mymodels.MyNet` imports from the current directory
        # or beside the config, on every rank (app/user_code.py has the rule).
        args = kwargs.get("args")
        add_user_code_directories(args if isinstance(args, list) else None)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("parser_class", OneLineErrorParser)
        kwargs.setdefault(
            "trainer_defaults",
            {
                "callbacks": [NonFiniteGuard(), HangReport()],
                # Defaults, so a config's own `profiler:` or `plugins:` replaces them.
                "profiler": {"class_path": "app.cli.NoProfiler"},
                "plugins": [{"class_path": "app.cli.SafeCheckpointIO"}],
            },
        )
        try:
            super().__init__(
                L.LightningModule,
                L.LightningDataModule,
                subclass_mode_model=True,
                subclass_mode_data=True,
                **kwargs,
            )
        finally:
            if self.run_lock is not None:
                self.run_lock.release()

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--collective_timeout_s",
            type=float,
            default=DEFAULT_COLLECTIVE_TIMEOUT_S,
            help="How long a collective (or the rendezvous) may wait for a peer before every rank fails.",
        )
        parser.add_argument(
            "--restarts",
            type=int,
            default=0,
            help="When a rank fails for a reason other than bad input (killed, lost, crashed), stop the others and "
            "start every local rank again from last.ckpt, up to this many times (a plain launch; under torchrun use "
            "--max-restarts).",
        )
        # A group of its own (not trainer.callbacks): ddp-app always keeps last.ckpt fresh, and the
        # interval is one key to set: `last_checkpoint.every_n_seconds`.
        parser.add_class_arguments(LastCheckpoint, "last_checkpoint")
        # Top-level too: one key for the all-reduce's compression, applied on CPU and GPU alike.
        parser.add_class_arguments(GradientCompression, "gradient_compression")
        # And for exact resume: `exact_resume.per_sample_seeding` (every run has the callback).
        parser.add_class_arguments(ExactResume, "exact_resume")
        # `tracking.mlflow`, `tracking.wandb`, `tracking.tensorboard` (app/tracking/run.py).
        parser.add_class_arguments(Tracking, "tracking")
        parser.add_argument(
            "--sweep",
            type=dict | None,
            default=None,
            help="What `python -m app.sweep` varies (app/sweep/spec.py); a single ddp-app run ignores it.",
        )
        parser.add_argument(
            "--compile",
            type=bool,
            default=False,
            help="Run the model's networks through torch.compile (app/models/compiling.py): faster steps on GPUs "
            "after a first step that compiles; weights equal an eager run's up to float rounding.",
        )

    def _subcommand_config(self, config: Any) -> Any:
        return config[self.subcommand] if self.subcommand else config

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        if args is None or isinstance(args, list):
            self.command_line = list(sys.argv[1:] if args is None else args)
        super().parse_arguments(parser, args)

    def _parse_ckpt_path(self) -> None:
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else None
        ckpt_path = config.get("ckpt_path") if config else None
        # Lightning's own condition: "last" and "best" (and URLs) are resolved later by the Trainer.
        if ckpt_path and is_checkpoint(ckpt_path):
            self.checkpoint = summarize_any(ckpt_path)
            model = config.get("model")
            if model is not None:
                check_model_class(self.checkpoint, model.class_path)
                arguments = model.get("init_args") or Namespace()
                given = {key: arguments[key] for key in command_line_model_keys(self.command_line) if key in arguments}
                check_overrides(
                    self.checkpoint,
                    {key: value.as_dict() if isinstance(value, Namespace) else value for key, value in given.items()},
                )
        # LightningCLI reads the checkpoint's hyperparameters with torch.load(weights_only=True)
        # before anything else (Lightning 2.6 `LightningCLI._parse_ckpt_path`); name the file if it fails.
        try:
            super()._parse_ckpt_path()
        except Exception as error:
            ckpt_path = self.config[self.config.subcommand].get("ckpt_path")
            raise as_checkpoint_error(ckpt_path, error) from error

    def before_instantiate_classes(self) -> None:
        config = self._subcommand_config(self.config)
        if self.parse_only and not self.check_machine:
            raise ConfigParsed(config, RankPlan(0), 1)
        expand_fsdp_name(config["trainer"])
        check_config(config)
        # No process group exists yet: a launch that disagrees with devices/num_nodes or would hang
        # stops here in one line, and SLURMEnvironment gets our per-job MASTER_PORT.
        self.launch = preflight(config["trainer"])
        if self.launch is not None:
            # A forked rank imported Lightning in the launcher, where Lightning took this process for
            # rank 0: until the strategy sets the ranks inside `fit`, every rank would print what only
            # rank 0 should (Lightning's rank-zero warnings about the Trainer, for one).
            rank_zero_only.rank = self.launch.global_rank
        if self.parse_only:  # the plan follows the config as written (before the changes below)
            plan = self._rank_plan(config["trainer"])
            self._check_trainer_arguments(config["trainer"], plan)
            if self.subcommand == "fit":  # last: a typo in the command is named before the directory's state
                self._claim_run_directory(config)
                if config["tracking"] and config["tracking"].get("mlflow") is not None:
                    check_remote_mlflow_answers(config["tracking"]["mlflow"].get("tracking_uri"))
            raise ConfigParsed(
                config,
                plan,
                self.launch.num_nodes if self.launch else 1,
                self.subcommand,
                is_global_rank_zero(self.launch, os.environ),
            )
        if self.launch is not None and self.launch.launcher == "torchrun":
            fresh_store_for_this_round(os.environ, config["collective_timeout_s"])
        self._follow_the_launchers_nodes(config["trainer"])
        world_size = self.launch.world_size if self.launch is not None else int(config["trainer"]["num_nodes"] or 1)
        apply_collective_timeout(config["trainer"], config["collective_timeout_s"], world_size)
        notice = drop_static_graph_for_accumulation(config["trainer"])
        # Every rank parses the config and makes the same change; one line in the log is enough.
        if notice and is_global_rank_zero(self.launch, os.environ):
            print(notice, flush=True)
        if self.subcommand == "fit":
            self._claim_run_directory(config)

    def _claim_run_directory(self, config: Any) -> None:
        """One run per directory (app/run/directory.py): a fit that another one is training into, or that
        would write over another run's checkpoints, stops here in one line, before anything is
        written; global rank 0 of a rank launched by torchrun or srun (or an in-process fit) then
        holds the directory's lock. The launcher takes it for the ranks it forks (app/cli/entry.py)."""
        root = Path(config["trainer"]["default_root_dir"] or os.getcwd())
        rank_zero = is_global_rank_zero(self.launch, os.environ)
        if rank_zero:
            refuse_if_busy(root, os.environ)
        refuse_overwrite(root, configured_checkpoint_dirs(root, config["trainer"]), config.get("ckpt_path"))
        if rank_zero and not self.parse_only:
            self.run_lock = acquire(root, os.environ)

    def _follow_the_launchers_nodes(self, trainer_config: Any) -> None:
        """A torchrun round (--nnodes=MIN:MAX) or a requeued Slurm job may run on another number of
        nodes than trainer.num_nodes says (app.cluster.preflight accepted it): the Trainer follows."""
        launch = self.launch
        configured = int(trainer_config.get("num_nodes") or 1)
        if launch is None or launch.num_nodes == configured:
            return
        trainer_config["num_nodes"] = launch.num_nodes
        if is_global_rank_zero(launch, os.environ):
            who = "torchrun started" if launch.launcher == "torchrun" else "the requeued job runs on"
            print(
                f"ddp-app: {who} {launch.num_nodes} node(s); trainer.num_nodes {configured} -> {launch.num_nodes} "
                f"({launch.launcher} decides the nodes).",
                flush=True,
            )

    def _check_trainer_arguments(self, trainer_config: Any, plan: RankPlan) -> None:
        """Build the Trainer here, once, as the ranks will (app/run/trainer_check.py): an argument Lightning
        refuses stops the launch in one line before any rank starts."""

        def instantiate() -> dict[str, Any]:
            config = self.config.clone()
            section = self._subcommand_config(config)
            section["model"] = section["data"] = None  # only the trainer section's classes are built
            for key, value in LEFT_OUT.items():
                section["trainer"][key] = value
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # jsonargparse's deprecation notice; LightningCLI calls it too
                return dict(self._subcommand_config(self.parser.instantiate_classes(config))["trainer"])

        overrides = {"devices": plan.devices} if plan.devices is not None else None
        check_trainer_arguments(instantiate, trainer_config, overrides, self.trainer_class)

    def _rank_plan(self, trainer_config: Any) -> RankPlan:
        """The local ranks a plain launch forks; none under torchrun or srun, or for unknown devices."""
        if self.launch is None or self.launch.launcher != "plain":
            return RankPlan(0)
        strategy = resolve_strategy(trainer_config.get("strategy"), self.launch.world_size)
        return rank_plan(strategy, self.launch.devices, not on_gpu(trainer_config), trainer_config.get("devices"))

    def after_instantiate_classes(self) -> None:
        # Before the Trainer or a logger writes anything: a checkpoint that cannot load stops here,
        # in one line, instead of in `load_state_dict` inside every rank (`--ckpt_path last`: `_before_run`).
        if self.checkpoint is not None:
            check_state_fits(self.checkpoint, self.model)
        self.resume_checkpoint = self.checkpoint

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        config = self._subcommand_config(self.config_init)
        plugins = config["trainer"].get("plugins") or []
        plugins = list(plugins) if isinstance(plugins, list) else [plugins]
        if not any(isinstance(plugin, CheckpointIO) for plugin in plugins):
            # A config's own plugins replaced the default list: keep the safe checkpoint I/O anyway.
            plugins.append(SafeCheckpointIO())
        # Not SLURMEnvironment.detect(): that is also true under torchrun inside a Slurm job.
        if lightning_uses_slurm(os.environ) and not any(isinstance(plugin, ClusterEnvironment) for plugin in plugins):
            # Preemption is handled by our callback at a step boundary, not by Lightning's
            # SIGUSR1 handler, which saves inside the signal handler (Lightning #21406).
            plugins.append(SLURMEnvironment(auto_requeue=False))
        kwargs["plugins"] = plugins
        user_callbacks = config["trainer"].get("callbacks") or []
        user_callbacks = user_callbacks if isinstance(user_callbacks, list) else [user_callbacks]
        compression: GradientCompression = config["gradient_compression"]
        # The order of what ddp-app installs, and why (a user's callbacks, anywhere in their list, change
        # nothing of what ours do):
        # - ExactResume first: at a resumed run's first hooks it restores the random state before any
        #   other callback (the user's included) draws from it, and its log flush precedes any save.
        # - Tracking second: the tracked run is open before a user's callback logs.
        # - GradientCompression (only when it compresses) registers its DDP hook at train start; it talks
        #   to other ranks only inside DDP's backward and inside saves, which every rank reaches together.
        # - RunCoordinator last: the one owner of ddp-app's exchanges between ranks (app/run/coordinator.py).
        #   Lightning keeps `Checkpoint` callbacks after every other, so its hooks run after everything
        #   else of the same hook.
        # NonFiniteGuard and HangReport come from `trainer_defaults`; they talk to no other rank during
        # training (HangReport once, at setup, on every rank).
        callbacks = [config["exact_resume"], config["tracking"], *user_callbacks]
        if compression.method != "none":
            callbacks.append(compression)
        saves_last = config["trainer"].get("enable_checkpointing") is not False
        coordinator = None
        if self.subcommand in (None, "fit"):  # no subcommand (`run=False`): the caller may fit
            coordinator = RunCoordinator(config["last_checkpoint"] if saves_last else None, config["tracking"])
            if saves_last:  # a Checkpoint callback: Lightning adds no default ModelCheckpoint beside it
                callbacks.append(coordinator)
        kwargs["callbacks"] = callbacks
        trainer = super().instantiate_trainer(**kwargs)
        if coordinator is not None and not saves_last:
            # After the Trainer is built: `enable_checkpointing: false` refuses any Checkpoint callback at
            # construction, and the coordinator is one (for its place in the hooks) that then saves nothing.
            trainer.callbacks.append(coordinator)
        if trainer.world_size == 1:  # no peer to hang on or to ask
            trainer.callbacks = [callback for callback in trainer.callbacks if not isinstance(callback, HangReport)]
        keep_lightning_off_stop_signals(trainer)
        build_ddp_on_the_current_stream(trainer.strategy)
        # Only fit's coordinator acts on stop signals recorded since `run` started, and only where it
        # saves last.ckpt; otherwise a stop signal ends this process, as by default.
        if self.subcommand not in (None, "fit") or not saves_last:
            STOP_SIGNAL_FLAG.release()
        environment = getattr(trainer.strategy, "cluster_environment", None)
        if self.launch is not None and self.launch.global_rank == 0 and environment is not None:
            print(describe_launch(self.launch, environment), flush=True)
        if config["trainer"]["logger"] in (None, True) and self.subcommand != "fit":
            trainer.loggers = default_loggers(trainer.default_root_dir)  # fit's: `_open_tracked_run`
        if self.subcommand == "predict":
            # Only here: Lightning calls every hook of every callback at every step, so a callback
            # that does nothing during fit still costs time per step.
            trainer.callbacks.append(PredictionWriter())
        if self.subcommand in ("validate", "test", "predict"):
            self.evaluation_throughput = EvaluationThroughput()
            trainer.callbacks.append(self.evaluation_throughput)
        bar = trainer.progress_bar_callback
        if bar is not None and not any(isinstance(callback, ProgressBar) for callback in user_callbacks):
            # The Trainer's default (TQDMProgressBar, or RichProgressBar where `rich` is installed) redraws
            # every step, and a log file (sbatch, CI, `| tee`) gets its redraws as one unreadable line.
            replacement = ThrottledProgressBar() if sys.stdout.isatty() else LogLineProgressBar()
            trainer.callbacks[trainer.callbacks.index(bar)] = replacement
        for index, callback in enumerate(trainer.callbacks):
            if type(callback) in (ModelSummary, RichModelSummary) and callback not in user_callbacks:
                # Lightning's default (RichModelSummary where `rich` is installed): the plain table a log
                # reads the same whatever the environment has installed, without a column of zero FLOPs.
                trainer.callbacks[index] = PlainModelSummary()  # max_depth=1, as Lightning's
        for callback in trainer.checkpoint_callbacks:
            # A fixed directory (not inside the versioned log dir) lets `--ckpt_path last` find the
            # previous run's last.ckpt after a crash or a requeue.
            if isinstance(callback, ModelCheckpoint) and callback.dirpath is None:
                callback.dirpath = str(Path(trainer.default_root_dir) / "checkpoints")
        return trainer

    def _before_run(self) -> None:
        """`--ckpt_path last`: our last.ckpt (Lightning only looks in ModelCheckpoint directories);
        none yet means a first run, which starts fresh (one line says which). Any DataModule's loaders
        get our samplers (exact evaluation, exact mid-epoch resume), and per-rank means logged
        during evaluation are reported once."""
        config = self.config_init[self.subcommand]
        asked_for_last = config.get("ckpt_path") == "last"
        if asked_for_last:
            config["ckpt_path"] = agreed_last_checkpoint(self.trainer)  # rank 0's answer, on every rank
            if config["ckpt_path"]:  # the checks after_instantiate_classes makes for a given file
                self.resume_checkpoint = summarize_any(config["ckpt_path"])
                check_model_class(self.resume_checkpoint, self._subcommand_config(self.config)["model"].class_path)
                check_state_fits(self.resume_checkpoint, self.model)
            if self.trainer.is_global_zero:  # a restarted or requeued job says where it picks up
                found = f"resuming from {config['ckpt_path']}" if config["ckpt_path"] else "none yet, starting fresh"
                print(f"ddp-app: --ckpt_path last: {found}", flush=True)
        if self.subcommand == "fit" and self.config[self.subcommand]["trainer"]["logger"] in (None, True):
            self._open_tracked_run(config, asked_for_last)
        shard_all_loaders(self.trainer, self.datamodule, self.model)
        warn_on_per_rank_means(self.trainer, self.model)
        if isinstance(self.trainer.precision_plugin, DoublePrecision):
            # Lightning restores a checkpoint's weights before its precision plugin converts the
            # module: a float64 checkpoint loaded into the float32 module is rounded to float32
            # once (a resume of a 64-true run was 5.6e-5 off the uninterrupted run). In float64
            # from the start, the weights load unrounded (the plugin's own `.double()` is a no-op).
            self.model.double()
        if config.get("compile"):
            compiled = compile_networks(self.model)
            if not compiled:
                raise UserFacingError(
                    f"compile: true, but {type(self.model).__name__} has no submodule with parameters to compile. "
                    "Fix: keep its layers in attributes (self.net = ...), or set compile: false."
                )
            if self.trainer.is_global_zero:
                print(f"ddp-app: compile: torch.compile on {', '.join(compiled)} (the first step compiles)", flush=True)

    before_fit = before_validate = before_test = before_predict = _before_run

    def after_fit(self) -> None:
        metrics = scalar_metrics(self.trainer)  # on every rank: it may reduce (app/run/summary.py)
        if self.trainer.is_global_zero:
            tracking: Tracking = self.config_init[self.subcommand]["tracking"]
            lines = fit_summary(self.trainer, metrics, time.time() - self.started, tracking.viewing_lines())
            print("\n".join(lines), flush=True)

    def _after_evaluation(self) -> None:
        metrics = scalar_metrics(self.trainer)  # on every rank: it may reduce (app/run/summary.py)
        if self.trainer.is_global_zero:
            ckpt_path = self.config_init[self.subcommand].get("ckpt_path")
            elapsed_s = time.time() - self.started
            lines = evaluation_summary(
                self.subcommand, self.trainer, metrics, elapsed_s, ckpt_path, self.evaluation_throughput
            )
            print("\n".join(lines), flush=True)

    after_validate = after_test = after_predict = _after_evaluation

    def _open_tracked_run(self, config: Any, asked_for_last: bool) -> None:
        """fit logs through the run's identity (app/tracking/run.py): a resume continues the run of
        its checkpoint, `--ckpt_path last` with no checkpoint yet the directory's latest run."""
        ckpt_path = config.get("ckpt_path")
        summary = self.resume_checkpoint
        if ckpt_path and self.trainer.is_global_zero and (summary is None or summary.path != str(ckpt_path)):
            summary = summarize_any(ckpt_path) if is_checkpoint(ckpt_path) else None
        resume_state = summary.run if summary is not None and ckpt_path else None
        subcommand_config = self.config[self.subcommand]
        config_yaml = self._parser(self.subcommand).dump(subcommand_config, skip_none=False)
        tracking: Tracking = config["tracking"]
        logger = tracking.open(
            self.trainer,
            resume_state,
            asked_for_last and not ckpt_path,
            config_yaml,
            str(ckpt_path) if ckpt_path else None,
        )
        self.trainer.loggers = [logger]


class ConfigParsed(Exception):  # noqa: N818 (control flow, not an error)
    """Raised by a parse-only DDPAppCLI once the whole config is parsed (and checked): what to launch."""

    def __init__(
        self, config: Any, plan: RankPlan, num_nodes: int, subcommand: str | None = None, rank_zero: bool = True
    ) -> None:
        super().__init__("config parsed")
        self.config = config
        self.plan = plan
        self.num_nodes = num_nodes
        self.subcommand = subcommand
        self.rank_zero = rank_zero  # this launcher starts global rank 0 (node 0 of a multi-node launch)


def configured_checkpoint_dirs(root: Path, trainer_config: Any) -> list[Path]:
    """Where a fit with this trainer config writes checkpoints: `<root>/checkpoints` (ddp-app's last.ckpt
    and every ModelCheckpoint without a dirpath) and the dirpath of any configured callback that has one."""
    dirs = [root / "checkpoints"]
    callbacks = trainer_config.get("callbacks") or []
    for callback in callbacks if isinstance(callbacks, list) else [callbacks]:
        if isinstance(callback, ModelCheckpoint):  # an object given in Python, not a config entry
            dirpath = callback.dirpath
        else:
            dirpath = (getattr(callback, "init_args", None) or {}).get("dirpath")
        if dirpath:
            dirs.append(Path(dirpath))
    return dirs


def parse_config(args: list[str]) -> Any:
    """The subcommand config `ddp-app <args>` would run with: the same parser, files and precedence,
    nothing checked against this machine (for tools like `python -m app.slurm` on a login node)."""
    try:
        DDPAppCLI(args=args, parse_only=True, check_machine=False)
    except ConfigParsed as parsed:
        return parsed.config
    raise AssertionError("DDPAppCLI(parse_only=True) returned without parsing")
