"""One run per directory (app/run/directory.py): what counts as a live holder, what a fit may write over."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from app.run.directory import (
    LOCK_NAME,
    LOCK_VARIABLE,
    STALE_AFTER_S,
    Holder,
    RunDirectoryBusy,
    RunDirectoryTaken,
    acquire,
    read_holder,
    refuse_if_busy,
    refuse_overwrite,
    this_holder,
)


def write_lock(root: Path, holder: Holder, age_s: float = 0.0) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_NAME
    path.write_text(json.dumps(asdict(holder)))
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def dead_pid(reap: bool) -> int:
    """The pid of a process of this host that was killed (reaped, or left a zombie)."""
    process = subprocess.Popen(["sleep", "60"])
    process.kill()
    if reap:
        process.wait()
    else:
        time.sleep(0.2)  # a zombie until the Popen is collected
    return process.pid


def test_a_live_fit_on_this_host_is_named_and_refuses_a_second(tmp_path: Path) -> None:
    lock = acquire(tmp_path, {})
    assert lock is not None
    try:
        with pytest.raises(RunDirectoryBusy) as refused:
            acquire(tmp_path, {})
        message = str(refused.value)
        assert f"pid {os.getpid()}" in message and socket.gethostname() in message and "\n" not in message
        assert "another --trainer.default_root_dir" in message
    finally:
        lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


@pytest.mark.parametrize("reap", [True, False], ids=["reaped", "zombie"])
def test_a_killed_holder_on_this_host_never_blocks_a_resume(
    tmp_path: Path, reap: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    write_lock(tmp_path, replace(this_holder({}), pid=dead_pid(reap), process_start=None))
    lock = acquire(tmp_path, {})
    assert lock is not None
    try:
        assert "no longer runs" in capsys.readouterr().out  # one line says whose lock was taken over
        holder, _ = read_holder(tmp_path / LOCK_NAME)
        assert holder.pid == os.getpid()
    finally:
        lock.release()


def test_a_reused_pid_is_not_the_holder(tmp_path: Path) -> None:
    """This process's pid, but recorded with another start time: the holder was an earlier process."""
    write_lock(tmp_path, replace(this_holder({}), process_start="1"))
    refuse_if_busy(tmp_path, {})


def test_another_hosts_holder_counts_until_its_heartbeat_is_stale(tmp_path: Path) -> None:
    elsewhere = replace(this_holder({}), host="node-elsewhere", pid=4242)
    write_lock(tmp_path, elsewhere, age_s=STALE_AFTER_S / 2)
    with pytest.raises(RunDirectoryBusy, match="node-elsewhere, pid 4242"):
        refuse_if_busy(tmp_path, {})
    write_lock(tmp_path, elsewhere, age_s=STALE_AFTER_S + 5)
    refuse_if_busy(tmp_path, {})


def test_a_requeued_slurm_job_takes_over_its_earlier_attempts_lock_at_once(tmp_path: Path) -> None:
    first = replace(this_holder({"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "0"}), host="node-a")
    write_lock(tmp_path, first)
    refuse_if_busy(tmp_path, {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"})
    with pytest.raises(RunDirectoryBusy, match="slurm job 77"):  # another job: its heartbeat is fresh
        refuse_if_busy(tmp_path, {"SLURM_JOB_ID": "78", "SLURM_RESTART_COUNT": "0"})
    # torchrun inside the job restarted its ranks (rank 0 may now be on another node): taken over too.
    refuse_if_busy(tmp_path, {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "0", "TORCHELASTIC_RESTART_COUNT": "1"})
    with pytest.raises(RunDirectoryBusy):  # the same attempt on another node: its heartbeat is fresh
        refuse_if_busy(tmp_path, {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "0"})


def test_the_ranks_of_a_launcher_that_holds_the_lock_do_not_take_it_again(tmp_path: Path) -> None:
    lock = acquire(tmp_path, {})
    try:
        assert acquire(tmp_path, {LOCK_VARIABLE: str(tmp_path / LOCK_NAME)}) is None
    finally:
        lock.release()


def test_an_unreadable_lock_counts_as_held_until_stale(tmp_path: Path) -> None:
    path = tmp_path / LOCK_NAME
    path.write_text("{half a")
    with pytest.raises(RunDirectoryBusy, match="cannot be read"):
        refuse_if_busy(tmp_path, {})
    old = time.time() - STALE_AFTER_S - 5
    os.utime(path, (old, old))
    refuse_if_busy(tmp_path, {})


def test_a_fit_continues_the_run_in_its_directory_or_is_refused(tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    refuse_overwrite(tmp_path, [checkpoints], None)  # nothing there: a first run
    checkpoints.mkdir()
    (checkpoints / "last.ckpt").write_bytes(b"x")
    for continuing in ("last", str(checkpoints / "last.ckpt")):
        refuse_overwrite(tmp_path, [checkpoints], continuing)
    for fresh in (None, str(tmp_path / "elsewhere" / "pretrained.ckpt")):
        with pytest.raises(RunDirectoryTaken) as refused:
            refuse_overwrite(tmp_path, [checkpoints], fresh)
        message = str(refused.value)
        assert "--ckpt_path last" in message and "--trainer.default_root_dir" in message
        assert str(checkpoints / "last.ckpt") in message and "\n" not in message


def test_a_user_checkpoint_directory_counts_too(tmp_path: Path) -> None:
    mine = tmp_path / "my-checkpoints"
    mine.mkdir()
    (mine / "epoch=3.ckpt").write_bytes(b"x")
    with pytest.raises(RunDirectoryTaken, match="epoch=3.ckpt"):
        refuse_overwrite(tmp_path, [tmp_path / "checkpoints", mine], None)
    refuse_overwrite(tmp_path, [tmp_path / "checkpoints", mine], str(mine / "epoch=3.ckpt"))
