"""One run per directory: a fit never overwrites another run's checkpoints, and two fits never train into one directory
at once.

The rule (docs/usage.md, "One run per directory"):

- A fit into a `default_root_dir` whose checkpoint directories hold checkpoints either continues that run (`--ckpt_path
  last`, or one of its files) or is refused in one line naming both choices. Logs are versioned and tracker runs belong
  to their run, so a refused fit writes nothing.
- While a fit runs, `<default_root_dir>/fit.lock` names it (host, pid, start, Slurm job or torchrun run); a second fit,
  on any host, is refused in one line. The holder touches it every `HEARTBEAT_S`; a lock whose holder is gone (dead pid
  on its host, an earlier attempt of the same job or run, or older than `STALE_AFTER_S`) never blocks a resume.

The holder: the launcher for its forked ranks (they see `LOCK_VARIABLE`), global rank 0 under torchrun or srun, an
in-process `DDPAppCLI` fit for its length. O_EXCL makes simultaneous starts agree (NFS v3+); two takeovers of one stale
lock in the same millisecond is a race left open. No torch or Lightning here."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import threading
import time
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint

from app.errors import UserFacingError

LOCK_NAME = "fit.lock"
# Set by the launcher for the ranks it forks: the lock is held by their launcher, not to be taken again.
LOCK_VARIABLE = "DDP_APP_FIT_LOCK"
# A live holder touches its lock this often; one silent for STALE_AFTER_S is taken for gone. The margin covers a
# holder's host clock being off from ours by a minute (mtimes on shared storage come from the writer's host or the file
# server).
HEARTBEAT_S = 15.0
STALE_AFTER_S = 120.0


class RunDirectoryBusy(UserFacingError):
    """Another fit is training into this directory right now."""


class RunDirectoryTaken(UserFacingError):
    """This directory holds another run's checkpoints, and this fit does not continue it."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lock: enough to name it to a user and to tell whether it still runs."""

    host: str
    pid: int
    started: str  # UTC, ISO 8601, seconds
    process_start: str | None  # the kernel's start time of `pid` (Linux), so a reused pid is told apart
    job: str | None  # "slurm:<job id>" or "torchrun:<run id>": whose attempts may take it over
    attempt: str | None  # "<SLURM_RESTART_COUNT>.<TORCHELASTIC_RESTART_COUNT>"

    def describe(self) -> str:
        job = f", {self.job.replace(':', ' job ', 1) if self.job.startswith('slurm') else self.job}" if self.job else ""
        started = self.started.replace("T", " ").replace("+00:00", " UTC")
        return f"a fit started {started} on host {self.host}, pid {self.pid}{job}"


def process_start(pid: int) -> str | None:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks since boot); None where there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def process_runs(pid: int) -> bool:
    """Whether `pid` is a running process of this host (a zombie, killed but not reaped, is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state not in ("Z", "X")


def job_of(env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(job, attempt) of this process: a Slurm job id, else a torchrun run id, and the restart counts of both (torchrun
    inside Slurm restarts within one job attempt). A requeued job keeps its id; torchrun restarts keep their run id."""
    attempt = f"{env.get('SLURM_RESTART_COUNT', '0')}.{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if env.get("SLURM_JOB_ID"):
        return f"slurm:{env['SLURM_JOB_ID']}", attempt
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return f"torchrun:{run_id}", attempt
    return None, None


def this_holder(env: Mapping[str, str]) -> Holder:
    job, attempt = job_of(env)
    pid = os.getpid()
    return Holder(
        host=socket.gethostname(),
        pid=pid,
        started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        process_start=process_start(pid),
        job=job,
        attempt=attempt,
    )


def why_gone(holder: Holder, silent_s: float, env: Mapping[str, str]) -> str | None:
    """Why the holder of a lock no longer runs, or None if it may still: see the module docstring."""
    if holder.host == socket.gethostname():
        if not process_runs(holder.pid):
            return f"process {holder.pid} no longer runs"
        if holder.process_start is not None and process_start(holder.pid) != holder.process_start:
            return f"process {holder.pid} no longer runs (its pid is now another process's)"
        return None
    job, attempt = job_of(env)
    if holder.job is not None and holder.job == job and holder.attempt != attempt:
        return f"it ran an earlier attempt of this {holder.job.split(':')[0]} job"
    if silent_s > STALE_AFTER_S:
        return f"it has not touched the lock for {silent_s:.0f} s"
    return None


def read_holder(path: Path) -> tuple[Holder, float] | None:
    """The lock's holder and how long since it last touched the file; None if there is no lock.

    A lock that cannot be read (a holder killed while writing it, a file from another version) has an unknown holder: it
    counts as held until its heartbeat is stale."""
    try:
        silent_s = time.time() - path.stat().st_mtime
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        return Holder(**json.loads(text)), silent_s
    except (ValueError, TypeError):
        return Holder(host="unknown", pid=-1, started="unknown", process_start=None, job=None, attempt=None), silent_s


def refuse_if_busy(root: Path, env: Mapping[str, str]) -> None:
    """Stop in one line if a fit that still runs holds `root`'s lock (not one of this launch's own)."""
    if env.get(LOCK_VARIABLE):  # our launcher holds it
        return
    found = read_holder(root / LOCK_NAME)
    if found is None:
        return
    holder, silent_s = found
    if holder.host == "unknown":
        if silent_s <= STALE_AFTER_S:
            raise RunDirectoryBusy(
                f"{root} is in use: {root / LOCK_NAME} was written {silent_s:.0f} s ago and cannot be read. "
                f"Fix: wait {STALE_AFTER_S - silent_s:.0f} s, or use another --trainer.default_root_dir."
            )
        return
    if why_gone(holder, silent_s, env) is None:
        raise RunDirectoryBusy(
            f"{root} is in use by {holder.describe()} ({root / LOCK_NAME}). Fix: wait for it to end or stop it, "
            "or use another --trainer.default_root_dir."
        )


