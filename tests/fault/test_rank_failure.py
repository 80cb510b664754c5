"""A rank killed with kill -9: every other process of the job ends within 60 s, and says which rank died."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.run import BIN, kill_job, live_job_processes, rank_pids, start

pytestmark = [pytest.mark.fault, pytest.mark.distributed]

BOUND_S = 60


@pytest.mark.parametrize(
    ("devices", "victim"),
    [("2", 1), ("2", 0), ("auto", 0), ("[0]", 0), ("[0,1]", 1), ("-1", 0)],
    ids=["2-rank1", "2-rank0", "auto", "list-of-one", "list-of-two", "minus-one"],
)
def test_killing_one_rank_ends_the_job_within_bound(devices: str, victim: int, tmp_path: Path) -> None:
    """Every `devices` form runs under the one launcher, which names the rank that died."""
    log_path = tmp_path / "job.log"
    with open(log_path, "w") as log:
        job = start(
            [
                str(BIN / "ddp-app"),
                "fit",
                "--config",
                "configs/digits.yaml",
                "--trainer.max_epochs=500",
                f"--trainer.devices={devices}",
                "--trainer.enable_progress_bar=false",
                f"--trainer.default_root_dir={tmp_path / 'run'}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "run" / "checkpoints" / "last.ckpt").exists():  # training is under way
            assert job.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.1)
        ranks = rank_pids(job.pid)
        assert victim in ranks and job.pid not in ranks.values(), ranks  # the ranks are the launcher's children
        os.kill(ranks[victim], signal.SIGKILL)
        killed_at = time.monotonic()
        while live_job_processes(job.pid) and time.monotonic() - killed_at < BOUND_S:
            job.poll()
            time.sleep(0.2)
        elapsed = time.monotonic() - killed_at
        assert not live_job_processes(job.pid), f"processes still alive {BOUND_S} s after the kill"
    finally:
        kill_job(job.pid)
        job.wait()
    output = log_path.read_text()
    assert job.returncode != 0
    assert f"ddp-app: rank {victim} (pid {ranks[victim]}) was killed by SIGKILL" in output, output[-3000:]
    print(f"killed rank {victim}: every process gone after {elapsed:.1f} s")
