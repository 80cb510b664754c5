"""The one thread per tracked run that talks to its trackers, so that training never waits on them.

A tracker can hang for minutes (MLflow retries a lost server), which would stall rank 0 in a hook while the others wait
in a collective. So every call after the open runs here, in order; the training thread only enqueues. `Outboxes` is what
each tracker still has to be sent. A daemon: a run that ends leaves a hung tracker behind (the journal keeps the rest
for the next attempt)."""

from __future__ import annotations

import queue
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from app.tracking.history import Call, mark_sent
from app.tracking.sinks import RunFacts

Result = TypeVar("Result")


class TrackerThread:
    """Runs tasks (callables that take no argument) one after the other on one daemon thread."""

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self._busy_since: float | None = None  # time.monotonic() when the running task started
        self._thread = threading.Thread(target=self._work, name="ddp-app-tracking", daemon=True)
        self._thread.start()

    def submit(self, task: Callable[[], object]) -> None:
        """Queue `task`; returns at once. A task handles its own errors (one that raises is a bug: its traceback is
        printed and the next task runs)."""
        self._tasks.put(task)

    def call(self, task: Callable[[], Result], timeout: float | None) -> Result:
        """Run `task` here and wait for its result or exception, at most `timeout` seconds (None: as long as it takes);
        TimeoutError after that, the task still running."""
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


def one_line(error: BaseException) -> str:
    """An error of a tracker library as a short reason: the system's word for a failed connection ("Connection refused",
    "Name or service not known"), else the first line of its message."""
    text = str(error)
    system = re.search(r"\[Errno -?\d+\] ([^'\")\]]+)", text)
    if system:
        return system.group(1).strip()
    if "timed out" in text.lower():
        return "no answer: timed out"
    first = text.splitlines()[0] if text else repr(error)
    return first if len(first) <= 200 else first[:197] + "..."


class _Outbox:
    """What one tracker still has to be sent: this attempt's start, settled calls in step order, the latest tags, and
    the calls it holds but has not made durable yet (W&B, until `finish`)."""

    def __init__(self, start: RunFacts) -> None:
        self.start: RunFacts | None = start
        self.calls: list[Call] = []
        self.tags: dict[str, str] = {}
        self.unconfirmed: list[Call] = []


class Outboxes:
    """The tracker thread's own state for a run's attempt (app/tracking/run.py `TrackedRun` hands it work): per tracker,
    what it did not take yet, kept in step order and tried again at the next save. A call is written to
    `sent-<tracker>.txt` only once the tracker confirmed it. The user is told once per outage, by either thread."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._outboxes: dict[str, _Outbox] = {}
        self.calling: str | None = None  # the tracker the thread is waiting on (read by the training thread)
        # Trackers the user was told are failing or not answering; both threads report, under the lock.
        self._warned: set[str] = set()
        self._warned_lock = threading.Lock()

    def sent_file(self, name: str) -> Path:
        return self.log_dir / f"sent-{name}.txt"

    def open(self, name: str, facts: RunFacts) -> None:
        self._outboxes[name] = _Outbox(facts)

    def deliver(self, sink: Any, calls: list[Call], tags: dict[str, str]) -> None:
        outbox = self._outboxes[sink.name]
        outbox.calls.extend(calls)
        outbox.tags.update(tags)
        self._flush(sink, outbox)

    def _flush(self, sink: Any, outbox: _Outbox) -> bool:
        """Send a tracker its outbox (this attempt's start first); whether it took all of it. One that fails keeps its
        outbox for the next try (the next save, or the close)."""
        self.calling = sink.name
        called = False  # a tracker that had nothing to take has not shown that it answers again
        try:
            if outbox.start is not None:
                called = True
                sink.start(outbox.start)
                outbox.start = None
            if outbox.calls:
                called = True
                calls = outbox.calls
                sink.send([call for call in calls if call.values])
                outbox.calls = []
                if sink.durable_on_send:
                    mark_sent(self.sent_file(sink.name), calls)
                else:
                    outbox.unconfirmed.extend(calls)
            if outbox.tags:
                called = True
                sink.note(outbox.tags)
                outbox.tags = {}
        except Exception as error:
            self.warn(
                sink.name,
                f"sending to {sink.name} failed ({one_line(error)}); training goes on, the values are kept and "
                "sent again at the next checkpoint.",
            )
            return False
        finally:
            self.calling = None
        with self._warned_lock:
            answered_again = called and sink.name in self._warned
            if called:
                self._warned.discard(sink.name)
        if answered_again:
            print(f"ddp-app: tracking: {sink.name} answers again; it has been sent what it missed.", file=sys.stderr)
        return True

    def close(self, sink: Any, status: str, tags: dict[str, str]) -> None:
        outbox = self._outboxes[sink.name]
        outbox.tags.update(tags)
        if not self._flush(sink, outbox):
            return  # warned; the next attempt sends the rest and sets the run's status
        self.calling = sink.name
        try:
            sink.close(status)
        except Exception as error:  # the run's outcome stands; the tracker is told later or never
            self.warn(sink.name, f"{sink.name} could not be closed ({one_line(error)})")
        else:
            mark_sent(self.sent_file(sink.name), outbox.unconfirmed)
            outbox.unconfirmed = []
        finally:
            self.calling = None

    def warn(self, name: str, message: str) -> None:
        """Tell the user, once per outage of the tracker `name`."""
        with self._warned_lock:
            if name in self._warned:
                return
            self._warned.add(name)
        print(f"ddp-app: tracking: {message}", file=sys.stderr, flush=True)
