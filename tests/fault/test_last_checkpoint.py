"""last.ckpt stays fresh on a real 2-rank job: a crash late in training loses at most one epoch,
and Ctrl-C saves at one step for every rank, exits 130 and resumes bit-exactly."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from app.checkpoints.io import CheckpointError, safe_load
from app.cluster.exit_codes import INTERRUPTED_EXIT_CODE
from tests.fault.conftest import EPOCHS
from tests.fault.test_resume import resume_and_compare, start_fit, stop_with_signal, wait_for_step
from tests.helpers.run import kill_job, seconds_to_exit

pytestmark = [pytest.mark.fault, pytest.mark.distributed]


def newest_step_seen(last: Path, process, until_step: int, timeout: float = 120) -> int:
    """Poll last.ckpt until it holds `until_step` or later; the newest step read."""
    return wait_for_step(last, until_step, process, timeout)


def test_kill_9_after_the_best_epoch_loses_at_most_one_epoch_and_resumes_bit_exact(
    uninterrupted, tmp_path: Path
) -> None:
    overlay, expected = uninterrupted
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    process = start_fit("configs/digits.yaml", overlay, tmp_path / "run")
    try:
        seen = newest_step_seen(last, process, until_step=EPOCHS * 20 // 2)
        deadline = time.monotonic() + 0.5  # keep reading while training goes on, then kill mid-run
        while time.monotonic() < deadline:
            try:
                seen = max(seen, safe_load(last)["global_step"])
            except CheckpointError:
                raise AssertionError("last.ckpt was unreadable while training wrote it") from None
        kill_job(process.pid)
    finally:
        kill_job(process.pid)
        process.wait()
    state = safe_load(last)
    (best,) = (tmp_path / "run" / "checkpoints").glob("best-*.ckpt")
    best_epoch = safe_load(best)["epoch"]
    assert state["global_step"] >= seen, "last.ckpt went back in time"
    assert state["epoch"] > best_epoch + 5, f"last.ckpt is stale: epoch {state['epoch']}, best {best_epoch}"
    assert state["global_step"] < EPOCHS * 20, "the kill came after the end of training: it proved nothing"
    resume_and_compare("configs/digits.yaml", overlay, tmp_path / "run", expected)


def interrupt_line(log: str) -> tuple[int, str]:
    lines = [line for line in log.splitlines() if "interrupted (Ctrl-C) at global step" in line]
    assert len(lines) == 1, log[-3000:]  # one line, from rank 0, not one per rank
    return int(re.search(r"at global step (\d+)", lines[0]).group(1)), lines[0]


def test_ctrl_c_to_the_process_group_saves_at_one_step_exits_130_and_resumes_bit_exact(
    uninterrupted, tmp_path: Path
) -> None:
    overlay, expected = uninterrupted
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    # To the process group: what a terminal does on Ctrl-C.
    code, log = stop_with_signal("configs/digits.yaml", overlay, tmp_path / "run", signal.SIGINT, at_step=200)
    assert code == INTERRUPTED_EXIT_CODE, log[-3000:]
    step, line = interrupt_line(log)
    assert safe_load(last)["global_step"] == step
    assert f"Resume with: ddp-app fit --config configs/digits.yaml --config {overlay}" in line
    assert line.endswith("--ckpt_path last")
    assert "Traceback" not in log and "exited with code" not in log, log[-3000:]
    resume_and_compare("configs/digits.yaml", overlay, tmp_path / "run", expected)


def test_sigint_to_the_launcher_alone_stops_like_ctrl_c(uninterrupted, tmp_path: Path) -> None:
    overlay, _ = uninterrupted
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    code, log = stop_with_signal(
        "configs/digits.yaml", overlay, tmp_path / "run", signal.SIGINT, at_step=100, to_group=False
    )
    assert code == INTERRUPTED_EXIT_CODE, log[-3000:]
    step, _ = interrupt_line(log)
    assert safe_load(last)["global_step"] == step


def test_a_second_ctrl_c_aborts_at_once_and_keeps_a_loadable_last_ckpt(uninterrupted, tmp_path: Path) -> None:
    overlay, _ = uninterrupted
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    process = start_fit("configs/digits.yaml", overlay, tmp_path / "run")
    try:
        before = wait_for_step(last, 100, process)
        os.killpg(process.pid, signal.SIGINT)
        time.sleep(0.05)  # the ranks are stopping (and may be saving) now
        os.killpg(process.pid, signal.SIGINT)
        took = seconds_to_exit(process, 30)
    finally:
        kill_job(process.pid)
        process.wait()
    log = (tmp_path / "run.log").read_text()
    assert process.returncode == INTERRUPTED_EXIT_CODE, log[-3000:]
    assert "second Ctrl-C" in log, log[-3000:]
    assert took < 10, f"the second Ctrl-C took {took:.1f} s"
    assert safe_load(last)["global_step"] >= before  # the previous last.ckpt, or the new one: never a broken one
