"""`ddp-app resume-check --config CONFIG [overrides] [--json FILE]`: prove that your own run resumes exactly.

Runs the config shortened (`--epochs`, `--limit-batches`), once uninterrupted and then stopped and resumed with
`--ckpt_path last` at moments where resumes go wrong, and prints one table:

    moment                                      steps  weights    optimizer  metrics  result
    kill -9 of rank 1 mid-epoch                 20     0          0          same     EXACT

Exit code 0 only if every moment is EXACT; otherwise one line names the likely cause, from run-independent checks (a
dataset with its own generator, a sampler of its own, an IterableDataset that restarts). Stops are made inside the rank
by `StopAt`. The same runner drives tests/fault/test_resume_matrix.py."""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch

from app.checkpoints import state as checkpoint_state
from app.checkpoints.plugin import background_writer
from app.checkpoints.sharded import load_whole
from app.plot import is_resumed, join_versions, metrics_files, read_metrics
from app.tracking.layout import MEASURED_METRICS

# How a run stops; the first four are done by StopAt inside a rank, the budgets by the command line.
STOPS = {
    "kill-rank1": "kill -9 of rank 1",
    "kill-rank0": "kill -9 of rank 0",
    "sigterm": "SIGTERM (preemption)",
    "ctrl-c": "Ctrl-C",
    "max_steps": "a max_steps budget",
    "max_time": "a max_time budget",
}
# Where a run stops (StopAt's moments).
MOMENTS = {
    "first-step": "after the first step",
    "mid-epoch": "mid-epoch",
    "last-batch": "on an epoch's last batch",
    "validation": "during validation",
    "checkpoint-write": "while a checkpoint is written",
    # The stopped rank must be one that writes: rank 0 under DDP (kill-rank0), any rank under fsdp.
    "background-write": "while its background checkpoint write is in flight",
    "after-epoch-save": "right after the epoch-end save",
    "micro-batch": "between accumulated micro-batches",
}
# How the stopped run continues.
CONTINUES = {"same": "same config", "more-epochs": "larger max_epochs", "more-steps": "larger max_steps"}


