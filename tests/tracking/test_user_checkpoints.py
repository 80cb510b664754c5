"""A user's own checkpoints settle no logged value: only last.ckpt does, the checkpoint `--ckpt_path
last` resumes from. A ModelCheckpoint every few steps holds later steps than last.ckpt; the values
logged between the two, settled at its saves, were logged again by the resume from last.ckpt and
metrics.csv held them twice (the stop matrix's `user-ckpt` case). In-process, 1 rank, the digits job."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest

from app.cli import DDPAppCLI
from app.cli.resume_check import compare_metrics, joined_metrics, repeated_values
from tests.helpers.run import REPO

DIGITS = str(REPO / "configs" / "digits.yaml")
STEPS_PER_EPOCH = 40  # digits at 1 rank, batch 32
CRASH_STEP = STEPS_PER_EPOCH + 12  # last.ckpt holds step 40, the user's checkpoints steps up to 51


class CrashAt(L.Callback):
    """Fails the fit at the end of an optimizer step, before any save there, as a killed rank would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"crashed at step {self.step}")


def fit(root: Path, every_n_train_steps: int, *args: str) -> None:
    user_checkpoint = {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {"every_n_train_steps": every_n_train_steps, "save_top_k": -1, "filename": "step-{step}"},
    }
    DDPAppCLI(
        args=[
            "fit", "--config", DIGITS, f"--trainer.default_root_dir={root}", "--trainer.devices=1",
            "--trainer.max_epochs=2", "--trainer.log_every_n_steps=2", "--trainer.enable_progress_bar=false",
            "--trainer.callbacks+=" + json.dumps(user_checkpoint),
            # last.ckpt at epoch ends only: the user's checkpoints after step 40 are newer than it.
            "--last_checkpoint.every_n_seconds=0", "--last_checkpoint.check_interval_s=0", *args,
        ]
    )  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("uninterrupted")
    fit(root, every_n_train_steps=7)  # saving changes nothing that training computes or logs
    return root


# Saves every 3 steps land on steps with and without a row, every 7 as in the matrix. Not in the quick
# tier (3 fits, about 15 s): the default run and CI have it.
@pytest.mark.more_cases
@pytest.mark.parametrize("every_n_train_steps", [3, 7])
def test_a_resume_from_last_ckpt_logs_every_value_once_whatever_the_users_checkpoints_saved(
    uninterrupted: Path, tmp_path: Path, every_n_train_steps: int
) -> None:
    crash = {"class_path": f"{__name__}.CrashAt", "init_args": {"step": CRASH_STEP}}
    with pytest.raises(RuntimeError, match=f"crashed at step {CRASH_STEP}"):
        fit(tmp_path, every_n_train_steps, "--trainer.callbacks+=" + json.dumps(crash))
    # The user's saves up to the crash, the last of them newer than last.ckpt (step 40).
    assert len(list((tmp_path / "checkpoints").glob("step-*.ckpt"))) == CRASH_STEP // every_n_train_steps
    fit(tmp_path, every_n_train_steps, "--ckpt_path=last")
    assert repeated_values(tmp_path) == ""
    # None lost, none changed: the uninterrupted run's values at its steps, and no other step.
    assert compare_metrics(joined_metrics(uninterrupted), joined_metrics(tmp_path), extra_steps=set()) == ""
