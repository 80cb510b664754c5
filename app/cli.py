"""The `ddp-app` command: LightningCLI over the models in `app.models` and data in `app.data`.

    ddp-app fit --config configs/digits.yaml [--trainer.max_epochs 5 ...]
    python -m app fit --config configs/digits.yaml

With `strategy: ddp`, Lightning starts ranks >= 1 by running this same command line again when
rank 0 reaches `fit`. Everything before `fit` (parsing, building the model and data module)
therefore runs once per rank: nothing here may download or write.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import importlib.util
import inspect
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

import lightning as L
from jsonargparse import Namespace
from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from lightning.pytorch.profilers import PassThroughProfiler
from lightning.pytorch.strategies import StrategyRegistry

import app.data
import app.models.lightning  # noqa: F401  (registers the LightningModules for short `class_path` names)
from app.callbacks import ExactResume, NonFiniteGuard, PredictionWriter, ThrottledProgressBar
from app.checkpoints import as_checkpoint_error, atomic_torch_save, remove_stale_temporaries, safe_load
from app.cluster.exit_codes import INTERRUPTED_EXIT_CODE
from app.cluster.launch import describe_exit
from app.cluster.preemption import Stopped
from app.cluster.preflight import Launch, describe_launch, lightning_uses_slurm, preflight
from app.cluster.threads import configure_cpu_threads
from app.errors import UserFacingError, summarize_parser_error, user_message
from app.last_checkpoint import LastCheckpoint, find_last_checkpoint

app.data.import_all()  # registers the DataModules for short `class_path` names

# Trainers this process built: on an error, the rank processes their launchers started are stopped.
STARTED_TRAINERS: list[Trainer] = []

# Lightning's default collective timeout is 30 minutes: a dead peer then hangs the others that long.
DEFAULT_COLLECTIVE_TIMEOUT_S = 1800.0


class OneLineErrorParser(LightningArgumentParser):
    """Bad command-line or config input: one line on stderr and exit code 2, not a 60-line usage dump."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:
            super().error(message, ex)
        prog = self.prog.replace(" [options]", "")
        sys.stderr.write(f"{prog}: error: {summarize_parser_error(message)} (see: {prog} --help)\n")
        self.exit(2)


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint I/O with atomic, fsynced saves and `weights_only=True` loads."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        remove_stale_temporaries(Path(path))
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        return safe_load(path, map_location=map_location if map_location is not None else "cpu")


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


def check_config(config: Any) -> None:
    """Refuse values that Lightning or PyTorch would accept silently or reject deep inside a rank."""
    trainer = config["trainer"]
    max_epochs = trainer.get("max_epochs")
    if max_epochs is not None and max_epochs < 1:
        raise UserFacingError(
            f"trainer.max_epochs must be >= 1, got {max_epochs}. Fix: a positive number of epochs "
            "(for a run bounded by steps or time, set trainer.max_steps or trainer.max_time instead)."
        )
    optimizer = config.get("optimizer")
    lr = (optimizer or {}).get("init_args", {}).get("lr") if optimizer else None
    if isinstance(lr, (int, float)) and lr <= 0:
        raise UserFacingError(f"optimizer.init_args.lr must be > 0, got {lr}. Fix: a positive learning rate.")
    devices = trainer.get("devices")
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, int) and devices < 1:
        raise UserFacingError(f"trainer.devices must be >= 1, got {devices}. Fix: a positive process count.")
    accelerator = trainer.get("accelerator")
    accelerator = accelerator if isinstance(accelerator, str) else None
    if accelerator in ("gpu", "cuda") and not _cuda_available():
        raise UserFacingError(
            f"trainer.accelerator={accelerator} but this machine has no usable GPU (torch.cuda.is_available() "
            "is False). Fix: --trainer.accelerator=cpu (or auto), or run on a GPU node."
        )
    on_cpu = accelerator == "cpu" or (accelerator in (None, "auto") and not _cuda_available())
    precision = str(trainer.get("precision"))
    if on_cpu and precision in ("16", "16-mixed", "16-true", "half"):
        raise UserFacingError(
            f"trainer.precision={precision} on CPU: CPUs have no native float16 arithmetic (it is emulated, "
            "slower than 32-bit). Fix: --trainer.precision=bf16-mixed or 32-true on CPU; 16-mixed is for GPUs."
        )
    cores = os.cpu_count() or 1
    if on_cpu and isinstance(devices, int) and devices > cores and not os.environ.get("DDP_APP_ALLOW_OVERSUBSCRIBE"):
        raise UserFacingError(
            f"trainer.devices={devices} CPU processes on a machine with {cores} cores would oversubscribe it "
            f"(every step waits for the slowest rank). Fix: trainer.devices <= {cores}, or set "
            "DDP_APP_ALLOW_OVERSUBSCRIBE=1 to run anyway."
        )
    if os.environ.get("LOCAL_RANK", "0") == "0":
        check_writable(Path(trainer.get("default_root_dir") or os.getcwd()))


