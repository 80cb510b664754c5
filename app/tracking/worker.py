"""The one thread per tracked run that talks to its trackers, so that training never waits on them.

A tracker is a network service (or a library with a service process of its own): MLflow's HTTP
client retries a server that went away for about 4 minutes per request, during which rank 0 would
sit in a checkpoint hook while the other ranks wait for it in a collective, and a stop signal would
go unanswered. Every tracker call after the open therefore runs here, one at a time and in the
order the training thread asked for them; the training thread only enqueues (app/tracking/run.py).

The thread is a daemon: a run that ends while a tracker still hangs leaves it behind (the journal
keeps what it did not confirm, and the next attempt sends it), and the process exits regardless.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

Result = TypeVar("Result")


class TrackerThread:
    """Runs tasks (callables that take no argument) one after the other on one daemon thread."""

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self._busy_since: float | None = None  # time.monotonic() when the running task started
        self._thread = threading.Thread(target=self._work, name="ddp-app-tracking", daemon=True)
        self._thread.start()

    def submit(self, task: Callable[[], object]) -> None:
        """Queue `task`; returns at once. A task handles its own errors (one that raises is a bug:
        its traceback is printed and the next task runs)."""
        self._tasks.put(task)

    def call(self, task: Callable[[], Result], timeout: float | None) -> Result:
        """Run `task` here and wait for its result or exception, at most `timeout` seconds
        (None: as long as it takes); TimeoutError after that, the task still running."""
        future: Future[Result] = Future()

        def run() -> None:
            try:
                future.set_result(task())
            except BaseException as error:  # handed to the waiting caller, whatever it is
                future.set_exception(error)

        self.submit(run)
        return future.result(timeout)

    def drain(self, timeout: float) -> bool:
        """Wait until every task queued so far has run, at most `timeout` seconds; whether they did."""
        done = threading.Event()
        self.submit(done.set)
        return done.wait(timeout)

    def busy_for(self) -> float:
        """Seconds the running task has run so far; 0 when the thread is idle."""
        started = self._busy_since
        return 0.0 if started is None else time.monotonic() - started

    def _work(self) -> None:
        while True:
            task = self._tasks.get()
            self._busy_since = time.monotonic()
            try:
                task()
            except Exception:
                traceback.print_exc()
            finally:
                self._busy_since = None
