"""W&B keeps a step's row as the first attempt that wrote it left it: an attempt that ends after
sending part of a step (the epoch's values are logged in several calls, some after the epoch-end
checkpoint) must not leave the rest out. Real offline W&B runs, driven through the run's journal
as a 2-attempt training run drives it, with the attempt ending at the moment CI once caught
(rank 0 leaving cleanly after a peer died, so W&B's `finish()` wrote the partial row)."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.tracking.run import TrackedRun
from app.tracking.sinks import RunFacts, WandbSink
from tests.helpers.wandb_files import wandb_history

pytest.importorskip("wandb")

RUN_ID = "0123456789abcdef"


def attempt(log_dir: Path, number: int, resumed: tuple[int, int]) -> TrackedRun:
    sink = WandbSink(log_dir, project="steps", entity=None, mode="offline")
    sink.open_run(RUN_ID, "steps", {})
    run = TrackedRun(log_dir, {"run_id": RUN_ID, "log_version": "version_0"}, [sink])
    run.begin(*resumed, {"attempt": number}, RunFacts(number, max(resumed[1], 0), {}, {}, ""))
    return run


def epoch(run: TrackedRun, last_step: int, loss: float) -> tuple[int, int]:
    """A training epoch as Lightning logs it: a step row, validation, the epoch-end checkpoint,
    then the epoch's own values at the same step; returns the checkpoint's (seq, step)."""
    run.log(last_step - 10, {"train_loss": loss + 0.5})
    run.log(last_step, {"train_loss": loss})
    run.log(last_step, {"val_loss": loss + 0.1, "val_acc": 1 - loss})
    checkpoint = (run.history.last_seq, last_step)
    run.saved(*checkpoint, {})
    run.log(last_step, {"train_acc": 1 - loss, "samples_per_s": 1000.0 + last_step})
    return checkpoint


def test_a_step_half_sent_when_an_attempt_ends_is_whole_in_wandb(tmp_path: Path) -> None:
    log_dir = tmp_path / "version_0"
    first = attempt(log_dir, 1, (0, -1))
    epoch(first, 19, 0.9)
    checkpoint = epoch(first, 39, 0.5)
    first.log(49, {"train_loss": 0.45})  # redone by the next attempt
    first.close("failed", {})  # a peer died: rank 0 leaves through its exception path

    second = attempt(log_dir, 2, checkpoint)
    epoch(second, 59, 0.3)
    second.finish()
    second.close("success", {})

    _, logged = wandb_history(log_dir / "wandb")
    assert {name: [step for step, _ in values] for name, values in logged.items()} == {
        "train_loss": [9, 19, 29, 39, 49, 59],
        "val_loss": [19, 39, 59],
        "val_acc": [19, 39, 59],
        "train_acc": [19, 39, 59],
        "samples_per_s": [19, 39, 59],
    }
    assert logged["samples_per_s"][1] == (39, 1039.0)
    assert logged["train_loss"][4] == (49, 0.8)  # the last attempt's value
