"""A run's metric history across attempts: which logged values are final, and when they become so.

Every rank-0 `log_metrics` call (seq, step, time, values) is appended to `journal.jsonl` first, beside two events:

- `saved` (seq, step): last.ckpt, holding the run as of call `seq`, is on disk (only last.ckpt: `--ckpt_path last`
  resumes from it);
- `resumed` (seq, step): an attempt continues from a checkpoint holding the run as of call `seq`.

A call after the last completed save is *pending* while its attempt lives and *provisional* once an attempt resumes from
an earlier checkpoint; it is replaced when the resumed attempt logs the same (name, step), and *settled* once it cannot
be redone (a save past its step, or the run's end). Values no resume logs again (epoch values logged after the epoch-end
save) are kept.

Trackers get settled calls only, once each (app/tracking/sinks.py); `metrics.csv` shows every call as it stands.
Replaying the journal rebuilds the state. No Lightning or tracker library here."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PENDING, PROVISIONAL, SETTLED = "pending", "provisional", "settled"


@dataclass
class Call:
    """One `log_metrics` call: its values at one step."""

    seq: int
    step: int
    time: float
    values: dict[str, float]
    state: str = PENDING

    @property
    def order(self) -> tuple[int, int]:
        """Step order (a provisional value from an earlier attempt sits between the new attempt's)."""
        return self.step, self.seq


@dataclass
class RunHistory:
    """The state machine over the journal's events; each method returns the calls it settled."""

    calls: dict[int, Call] = field(default_factory=dict)
    last_seq: int = 0
    attempt_max_step: int = -1  # the largest step the current attempt has logged
    # (name, step) -> seq of the provisional call holding that value
    _provisional: dict[tuple[str, int], int] = field(default_factory=dict)

    def log(self, step: int, values: dict[str, float], time: float, seq: int | None = None) -> tuple[Call, bool]:
        """A new call; also whether it replaced a provisional value (the CSV view must be rewritten)."""
        self.last_seq = seq if seq is not None else self.last_seq + 1
        replaced = False
        for name in values:
            old_seq = self._provisional.pop((name, step), None)
            if old_seq is not None:
                old = self.calls[old_seq]
                old.values.pop(name, None)
                if not old.values:
                    del self.calls[old_seq]
                replaced = True
        call = Call(self.last_seq, step, time, dict(values))
        self.calls[call.seq] = call
        self.attempt_max_step = max(self.attempt_max_step, step)
        return call, replaced

    def saved(self, seq: int, step: int) -> list[Call]:
        """A checkpoint holding calls up to `seq` is on disk; its attempt had logged up to `step`."""
        settled = [call for call in self.calls.values() if call.state == PENDING and call.seq <= seq]
        settled += [call for call in self.calls.values() if call.state == PROVISIONAL and call.step < step]
        return self._settle(settled)

    def resumed(self, seq: int, step: int) -> list[Call]:
        """An attempt continues from the checkpoint saved after call `seq` (at logged step `step`): calls before it are
        final."""
        settled = self.saved(seq, step)
        for call in self.calls.values():
            if call.state == PENDING:  # logged after the checkpoint by an attempt that died
                call.state = PROVISIONAL
                for name in call.values:
                    self._provisional[(name, call.step)] = call.seq
        self.attempt_max_step = -1
        return settled

    def finished(self) -> list[Call]:
        """The run ended: nothing will be redone."""
        return self._settle([call for call in self.calls.values() if call.state != SETTLED])

    def _settle(self, calls: list[Call]) -> list[Call]:
        for call in calls:
            if call.state == PROVISIONAL:
                for name in call.values:
                    if self._provisional.get((name, call.step)) == call.seq:
                        del self._provisional[(name, call.step)]
            call.state = SETTLED
        return sorted(calls, key=lambda call: call.order)

    def settled(self) -> list[Call]:
        return sorted((call for call in self.calls.values() if call.state == SETTLED), key=lambda call: call.order)

    def view(self) -> list[Call]:
        """Every call as it stands (one value per name and step), in step order."""
        return sorted(self.calls.values(), key=lambda call: call.order)

    def apply(self, event: dict[str, Any]) -> list[Call]:
        """One journal event (as `Journal.read` yields them); returns the calls it settled."""
        if "values" in event:
            self.log(event["step"], event["values"], event["time"], seq=event["seq"])
            return []
        if "saved" in event:
            return self.saved(event["saved"], event["step"])
        if "resumed" in event:
            return self.resumed(event["resumed"], event["step"])
        if "finished" in event:
            return self.finished()
        return []  # an attempt's facts (`attempt`), kept for people reading the journal


class Journal:
    """`journal.jsonl`: one JSON object per line, appended and flushed (not fsynced: a kill loses nothing, a power loss
    the last lines, which are skipped when cut short)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")

    def append(self, event: dict[str, Any]) -> None:
        self._file.write(json.dumps(event, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    @staticmethod
    def read(path: Path) -> Iterator[dict[str, Any]]:
        if not path.is_file():
            return
        with path.open(encoding="utf-8") as file:
            for line in file:
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    if line.endswith("\n"):
                        raise
                    return  # the last line, cut short by a crash


def replay(path: Path) -> RunHistory:
    history = RunHistory()
    for event in Journal.read(path):
        history.apply(event)
    return history


def sent_seqs(path: Path) -> set[int]:
    """The calls a tracker has been sent (`sent-<tracker>.txt`, one seq per line)."""
    if not path.is_file():
        return set()
    return {int(line) for line in path.read_text().split() if line.isdigit()}


# The first line of a `sent-<tracker>.txt`, for whoever opens it (no number in it: `sent_seqs` reads numbers).
SENT_HEADER = (
    "# ddp-app: the seq of each call of journal.jsonl this tracker confirmed, one per line; "
    "a resumed or restarted run sends it only the others (docs/tracking.md)\n"
)


def mark_sent(path: Path, calls: list[Call]) -> None:
    with path.open("a", encoding="utf-8") as file:
        if file.tell() == 0:
            file.write(SENT_HEADER)
        file.write("".join(f"{call.seq}\n" for call in calls))
        file.flush()
        os.fsync(file.fileno())
