"""Any callback list, no hang: a 2-rank fit with each callback setup a user brings completes, keeps
last.ckpt fresh, and, killed mid-epoch (SIGKILL of rank 1) and resumed with `--ckpt_path last`,
ends with the uninterrupted run's weights and optimizer state bit for bit and a metric history with
no step missing or logged twice (`app.cli.resume_check.Runner`, the stop matrix's harness).

Every setup starts from the shipped digits config with its callbacks removed (`trainer.callbacks:
[]`), the progress display on (a line per epoch: these runs write to a file), so the sync_dist
values the digits module logs are read by a rank-0-only reader. The default run takes "none" (the
config that hung at its first epoch end, issue 31) and "sync-dist"; `-m slow` runs them all.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from app.checkpoints.io import safe_load
from app.cli.resume_check import Case, Runner
from app.resume.position import saved_position
from tests.helpers.run import BIN, REPO, clean_env, fit_runner

pytestmark = [pytest.mark.fault, pytest.mark.distributed]

EPOCHS = 3


def callback(class_path: str, **init_args: object) -> str:
    return "--trainer.callbacks+=" + json.dumps({"class_path": class_path, "init_args": init_args})


CALLBACKS = "lightning.pytorch.callbacks"
SETUPS = {
    "none": [],
    "progress-bar-off": ["--trainer.enable_progress_bar=false"],
    "best-k": [callback(f"{CALLBACKS}.ModelCheckpoint", monitor="val_loss")],
    "every-7-steps": [
        callback(f"{CALLBACKS}.ModelCheckpoint", every_n_train_steps=7, save_top_k=-1, filename="step-{step}")
    ],
    "early-stopping": [callback(f"{CALLBACKS}.EarlyStopping", monitor="val_loss", patience=1)],
    "lr-monitor": [callback(f"{CALLBACKS}.LearningRateMonitor")],
    "tqdm": [callback(f"{CALLBACKS}.TQDMProgressBar")],
    "rich": [callback(f"{CALLBACKS}.RichProgressBar")],
    "sync-dist": [callback("tests.helpers.user_callbacks.LogsSyncedValues")],
    "barrier": [callback("tests.helpers.user_callbacks.BarrierAtEpochEnd")],
    # A rank-0-only reader of the metrics (tqdm) and a value it reduces early on rank 0 only.
    "tqdm-and-sync-dist": [
        callback(f"{CALLBACKS}.TQDMProgressBar"),
        callback("tests.helpers.user_callbacks.LogsSyncedValues"),
    ],
}
DEFAULT_SETUPS = ("sync-dist",)  # "none": the users-own-module test below has no callbacks either


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Runner:
    return fit_runner(
        base_args=["--config", str(REPO / "configs" / "digits.yaml"), "--trainer.callbacks=[]"],
        workdir=tmp_path_factory.mktemp("callback-matrix"),
        epochs=EPOCHS,
        timeout=240.0,
        variants=SETUPS,
        progress_bar=True,
    )


@pytest.mark.parametrize(
    "setup", [name if name in DEFAULT_SETUPS else pytest.param(name, marks=pytest.mark.slow) for name in SETUPS]
)
def test_any_callback_setup_completes_fresh_and_resumes_exactly(runner: Runner, setup: str) -> None:
    baseline = runner.baseline(setup)  # completes (exit 0), or raises naming its log
    steps, _ = runner.steps_per_epoch(setup)
    last = safe_load(baseline / "checkpoints" / "last.ckpt")
    position = saved_position(last)
    stopped_early = setup == "early-stopping" and last["global_step"] < EPOCHS * steps
    # Fresh at the end: the run's last step, its last epoch over (an early stop: at that epoch's end).
    assert position["epoch_end_done"], position
    assert last["global_step"] == (position["epoch"] + 1) * steps
    assert stopped_early or last["global_step"] == EPOCHS * steps
    log = (runner.workdir / f"uninterrupted-{setup}.log").read_text()
    if setup in ("none", "sync-dist", "barrier"):  # ddp-app's own progress display: a line per epoch
        assert [line.split()[0] for line in log.splitlines() if line.startswith("epoch=")][-1] == (
            f"epoch={position['epoch']}"
        ), log[-2000:]
    outcome = runner.run(Case("kill-rank1", "mid-epoch", epoch=1, variant=setup))
    assert outcome.exact, f"{setup}: {outcome.detail or outcome} (log: {runner.workdir})"


def test_a_users_own_module_without_callbacks_completes_and_resumes_exactly(tmp_path: Path) -> None:
    """The same on a user's plain LightningModule and DataModule (examples/custom, issue 31's second
    acceptance command): no callbacks, the progress line on, a kill of rank 1 mid-epoch."""
    runner = fit_runner(
        base_args=["--config", str(REPO / "examples" / "custom" / "config.yaml"), "--trainer.callbacks=[]"],
        workdir=tmp_path,
        epochs=EPOCHS,
        timeout=240.0,
        progress_bar=True,
    )
    outcome = runner.run(Case("kill-rank1", "mid-epoch", epoch=1))
    assert outcome.exact, f"{outcome.detail or outcome} (log: {tmp_path})"


@pytest.mark.slow
def test_checkpointing_off_completes_and_writes_no_checkpoint(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            str(BIN / "ddp-app"), "fit", "--config", "configs/digits.yaml", "--trainer.callbacks=[]",
            "--trainer.enable_checkpointing=false", "--trainer.max_epochs=2", f"--trainer.default_root_dir={tmp_path}",
        ],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert not list(tmp_path.rglob("*.ckpt"))
    assert "epoch=1 step=40" in result.stdout, result.stdout[-2000:]