def drop_static_graph_for_accumulation(trainer_config: Any) -> str | None:
    """Turn DDP's `static_graph` off when gradients are accumulated; returns a notice, or None if unchanged.

    Lightning skips the all-reduce on accumulation micro-batches with `DistributedDataParallel.no_sync()`,
    which static_graph does not support: the reducer fails an internal assert, and PyTorch reports
    runs where it instead silently stops all-reducing (ranks train apart). static_graph is only a
    speed hint (the gradients are the same without it), so we drop it for this run rather than
    refuse a config we ship. The reference trainer decides the same (`app.reference.config.ddp_arguments`).
    """
    accumulate = trainer_config.get("accumulate_grad_batches") or 1
    strategy = trainer_config.get("strategy")
    init_args = getattr(strategy, "init_args", None)
    if accumulate <= 1 or init_args is None or not init_args.get("static_graph"):
        return None
    init_args["static_graph"] = False
    return (
        f"ddp-app: trainer.accumulate_grad_batches={accumulate} with static_graph: true in "
        "trainer.strategy.init_args: DDP's static graph cannot skip the all-reduce on accumulation steps "
        "(no_sync), so this run uses static_graph=false (a speed hint; same gradients). "
        "Set static_graph: false in the config to silence this."
    )


def runs_several_processes(trainer_config: Any) -> bool:
    """Whether `strategy: auto` becomes "ddp": Lightning picks it for more than one device or node
    (outside a notebook, which `ddp-app` never runs in)."""
    devices = trainer_config.get("devices")
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    count = len(devices) if isinstance(devices, (list, tuple)) else devices if isinstance(devices, int) else 1
    return count > 1 or int(trainer_config.get("num_nodes") or 1) > 1


def apply_collective_timeout(trainer_config: Any, seconds: float) -> None:
    """Give the strategy `timeout=collective_timeout_s` through its own argument, before it is built.

    A `class_path` strategy gets it in its `init_args` (unless the config sets a timeout of its
    own); a name (`ddp`, `ddp_spawn`, ..., or `auto` where Lightning would choose `ddp`) becomes
    the registered class with its registered arguments plus the timeout. Strategies without a
    `timeout` argument (single device) are left alone.
    """
    timeout = datetime.timedelta(seconds=seconds)
    strategy = trainer_config.get("strategy")
    if strategy == "auto" and runs_several_processes(trainer_config):
        strategy = "ddp"
    if isinstance(strategy, str):
        if strategy not in StrategyRegistry:
            return
        entry = StrategyRegistry[strategy]
        cls = entry["strategy"]
        if "timeout" in inspect.signature(cls).parameters:
            init_args = Namespace(**{**entry["init_params"], "timeout": timeout})
            trainer_config["strategy"] = Namespace(
                class_path=f"{cls.__module__}.{cls.__qualname__}", init_args=init_args
            )
        return
    class_path = getattr(strategy, "class_path", None)
    if class_path is None:
        return
    module_name, _, class_name = class_path.rpartition(".")
    parameter = inspect.signature(getattr(importlib.import_module(module_name), class_name)).parameters.get("timeout")
    if parameter is None:
        return
    if strategy.get("init_args") is None:
        strategy["init_args"] = Namespace()
    if strategy["init_args"].get("timeout") in (None, parameter.default):
        strategy["init_args"]["timeout"] = timeout


