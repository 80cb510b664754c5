"""A sweep's shared state on the filesystem: one directory per point, claimed by one worker at a time.

    DIR/sweep.json                the spec (app/sweep/spec.py)
    DIR/study.journal             a search's Optuna study (JournalFileBackend: safe on NFS, SQLite is not)
    DIR/points/NNN/point.json     params, state, the claim of the worker running it, its attempts
    DIR/points/NNN/               the point's ddp-app run directory (checkpoints/, lightning_logs/)

Workers claim the next point under an O_EXCL lock file (atomic on NFS too). A requeued Slurm array task finds its own
claim by job and task id and continues that point from its last.ckpt."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from app.checkpoints.io import atomic_write

PENDING, RUNNING, PREEMPTED, FAILED, DONE, PRUNED = "pending", "running", "preempted", "failed", "done", "pruned"
FINISHED = (DONE, PRUNED)
LOCK_STALE_S = 120.0  # a lock older than this was left by a killed worker


@dataclass
class Point:
    number: int
    params: dict[str, str]
    state: str = PENDING
    trial: int | None = None  # the Optuna trial number of a search point
    claim: dict[str, Any] | None = None  # who runs it: {"slurm_job": "123_4", "host", "pid"}
    attempts: list[dict[str, Any]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.number:03d}"


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class SweepStore:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.points_dir = directory / "points"

    def point_dir(self, point: Point) -> Path:
        return self.points_dir / point.name

    def save(self, point: Point) -> None:
        text = json.dumps(asdict(point), indent=1).encode()
        atomic_write(self.point_dir(point) / "point.json", lambda file: file.write(text))

    def points(self) -> list[Point]:
        found = []
        for path in sorted(self.points_dir.glob("*/point.json")):
            found.append(Point(**json.loads(path.read_text())))
        return found

    def add(self, params: dict[str, str], trial: int | None = None) -> Point:
        numbers = [point.number for point in self.points()]
        point = Point(max(numbers, default=-1) + 1, params, trial=trial)
        self.save(point)
        return point

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        path = self.directory / "lock"
        deadline = time.monotonic() + 600
        while True:
            try:
                descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                break
            except FileExistsError:
                with contextlib.suppress(OSError):
                    if time.time() - path.stat().st_mtime > LOCK_STALE_S:
                        path.unlink()
                        continue
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{path} held for 10 minutes; remove it if no sweep worker is running") from None
                time.sleep(0.1)
        try:
            os.write(descriptor, f"{socket.gethostname()} {os.getpid()}\n".encode())
            os.close(descriptor)
            yield
        finally:
            path.unlink(missing_ok=True)


def my_claim() -> dict[str, Any]:
    """Who this worker is: a Slurm array task (stable across its requeues), or a local process."""
    claim: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(), "since": now()}
    array_job, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and task:
        claim["slurm_job"] = f"{array_job}_{task}"
    elif os.environ.get("SLURM_JOB_ID"):
        claim["slurm_job"] = os.environ["SLURM_JOB_ID"]
    return claim


def same_worker(claim: dict[str, Any] | None, mine: dict[str, Any]) -> bool:
    if not claim:
        return False
    if "slurm_job" in mine:
        return claim.get("slurm_job") == mine["slurm_job"]
    return claim.get("host") == mine["host"] and claim.get("pid") == mine["pid"]


def claim_alive(claim: dict[str, Any] | None) -> bool:
    """Whether the worker holding a claim still runs: its Slurm job is in the queue, or its process lives on this host.
    A claim of another host without Slurm is taken as alive (we cannot tell)."""
    if not claim:
        return False
    if "slurm_job" in claim:
        try:
            listed = subprocess.run(
                ["squeue", "-h", "-o", "%i", "-j", claim["slurm_job"]], capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.SubprocessError):
            return True
        return listed.returncode == 0 and bool(listed.stdout.strip())
    if claim.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(claim["pid"]), 0)
    except (ProcessLookupError, ValueError, KeyError):
        return False
    except PermissionError:
        return True
    return True


def shown_state(point: Point) -> str:
    """The state `status` shows: a running point whose worker is gone was stopped (preempted or lost)."""
    if point.state == RUNNING and not claim_alive(point.claim):
        return PREEMPTED
    return point.state
