"""Gradient compression survives a crash: PowerSGD's state (error feedback, warm-started Q, its RNG
and step count, every rank's) is in last.ckpt, and a resume ends bit-identical to the run that was
never interrupted, from the middle of an epoch and after a kill -9 of the whole job."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.checkpoints import state as checkpoint_state
from app.checkpoints.io import safe_load
from tests.fault.test_resume import (
    assert_same_weights,
    fit,
    fit_uninterrupted,
    kill_9_at_step,
)

pytestmark = [pytest.mark.fault, pytest.mark.distributed]

# start_iter 5: compressing from the first epoch on, so every checkpoint below holds PowerSGD state.
POWERSGD = ["--gradient_compression.method=powersgd", "--gradient_compression.powersgd_rank=2",
            "--gradient_compression.start_iter=5"]  # fmt: skip


@pytest.fixture(scope="module")
def powersgd_uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Digits with PowerSGD, 6 epochs of 20 steps, a checkpoint every 7 steps and at each epoch end."""
    return fit_uninterrupted(tmp_path_factory.mktemp("powersgd"), "configs/digits.yaml", 6, 7, *POWERSGD)


def test_checkpoints_hold_every_ranks_powersgd_state(powersgd_uninterrupted) -> None:
    _, checkpoints = powersgd_uninterrupted
    state = checkpoint_state.get(
        safe_load(checkpoints / "step-step=21.ckpt"), "gradient_compression"
    )  # weights_only=True
    assert state["method"] == "powersgd" and len(state["per_rank"]) == 2
    first, second = (rank["powersgd"] for rank in state["per_rank"])
    assert first["iter"] == second["iter"] == 21
    assert first["error"].keys() == second["error"].keys() and first["error"], "no error feedback saved"
    # Error feedback is what each rank's own gradient lost: it differs between ranks.
    assert any(not first["error"][name].equal(second["error"][name]) for name in first["error"])
    assert first["q"], "no warm-start Q saved"


@pytest.mark.parametrize(
    "checkpoint",
    ["step-step=21.ckpt", pytest.param("epoch-epoch=2.ckpt", marks=pytest.mark.slow)],  # one resume a tier
    ids=["mid-epoch", "epoch-end"],
)
def test_powersgd_resume_is_bit_exact(powersgd_uninterrupted, checkpoint: str, tmp_path: Path) -> None:
    """The first step after a restart runs on DDP's initial buckets, the next ones on rebuilt
    buckets: the state must follow the parameters, not the bucket numbers."""
    extra, checkpoints = powersgd_uninterrupted
    result = fit("configs/digits.yaml", extra, tmp_path, *POWERSGD, f"--ckpt_path={checkpoints / checkpoint}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fresh state" not in result.stderr
    assert_same_weights(checkpoints / "epoch-epoch=5.ckpt", tmp_path / "checkpoints" / "epoch-epoch=5.ckpt")


@pytest.mark.slow  # about 30 s; the resume matrix's default powersgd row stops and resumes a PowerSGD run
def test_kill_9_mid_run_with_powersgd_then_resume_last_is_bit_exact(powersgd_uninterrupted, tmp_path: Path) -> None:
    extra, checkpoints = powersgd_uninterrupted
    killed_at = kill_9_at_step("configs/digits.yaml", extra, tmp_path / "run", 50, *POWERSGD)
    assert killed_at < 120, "the kill came after the end of training: it proved nothing"
    resumed = fit("configs/digits.yaml", extra, tmp_path / "run", *POWERSGD, "--ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout + resumed.stderr
    final = "epoch-epoch=5.ckpt"
    assert_same_weights(checkpoints / final, tmp_path / "run" / "checkpoints" / final)


def test_a_checkpoint_without_compression_state_resumes_powersgd_fresh(powersgd_uninterrupted, tmp_path: Path) -> None:
    """Switching compression on for a resumed run is allowed, and said in one line."""
    extra, checkpoints = powersgd_uninterrupted
    plain = fit("configs/digits.yaml", extra, tmp_path / "plain", "--trainer.max_epochs=1")
    assert plain.returncode == 0, plain.stderr[-3000:]
    resumed = fit(
        "configs/digits.yaml", extra, tmp_path / "plain", *POWERSGD, "--trainer.max_epochs=2", "--ckpt_path=last"
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    switched = fit(
        "configs/digits.yaml", extra, tmp_path / "plain", "--gradient_compression.method=bf16",
        "--trainer.max_epochs=3", "--ckpt_path=last",
    )  # fmt: skip
    assert switched.returncode == 0, switched.stderr[-3000:]
    assert "gradient compression starts with fresh state: it was saved with gradient_compression.method=powersgd" in (
        switched.stderr
    )
