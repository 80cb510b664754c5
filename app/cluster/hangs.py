"""A hang names its culprit: the rank that did not arrive, its host, and the collective the others wait in.

PyTorch's timeout says nothing about who is missing. So every rank keeps the flight recorder on
(`TORCH_FR_BUFFER_SIZE`), runs PyTorch's per-rank debug endpoint (`_WorkerServer`, a C++ thread that answers
`dump_traceback` and `fr_trace_json` while Python is blocked), and tells every other rank its host, pid and endpoint
once at setup (`all_gather_object`: rank 0 may be the stopped one).

On a timeout (`HangReport.on_exception`) a rank asks every other for its stack and flight recorder, compares the
collectives each entered by sequence number, writes `<default_root_dir>/hang-<time>-rank<R>/` and names the culprit(s)
in one line. The network is blamed only when every rank entered the same collectives and none moved within `RECHECK_S`.
What works where: docs/hangs.md."""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import http.client
import json
import os
import re
import socket
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from app.cluster.exit_codes import HANG_EXIT_CODE
from app.cluster.launch import end_rank, outlive_the_interpreter
from app.errors import PEER_LOST
from app.private_apis import require

# Collectives the flight recorder keeps per process (a ring buffer; a few hundred bytes each).
FLIGHT_RECORDER_ENTRIES = 2000
# How long a waiting rank waits for each other rank's answer: a stopped rank never answers.
ASK_TIMEOUT_S = 10.0
# How often each rank reads which collective it entered last per group (microseconds), for `_watch_for_mismatch`.
MISMATCH_CHECK_S = 1.0
# A rank stalled this long compares its newest collective with the others' at that sequence number; only the cost
# depends on it, never the decision.
STALLED_S = 2.0
# How long such a comparison waits for each other rank's recent collectives (a stopped rank never answers; it is named
# by the collective timeout's report).
PEEK_TIMEOUT_S = 2.0
# A rank that did not answer that ask is asked again after this long, then twice as long each time, up to the maximum
# (`HangReport._peek` says why).
SILENT_RETRY_S = 4.0
SILENT_RETRY_MAX_S = 60.0
# How many of its newest collectives per process group a rank shows the others for that comparison.
RECENT_ENTRIES = 16
# A rank reads its whole flight recorder for those at most this often (one read per interval however often it is
# asked); a rank paused for `STALLED_S` is always read as it is.
FULL_READ_EVERY_S = STALLED_S
# PyTorch's debug endpoint handlers (torch/csrc/distributed/c10d/control_plane/Handlers.cpp).
STACKS_HANDLER = "dump_traceback"
COLLECTIVES_HANDLER = "fr_trace_json"
# This project's files that every rank's stack passes through on its way into Lightning: never the place.
PLUMBING = ("app/cli/parser.py", "app/cli/entry.py", "app/__main__.py", "app/cluster/launch.py", "bin/ddp-app")
# ddp-app's entry point: whatever called it (the console script, a user's wrapper, the tests' zygote that forks their
# commands) is outside the run and never the place either.
ENTRY_POINT = "app/__main__.py"
# Ours, on the same endpoint: where this rank's own collective timed out (its main thread has left that place to write
# its report by the time another rank asks).
WAITED_HANDLER = "ddp_app_waited"
# What a stalled rank's deadlock check asks the others for (`HangReport._peek` says why PyTorch's C++ handler).
PEEK_HANDLER = COLLECTIVES_HANDLER
# The fields of a flight-recorder entry the deadlock check and `entries_by_seq` read.
ENTRY_FIELDS = (
    "process_group", "collective_seq_id", "is_p2p", "profiling_name", "input_sizes", "input_dtypes", "time_created_ns",
)  # fmt: skip
# Code a main thread is in while it waits in a collective (besides a backward: DDP's all-reduce).
COLLECTIVE_CODE = ("/torch/distributed/", "/torch/nn/parallel/")
# When every rank seems to wait where the reporter does, read again this much later before blaming the network: a rank
# read just before its next collective has moved on by then.
RECHECK_S = 2.0
# {"frames": [[filename, line, function], ...]} of this process's timed-out wait, innermost last.
_waited: dict[str, list[list[Any]]] = {"frames": []}
# What a collective timeout says: gloo "Timed out waiting 15000ms for recv operation", NCCL's watchdog "Watchdog caught
# collective operation timeout", the store "Socket Timeout".
TIMEOUT_MESSAGE = re.compile(r"timed out|timeout", re.IGNORECASE)
STDLIB_DIRECTORIES = tuple({str(Path(sysconfig.get_paths()[name]).resolve()) for name in ("stdlib", "platstdlib")})


