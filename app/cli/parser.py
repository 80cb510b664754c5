"""The LightningCLI of `ddp-app`: the parser, our Trainer defaults and what happens around `fit`.

    ddp-app fit --config configs/digits.yaml [--trainer.max_epochs 5 ...]

`DDPAppCLI` parses the command line into the models in `app.models` and the data in `app.data`,
checks the config (app/run/config_checks.py) and the launch (app/cluster/preflight.py), and builds the
Trainer with safe checkpoint I/O, exact resume and the tracked run. Starting and supervising the
ranks is app/cli/entry.py's job. Everything before `fit` (parsing, building the model and data
module) runs once per rank: nothing here may download or write.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, NoReturn

import lightning as L
import yaml
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_only

import app.data
import app.models.lightning  # noqa: F401  (registers the LightningModules for short `class_path` names)
from app.checkpoints.io import CheckpointSummary
from app.checkpoints.last import LastCheckpoint
from app.cluster.launch import RankPlan
from app.errors import summarize_parser_error
from app.parallel.compression import GradientCompression
from app.parallel.fault_tolerance import FaultTolerance
from app.parallel.strategy import name_as_class_spec
from app.private_apis import require
from app.resume.exact import ExactResume
from app.run.build import build_trainer, config_for_the_ranks, open_tracked_run, prepare_run
from app.run.console import STARTED_VARIABLE
from app.run.directory import RunLock, claim_run_directory
from app.run.plan import ResumeFrom, RunPlan, make_run_plan
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
    # `fault_tolerance.enabled` (app/parallel/fault_tolerance.py, docs/fault_tolerance.md): replica groups
    # that keep training when one of them dies (torchft).
    parser.add_class_arguments(FaultTolerance, "fault_tolerance")
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
    boundaries, a bounded collective timeout, and the config saved next to the logs.

    Right after parsing, the run plan (app/run/plan.py) decides the run once; everything after
    reads `self.plan`. With `parse_only`, nothing is built or run: the constructor returns once the
    config is parsed and planned (and, with `check_machine`, checked against this machine and
    launch), and `parsed` holds the result. `main` does that once before it starts the ranks, so
    that bad input is reported once, quickly; `parse_config` for tools.
    """

    def __init__(self, parse_only: bool = False, check_machine: bool = True, **kwargs: Any) -> None:
        # LightningCLI calls `_parse_ckpt_path` right after parsing, to read a checkpoint's
        # hyperparameters; the plan does that from its one reading of the file, so ours does nothing.
        # A LightningCLI that no longer calls it would read the checkpoint a second time.
        require(LightningCLI, "_parse_ckpt_path", "lightning", "reading a resumed checkpoint once (app/run/plan.py)")
        self.parse_only = parse_only
        self.check_machine = check_machine
        # The wall time the end-of-run summary reports: from the launcher's start (app/cli/entry.py), so it
        # includes the imports, the forks and every restart.
        self.started = float(os.environ.get(STARTED_VARIABLE) or time.time())
        self.run_lock: RunLock | None = None  # this fit's hold on its directory (app/run/directory.py)
        self.evaluation_throughput: EvaluationThroughput | None = None
        self.command_line: list[str] = []
        self.plan: RunPlan | None = None
        self.parsed: ParsedRun | None = None  # parse_only: what was parsed and planned
        self.resume: ResumeFrom = ResumeFrom()  # the plan's, or the file `--ckpt_path last` found (`_before_run`)
        # Before parsing: a user's `class_path: mymodels.MyNet` imports from the current directory
        # or beside the config, on every rank (app/user_code.py has the rule).
        args = kwargs.get("args")
        add_user_code_directories(args if isinstance(args, list) else None)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("parser_class", OneLineErrorParser)
        kwargs.setdefault(
            "trainer_defaults",
            {
                # Defaults, so a config's own `profiler:` or `plugins:` replaces them. ddp-app's callbacks
                # are installed in one place, app/run/build.py `build_trainer`.
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
        subcommand = config.get("subcommand")
        return config[subcommand] if subcommand else config

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse, then plan: the plan is made once per process, here, before any class is built."""
        if args is None or isinstance(args, list):
            self.command_line = list(sys.argv[1:] if args is None else args)
            args = strategy_names_as_classes(self.command_line)
        super().parse_arguments(parser, args)
        self.plan = make_run_plan(
            self._subcommand_config(self.config),
            self.config.get("subcommand"),
            self.command_line,
            check_machine=self.check_machine,
            apply_checkpoint_arguments=self._apply_checkpoint_arguments,
        )
        self.resume = self.plan.resume
        if self.plan.launch is not None:
            # A forked rank imported Lightning in the launcher, where Lightning took this process for
            # rank 0: until the strategy sets the ranks inside `fit`, every rank would print what only
            # rank 0 should (Lightning's rank-zero warnings about the Trainer, for one).
            rank_zero_only.rank = self.plan.launch.global_rank

    def _apply_checkpoint_arguments(self, summary: CheckpointSummary) -> Any:
        """LightningCLI's rule for a resumed checkpoint file (its `_parse_ckpt_path`): the model's
        arguments saved in the checkpoint win over the config's. Applied from the plan's one reading of
        the file; returns the subcommand's config with them."""
        subcommand = self.config.get("subcommand")
        hparams: dict[str, Any] = dict(summary.hyper_parameters)
        if not hparams and summary.class_path is None:
            return self._subcommand_config(self.config)
        if summary.class_path is not None:
            hparams = {"class_path": summary.class_path, "dict_kwargs": hparams}
        try:
            self.config = self.parser.parse_object({subcommand: {"model": hparams}}, self.config)
        except SystemExit:
            sys.stderr.write("Parsing of ckpt_path hyperparameters failed!\n")
            raise
        return self._subcommand_config(self.config)

    def _parse_ckpt_path(self) -> None:
        """Nothing: the plan applied the checkpoint's arguments (`_apply_checkpoint_arguments`)."""

    def before_instantiate_classes(self) -> None:
        config = self._subcommand_config(self.config)
        assert self.plan is not None  # made by parse_arguments
        if self.parse_only:
            if self.check_machine:
                self._check_before_launch(config, self.plan)
            self.parsed = ParsedRun(config, self.plan)
            # Nothing is built or run in a parse-only pass: LightningCLI runs no subcommand without one.
            self.subcommand = None
            return
        config_for_the_ranks(config, self.plan)
        if self.subcommand == "fit":
            self.run_lock = claim_run_directory(config, self.plan.rank_zero, lock=self.plan.rank_zero)

    def _check_before_launch(self, config: Any, plan: RunPlan) -> None:
        """The launcher's own checks, once, before any rank starts (the plan follows the config as
        written, before the changes every rank makes)."""
        try_trainer_arguments(self.parser, self.config, self.trainer_class, plan.ranks)
        if plan.subcommand == "fit":  # last: a typo in the command is named before the directory's state
            claim_run_directory(config, plan.rank_zero, lock=False)
            if config["tracking"] and config["tracking"].get("mlflow") is not None:
                check_remote_mlflow_answers(config["tracking"]["mlflow"].get("tracking_uri"))

    def instantiate_classes(self) -> None:
        if not self.parse_only:
            super().instantiate_classes()

    def after_instantiate_classes(self) -> None:
        # Before the Trainer or a logger writes anything: a checkpoint that cannot load stops here,
        # in one line, instead of in `load_state_dict` inside every rank (`--ckpt_path last`: `_before_run`).
        if not self.parse_only:
            self.resume.check_fits(self.model)

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        def make_trainer(**ours: Any) -> Trainer:
            return super(DDPAppCLI, self).instantiate_trainer(**{**kwargs, **ours})

        assert self.plan is not None
        config = self._subcommand_config(self.config_init)
        trainer, self.evaluation_throughput = build_trainer(config, self.plan, make_trainer)
        return trainer

    def _before_run(self) -> None:
        """app/run/build.py `prepare_run`: the checkpoint to resume from, the tracked run, the loaders."""
        assert self.plan is not None
        config = self.config_init[self.subcommand]
        tracked = self.subcommand == "fit" and self.config[self.subcommand]["trainer"]["logger"] in (None, True)
        self.resume = prepare_run(
            config,
            self.plan,
            self.trainer,
            self.model,
            self.datamodule,
            self._subcommand_config(self.config)["model"].class_path,
            self._open_tracked_run if tracked else None,
        )

    before_fit = before_validate = before_test = before_predict = _before_run

    def after_fit(self) -> None:
        metrics = scalar_metrics(self.trainer)  # on every rank: it may reduce (app/run/summary.py)
        # Replica groups (fault tolerance) are runs of their own to Lightning: group 0 speaks for the run.
        groups = self.plan.fault_tolerance if self.plan is not None else None
        if self.trainer.is_global_zero and (groups is None or groups.group in (None, 0)):
            tracking: Tracking = self.config_init[self.subcommand]["tracking"]
            lines = fit_summary(
                self.trainer, metrics, time.time() - self.started, tracking.viewing_lines(), replica_groups=groups
            )
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


def try_trainer_arguments(parser: LightningArgumentParser, config: Any, trainer_class: type, ranks: RankPlan) -> None:
    """Build the Trainer here, once, as the ranks will (app/run/trainer_check.py): an argument Lightning
    refuses stops the launch in one line before any rank starts."""
    subcommand = config.get("subcommand")

    def instantiate() -> dict[str, Any]:
        clone = config.clone()
        section = clone[subcommand] if subcommand else clone
        section["model"] = section["data"] = None  # only the trainer section's classes are built
        for key, value in LEFT_OUT.items():
            section["trainer"][key] = value
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # jsonargparse's deprecation notice; LightningCLI calls it too
            built = parser.instantiate_classes(clone)
        return dict((built[subcommand] if subcommand else built)["trainer"])

    trainer_config = (config[subcommand] if subcommand else config)["trainer"]
    overrides = {"devices": ranks.devices} if ranks.devices is not None else None
    check_trainer_arguments(instantiate, trainer_config, overrides, trainer_class)


@dataclass(frozen=True)
class ParsedRun:
    """A parse-only DDPAppCLI's result: the subcommand's parsed config and the run plan made from it."""

    config: Any
    plan: RunPlan


def parse_config(args: list[str]) -> Any:
    """The subcommand config `ddp-app <args>` would run with: the same parser, files and precedence,
    nothing checked against this machine (for tools like `python -m app.slurm` on a login node)."""
    parsed = DDPAppCLI(args=args, parse_only=True, check_machine=False).parsed
    assert parsed is not None  # a parse-only DDPAppCLI always plans, or exits
    return parsed.config


def strategy_names_as_classes(args: list[str]) -> list[str]:
    """The command line with a strategy name that arguments follow written as the class it stands for.

    jsonargparse takes `--trainer.strategy.init_args.*` only after a class (after a name it fails with
    "NestedArg ... expected str"), so `--trainer.strategy fsdp --trainer.strategy.init_args.shard_group_size
    2` becomes `--trainer.strategy={"class_path": "app.parallel.fsdp.FSDP2Strategy", "init_args": {}}`
    and the same argument. A name given in a config file (`strategy: fsdp`) that command-line arguments
    follow gets the same line before them. A name that stands for no class is left for the plan to refuse.
    """
    first_argument = next((i for i, arg in enumerate(args) if arg.startswith(STRATEGY_OPTION + ".")), None)
    if first_argument is None:
        return args
    name, at = _strategy_written_before(args, first_argument)
    spec = name_as_class_spec(name) if isinstance(name, str) else None
    if spec is None:
        return args
    rewritten = f"{STRATEGY_OPTION}={json.dumps(spec, default=str)}"
    if at is None:  # named in a config file: the class goes before the first argument
        return [*args[:first_argument], rewritten, *args[first_argument:]]
    end = at + (1 if "=" in args[at] else 2)
    return [*args[:at], rewritten, *args[end:]]


STRATEGY_OPTION = "--trainer.strategy"


def _strategy_written_before(args: list[str], before: int) -> tuple[Any, int | None]:
    """The last `trainer.strategy` set before `args[before]`: on the command line (its value and index)
    or in the last config file given before it (its value, no index)."""
    written: Any = None
    at: int | None = None
    for index, arg in enumerate(args[:before]):
        option, equals, value = arg.partition("=")
        if option == STRATEGY_OPTION:
            written, at = (value if equals else (args[index + 1] if index + 1 < len(args) else None)), index
        elif option == "--config":
            path = value if equals else (args[index + 1] if index + 1 < len(args) else None)
            written, at = _strategy_in_config_file(path), None
    return written, at


def _strategy_in_config_file(path: str | None) -> Any:
    """`trainer.strategy` as a config file writes it, or None (no file, no such key, not YAML)."""
    try:
        with open(str(path)) as file:
            content = yaml.safe_load(file)
    except (OSError, yaml.YAMLError):
        return None
    trainer = content.get("trainer") if isinstance(content, dict) else None
    return trainer.get("strategy") if isinstance(trainer, dict) else None
