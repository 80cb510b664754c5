"""DataLoader workers that are forked again if they hang before running their first line.

Why: on CPython before 3.12 (gh-112275; 3.11.7 on this VM and CI), a forked child can inherit CPython's runtime lock
(`HEAD_LOCK`) held by another thread of the parent, and then waits for it forever inside `PyOS_AfterFork_Child`,
before its first line of Python. A thread holds that lock without the GIL when it creates a Python thread state, and
in every ddp-app rank on gloo such a thread exists: gloo's run loop (`pt_gloo_runloop`) destroys each finished
collective's work object, and the last reference it drops to a tensor that has a Python object enters Python
(`c10::TensorImpl::decref_pyobject` -> pybind11's `gil_scoped_acquire` -> `PyThreadState_New`). gdb counted 48 such
thread states in rank 0 of a 3-epoch imagefolder fit. A DataLoader that forks its workers at that instant (every
epoch's start, every validation) gets a worker that never runs: torch sees it alive, and the rank waits for its batch
until the collective timeout, or forever. Caught alive twice in CI's slow shard 2 (the resume matrix with 2 workers):
gdb showed the worker in `os.fork` -> `PyOS_AfterFork_Child` -> `_PyEval_ReInitThreads` -> `_PyThreadState_DeleteExcept`
(docs/resume.md, "A rank waiting forever for a loader batch").

How: the worker's process writes one byte to a pipe as its first line (before `_bootstrap` runs the worker loop); the
rank waits for it at most `FIRST_LINE_S` and otherwise kills that child and forks again. The lock is held only for the
microseconds a thread state takes to create, so the next fork finds it free. Nothing else changes: same fork, same
worker loop, same seeds. Not applied where the fork is safe (CPython 3.12 and later) or not used (a loader with a
`multiprocessing_context` of spawn or forkserver, or no workers).

Private API (docs/private_apis.md, guarded in tests/test_private_apis.py): overrides of
`multiprocessing.popen_fork.Popen._launch` and `BaseProcess._bootstrap`, multiprocessing's own extension points for its
start methods.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import multiprocessing.popen_fork
import multiprocessing.process
import os
import select
import signal
import sys
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

from app.private_apis import require

# A healthy child writes within milliseconds, seconds on a machine loaded many times over; a child stuck before its
# first line never does. Each retry waits twice as long, so a merely slow child gets its chance.
FIRST_LINE_S = 5.0
ATTEMPTS = 4
# CPython 3.12 reinitialises the runtime lock in the child before it takes it (gh-112275).
FORK_NEEDS_CHECK = sys.version_info < (3, 12) and sys.platform.startswith("linux")


class WorkerDidNotStart(RuntimeError):
    """Every fork of one worker hung before its first line."""


class _FirstLinePopen(multiprocessing.popen_fork.Popen):
    """`popen_fork.Popen` that waits for the child's first line, and forks again if it does not come."""

    def _launch(self, process_obj: Any) -> None:
        wait_s = FIRST_LINE_S
        for _ in range(ATTEMPTS):
            ready_read, ready_write = os.pipe()
            process_obj._ddp_app_first_line = (ready_read, ready_write)
            try:
                super()._launch(process_obj)  # the child never returns from here
            finally:
                os.close(ready_write)
            try:
                started = bool(select.select([ready_read], [], [], wait_s)[0])
            finally:
                os.close(ready_read)
            if started:
                return
            seen = state_of(self.pid)
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self.finalizer()  # the pipes of that child
            print(
                f"ddp-app: a DataLoader worker (pid {self.pid}) hung before its first line ({seen}; CPython before "
                "3.12, gh-112275): forked it again",
                file=sys.stderr,
                flush=True,
            )
            wait_s *= 2
        raise WorkerDidNotStart(
            f"a DataLoader worker hung before its first line in {ATTEMPTS} forks (CPython before 3.12, gh-112275). "
            "Fix: Python 3.12 or later, or multiprocessing_context='forkserver' on the DataLoader."
        )


def state_of(pid: int) -> str:
    """What the kernel says a process does: "sleeping in futex_do_wait" (waiting for a lock: the deadlock; the name
    varies by kernel) or "running" (only slow), for the line that reports a retry."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip()
    except (OSError, IndexError):
        return "state unknown"
    if state == "S":
        return f"sleeping in {wchan}" if wchan and wchan != "0" else "sleeping"
    return {"R": "running", "D": "in uninterruptible I/O"}.get(state, f"state {state}")


class _FirstLineForkProcess(multiprocessing.context.ForkProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> _FirstLinePopen:
        return _FirstLinePopen(process_obj)

    def _bootstrap(self, parent_sentinel: Any = None) -> int:
        ready_read, ready_write = self._ddp_app_first_line
        os.close(ready_read)
        os.write(ready_write, b"1")
        os.close(ready_write)
        return super()._bootstrap(parent_sentinel=parent_sentinel)


class FirstLineForkContext(multiprocessing.context.ForkContext):
    """The fork start method, with `_FirstLineForkProcess` as its Process (DataLoader's `multiprocessing_context`)."""

    Process = _FirstLineForkProcess


FIRST_LINE_FORK = FirstLineForkContext()


def forks_unchecked(loader: DataLoader) -> bool:
    """Whether `loader` would fork its workers with the plain fork start method."""
    if loader.num_workers == 0:
        return False
    context = loader.multiprocessing_context
    if context is None:  # multiprocessing's start method: fork unless the program set another (Linux, CPython < 3.14)
        return (multiprocessing.get_start_method(allow_none=True) or "fork") == "fork"  # allow_none: fix nothing
    return type(context) is multiprocessing.context.ForkContext


def fork_workers_safely(loaders: Any) -> Any:
    """`loaders` (a DataLoader, or lists and dicts of them), each that forks its workers doing so through
    `FIRST_LINE_FORK` where CPython needs it; anything else unchanged."""
    if isinstance(loaders, (list, tuple)):
        return type(loaders)(fork_workers_safely(item) for item in loaders)
    if isinstance(loaders, dict):
        return {key: fork_workers_safely(item) for key, item in loaders.items()}
    if FORK_NEEDS_CHECK and isinstance(loaders, DataLoader) and forks_unchecked(loaders):
        for owner, name in (
            (multiprocessing.popen_fork.Popen, "_launch"),
            (multiprocessing.process.BaseProcess, "_bootstrap"),
        ):
            require(owner, name, "python", "checking that a DataLoader worker's fork did not hang (CPython < 3.12)")
        loaders.multiprocessing_context = FIRST_LINE_FORK
    return loaders