class StopAt(L.Callback):
    """Stops a run inside a rank at an exact moment (test and `resume-check` use only).

    Args:
        how: `kill-rank1`, `kill-rank0` (SIGKILL of that rank), `sigterm` (to rank 1, as a preemption
            does), `ctrl-c` (SIGINT to the launcher, as a terminal does) or `none`.
        moment: one of MOMENTS.
        epoch: the epoch in which to stop (0-based).
        batch: for `mid-epoch`, the batch index within the epoch after which to stop."""

    HOLD_WRITE_S = 60.0  # the longest a `background-write` stop holds a write in flight

    def __init__(self, how: str = "kill-rank1", moment: str = "mid-epoch", epoch: int = 1, batch: int = 3) -> None:
        if how not in STOPS or moment not in MOMENTS:
            raise ValueError(f"StopAt: unknown how={how!r} or moment={moment!r}")
        self.how, self.moment, self.epoch, self.batch = how, moment, epoch, batch
        self._done = False
        self._saved_epoch_end = False
        self._stopped = threading.Event()  # set once this rank has stopped (`_act`): a held write goes on

    def _act(self, trainer: L.Trainer) -> None:
        if self._done:
            return
        self._done = True
        rank = trainer.global_rank
        if (
            self.how == "kill-rank1"
            and rank == min(1, trainer.world_size - 1)
            or self.how == "kill-rank0"
            and rank == 0
        ):
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.how == "sigterm" and rank == min(1, trainer.world_size - 1):
            os.kill(os.getpid(), signal.SIGTERM)
        elif self.how == "ctrl-c" and rank == 0:
            # The launcher forwards one SIGINT to every rank, as after a terminal's Ctrl-C.
            forked = Path("/proc/self/comm").read_text().startswith("ddp-app rank")
            os.kill(os.getppid() if forked else os.getpid(), signal.SIGINT)
        self._stopped.set()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.current_epoch != self.epoch:
            return
        # An unsized stream's last batch is known only when it ends: `on_train_epoch_end` acts for it.
        last = batch_idx + 1 == trainer.num_training_batches
        stepped = (batch_idx + 1) % trainer.accumulate_grad_batches == 0 or last
        if (
            (self.moment == "first-step" and stepped)
            or (self.moment == "mid-epoch" and batch_idx == self.batch)
            or (self.moment == "last-batch" and last)
            or (self.moment == "micro-batch" and not stepped and batch_idx >= self.batch)
        ):
            self._act(trainer)

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        if self.moment == "background-write":
            writer = background_writer(trainer)
            if writer is not None:
                writer.before_write = lambda: self._hold_write(trainer)

    def _hold_write(self, trainer: L.Trainer) -> None:
        # On the writer thread: from `epoch` on, a write waits here until `_act_if_writing` stops the run, so the stop
        # lands while it is in flight however fast the disk is. Bounded: where no batch starts after the save, the write
        # goes on and the run ends without its stop (reported).
        if trainer.current_epoch >= self.epoch and not self._done:
            self._stopped.wait(timeout=self.HOLD_WRITE_S)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        # From `epoch` on, the first batch that starts while this rank's background write is in flight (right after a
        # save, as a rank's training goes on while its copy is written).
        self._act_if_writing(trainer)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        # With `last_checkpoint.overlap_copy` the step after a save waits here for the save's copy, which the held write
        # has not made: stop here, or the hold would run out first.
        self._act_if_writing(trainer)

    def _act_if_writing(self, trainer: L.Trainer) -> None:
        if self.moment == "background-write" and trainer.current_epoch >= self.epoch:
            writer = background_writer(trainer)
            if writer is not None and writer.writing():
                self._act(trainer)

    def on_validation_batch_start(
        self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int, *_: Any
    ) -> None:
        if self.moment == "validation" and not trainer.sanity_checking and trainer.current_epoch == self.epoch:
            self._act(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        # `last-batch` of a stream without a length: the first hook that knows the batches are over (after validation,
        # before the coordinator's epoch-end save, which runs after every callback).
        unsized = trainer.num_training_batches == float("inf")
        if self.moment == "last-batch" and unsized and trainer.current_epoch == self.epoch:
            self._act(trainer)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: Any, checkpoint: dict) -> None:
        if self.moment == "checkpoint-write" and trainer.current_epoch == self.epoch:
            self._act(trainer)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        # The previous epoch's end, its save included, is complete when the next epoch starts.
        if self.moment == "after-epoch-save" and trainer.current_epoch == self.epoch + 1:
            self._act(trainer)


@dataclass(frozen=True)
class Case:
    """One stop-and-resume: how, where, how it continues, and the user-code variant it runs on."""

    stop: str
    moment: str = "mid-epoch"
    continues: str = "same"
    variant: str = "default"
    epoch: int = 1
    # 2: the resumed run is stopped the same way one epoch later and resumed again (a second resume in a row must
    # continue the first one's position, not its starting point). StopAt stops only.
    stops: int = 1

    @property
    def name(self) -> str:
        again = "x2" if self.stops == 2 else ""
        return f"{self.stop}@{self.moment}/e{self.epoch}{again}->{self.continues}[{self.variant}]"

    def describe(self) -> str:
        where = MOMENTS[self.moment] if self.stop not in ("max_steps", "max_time") else "mid-epoch"
        again = f", again in epoch {self.epoch + 1}" if self.stops == 2 else ""
        return f"{STOPS[self.stop]} {where}, epoch {self.epoch}{again}, then {CONTINUES[self.continues]}"


@dataclass
class Outcome:
    case: Case
    steps: int
    weights_diff: float
    optimizer_diff: float
    metrics_same: bool
    detail: str = ""
    root: Path | None = None  # the stopped-and-resumed run's default_root_dir
    exact: bool = field(init=False)

    def __post_init__(self) -> None:
        self.exact = self.weights_diff == 0 and self.optimizer_diff == 0 and self.metrics_same and not self.detail


def ddp_app_command() -> list[str]:
    return [sys.executable, "-m", "app"]