def is_global_rank_zero(launch: Launch | None, env: Mapping[str, str]) -> bool:
    """Before any process group exists: from the launch, or from the launcher's variables if unknown."""
    if launch is not None:
        return launch.global_rank == 0
    return all(env.get(name, "0") == "0" for name in ("RANK", "LOCAL_RANK", "NODE_RANK"))


def check_writable(directory: Path) -> None:
    """Fail before training, not at the first checkpoint an hour later."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-probe-"):
            pass
    except OSError as error:
        raise UserFacingError(
            f"trainer.default_root_dir {directory} is not writable ({error.strerror}). "
            "Fix: choose a directory you can write to."
        ) from error


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


class DDPAppCLI(LightningCLI):
    """LightningCLI with our defaults: one-line errors, input checks, CSV (+TensorBoard) logs,
    atomic and safe checkpoints in a fixed directory, exact resume, preemption at step
    boundaries, a bounded collective timeout, and the config saved next to the logs."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("parser_class", OneLineErrorParser)
        kwargs.setdefault(
            "trainer_defaults",
            {
                "callbacks": [ExactResume(), NonFiniteGuard()],
                # Defaults, so a config's own `profiler:` or `plugins:` replaces them.
                "profiler": {"class_path": "app.cli.NoProfiler"},
                "plugins": [{"class_path": "app.cli.SafeCheckpointIO"}],
            },
        )
        super().__init__(
            L.LightningModule,
            L.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            **kwargs,
        )

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--collective_timeout_s",
            type=float,
            default=DEFAULT_COLLECTIVE_TIMEOUT_S,
            help="How long a collective (or the rendezvous) may wait for a peer before every rank fails.",
        )
        # A group of its own (not trainer.callbacks): ddp-app always keeps last.ckpt fresh, and the
        # interval is one key to set: `last_checkpoint.every_n_seconds`.
        parser.add_class_arguments(LastCheckpoint, "last_checkpoint")

    def _subcommand_config(self, config: Any) -> Any:
        return config[self.subcommand] if self.subcommand else config

    def _parse_ckpt_path(self) -> None:
        # LightningCLI reads the checkpoint's hyperparameters with torch.load(weights_only=True)
        # before anything else (Lightning 2.6 `LightningCLI._parse_ckpt_path`); name the file if it fails.
        try:
            super()._parse_ckpt_path()
        except Exception as error:
            ckpt_path = self.config[self.config.subcommand].get("ckpt_path")
            raise as_checkpoint_error(ckpt_path, error) from error

    def before_instantiate_classes(self) -> None:
        config = self._subcommand_config(self.config)
        check_config(config)
        # No process group exists yet: a launch that disagrees with devices/num_nodes or would hang
        # stops here in one line, and SLURMEnvironment gets our per-job MASTER_PORT.
        self.launch = preflight(config["trainer"])
        apply_collective_timeout(config["trainer"], config["collective_timeout_s"])
        notice = drop_static_graph_for_accumulation(config["trainer"])
        # Every rank parses the config and makes the same change; one line in the log is enough.
        if notice and is_global_rank_zero(self.launch, os.environ):
            print(notice, flush=True)

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
        if config["trainer"].get("enable_checkpointing") is not False:
            callbacks = config["trainer"].get("callbacks") or []
            callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
            kwargs["callbacks"] = [*callbacks, config["last_checkpoint"]]
        trainer = super().instantiate_trainer(**kwargs)
        STARTED_TRAINERS.append(trainer)
        environment = getattr(trainer.strategy, "cluster_environment", None)
        if self.launch is not None and self.launch.global_rank == 0 and environment is not None:
            print(describe_launch(self.launch, environment), flush=True)
        if config["trainer"]["logger"] in (None, True):
            trainer.loggers = default_loggers(trainer.default_root_dir)
        if self.subcommand == "predict":
            # Only here: Lightning calls every hook of every callback at every step, so a callback
            # that does nothing during fit still costs time per step.
            trainer.callbacks.append(PredictionWriter())
        bar = trainer.progress_bar_callback
        if type(bar) is TQDMProgressBar and bar.refresh_rate == 1:  # the Trainer's default: redraws every step
            trainer.callbacks[trainer.callbacks.index(bar)] = ThrottledProgressBar()
        for callback in trainer.checkpoint_callbacks:
            # A fixed directory (not inside the versioned log dir) lets `--ckpt_path last` find the
            # previous run's last.ckpt after a crash or a requeue.
            if isinstance(callback, ModelCheckpoint) and callback.dirpath is None:
                callback.dirpath = str(Path(trainer.default_root_dir) / "checkpoints")
        return trainer

    def _resolve_last_checkpoint(self) -> None:
        """`--ckpt_path last`: our last.ckpt (Lightning only looks in ModelCheckpoint directories);
        none yet means a first run, which starts fresh without a warning."""
        config = self.config_init[self.subcommand]
        if config.get("ckpt_path") == "last":
            config["ckpt_path"] = find_last_checkpoint(self.trainer)

    before_fit = before_validate = before_test = before_predict = _resolve_last_checkpoint