def keep_hang_records(env: MutableMapping[str, str]) -> None:
    """In a rank, before its process group exists: flight recorder on, and faulthandler, which prints every thread's
    Python stack to stderr if the process dies of SIGSEGV or SIGABRT (gloo aborts on a collective whose sizes differ
    between ranks)."""
    env.setdefault("TORCH_FR_BUFFER_SIZE", str(FLIGHT_RECORDER_ENTRIES))
    faulthandler.enable(all_threads=True)


@dataclass(frozen=True)
class RankAddress:
    """Who a rank is and where its debug endpoint listens (port 0: it has none)."""

    rank: int
    host: str
    pid: int
    ip: str
    port: int

    def __str__(self) -> str:
        return f"rank {self.rank} (host {self.host}, pid {self.pid})"


@dataclass(frozen=True)
class Frame:
    filename: str
    lineno: int
    name: str


@dataclass(frozen=True)
class Collective:
    """One flight-recorder entry: `op` #`seq` on process group `group`."""

    group: str
    seq: int
    op: str
    sizes: str = ""
    created_ns: int = 0

    def __str__(self) -> str:
        return f"{self.op} #{self.seq}"


@dataclass
class Answer:
    """What one rank said: its stacks, flight recorder and timed-out wait, or why it said nothing."""

    address: RankAddress
    stacks: str | None = None
    collectives: dict[str, Any] | None = None
    waited: list[Frame] | None = None  # where its own collective timed out or failed, if it did
    problem: str = ""  # "" (answered), "unreachable", "gone", "silent"