def run_ddp_app(args: list[str], log: Path, timeout: float) -> int:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("a") as out:
        process = subprocess.Popen(
            [*ddp_app_command(), *args], stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise


def max_abs_diff(first: Any, second: Any) -> float:
    """The largest |a - b| over matching tensors of two nested structures; inf where they do not match."""
    if isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor):
        if first.shape != second.shape:
            return math.inf
        if first.numel() == 0:
            return 0.0
        if first.is_floating_point() or second.is_floating_point():
            return float((first.double() - second.double()).abs().max())
        return 0.0 if torch.equal(first, second) else math.inf
    if isinstance(first, dict) and isinstance(second, dict):
        if first.keys() != second.keys():
            return math.inf
        return max((max_abs_diff(first[key], second[key]) for key in first), default=0.0)
    if isinstance(first, (list, tuple)) and isinstance(second, (list, tuple)):
        if len(first) != len(second):
            return math.inf
        return max((max_abs_diff(a, b) for a, b in zip(first, second, strict=False)), default=0.0)
    return 0.0 if first == second else math.inf


def joined_metrics(root: Path) -> dict[int, dict[str, float]]:
    try:
        files = metrics_files(root)
        return join_versions([read_metrics(path) for path in files], [is_resumed(path) for path in files])
    except Exception:  # noqa: BLE001 (a run without CSV logs: nothing to compare)
        return {}


def compare_metrics(
    expected: dict[int, dict[str, float]], actual: dict[int, dict[str, float]], extra_steps: set[int]
) -> str:
    """'' if every logged value of `expected` is in `actual` at the same step and `actual` has no other step (except
    `extra_steps`: where a budget stop ended an epoch early and Lightning logged it)."""
    for step, values in expected.items():
        found = actual.get(step, {})
        for name, value in values.items():
            if name not in found:
                return f"metric {name} at step {step} is missing after the resume"
            if name in MEASURED_METRICS:  # a throughput: there, but differs between any two runs
                continue
            if found[name] != value and not (math.isnan(found[name]) and math.isnan(value)):
                return f"metric {name} at step {step}: {found[name]!r} after the resume, {value!r} uninterrupted"
    extra = sorted(set(actual) - set(expected) - extra_steps)
    return f"steps logged only after the resume: {extra[:5]}" if extra else ""


def compare(expected_root: Path, actual_root: Path, case: Case, extra_steps: set[int]) -> Outcome:
    expected = load_whole(expected_root / "checkpoints" / "last.ckpt")
    actual = load_whole(actual_root / "checkpoints" / "last.ckpt")
    details = []
    for key in ("global_step", "epoch"):
        if expected[key] != actual[key]:
            details.append(f"{key} {actual[key]} after the resume, {expected[key]} uninterrupted")
    weights = max_abs_diff(expected["state_dict"], actual["state_dict"])
    optimizer = max(
        max_abs_diff(expected["optimizer_states"], actual["optimizer_states"]),
        max_abs_diff(expected.get("lr_schedulers"), actual.get("lr_schedulers")),
    )
    metrics = compare_metrics(joined_metrics(expected_root), joined_metrics(actual_root), extra_steps)
    metrics = metrics or repeated_values(actual_root)
    if metrics:
        details.append(metrics)
    return Outcome(
        case, int(actual["global_step"]), weights, optimizer, not metrics, "; ".join(details), root=actual_root
    )


def repeated_values(root: Path) -> str:
    """'' if no metrics.csv of the run holds a value twice at one step (what a user plotting it, or a tracker fed from
    it, would see as two points); `epoch` repeats by design (Lightning adds it to every call)."""
    for path in metrics_files(root):
        seen: set[tuple[str, str]] = set()
        with path.open(newline="") as file:
            for row in csv.DictReader(file):
                for name, value in row.items():
                    if name not in ("step", "epoch") and value:
                        if (name, row["step"]) in seen:
                            return f"{path} holds {name} at step {row['step']} twice"
                        seen.add((name, row["step"]))
    return ""


