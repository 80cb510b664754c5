"""`ddp-app resume-check --config CONFIG [overrides] [--json FILE]`: prove that your own run resumes exactly.

Runs the config, shortened (`--epochs`, `--limit-batches`), once uninterrupted and then stopped and
resumed with `--ckpt_path last` at a few moments where resumes go wrong, and prints one table:

    moment                                      steps  weights    optimizer  metrics  result
    kill -9 of rank 1 mid-epoch                 20     0          0          same     EXACT

Exit code 0 only if every moment is EXACT. Where one differs, one line names the most likely cause,
found by checks that do not depend on the run: a training set that returns different data for the
same (seed, epoch, index) draws randomness from a generator of its own; a training loader with a
sampler of its own cannot be positioned; an IterableDataset restarts its stream. The stop itself is
made inside the rank by `StopAt`, a callback added on the command line for the stopped run only.

The same runner drives the stop matrix in tests/fault/test_resume_matrix.py.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch

from app.checkpoints import safe_load
from app.plot import join_versions, metrics_files, read_metrics

POSITION_KEY = "ddp_app_data_position"

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
        batch: for `mid-epoch`, the batch index within the epoch after which to stop.
    """

    def __init__(self, how: str = "kill-rank1", moment: str = "mid-epoch", epoch: int = 1, batch: int = 3) -> None:
        if how not in STOPS or moment not in MOMENTS:
            raise ValueError(f"StopAt: unknown how={how!r} or moment={moment!r}")
        self.how, self.moment, self.epoch, self.batch = how, moment, epoch, batch
        self._done = False
        self._saved_epoch_end = False

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

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.current_epoch != self.epoch:
            return
        last = batch_idx + 1 == trainer.num_training_batches
        stepped = (batch_idx + 1) % trainer.accumulate_grad_batches == 0 or last
        if (
            (self.moment == "first-step" and stepped)
            or (self.moment == "mid-epoch" and batch_idx == self.batch)
            or (self.moment == "last-batch" and last)
            or (self.moment == "micro-batch" and not stepped and batch_idx >= self.batch)
        ):
            self._act(trainer)

    def on_validation_batch_start(
        self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int, *_: Any
    ) -> None:
        if self.moment == "validation" and not trainer.sanity_checking and trainer.current_epoch == self.epoch:
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

    @property
    def name(self) -> str:
        return f"{self.stop}@{self.moment}/e{self.epoch}->{self.continues}[{self.variant}]"

    def describe(self) -> str:
        where = MOMENTS[self.moment] if self.stop not in ("max_steps", "max_time") else "mid-epoch"
        return f"{STOPS[self.stop]} {where}, epoch {self.epoch}, then {CONTINUES[self.continues]}"


@dataclass
class Outcome:
    case: Case
    steps: int
    weights_diff: float
    optimizer_diff: float
    metrics_same: bool
    detail: str = ""
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
        return max((max_abs_diff(a, b) for a, b in zip(first, second)), default=0.0)
    return 0.0 if first == second else math.inf


def joined_metrics(root: Path) -> dict[int, dict[str, float]]:
    try:
        return join_versions([read_metrics(path) for path in metrics_files(root)])
    except Exception:  # noqa: BLE001 (a run without CSV logs: nothing to compare)
        return {}


def compare_metrics(
    expected: dict[int, dict[str, float]], actual: dict[int, dict[str, float]], extra_steps: set[int]
) -> str:
    """'' if every logged value of `expected` is in `actual` at the same step and `actual` has no other
    step (except `extra_steps`: where a budget stop ended an epoch early and Lightning logged it)."""
    for step, values in expected.items():
        found = actual.get(step, {})
        for name, value in values.items():
            if name not in found:
                return f"metric {name} at step {step} is missing after the resume"
            if found[name] != value and not (math.isnan(found[name]) and math.isnan(value)):
                return f"metric {name} at step {step}: {found[name]!r} after the resume, {value!r} uninterrupted"
    extra = sorted(set(actual) - set(expected) - extra_steps)
    return f"steps logged only after the resume: {extra[:5]}" if extra else ""


