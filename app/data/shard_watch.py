"""Watching the processes LitData's `optimize` forks to write shards, so a write that cannot finish ends in bounded time
and none outlives it.

LitData 0.2.76 has no deadline: a writer that never reports (stuck, or blocked on a queue lock a killed sibling held)
keeps it waiting forever. `WriterWatch` ends the write when a writer ends by a signal or error status, or no sample was
made for `stall_seconds`."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

POLL_SECONDS = 0.05  # how often the watch looks: LitData reaps a dead writer up to 1 s after its death


def holders_of(link: str) -> list[int]:
    """The other processes that have a file descriptor open on `link` (a /proc fd link, `pipe:[INODE]`)."""
    holders = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        if _holds(int(entry.name), link):
            holders.append(int(entry.name))
    return holders


def _holds(pid: int, link: str) -> bool:
    with contextlib.suppress(OSError):
        return any(os.readlink(fd) == link for fd in Path(f"/proc/{pid}/fd").iterdir())
    return False


def kill_holders(link: str, reap: bool) -> None:
    """SIGKILL every process holding `link`, until none is left (10 s at most); `reap`: wait for those that are this
    process's children (not while LitData's own `Process` objects may still wait for them)."""
    deadline = time.monotonic() + 10
    while (left := holders_of(link)) and time.monotonic() < deadline:
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            if reap:
                with contextlib.suppress(ChildProcessError):  # a child of this process; an orphan is init's
                    os.waitpid(pid, 0)
        time.sleep(0.01)  # an orphan holds its descriptors until its exit is through


@contextlib.contextmanager
def no_process_outlives() -> Iterator[str | None]:
    """Kill, by PID, every process forked during the block that still runs after it; yields the /proc link of the pipe
    that finds them (None without /proc).

    LitData forks a remover per writer that outlives a dead writer, holding the caller's stdout open. Every process
    forked in the block inherits a pipe made for it, which finds it whatever its parent; run LitData from the main
    thread."""
    if not Path("/proc/self/fd").is_dir():
        yield None
        return
    read_fd, write_fd = os.pipe()
    marker = f"pipe:[{os.fstat(read_fd).st_ino}]"
    try:
        yield marker
    finally:
        os.close(read_fd)
        os.close(write_fd)
        kill_holders(marker, reap=True)


def _children() -> list[int]:
    """This process's children (Linux's /proc/PID/task/TID/children, for each of its threads)."""
    pids: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path("/proc/self/task").iterdir():
            with contextlib.suppress(OSError):
                pids.extend(int(pid) for pid in (task / "children").read_text().split())
    return pids


def _ended_badly(pid: int) -> str | None:
    """How child `pid` ended, if it ended by a signal or with a non-zero status; None while it runs or after a clean
    exit. WNOWAIT leaves it waitable: LitData's `Process.is_alive` still reaps it."""
    try:
        status = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped already (by LitData), or not a child
        return None
    if status is None or (status.si_code == os.CLD_EXITED and status.si_status == 0):
        return None
    if status.si_code == os.CLD_EXITED:
        return f"writer process {pid} exited with status {status.si_status}"
    return f"writer process {pid} was killed by {signal.Signals(status.si_status).name}"


class WriterWatch:
    """A thread that kills every process holding `marker` when a writer ends by a signal or error status, or when `made`
    has not grown for `stall_seconds`; `optimize` then returns within its 1 s poll, and `cause` says why. It holds no
    lock the forked writers need."""

    def __init__(self, marker: str, made: Any, stall_seconds: float) -> None:
        self.marker, self.made, self.stall_seconds = marker, made, stall_seconds
        self.cause: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddp-app shard watch", daemon=True)

    def __enter__(self) -> WriterWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        writers: set[int] = set()  # children seen holding the marker (a dead one's fds are gone)
        last_total, last_change = -1, time.monotonic()
        while not self._stop.wait(POLL_SECONDS):
            total = sum(self.made)
            if total != last_total:
                last_total, last_change = total, time.monotonic()
            children = _children()
            writers.update(pid for pid in children if pid not in writers and _holds(pid, self.marker))
            cause = next((ended for pid in sorted(writers) if (ended := _ended_badly(pid))), None)
            running = any(pid in children and _holds(pid, self.marker) for pid in writers)
            if cause is None and running and time.monotonic() - last_change > self.stall_seconds:
                cause = f"no sample was made for {self.stall_seconds:g} s (a writer process is stuck)"
            if cause is not None:
                self.cause = cause
                kill_holders(self.marker, reap=False)
                return