class RunLock:
    """The lock of a fit's directory, held by this process until `release`; a thread keeps it fresh."""

    def __init__(self, path: Path, holder: Holder) -> None:
        self.path, self.holder = path, holder
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name="ddp-app-fit-lock", daemon=True)
        self._thread.start()

    def _heartbeat(self) -> None:
        # Only a utime per beat: the launcher forks its ranks while this thread runs, and a thread that held a
        # Python-level lock (a print, logging) at the fork would leave it held in the child.
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):  # removed by hand, or the storage hiccuped: the next beat tries
                os.utime(self.path)

    def release(self) -> None:
        """Stop the heartbeat and remove the lock, if it is still this process's."""
        self._stop.set()
        found = read_holder(self.path)
        if found is not None and found[0] == self.holder:
            self.path.unlink(missing_ok=True)


def acquire(root: Path, env: MutableMapping[str, str]) -> RunLock | None:
    """Take `root`'s lock for this process (None if our launcher holds it), or stop in one line.

    A lock whose holder is gone is taken over, and one line says whose it was."""
    if env.get(LOCK_VARIABLE):
        return None
    refuse_if_busy(root, env)
    path = root / LOCK_NAME
    root.mkdir(parents=True, exist_ok=True)
    found = read_holder(path)
    if found is not None:  # refuse_if_busy found it gone
        holder, silent_s = found
        reason = why_gone(holder, silent_s, env) or "unreadable"
        print(
            f"ddp-app: {path} named {holder.describe()}, which is gone ({reason}); this fit takes it over.",
            flush=True,
        )
        path.unlink(missing_ok=True)
    holder = this_holder(env)
    try:
        descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:  # another fit took it in between: name it
        refuse_if_busy(root, env)
        raise RunDirectoryBusy(
            f"{root} is in use by another fit ({path}). Fix: use another --trainer.default_root_dir."
        ) from None
    with os.fdopen(descriptor, "w") as file:
        json.dump(asdict(holder), file)
        file.flush()
        os.fsync(file.fileno())
    return RunLock(path, holder)


def refuse_overwrite(root: Path, checkpoint_dirs: Iterable[Path], ckpt_path: str | None) -> None:
    """Stop in one line if a fit that does not continue the run in `root` would write over its checkpoints.

    Continuing means `--ckpt_path last` ("best", "hpc") or a checkpoint (file or sharded link) inside `checkpoint_dirs`.
    """
    dirs = [Path(directory) for directory in checkpoint_dirs]
    existing = sorted(
        (path for directory in dirs if directory.is_dir() for path in directory.glob("*.ckpt") if path.exists()),
        key=lambda path: path.stat().st_mtime,
    )
    if not existing:
        return
    if ckpt_path in ("last", "best", "hpc", "registry"):
        return
    if ckpt_path is not None:
        given = Path(ckpt_path).resolve()
        if any(given.parent == directory.resolve() for directory in dirs):
            return
    newest = existing[-1]
    written = datetime.datetime.fromtimestamp(newest.stat().st_mtime).strftime("%Y-%m-%d %H:%M")
    how = "starting fresh" if ckpt_path is None else f"from {ckpt_path}"
    raise RunDirectoryTaken(
        f"{root} already holds a run ({newest}, written {written}), and this fit would write over its checkpoints, "
        f"{how}. Fix: continue that run with --ckpt_path last, or start a new one with another "
        f"--trainer.default_root_dir (e.g. {root.with_name(root.name + '-2')})."
    )


def claim_run_directory(config: Any, rank_zero: bool, lock: bool) -> RunLock | None:
    """One run per directory: a fit that another one is training into, or that would write over another run's
    checkpoints, stops here in one line, before anything is written; with `lock` (global rank 0 of a rank launched by
    torchrun or srun, or an in-process fit) it then holds the directory's lock. The launcher takes it for the ranks it
    forks (app/cli/entry.py)."""
    root = Path(config["trainer"]["default_root_dir"] or os.getcwd())
    if rank_zero:
        refuse_if_busy(root, os.environ)
    refuse_overwrite(root, configured_checkpoint_dirs(root, config["trainer"]), config.get("ckpt_path"))
    return acquire(root, os.environ) if lock else None


def configured_checkpoint_dirs(root: Path, trainer_config: Any) -> list[Path]:
    """Where a fit with this trainer config writes checkpoints: `<root>/checkpoints` (ddp-app's last.ckpt and every
    ModelCheckpoint without a dirpath) and the dirpath of any configured callback that has one."""
    dirs = [root / "checkpoints"]
    callbacks = trainer_config.get("callbacks") or []
    for callback in callbacks if isinstance(callbacks, list) else [callbacks]:
        if isinstance(callback, ModelCheckpoint):  # an object given in Python, not a config entry
            dirpath = callback.dirpath
        else:
            dirpath = (getattr(callback, "init_args", None) or {}).get("dirpath")
        if dirpath:
            dirs.append(Path(dirpath))
    return dirs
