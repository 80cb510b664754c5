"""The LightningCLI of `ddp-app`: the parser, our Trainer defaults and what happens around `fit`.

    ddp-app fit --config configs/digits.yaml [--trainer.max_epochs 5 ...]

`DDPAppCLI` parses the command line into the models in `app.models` and the data in `app.data`,
checks the config (app/run/config_checks.py) and the launch (app/cluster/preflight.py), and builds the
Trainer with safe checkpoint I/O, exact resume and the tracked run. Starting and supervising the
ranks is app/cli/entry.py's job. Everything before `fit` (parsing, building the model and data
module) runs once per rank: nothing here may download or write.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Mapping
from typing import Any, NoReturn

import lightning as L
from jsonargparse import Namespace
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_only

import app.data
import app.models.lightning  # noqa: F401  (registers the LightningModules for short `class_path` names)
from app.checkpoints.io import (
    CheckpointSummary,
    as_checkpoint_error,
    check_model_class,
    check_overrides,
    check_state_fits,
)
from app.checkpoints.last import LastCheckpoint
from app.checkpoints.sharded import is_checkpoint, summarize_any
from app.cluster.hangs import HangReport
from app.cluster.launch import RankPlan, rank_plan
from app.cluster.preflight import (
    Launch,
    on_gpu,
    preflight,
)
from app.errors import summarize_parser_error
from app.parallel.compression import GradientCompression
from app.parallel.strategy import expand_fsdp_name, resolve_strategy
from app.private_apis import require
from app.resume.exact import ExactResume
from app.run.build import build_trainer, config_for_the_ranks, open_tracked_run, prepare_run
from app.run.callbacks import (
    NonFiniteGuard,
)
from app.run.config_checks import (
    check_config,
    command_line_model_keys,
)
from app.run.console import STARTED_VARIABLE
from app.run.directory import RunLock, claim_run_directory
from app.run.step_timing import StepTiming
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


def is_global_rank_zero(launch: Launch | None, env: Mapping[str, str]) -> bool:
    """Before any process group exists: from the launch, or from the launcher's variables if unknown."""
    if launch is not None:
        return launch.global_rank == 0
    return all(env.get(name, "0") == "0" for name in ("RANK", "LOCAL_RANK", "NODE_RANK"))


def add_ddp_app_arguments(parser: LightningArgumentParser) -> None:
    """ddp-app's own top-level config keys, beside LightningCLI's trainer, model, data, optimizer."""
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
    # `step_timing.enabled` (app/run/step_timing.py): where each step's time goes, in every fit.
    parser.add_class_arguments(StepTiming, "step_timing")
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
                "profiler": {"class_path": "app.cli.NoProfiler"},  # app/run/build.py
                "plugins": [{"class_path": "app.cli.SafeCheckpointIO"}],  # app/checkpoints/plugin.py
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
        add_ddp_app_arguments(parser)

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
            # A shard_group_size that does not divide the ranks stops here, in one line, before any rank starts.
            resolve_strategy(config["trainer"].get("strategy")).mesh(self.launch.world_size, self.launch.devices)
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
        config_for_the_ranks(config, self.launch, is_global_rank_zero(self.launch, os.environ))
        if self.subcommand == "fit":
            self._claim_run_directory(config)

    def _claim_run_directory(self, config: Any) -> None:
        rank_zero = is_global_rank_zero(self.launch, os.environ)
        self.run_lock = claim_run_directory(config, rank_zero, lock=rank_zero and not self.parse_only)

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
        def make_trainer(**ours: Any) -> Trainer:
            return super(DDPAppCLI, self).instantiate_trainer(**{**kwargs, **ours})

        config = self._subcommand_config(self.config_init)
        trainer, self.evaluation_throughput = build_trainer(config, self.subcommand, self.launch, make_trainer)
        return trainer

    def _before_run(self) -> None:
        """app/run/build.py `prepare_run`: the checkpoint to resume from, the tracked run, the loaders."""
        config = self.config_init[self.subcommand]
        tracked = self.subcommand == "fit" and self.config[self.subcommand]["trainer"]["logger"] in (None, True)
        self.resume_checkpoint = prepare_run(
            config,
            self.subcommand,
            self.trainer,
            self.model,
            self.datamodule,
            self.resume_checkpoint,
            self._subcommand_config(self.config)["model"].class_path,
            self._open_tracked_run if tracked else None,
        )

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

    def _open_tracked_run(self, ckpt_path: str | None, latest: bool, summary: CheckpointSummary | None) -> None:
        config_yaml = self._parser(self.subcommand).dump(self.config[self.subcommand], skip_none=False)
        tracking: Tracking = self.config_init[self.subcommand]["tracking"]
        open_tracked_run(tracking, self.trainer, config_yaml, ckpt_path, latest, summary)


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


def parse_config(args: list[str]) -> Any:
    """The subcommand config `ddp-app <args>` would run with: the same parser, files and precedence,
    nothing checked against this machine (for tools like `python -m app.slurm` on a login node)."""
    try:
        DDPAppCLI(args=args, parse_only=True, check_machine=False)
    except ConfigParsed as parsed:
        return parsed.config
    raise AssertionError("DDPAppCLI(parse_only=True) returned without parsing")