def address_towards(master_addr: str) -> str:
    """The local IP address this host uses to reach `master_addr`: the one peers can reach us on."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((master_addr, 9))  # UDP: no packet is sent, only a route chosen
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def _serve_waited(request: Any, response: Any) -> None:
    response.set_content(json.dumps(_waited), "application/json")
    response.set_status(200)


_recent_lock = threading.Lock()
_recent: dict[str, Any] = {"entered": None, "recorder": None, "at": 0.0}  # the last full read: what it had entered


def entered_by_group(recorder: dict[str, Any] | None) -> dict[str, int]:
    """Per process group, the sequence number of the last collective entered."""
    return {group: last_entered(recorder, group) for group in ((recorder or {}).get("pg_status") or {})}


def entered_now() -> dict[str, int]:
    """`entered_by_group` of this process, from its flight recorder's status without the entries: a few microseconds,
    whatever the recorder holds."""
    # Private (docs/private_apis.md): required with the endpoint's names (`debug_endpoint_api`).
    import torch._C._distributed_c10d as c10d

    return entered_by_group(json.loads(c10d._dump_fr_trace_json(False, False)))


def recent_collectives() -> dict[str, Any]:
    """This process's flight recorder, cut to the newest `RECENT_ENTRIES` per group and the fields the deadlock check
    reads.

    The full recorder (slow, GIL held) is read only after a new collective, at most every `FULL_READ_EVERY_S`; entries
    never change, so what was read is kept."""
    import torch._C._distributed_c10d as c10d

    with _recent_lock:
        stale = time.monotonic() - _recent["at"] >= FULL_READ_EVERY_S and entered_now() != _recent["entered"]
        if _recent["recorder"] is None or stale:
            recorder = cut_to_recent(json.loads(c10d._dump_fr_trace_json(True, False)))
            _recent["entered"], _recent["at"] = entered_by_group(recorder), time.monotonic()
            _recent["recorder"] = recorder
        return _recent["recorder"]


def cut_to_recent(recorder: dict[str, Any]) -> dict[str, Any]:
    """A flight recorder cut to the newest `RECENT_ENTRIES` per group and the fields the deadlock check reads."""
    entered = entered_by_group(recorder)
    entries = []
    for entry in recorder.get("entries") or []:
        group, seq = str(entry.get("process_group", [""])[0]), entry.get("collective_seq_id")
        if isinstance(seq, int) and seq > entered.get(group, -1) - RECENT_ENTRIES:
            entries.append({field: entry[field] for field in ENTRY_FIELDS if field in entry})
    return {"pg_status": recorder.get("pg_status") or {}, "entries": entries}


def debug_endpoint_api() -> Any:
    """PyTorch's private endpoint module, with every name and handler the hang report uses; a PyTorch without one stops
    the run in one line (app/private_apis.py) instead of losing the diagnosis."""
    import torch._C._distributed_c10d as c10d

    needed_for = "naming the rank a hang waits for (app/cluster/hangs.py)"
    for name in ("_WorkerServer", "_register_handler", "_get_handler_names", "_dump_fr_trace_json"):
        require(c10d, name, "torch", needed_for)
    registered = dict.fromkeys(c10d._get_handler_names())
    for handler in (STACKS_HANDLER, COLLECTIVES_HANDLER, "ping"):
        require(registered, handler, "torch", needed_for, "the debug endpoint's handlers")
    return c10d


def start_debug_endpoint(ip: str) -> tuple[Any, int]:
    """PyTorch's per-rank debug endpoint on `ip` (only that interface), any free port; (None, 0) if it cannot listen
    there (the report then says this rank's endpoint does not answer)."""
    # Private: docs/private_apis.md, guarded in tests/test_private_apis.py.
    c10d = debug_endpoint_api()
    for name, handler in ((WAITED_HANDLER, _serve_waited),):
        if name not in c10d._get_handler_names():  # once per process: registering twice raises
            # Never freed: torch frees its handlers after Python has finalized (outlive_the_interpreter).
            c10d._register_handler(name, outlive_the_interpreter(handler))
    try:
        server = c10d._WorkerServer(ip, 0)
    except RuntimeError as error:  # no diagnosis is no reason to stop training, but say it is lost
        print(f"ddp-app: warning: the hang report's debug endpoint did not start on {ip} ({error})", file=sys.stderr)
        return None, 0
    return server, int(server.port)


def ask(address: RankAddress, handler: str, timeout_s: float) -> tuple[str | None, str]:
    """(body, "") from a rank's debug endpoint, or (None, "unreachable", "gone" or "silent")."""
    if not address.port:
        return None, "silent"
    connection = http.client.HTTPConnection(address.ip, address.port, timeout=timeout_s)
    try:
        try:
            connection.connect()
        except ConnectionRefusedError:  # its host answers, nothing listens there any more
            return None, "gone"
        except OSError:  # no route, or no SYN-ACK in time: its host is not reachable
            return None, "unreachable"
        try:
            connection.request("POST", f"/handler/{handler}")
            response = connection.getresponse()
            body = response.read().decode(errors="replace")
        except OSError:  # connected (the kernel accepts for a stopped process) but no answer
            return None, "silent"
        return (body, "") if response.status == 200 else (None, "silent")
    finally:
        connection.close()


def ask_rank(address: RankAddress, timeout_s: float) -> Answer:
    stacks, problem = ask(address, STACKS_HANDLER, timeout_s)
    if stacks is None:
        return Answer(address, problem=problem)
    body, _ = ask(address, COLLECTIVES_HANDLER, timeout_s)
    collectives = None
    with contextlib.suppress(TypeError, ValueError):
        collectives = json.loads(body)  # type: ignore[arg-type]
    body, _ = ask(address, WAITED_HANDLER, timeout_s)
    waited = None
    with contextlib.suppress(TypeError, ValueError, KeyError):
        waited = [Frame(str(file), int(line), str(name)) for file, line, name in json.loads(body or "")["frames"]]
    return Answer(address, stacks, collectives, waited or None)


def unreachable_only_off_reachable_hosts(answers: list[Answer], this_host: str) -> list[Answer]:
    """A rank on this host, or on a host where another rank took the connection, is not unreachable: a connection to it
    that timed out met a process that accepts none (stopped, and the short queue of connections its endpoint has not
    accepted is full: each earlier ask of it left one there, docs/hangs.md). Such a rank did not answer ("silent")."""
    reached = {this_host} | {answer.address.host for answer in answers if answer.problem != "unreachable"}
    return [
        Answer(answer.address, problem="silent")
        if answer.problem == "unreachable" and answer.address.host in reached
        else answer
        for answer in answers
    ]


def waited_collective(recorder: dict[str, Any] | None) -> Collective:
    """The collective a rank waits in (or whose wait failed): the newest one it entered, on any group.

    Not "the oldest not completed": gloo marks completion from worker threads, late and out of order, so a record can
    show a long-left collective as pending. Entries are written by the calling thread, in order, before it waits."""
    newest = newest_collectives(recorder)
    return max(newest, key=lambda collective: collective.created_ns, default=Collective("?", -1, "a collective"))


def last_entered(recorder: dict[str, Any] | None, group: str) -> int:
    """The sequence number of the last collective this rank entered on `group` (-1: none recorded)."""
    status = ((recorder or {}).get("pg_status") or {}).get(group) or {}
    return int(status.get("last_enqueued_collective", -1))


def entries_by_seq(recorder: dict[str, Any] | None, group: str) -> dict[int, Collective]:
    """Every collective the flight recorder still holds for `group`, by sequence number."""
    found: dict[int, Collective] = {}
    for entry in (recorder or {}).get("entries") or []:
        seq = entry.get("collective_seq_id")
        # A send or recv is numbered apart (`p2p_seq_id`) and carries the collectives' number beside it.
        if str(entry.get("process_group", [""])[0]) == group and isinstance(seq, int) and not entry.get("is_p2p"):
            op = str(entry.get("profiling_name", "?")).split(":")[-1]
            shapes = zip(entry.get("input_sizes") or [], entry.get("input_dtypes") or [], strict=False)
            sizes = " ".join(f"{dtype.lower()}{size}" for size, dtype in shapes)
            found[seq] = Collective(group, seq, op, sizes, int(entry.get("time_created_ns") or 0))
    return found


def entry_of(recorder: dict[str, Any], group: str, seq: int) -> Collective | None:
    return entries_by_seq(recorder, group).get(seq)


def newest_collectives(recorder: dict[str, Any] | None) -> list[Collective]:
    """Per process group, the last collective this rank entered (from its flight recorder)."""
    newest: list[Collective] = []
    for group_id, status in ((recorder or {}).get("pg_status") or {}).items():
        seq = int(status.get("last_enqueued_collective", -1))
        entry = entry_of(recorder or {}, group_id, seq) if seq >= 0 else None
        if entry is not None:
            newest.append(entry)
    return newest


def mismatched(mine: Collective, others: dict[int, dict[str, Any] | None]) -> dict[int, Collective]:
    """The ranks (of `others`: rank -> flight recorder) whose collective at `mine`'s sequence number on `mine`'s group
    is another operation: a certain deadlock, as neither will ever complete."""
    found: dict[int, Collective] = {}
    for rank, recorder in others.items():
        theirs = entry_of(recorder or {}, mine.group, mine.seq)
        if theirs is not None and theirs.op != mine.op:
            found[rank] = theirs
    return found


def main_thread_frames(stacks: str) -> list[Frame]:
    """The main thread's frames, innermost last, from a faulthandler dump (the thread whose outermost frame is a
    `<module>`: the program's entry point)."""
    threads: list[list[Frame]] = []
    for block in re.split(r"\n(?=(?:Current thread|Thread) 0x)", stacks):
        frames = [
            Frame(match[0], int(match[1]), match[2])
            for match in re.findall(r'File "([^"]+)", line (\d+) in (\S+)', block)
        ]
        threads.append(frames[::-1])
    for frames in threads:
        if frames and frames[0].name == "<module>":
            return frames
    return max(threads, key=len, default=[])


def is_library(filename: str) -> bool:
    """Python's own or an installed package's file (frozen modules, `<string>` too), not user code."""
    if filename.startswith("<") or "/site-packages/" in filename or "/dist-packages/" in filename:
        return True
    return str(Path(filename).resolve()).startswith(STDLIB_DIRECTORIES)


def call_site(frames: list[Frame]) -> str:
    """Where a stack stands, in words: DDP's gradient all-reduce, else the innermost frame of the user's (or this
    project's) code, else the innermost frame outside torch (Lightning's, torchmetrics')."""
    if is_gradient_all_reduce(frames):
        return "DDP gradient all-reduce in loss.backward()"
    entries = [index for index, frame in enumerate(frames) if frame.filename.endswith(ENTRY_POINT)]
    frames = frames[entries[-1] :] if entries else frames
    for frame in reversed(frames):
        if not is_library(frame.filename) and not frame.filename.endswith(PLUMBING):
            return f"{frame.name} at {short_path(frame.filename)}:{frame.lineno}"
    outside_torch = [frame for frame in frames if "/torch/" not in frame.filename] or frames
    if not outside_torch:
        return "an unknown place"
    frame = outside_torch[-1]
    place = f"{frame.name} at {short_path(frame.filename)}:{frame.lineno}"
    # Inside a library: the hook it runs in says which callback (Lightning's ModelCheckpoint reading the metrics at the
    # epoch's end, say).
    hook = next((hook for hook in reversed(outside_torch) if hook.name.startswith("on_")), None)
    if hook is not None and hook is not frame:
        place += f", in {hook.name} at {short_path(hook.filename)}:{hook.lineno}"
    return place


def short_path(filename: str) -> str:
    """`lightning/pytorch/...py` for an installed package's file; relative to here for a file below here."""
    if "site-packages/" in filename:
        return filename.rsplit("site-packages/", 1)[1]
    relative = os.path.relpath(filename)
    return filename if relative.startswith("..") else relative


def first_difference(
    mine: dict[str, Any] | None, theirs: dict[str, Any] | None, group: str, waiting: Collective
) -> tuple[Collective, Collective] | None:
    """(mine, theirs): the first collective on `group`, up to `waiting`, that both ranks entered as different operations
    (a certain deadlock: neither can complete), or `waiting` itself with other sizes. Earlier sizes are not compared:
    some collectives take per-rank sizes (gather, scatter)."""
    my_entries, their_entries = entries_by_seq(mine, group), entries_by_seq(theirs, group)
    for seq in sorted(set(my_entries) & set(their_entries)):
        if seq > waiting.seq:
            break
        ours, other = my_entries[seq], their_entries[seq]
        if ours.op != other.op or (seq == waiting.seq and ours.sizes != other.sizes):
            return ours, other
    return None


def is_gradient_all_reduce(frames: list[Frame]) -> bool:
    """Inside `loss.backward()`, where DDP's reducer waits for its gradient all-reduce."""
    return any(frame.name in ("backward", "_engine_run_backward") and is_library(frame.filename) for frame in frames)


def is_in_collective(frames: list[Frame]) -> bool:
    """Whether a main thread's stack may be waiting in a collective: in torch.distributed, DDP, or a backward (DDP's
    all-reduce). A stack with none of these (a data loader, a `time.sleep`, the model's forward) certainly is not. Only
    that side of the answer is used as evidence."""
    return is_gradient_all_reduce(frames) or any(part in frame.filename for frame in frames for part in COLLECTIVE_CODE)


@dataclass(frozen=True)
class Verdict:
    """Why one rank is not in the collective the reporting rank waits in, or that this cannot be told."""

    missed: Collective  # the reporting rank's collective this rank did not arrive at
    reason: str
    known: bool = True  # False: this rank may have arrived; its records cannot tell


def where_it_is(answer: Answer, mine: dict[str, Any] | None, this_host: str) -> Verdict | None:
    """Why `answer`'s rank is not in the collective the reporter (flight recorder `mine`) waits in, or None if it is
    (same collectives, same order, stack in a collective). A rank behind, ahead or apart is named with where it is."""
    waiting = waited_collective(mine)
    if answer.problem == "unreachable":
        return Verdict(waiting, f"its host {answer.address.host} is unreachable from {this_host}")
    if answer.problem == "gone":
        return Verdict(waiting, "its process has ended")
    if answer.problem:
        return Verdict(
            waiting, "it does not answer (stopped, e.g. by SIGSTOP, or stuck in native code holding the GIL)"
        )
    # A rank whose own wait timed out has left that place to write its report: it says where it was.
    frames = answer.waited or main_thread_frames(answer.stacks or "")
    place = f" ({call_site(frames)}{', where its own wait failed' if answer.waited else ''})"
    in_collective = bool(answer.waited) or is_in_collective(frames)
    if answer.collectives is None or waiting.seq < 0:
        if not in_collective:
            return Verdict(waiting, f"it is not in a collective{place}")
        unknown = "its flight recorder did not answer" if answer.collectives is None else "no collective is recorded"
        return Verdict(waiting, f"{unknown}{place}", known=False)
    group = waiting.group
    entered = last_entered(answer.collectives, group)
    differs = first_difference(mine, answer.collectives, group, waiting)
    if differs is not None:
        ours, theirs = differs
        return Verdict(ours, f"it called {theirs} [{theirs.sizes}] instead{place}")
    if entered < waiting.seq:  # behind: it has not entered the reporter's collective after its last
        missed = entry_of(mine or {}, group, entered + 1) or Collective(group, entered + 1, "?")
        if not in_collective:
            return Verdict(missed, f"it is not in a collective{place}")
        newest = waited_collective(answer.collectives)
        if newest.group != group:
            return Verdict(missed, f"it waits in {newest} on group {newest.group}{place}")
        return Verdict(missed, f"its newest collective is {newest}{place}")
    if entered > waiting.seq:  # ahead: it has left the collective the reporter waits in, or never waited in it
        ahead = entry_of(answer.collectives, group, entered) or Collective(group, entered, "?")
        return Verdict(waiting, f"its collectives run ahead, to {ahead} [{ahead.sizes}]{place}")
    if answer.stacks is not None and not in_collective:
        # Its record was read before it entered its next collective: it is not stuck in this one.
        return Verdict(waiting, f"it entered it and is no longer in a collective{place}")
    return None


def describe_hang(
    reporter: RankAddress,
    mine: dict[str, Any] | None,
    context: str,
    waited_s: float,
    answers: list[Answer],
    directory: str,
    note: str = "",
    rechecked_s: float = 0.0,
) -> str:
    """The one line: who did not arrive, where it is, and the collective the others wait in (`mine`: the reporting
    rank's flight recorder). `rechecked_s`: the records were read a second time this much later (`HangReport.report`),
    and `answers` are that second reading."""
    waiting = waited_collective(mine)
    verdicts = {answer.address: where_it_is(answer, mine, reporter.host) for answer in answers}
    culprits = [(address, verdict) for address, verdict in verdicts.items() if verdict and verdict.known]
    unsure = [(address, verdict) for address, verdict in verdicts.items() if verdict and not verdict.known]
    waiting_ranks = [str(reporter)] + [f"rank {address.rank}" for address, verdict in verdicts.items() if not verdict]

    def what(collective: Collective) -> str:
        sizes = f" [{collective.sizes}]" if collective.sizes else ""
        if collective.seq == waiting.seq:
            return f"{collective}{sizes} ({context})"
        return f"{collective}{sizes} (entered before {waiting}, where it waits: {context})"

    waited = f"{', '.join(waiting_ranks)} waited {waited_s:.0f} s"
    if not culprits and not unsure:
        again = f" and were still in it {rechecked_s:.0f} s later" if rechecked_s else ""
        story = (
            f"every rank arrived at {what(waiting)}{again}, yet it did not complete ({waited}): "
            "the network between them stalled"
        )
    elif reporter.rank != 0 and answers and all(answer.problem == "unreachable" for answer in answers):
        # Rank 0 hosts the rendezvous; any other rank that reaches no one is the one cut off.
        story = (
            f"no other rank is reachable from {reporter} ({', '.join(str(address) for address, _ in culprits)}): "
            f"this host may have lost its network; it waited {waited_s:.0f} s in {what(waiting)}"
        )
    else:
        # Never "the network" while a rank's records or stack cannot tell where it is.
        parts = [
            f"{address} did not arrive at {what(verdict.missed)}: {verdict.reason}" for address, verdict in culprits
        ]
        parts += [
            f"cannot tell whether {address} arrived at {what(verdict.missed)}: {verdict.reason}"
            for address, verdict in unsure
        ]
        story = "; ".join([*parts, waited])
    note = f" {note}" if note else ""
    return f"ddp-app: hang: {story}.{note} Stacks and last collectives: {directory}"


def exception_frames(exception: BaseException) -> list[Frame]:
    return [
        Frame(frame.filename, frame.lineno or 0, frame.name) for frame in traceback.extract_tb(exception.__traceback__)
    ]


def is_broken_connection(exception: BaseException) -> bool:
    """A collective failed because a peer's connection closed (gloo's and NCCL's store's messages)."""
    return isinstance(exception, RuntimeError) and any(sign in str(exception) for sign in PEER_LOST)


def is_collective_timeout(exception: BaseException) -> bool:
    """A collective (or the store) gave up waiting: gloo and NCCL raise RuntimeError subclasses."""
    return isinstance(exception, RuntimeError) and bool(TIMEOUT_MESSAGE.search(str(exception)))


class HangReport(Callback):
    """Runs PyTorch's debug endpoint on every rank, turns a collective timeout into the one line that names the rank
    that did not arrive (see the module docstring), and reports a certain deadlock (two ranks in different collectives
    at the same sequence number) without waiting for the timeout (`_watch_for_mismatch`). Added by `ddp-app` to every
    multi-process run."""

    def __init__(
        self,
        ask_timeout_s: float = ASK_TIMEOUT_S,
        mismatch_check_s: float = MISMATCH_CHECK_S,
        stalled_s: float = STALLED_S,
        peek_timeout_s: float = PEEK_TIMEOUT_S,
    ) -> None:
        self.ask_timeout_s = ask_timeout_s
        self.mismatch_check_s = mismatch_check_s
        self.stalled_s = stalled_s
        self.peek_timeout_s = peek_timeout_s
        self.peers: list[RankAddress] = []
        self._server: Any = None
        self._watch_stop = threading.Event()
        self._watch: threading.Thread | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.peers or trainer.world_size < 2 or not (dist.is_available() and dist.is_initialized()):
            return
        ip = address_towards(os.environ.get("MASTER_ADDR", "127.0.0.1"))
        self._server, port = start_debug_endpoint(ip)
        mine = RankAddress(trainer.global_rank, socket.gethostname(), os.getpid(), ip, port)
        everyone: list[Any] = [None] * trainer.world_size
        dist.all_gather_object(everyone, mine)
        self.peers = everyone
        if port and self.mismatch_check_s > 0:
            # The watcher reads the main thread's stack: without this CPython API it would fail in its thread, and a
            # mismatch would be reported only when collective_timeout_s runs out.
            require(sys, "_current_frames", "python", "naming a rank's call site in a collective mismatch")
            self._watch_stop.clear()
            self._watch = threading.Thread(
                target=self._watch_for_mismatch, args=(trainer,), name="ddp-app-mismatch-watch", daemon=True
            )
            self._watch.start()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._watch_stop.set()
        self._stop_server()

    def _stop_server(self) -> None:
        if self._server is not None:
            with contextlib.suppress(Exception):
                self._server.shutdown()
            self._server = None

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._watch_stop.set()
        if not self.peers:
            return
        lost, timed_out = is_broken_connection(exception), is_collective_timeout(exception)
        if lost or timed_out:  # where this rank's wait ended, for a peer that asks
            _waited["frames"] = [[frame.filename, frame.lineno, frame.name] for frame in exception_frames(exception)]
        if lost:
            self._let_reporting_peers_finish(trainer.global_rank)
        if not timed_out:
            return
        own = "".join(traceback.format_exception(exception))
        line = self.report(trainer, exception_frames(exception), f"Where it waited (the timeout's traceback):\n{own}")
        # Read by `app.cli.entry.run`, which prints it instead of the timeout's traceback (that is in the directory).
        # The endpoint stays up until the process ends: a peer that timed out too may still ask.
        exception.ddp_app_hang_report = line  # type: ignore[attr-defined]

    def _let_reporting_peers_finish(self, rank: int) -> None:
        """A peer closed its connections: it died, or its own collective timed out and it is asking everyone for their
        stacks. Stay (for a launcher that kills every rank when one exits) until no peer answers a ping, at most twice
        the time one report takes."""
        others = [peer for peer in self.peers if peer.rank != rank]
        deadline = time.monotonic() + 2 * self.ask_timeout_s
        while time.monotonic() < deadline and any(ask(peer, "ping", 1.0)[0] == "pong" for peer in others):
            time.sleep(0.2)

    def _watch_for_mismatch(self, trainer: L.Trainer) -> None:
        """A thread: every `mismatch_check_s`, read which collective this rank entered last on each group.

        Once stalled for `stalled_s`, compare its newest one per group with what each other rank entered at that
        sequence number (`_peek`). Another operation there is a certain deadlock: the lowest rank involved writes the
        report and every rank involved exits. A rank that has not reached that number yet is only slow: nothing here
        is decided by time (`stalled_s` only keeps the reads off a rank that progresses)."""
        me = self.peers[trainer.global_rank]
        others = [peer for peer in self.peers if peer.rank != me.rank]
        seen: dict[str, int] = {}
        since = time.monotonic()
        quiet: dict[int, tuple[float, float]] = {}  # rank -> (when to ask it again, the wait after its next silence)
        with ThreadPoolExecutor(max_workers=len(others)) as pool:
            while not self._watch_stop.wait(self.mismatch_check_s):
                try:
                    entered = entered_now()
                except (RuntimeError, TypeError, ValueError):  # no recorder: the collective timeout reports
                    return
                if entered != seen:  # progress since the last look
                    seen, since = entered, time.monotonic()
                    quiet.clear()
                    continue
                if not any(seq >= 0 for seq in entered.values()) or time.monotonic() - since < self.stalled_s:
                    continue
                try:
                    newest = newest_collectives(recent_collectives())
                except (RuntimeError, TypeError, ValueError):
                    continue
                recorders = self._peek(pool, others, quiet)
                for mine in newest:
                    conflicting = mismatched(mine, recorders)
                    if conflicting and not self._watch_stop.is_set():
                        self._end_mismatch(trainer, me, min([me.rank, *conflicting]))

    def _peek(
        self, pool: ThreadPoolExecutor, others: list[RankAddress], quiet: dict[int, tuple[float, float]]
    ) -> dict[int, dict[str, Any] | None]:
        """The other ranks' recent collectives, asked in parallel, of PyTorch's C++ `COLLECTIVES_HANDLER` and cut here.

        Not of a Python handler of ours, which this once was: PyTorch enters one with a new Python thread state for the
        endpoint's C++ thread, created without the GIL under CPython's runtime lock, and deletes it after. A DataLoader
        of the asked rank that forked its workers at that moment left the lock held in the child: on CPython before
        3.12 (gh-112275) the worker hung in `PyOS_AfterFork_Child` before running a line, and the
        rank waited for its batch forever (CI, slow shard 2's resume matrix; gdb showed `_PyThreadState_DeleteExcept`).
        Forking while the handler ran also crashed the asked rank ("PyThreadState_Get ... GIL is released").
        `tests/fault/test_hangs.py::test_a_rank_forks_safely_while_its_peers_check_for_deadlocks` forks beside a peer
        that asks nonstop. The C++ handler writes the whole recorder (up to `FLIGHT_RECORDER_ENTRIES`), and only a
        rank stalled for `stalled_s` asks.

        A silent rank is asked again only after `SILENT_RETRY_S`, doubling up to `SILENT_RETRY_MAX_S`: each unanswered
        ask fills a stopped rank's short accept queue, which would make it look unreachable to the timeout's report."""
        now = time.monotonic()
        asked = [peer for peer in others if now >= quiet.get(peer.rank, (0.0, 0.0))[0]]
        recorders: dict[int, dict[str, Any] | None] = {}
        bodies = pool.map(lambda peer: ask(peer, PEEK_HANDLER, self.peek_timeout_s)[0], asked)
        for peer, body in zip(asked, bodies, strict=True):
            if body is None:
                wait = quiet.get(peer.rank, (0.0, SILENT_RETRY_S))[1]
                quiet[peer.rank] = (time.monotonic() + wait, min(2 * wait, SILENT_RETRY_MAX_S))
                continue
            quiet.pop(peer.rank, None)
            with contextlib.suppress(TypeError, ValueError, AttributeError):
                recorders[peer.rank] = cut_to_recent(json.loads(body))
        return recorders

    def _end_mismatch(self, trainer: L.Trainer, me: RankAddress, reporter: int) -> None:
        """End this rank, which waits in a collective that can never complete (main thread blocked)."""
        main = sys._current_frames().get(threading.main_thread().ident or 0)
        frames = [Frame(f.filename, f.lineno or 0, f.name) for f in traceback.extract_stack(main)] if main else []
        # (Not `_waited`: its wait has not failed, and its main thread stays in the collective while the reporter reads
        # its stack.)
        if me.rank == reporter:
            text = "".join(traceback.format_list(traceback.extract_stack(main))) if main else ""
            note = (
                "Found by comparing the ranks' collectives, without waiting for collective_timeout_s: the first "
                "one that differs comes at or after the culprit, usually a collective that only some ranks call "
                "(under `if trainer.is_global_zero:`, in a progress bar or a print)."
            )
            line = self.report(trainer, frames, f"Where it waits (its main thread now):\n{text}", note)
            print(line, file=sys.stderr, flush=True)
        else:  # the reporter asks this rank for its stack: stay until it has ended, at most two asks' time
            self._let_reporting_peers_finish(me.rank)
        # From this thread: the main thread is blocked in native code and cannot be interrupted; the exit handlers run
        # (as at any exit of a rank), Lightning's teardown does not.
        end_rank(HANG_EXIT_CODE)

    def report(self, trainer: L.Trainer, frames: list[Frame], where_text: str, note: str = "") -> str:
        """Ask every rank, write the directory, return the line. `frames`: where this rank waits."""
        me = self.peers[trainer.global_rank]
        timed_out_ns = time.time_ns()
        answers, earlier, rechecked_s = self._ask_everyone(), None, 0.0
        others = [answer for answer in answers if answer.address.rank != me.rank]
        if not any(where_it_is(answer, answers[me.rank].collectives, me.host) for answer in others):
            # Every rank looks as if it waits where this one does: before blaming the network, read again, so that a
            # rank read just before it entered its next collective is seen to move.
            time.sleep(RECHECK_S)
            earlier, answers, rechecked_s = answers, self._ask_everyone(), RECHECK_S
            others = [answer for answer in answers if answer.address.rank != me.rank]
        own = answers[me.rank]
        waiting = waited_collective(own.collectives)
        stage = trainer.state.stage.value if trainer.state.stage is not None else "run"
        context = f"{call_site(frames)}, {stage} step {trainer.global_step}"
        waited_s = (timed_out_ns - waiting.created_ns) / 1e9 if waiting.created_ns else float("nan")
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        directory = Path(trainer.default_root_dir) / f"hang-{stamp}-rank{me.rank}"
        line = describe_hang(me, own.collectives, context, waited_s, others, f"{directory}/", note, rechecked_s)
        write_hang_directory(directory, line, answers, me.rank, where_text, earlier)
        return line

    def _ask_everyone(self) -> list[Answer]:
        """Every rank's answer (this one's too), in rank order, asked in parallel."""
        with ThreadPoolExecutor(max_workers=len(self.peers)) as pool:
            answers = list(pool.map(lambda address: ask_rank(address, self.ask_timeout_s), self.peers))
        return unreachable_only_off_reachable_hosts(answers, socket.gethostname())


def write_hang_directory(
    directory: Path, line: str, answers: list[Answer], reporter: int, where_text: str, earlier: list[Answer] | None
) -> None:
    """summary.txt, and rank<R>-stacks.txt and rank<R>-collectives.json of every rank that answered (`answers`;
    `earlier`: a first reading, if the records were read twice)."""
    with contextlib.suppress(OSError):  # the line is printed even where the directory cannot be written
        directory.mkdir(parents=True, exist_ok=True)
        summary = [line, ""]
        for answer in answers:
            state = answer.problem or "answered"
            entered = ""
            if answer.collectives is not None:
                newest = waited_collective(answer.collectives)
                before = next((old for old in earlier or [] if old.address == answer.address), None)
                first = f" (read {RECHECK_S:.0f} s earlier: {waited_collective(before.collectives)})" if before else ""
                entered = f"; newest collective entered: {newest}{first}"
            summary.append(f"{answer.address} at {answer.address.ip}:{answer.address.port}: {state}{entered}")
            if answer.stacks is not None:
                stacks = answer.stacks
                # The reporting rank has left the place where it waited to write this: that place comes first.
                if answer.address.rank == reporter:
                    stacks = f"{where_text}\nEvery thread now:\n{stacks}"
                elif answer.waited:
                    waited = "".join(f'  File "{f.filename}", line {f.lineno} in {f.name}\n' for f in answer.waited)
                    stacks = f"Where it waited (its own collective timed out):\n{waited}\nEvery thread now:\n{stacks}"
                (directory / f"rank{answer.address.rank}-stacks.txt").write_text(stacks)
            if answer.collectives is not None:
                (directory / f"rank{answer.address.rank}-collectives.json").write_text(
                    json.dumps(answer.collectives, indent=1)
                )
        (directory / "summary.txt").write_text("\n".join(summary) + "\n")