@dataclass
class Runner:
    """Runs a config uninterrupted once (cached) and stopped-and-resumed per case, and compares them."""

    base_args: list[str]  # --config ... and overrides, without a subcommand
    workdir: Path
    epochs: int = 3
    timeout: float = 300.0
    variants: dict[str, list[str]] = field(default_factory=lambda: {"default": []})
    progress_bar: bool = False  # the runs' progress display (a line per epoch in a log)
    # Arguments of the stopped and resumed runs only, not of the uninterrupted one: what only they are checked for (the
    # tests' matrix logs them to W&B, a slow logger, to compare it with metrics.csv).
    case_args: list[str] = field(default_factory=list)
    # Variants that train exactly as another (`last_checkpoint.overlap_copy`): compared with its uninterrupted run.
    trains_as: dict[str, str] = field(default_factory=dict)
    # How each fit runs: `ddp-app ARGS >> log`, its exit code (the tests fork theirs from a warm process).
    run_command: Callable[[list[str], Path, float], int] = run_ddp_app
    _baselines: dict[str, Path] = field(default_factory=dict)

    def _args(self, variant: str, root: Path) -> list[str]:
        return [
            "fit",
            *self.base_args,
            *self.variants[variant],
            f"--trainer.default_root_dir={root}",
            f"--trainer.enable_progress_bar={str(self.progress_bar).lower()}",
            # Stop signals are compared at every step, so a SIGTERM stops at the step it arrives in.
            "--last_checkpoint.check_interval_s=0",
        ]

    def baseline(self, variant: str) -> Path:
        variant = self.trains_as.get(variant, variant)
        if variant not in self._baselines:
            root = self.workdir / f"uninterrupted-{variant}"
            log = self.workdir / f"uninterrupted-{variant}.log"
            args = [*self._args(variant, root), f"--trainer.max_epochs={self.epochs}"]
            code = self.run_command(args, log, self.timeout)
            if code != 0:
                raise RuntimeError(f"the uninterrupted run failed (exit {code}); see {log}")
            self._baselines[variant] = root
        return self._baselines[variant]

    @staticmethod
    def _stop_at(case: Case, epoch: int, steps: int, batches: int) -> list[str]:
        """The arguments that stop a run at `case`'s moment in `epoch` (StopAt), with saves to resume from."""
        stop_at = {"how": case.stop, "moment": case.moment, "epoch": epoch, "batch": max(1, batches // 2)}
        return [
            "--trainer.callbacks+=" + json.dumps({"class_path": "app.cli.resume_check.StopAt", "init_args": stop_at}),
            # A save every few steps, one of them on an epoch's last batch, so kills have something to resume.
            f"--last_checkpoint.every_n_steps={max(1, steps // 2)}",
        ]

    def steps_per_epoch(self, variant: str) -> tuple[int, int]:
        """(optimizer steps, batches) per epoch of the uninterrupted run."""
        record = checkpoint_state.get(load_whole(self.baseline(variant) / "checkpoints" / "last.ckpt"), "exact_resume")[
            "position"
        ]
        batches = int(record["batches_per_epoch"])
        return math.ceil(batches / int(record["accumulate_grad_batches"])), batches

    def run(self, case: Case) -> Outcome:
        expected = self.baseline(case.variant)
        steps, batches = self.steps_per_epoch(case.variant)
        total = steps * self.epochs
        root = self.workdir / case.name.replace("/", "_").replace("@", "_").replace("->", "_")
        log = self.workdir / f"{root.name}.log"
        first = self._args(case.variant, root) + self.case_args
        stop_step = case.epoch * steps + max(1, steps // 2)
        budget_epochs = self.epochs - 1 if case.continues == "more-epochs" else self.epochs
        first.append(f"--trainer.max_epochs={budget_epochs}")
        if case.continues == "more-steps":
            first.append(f"--trainer.max_steps={total - 1}")
        extra_steps: set[int] = set()
        if case.stop == "max_steps":
            first.append(f"--trainer.max_steps={stop_step}")
            extra_steps = {stop_step - 1, stop_step}
        elif case.stop == "max_time":
            first.append("--trainer.max_time=00:00:00:04")
        else:
            first += self._stop_at(case, case.epoch, steps, batches)
        if case.stops == 2 and (case.stop in ("max_steps", "max_time") or case.epoch + 2 > self.epochs):
            raise ValueError(f"{case.name}: a second stop needs a StopAt stop and an epoch after it")
        code = self.run_command(first, log, self.timeout)
        if case.stop in ("max_steps", "max_time") and code != 0:
            return Outcome(case, -1, math.inf, math.inf, False, f"the stopped run failed with exit code {code}")
        if case.stop not in ("max_steps", "max_time") and code == 0:  # a kill or a signal ends it non-zero
            detail = f"the run ended without its stop ({case.describe()}); see {log}"
            return Outcome(case, -1, math.inf, math.inf, False, detail)
        if case.stop == "max_time":
            reached = load_whole(root / "checkpoints" / "last.ckpt")["global_step"]
            extra_steps = {reached - 1, reached}
        resumed = [
            *self._args(case.variant, root),
            *self.case_args,
            f"--trainer.max_epochs={self.epochs}",
            "--ckpt_path=last",
        ]
        if case.stops == 2:
            self.run_command(resumed + self._stop_at(case, case.epoch + 1, steps, batches), log, self.timeout)
            reached = load_whole(root / "checkpoints" / "last.ckpt")["global_step"]
            if reached >= total:
                return Outcome(case, reached, math.inf, math.inf, False, "the first resumed run was not stopped")
        code = self.run_command(resumed, log, self.timeout)
        if code != 0:
            return Outcome(
                case, -1, math.inf, math.inf, False, f"the resumed run failed with exit code {code} (see {log})"
            )
        return compare(expected, root, case, extra_steps)


# The moments `ddp-app resume-check` tries by default: where resumes went wrong before.
CHECK_CASES = (
    Case("kill-rank1", "mid-epoch", epoch=1),
    Case("sigterm", "last-batch", epoch=0),
    Case("kill-rank1", "validation", epoch=0),
    Case("max_steps", continues="more-epochs", epoch=1),
)


STATE_OUTSIDE = (
    "state outside the checkpoint: a callback or the module keeps values across steps that are not in "
    "state_dict (or randomness drawn in a callback or collate_fn)"
)


def likely_cause(base_args: list[str]) -> str:
    """The most likely reason a resume differs, from checks that need no training run."""
    import importlib

    from app.cli import parse_config  # the CLI's own parser, files and precedence
    from app.data.rank_loaders import is_plain_loader
    from app.data.seeding import PerSampleSeeded, SampleKey

    config = parse_config(["fit", *base_args])
    data = config.get("data")
    module_path, _, name = data["class_path"].rpartition(".")
    datamodule = getattr(importlib.import_module(module_path), name)(**(data.get("init_args") or {}))
    datamodule.setup("fit")
    loader = datamodule.train_dataloader()
    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, torch.utils.data.IterableDataset):
        if loader.num_workers > 0 and loader.persistent_workers:
            return "the training stream is read in persistent loader workers, where ddp-app cannot position it"
        return (
            "the training data is an IterableDataset whose state_dict/load_state_dict (if any) does not describe "
            "the samples already yielded: a resume cannot continue its stream exactly"
        )
    if not is_plain_loader(loader) and not isinstance(
        getattr(loader, "sampler", None), torch.utils.data.DistributedSampler
    ):
        return "the training loader has a sampler of its own, which ddp-app cannot position mid-epoch"
    if dataset is None:  # whole tensors cut into batches (app/data/on_device.py): no per-sample draws to compare
        return STATE_OUTSIDE
    seeded = PerSampleSeeded(dataset.dataset if isinstance(dataset, PerSampleSeeded) else dataset, seed=0)
    first, second = seeded[SampleKey(0, 0)], seeded[SampleKey(0, 0)]
    if max_abs_diff(_as_tensors(first), _as_tensors(second)) != 0:
        return (
            "randomness drawn outside the seeded paths: the training set returns different data for the same "
            "(seed, epoch, index), so it draws from a generator of its own (numpy.random.default_rng(), a "
            "torch.Generator or random.Random it keeps). Fix: draw from torch, numpy.random or random"
        )
    return STATE_OUTSIDE


def _as_tensors(sample: Any) -> Any:
    if isinstance(sample, (list, tuple)):
        return [_as_tensors(item) for item in sample]
    if isinstance(sample, dict):
        return {key: _as_tensors(value) for key, value in sample.items()}
    return torch.as_tensor(sample)


def format_table(outcomes: list[Outcome]) -> str:
    rows = [("moment", "steps", "weights", "optimizer", "metrics", "result")]
    for outcome in outcomes:
        rows.append(
            (
                outcome.case.describe(),
                str(outcome.steps),
                f"{outcome.weights_diff:.3g}",
                f"{outcome.optimizer_diff:.3g}",
                "same" if outcome.metrics_same else "differ",
                "EXACT" if outcome.exact else "DIFFERS",
            )
        )
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows)


def check_runner(
    config_args: list[str],
    workdir: Path,
    epochs: int = 2,
    limit_batches: int = 10,
    run_command: Callable[[list[str], Path, float], int] = run_ddp_app,
) -> Runner:
    """The shortened run `ddp-app resume-check` stops and resumes at each of `CHECK_CASES`."""
    base = [*config_args, f"--trainer.limit_train_batches={limit_batches}", "--trainer.limit_val_batches=4"]
    return Runner(base, workdir, epochs=epochs, run_command=run_command)


def parse_with_config(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """A subcommand's own options, and the rest: the run's --config and overrides, as for ddp-app fit."""
    known, config_args = parser.parse_known_args(argv)
    if "--config" not in " ".join(config_args):
        parser.error("give the run's --config (and any overrides), as for ddp-app fit")
    return known, config_args


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="ddp-app resume-check",
        description="Run your config shortened, uninterrupted and stopped-and-resumed at several moments; "
        "compare weights, optimizer state and logged metrics. Exit 0 only if all are EXACT.",
    )
    parser.add_argument("--epochs", type=int, default=2, help="epochs of the shortened run (default 2)")
    parser.add_argument("--limit-batches", type=int, default=10, help="training batches per epoch (default 10)")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    parser.add_argument("--workdir", type=Path, help="keep the runs here (default: a temporary directory)")
    parser.add_argument(
        "--fail-fast", action="store_true", help="stop at the first moment that differs (a quicker answer)"
    )
    known, config_args = parse_with_config(parser, argv)
    with tempfile.TemporaryDirectory(prefix="resume-check-") as temporary:
        workdir = known.workdir or Path(temporary)
        workdir.mkdir(parents=True, exist_ok=True)
        runner = check_runner(config_args, workdir, known.epochs, known.limit_batches)
        outcomes = []
        for case in CHECK_CASES:
            print(f"ddp-app resume-check: {case.describe()} ...", flush=True)
            outcomes.append(runner.run(case))
            if known.fail_fast and not outcomes[-1].exact:
                break
    print(format_table(outcomes))
    different = [outcome for outcome in outcomes if not outcome.exact]
    cause = likely_cause(config_args) if different else ""
    for outcome in different:
        if outcome.detail:
            print(f"  {outcome.case.describe()}: {outcome.detail}")
    if cause:
        print(f"most likely cause: {cause}")
    if known.json:
        known.json.write_text(
            json.dumps(
                {
                    "exact": not different,
                    "cause": cause or None,
                    "cases": [
                        {
                            "moment": outcome.case.describe(),
                            "steps": outcome.steps,
                            "weights_max_abs_diff": outcome.weights_diff,
                            "optimizer_max_abs_diff": outcome.optimizer_diff,
                            "metrics_same": outcome.metrics_same,
                            "result": "EXACT" if outcome.exact else "DIFFERS",
                            "detail": outcome.detail,
                        }
                        for outcome in outcomes
                    ],
                },
                indent=2,
            )
        )
    return 0 if not different else 1