# Lightning's launcher starts ranks >= 1 as children of rank 0: if this parent goes, rank 0 died.
PARENT_AT_START = os.getppid()


def dead_parent_rank() -> list[str]:
    """'rank 0 (pid 123) died' when this rank was started by Lightning's launcher in rank 0, now gone."""
    started_by_rank0 = os.environ.get("LOCAL_RANK", "0") != "0" and "TORCHELASTIC_RUN_ID" not in os.environ
    if started_by_rank0 and "SLURM_STEP_ID" not in os.environ and os.getppid() != PARENT_AT_START:
        return [f"rank 0 (pid {PARENT_AT_START}, which started this rank) died"]
    return []


def dead_child_ranks() -> list[str]:
    """'rank 1 (pid 123) was killed by SIGKILL' for each rank this process started that has died."""
    dead = []
    for trainer in STARTED_TRAINERS:
        for local_rank, process in enumerate(getattr(trainer.strategy.launcher, "procs", None) or [], start=1):
            if process.poll() not in (None, 0):
                dead.append(f"rank {local_rank} (pid {process.pid}) {describe_exit(process.returncode)}")
    return dead


def stop_child_ranks() -> None:
    """Kill the ranks Lightning's launcher started from this process, if any are still running.

    Lightning's process observer ends everything when a child rank fails, but when rank 0 itself
    fails (say, before the rendezvous) the children stay behind, blocked in `init_process_group`
    until the collective timeout: an orphaned job for up to 30 minutes.
    """
    for trainer in STARTED_TRAINERS:
        for process in getattr(trainer.strategy.launcher, "procs", None) or []:
            if process.poll() is None:
                process.kill()
                process.wait()


def main(args: list[str] | None = None) -> None:
    configure_cpu_threads()
    try:
        DDPAppCLI(args=args)
    except Stopped as stopped:
        stop_child_ranks()
        if stopped.is_global_zero:  # once, not once per rank
            print(f"ddp-app: {stopped}", file=sys.stderr)
        raise SystemExit(stopped.exit_code) from None
    except KeyboardInterrupt:  # Ctrl-C before training started: nothing to save yet
        stop_child_ranks()
        print("ddp-app: interrupted (Ctrl-C) before training started; nothing was saved.", file=sys.stderr)
        raise SystemExit(INTERRUPTED_EXIT_CODE) from None
    except Exception as error:
        dead = dead_child_ranks() + dead_parent_rank()
        stop_child_ranks()
        message = user_message(error)
        if dead:  # the root cause, before the symptom this rank saw
            message = f"{'; '.join(dead)}, so the job stops. {message or ''}".strip()
        if message is None:
            raise
        print(f"ddp-app: error: {message}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