def compare(expected_root: Path, actual_root: Path, case: Case, extra_steps: set[int]) -> Outcome:
    expected = safe_load(expected_root / "checkpoints" / "last.ckpt")
    actual = safe_load(actual_root / "checkpoints" / "last.ckpt")
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
    if metrics:
        details.append(metrics)
    return Outcome(case, int(actual["global_step"]), weights, optimizer, not metrics, "; ".join(details))


@dataclass
class Runner:
    """Runs a config uninterrupted once (cached) and stopped-and-resumed per case, and compares them."""

    base_args: list[str]  # --config ... and overrides, without a subcommand
    workdir: Path
    epochs: int = 3
    timeout: float = 300.0
    variants: dict[str, list[str]] = field(default_factory=lambda: {"default": []})
    _baselines: dict[str, Path] = field(default_factory=dict)

    def _args(self, case: Case, root: Path) -> list[str]:
        return [
            "fit",
            *self.base_args,
            *self.variants[case.variant],
            f"--trainer.default_root_dir={root}",
            "--trainer.enable_progress_bar=false",
            # Stop signals are compared at every step, so a SIGTERM stops at the step it arrives in.
            "--last_checkpoint.check_interval_s=0",
        ]

    def baseline(self, variant: str) -> Path:
        if variant not in self._baselines:
            root = self.workdir / f"uninterrupted-{variant}"
            code = run_ddp_app([*self._args(Case("max_steps", variant=variant), root), f"--trainer.max_epochs={self.epochs}"],
                               self.workdir / f"uninterrupted-{variant}.log", self.timeout)  # fmt: skip
            if code != 0:
                raise RuntimeError(
                    f"the uninterrupted run failed (exit {code}); see {self.workdir}/uninterrupted-{variant}.log"
                )
            self._baselines[variant] = root
        return self._baselines[variant]

    def steps_per_epoch(self, variant: str) -> tuple[int, int]:
        """(optimizer steps, batches) per epoch of the uninterrupted run."""
        record = safe_load(self.baseline(variant) / "checkpoints" / "last.ckpt")[POSITION_KEY]
        batches = int(record["batches_per_epoch"])
        return math.ceil(batches / int(record["accumulate_grad_batches"])), batches

    def run(self, case: Case) -> Outcome:
        expected = self.baseline(case.variant)
        steps, batches = self.steps_per_epoch(case.variant)
        total = steps * self.epochs
        root = self.workdir / case.name.replace("/", "_").replace("@", "_").replace("->", "_")
        log = self.workdir / f"{root.name}.log"
        first = self._args(case, root)
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
            stop_at = {"how": case.stop, "moment": case.moment, "epoch": case.epoch, "batch": max(1, batches // 2)}
            first.append(
                "--trainer.callbacks+=" + json.dumps({"class_path": "app.resume_check.StopAt", "init_args": stop_at})
            )
            # A save every few steps, one of them on an epoch's last batch, so kills have something to resume.
            first.append(f"--last_checkpoint.every_n_steps={max(1, steps // 2)}")
        code = run_ddp_app(first, log, self.timeout)
        if case.stop in ("max_steps", "max_time") and code != 0:
            return Outcome(case, -1, math.inf, math.inf, False, f"the stopped run failed with exit code {code}")
        if case.stop == "max_time":
            reached = safe_load(root / "checkpoints" / "last.ckpt")["global_step"]
            extra_steps = {reached - 1, reached}
        resumed = self._args(case, root) + [f"--trainer.max_epochs={self.epochs}", "--ckpt_path=last"]
        code = run_ddp_app(resumed, log, self.timeout)
        if code != 0:
            return Outcome(
                case, -1, math.inf, math.inf, False, f"the resumed run failed with exit code {code} (see {log})"
            )
        return compare(expected, root, case, extra_steps)
