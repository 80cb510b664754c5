"""Exact resume: a fit interrupted anywhere and resumed ends with the uninterrupted run's weights."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from app.checkpoints.io import CheckpointError, safe_load
from app.cluster.exit_codes import PREEMPTED_EXIT_CODE
from tests.helpers.run import BIN, ddp_app, kill_job, live_job_processes, rank_pids, start

pytestmark = [pytest.mark.fault, pytest.mark.distributed]

STEP_CHECKPOINTS = """
trainer:
  max_epochs: {epochs}
  enable_progress_bar: false
  logger: false
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args:
        every_n_train_steps: {every}
        save_top_k: {keep}
        save_last: true
        filename: "step-{{step}}"
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args:
        filename: "epoch-{{epoch}}"
        save_top_k: -1
"""


def overlay(directory: Path, epochs: int, every: int, keep: int = -1) -> Path:
    path = directory / f"overlay-{epochs}-{every}.yaml"
    path.write_text(STEP_CHECKPOINTS.format(epochs=epochs, every=every, keep=keep))
    return path


def fit(config: str, extra: Path, root: Path, *args: str, timeout: float = 240):
    return ddp_app(
        "fit", "--config", config, "--config", str(extra), f"--trainer.default_root_dir={root}", *args, timeout=timeout
    )


def fit_uninterrupted(
    root: Path, config: str, epochs: int, every: int, *args: str, keep: int = -1
) -> tuple[Path, Path]:
    """A fit that must succeed, in `root / "run"`: (its checkpoints overlay, its checkpoint directory)."""
    extra = overlay(root, epochs=epochs, every=every, keep=keep)
    result = fit(config, extra, root / "run", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return extra, root / "run" / "checkpoints"


def resume_and_compare(config: str, extra: Path, root: Path, expected: Path) -> None:
    """`fit ... --ckpt_path last` in `root` ends with exactly the weights of `expected` (the
    uninterrupted run's checkpoint of the same name)."""
    resumed = fit(config, extra, root, "--ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(expected, root / "checkpoints" / expected.name)


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return safe_load(checkpoint)["state_dict"]


def assert_same_weights(expected: Path, actual: Path) -> None:
    first, second = weights(expected), weights(actual)
    assert first.keys() == second.keys()
    different = [key for key in first if not torch.equal(first[key], second[key])]
    assert not different, f"weights differ after resume, first: {different[0]}"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """Digits, 4 epochs of 20 steps, a checkpoint every 7 steps (mid-epoch) and at each epoch end."""
    yield fit_uninterrupted(tmp_path_factory.mktemp("uninterrupted"), "configs/digits.yaml", 4, 7)


@pytest.mark.parametrize(
    "checkpoint",
    [  # one in the default run: the resume matrix stops at every moment
        "step-step=21.ckpt",
        pytest.param("step-step=42.ckpt", marks=pytest.mark.slow),
        pytest.param("epoch-epoch=1.ckpt", marks=pytest.mark.slow),
    ],
    ids=["epoch1-after-batch1", "epoch2-after-batch2", "end-of-epoch1"],
)
def test_resume_from_any_checkpoint_is_bit_exact(uninterrupted, checkpoint: str, tmp_path: Path) -> None:
    extra, checkpoints = uninterrupted
    result = fit("configs/digits.yaml", extra, tmp_path, f"--ckpt_path={checkpoints / checkpoint}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "not resumable" not in result.stderr
    final = tmp_path / "checkpoints" / "epoch-epoch=3.ckpt"  # the state after the last step (80)
    assert safe_load(final)["global_step"] == 80
    assert_same_weights(checkpoints / "epoch-epoch=3.ckpt", final)


CNN_SMALL = ["--data.init_args.train_size=256", "--data.init_args.eval_size=32", "--data.init_args.batch_size=16"]


@pytest.fixture(scope="module")
def cnn_uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The CNN (with dropout), 2 epochs of 8 steps, a checkpoint every 5 steps and at each epoch end."""
    return fit_uninterrupted(tmp_path_factory.mktemp("cnn"), "configs/bench_cnn.yaml", 2, 5, *CNN_SMALL)


@pytest.mark.parametrize("checkpoint", ["step-step=5.ckpt", "epoch-epoch=0.ckpt"], ids=["mid-epoch", "epoch-end"])
def test_resume_restores_random_state_for_dropout(cnn_uninterrupted, checkpoint: str, tmp_path: Path) -> None:
    """Without the per-rank RNG states the resumed dropout masks (and weights) differ; from an
    epoch end also if the next epoch's DataLoader iterator drew its seed from the global generator."""
    extra, checkpoints = cnn_uninterrupted
    resumed = fit(
        "configs/bench_cnn.yaml", extra, tmp_path / "resumed", *CNN_SMALL, f"--ckpt_path={checkpoints / checkpoint}"
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    final = "epoch-epoch=1.ckpt"
    assert_same_weights(checkpoints / final, tmp_path / "resumed" / "checkpoints" / final)


def start_fit(config: str, extra: Path, root: Path, *args: str) -> subprocess.Popen[str]:
    command = [
        str(BIN / "ddp-app"),
        "fit",
        "--config",
        config,
        "--config",
        str(extra),
        f"--trainer.default_root_dir={root}",
        *args,
    ]
    log = open(root.parent / f"{root.name}.log", "w")  # noqa: SIM115 (closed with the process)
    return start(command, stdout=log, stderr=subprocess.STDOUT)


def wait_for_step(last: Path, step: int, process: subprocess.Popen[str], timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, "training ended before the interruption point"
        if last.exists():
            try:
                reached = safe_load(last)["global_step"]
            except CheckpointError:
                raise AssertionError(f"{last} was unreadable while training wrote it") from None
            if reached >= step:
                return reached
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint at step >= {step} within {timeout} s")


def kill_9_at_step(config: str, extra: Path, root: Path, step: int, *args: str) -> int:
    """Start a fit into `root` and kill -9 its whole job once last.ckpt holds `step`; returns the step it held."""
    process = start_fit(config, extra, root, *args)
    try:
        killed_at = wait_for_step(root / "checkpoints" / "last.ckpt", step, process)
        kill_job(process.pid)  # launcher and ranks, at once
        assert group_is_gone(process, 10)
    finally:
        kill_job(process.pid)
        process.wait()
    return killed_at


def group_is_gone(process: subprocess.Popen[str], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        process.poll()  # reap our direct child; the others are reaped by init
        if not live_job_processes(process.pid):
            return True
        time.sleep(0.1)
    return False


def stop_with_signal(
    config: str, extra: Path, root: Path, signum: int, at_step: int, to_group: bool = True
) -> tuple[int, str]:
    """Start `fit`, send `signum` once last.ckpt holds `at_step` (to the job's process group, as a
    terminal or SLURM does, or to the launcher's pid alone), wait; returns (exit code, log)."""
    process = start_fit(config, extra, root)
    try:
        wait_for_step(root / "checkpoints" / "last.ckpt", at_step, process)
        if to_group:
            os.killpg(process.pid, signum)
        else:
            os.kill(process.pid, signum)
        process.wait(timeout=60)
        assert group_is_gone(process, 10)
    finally:
        kill_job(process.pid)
        process.wait()
    return process.returncode, (root.parent / f"{root.name}.log").read_text()


@pytest.fixture(scope="module")
def long_uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """20 epochs (400 steps), last.ckpt every 3 steps: long enough to interrupt mid-run."""
    extra, checkpoints = fit_uninterrupted(tmp_path_factory.mktemp("long"), "configs/digits.yaml", 20, 3, keep=0)
    return extra, checkpoints / "epoch-epoch=19.ckpt"


def test_kill_9_of_the_whole_job_then_resume_last_is_bit_exact(long_uninterrupted, tmp_path: Path) -> None:
    extra, expected = long_uninterrupted
    killed_at = kill_9_at_step("configs/digits.yaml", extra, tmp_path / "run", 100)
    assert killed_at < 400
    resume_and_compare("configs/digits.yaml", extra, tmp_path / "run", expected)


def test_sigusr1_preemption_saves_at_a_step_boundary_and_resumes_exactly(long_uninterrupted, tmp_path: Path) -> None:
    extra, expected = long_uninterrupted
    code, log = stop_with_signal("configs/digits.yaml", extra, tmp_path / "run", signal.SIGUSR1, at_step=60)
    assert code == PREEMPTED_EXIT_CODE, log[-3000:]
    assert "preempted at global step" in log, log[-3000:]
    step = int(re.search(r"preempted at global step (\d+)", log).group(1))
    assert safe_load(tmp_path / "run" / "checkpoints" / "last.ckpt")["global_step"] == step
    assert "Traceback" not in log
    resume_and_compare("configs/digits.yaml", extra, tmp_path / "run", expected)


def test_a_signal_to_one_rank_only_stops_every_rank_at_the_same_step(long_uninterrupted, tmp_path: Path) -> None:
    """A local `kill -USR1` of rank 1: the ranks agree at their next check (about once a second)."""
    extra, expected = long_uninterrupted
    process = start_fit("configs/digits.yaml", extra, tmp_path / "run")
    try:
        wait_for_step(tmp_path / "run" / "checkpoints" / "last.ckpt", 60, process)
        os.kill(rank_pids(process.pid)[1], signal.SIGUSR1)
        process.wait(timeout=60)
        assert process.returncode == PREEMPTED_EXIT_CODE
    finally:
        if process.poll() is None:
            kill_job(process.pid)
            process.wait()
    log = (tmp_path / "run.log").read_text()
    step = int(re.search(r"preempted at global step (\d+)", log).group(1))
    assert safe_load(tmp_path / "run" / "checkpoints" / "last.ckpt")["global_step"] == step
    resume_and_compare("configs/digits.yaml", extra, tmp_path / "run", expected)


def test_a_run_by_max_steps_resumes_exactly_from_an_epoch_end_save(tmp_path: Path) -> None:
    """With `trainer.max_steps` set Lightning keeps its fit loop "restarting" after a finished epoch, and a resume
    from an epoch-end last.ckpt once crashed ("Lightning restored epoch 0, the data position says 1"): it resumes
    exactly, as a run by epochs does."""
    steps = ["--config", "configs/digits.yaml", "--trainer.max_steps=60", "--trainer.enable_progress_bar=false"]
    whole = ddp_app("fit", *steps, "--trainer.max_epochs=100", f"--trainer.default_root_dir={tmp_path / 'whole'}")
    assert whole.returncode == 0, whole.stderr[-3000:]
    first = ddp_app("fit", *steps, "--trainer.max_epochs=1", f"--trainer.default_root_dir={tmp_path / 'parts'}")
    assert first.returncode == 0, first.stderr[-3000:]
    assert safe_load(tmp_path / "parts" / "checkpoints" / "last.ckpt")["global_step"] == 20  # the first epoch's end
    rest = ddp_app(
        "fit",
        *steps,
        "--trainer.max_epochs=100",
        f"--trainer.default_root_dir={tmp_path / 'parts'}",
        "--ckpt_path=last",
    )
    assert rest.returncode == 0, rest.stderr[-3000:]
    resumed = tmp_path / "parts" / "checkpoints" / "last.ckpt"
    assert safe_load(resumed)["global_step"] == 60
    assert_same_weights(tmp_path / "whole" / "checkpoints" / "last.ckpt", resumed)
