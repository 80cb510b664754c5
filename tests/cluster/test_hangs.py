"""The hang report's reading of other ranks' answers (app/cluster/hangs.py), on recorded shapes.

The real endpoint and flight recorder are exercised by tests/fault/test_hangs.py (every kind of
hang) and their format by tests/test_private_apis.py; here, each verdict in one line. The records
are shaped as gloo's flight recorder writes them on a busy machine: `last_completed_collective`
lags behind (it is written by a worker thread after the waiting call returned, and out of order
when two collectives were in flight), so it says nothing about where a rank waits.
"""

from __future__ import annotations

import json

import pytest

from app.cluster.hangs import (
    Answer,
    Frame,
    RankAddress,
    call_site,
    describe_hang,
    main_thread_frames,
    mismatched,
    newest_collectives,
    unreachable_only_off_reachable_hosts,
    waited_collective,
)
from tests.helpers.run import REPO

ME = RankAddress(0, "node1", 100, "10.0.0.1", 5000)
PEER = RankAddress(1, "node2", 200, "10.0.0.2", 5001)
GRADIENTS = [[19210]]
LOADER_STACK = """Thread 0x00007f (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait

Thread 0x00007e (most recent call first):
  File "/home/me/my_dataset.py", line 12 in __getitem__
  File "/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", line 700 in __next__
  File "/venv/bin/ddp-app", line 8 in <module>
"""
COLLECTIVE_STACK = """Thread 0x00007e (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 4800 in barrier
  File "/home/me/my_callback.py", line 30 in on_train_batch_end
  File "/venv/bin/ddp-app", line 8 in <module>
"""
HISTORY = [(seq, "all_reduce", GRADIENTS) for seq in range(95, 100)]


def recorder(last_entered: int, *entries: tuple[int, str, list[list[int]]], completed: int = 97) -> dict:
    return {
        "pg_status": {
            "0": {"last_enqueued_collective": str(last_entered), "last_completed_collective": str(completed)}
        },
        "entries": [
            {
                "process_group": ["0", "default_pg"], "collective_seq_id": seq, "profiling_name": f"gloo:{op}",
                "input_sizes": sizes, "input_dtypes": ["Float"] * len(sizes), "time_created_ns": seq,
            }
            for seq, op, sizes in [*HISTORY, *entries]
        ],
    }  # fmt: skip


# Rank 0 waits in the DDP gradient all-reduce #100 of step 9 (its record still shows #98 as pending).
IN_GRADIENTS = recorder(100, (100, "all_reduce", GRADIENTS))
# Rank 0 waits in a barrier #101 after step 25's all-reduce #100, which its record does not show completed.
IN_BARRIER = recorder(101, (100, "all_reduce", GRADIENTS), (101, "barrier", []), completed=99)


GRADIENT_WAIT = "(DDP gradient all-reduce in loss.backward(), train step 9)"
# id: (rank 0's record, rank 1's answer, what the line says)
VERDICTS = {
    "stopped": (
        IN_GRADIENTS,
        Answer(PEER, problem="silent"),
        "(host node2, pid 200) did not arrive at all_reduce #100",
    ),
    "unreachable": (IN_GRADIENTS, Answer(PEER, problem="unreachable"), "its host node2 is unreachable from node1"),
    "ended": (IN_GRADIENTS, Answer(PEER, problem="gone"), "its process has ended"),
    "loader": (
        IN_GRADIENTS,
        Answer(PEER, LOADER_STACK, recorder(99)),
        f"all_reduce #100 [float[19210]] {GRADIENT_WAIT}: it is not in a collective (__getitem__ at /home/me/my_data",
    ),
    "mismatch": (
        IN_GRADIENTS,
        Answer(PEER, LOADER_STACK, recorder(100, (100, "barrier", []))),
        "it called barrier #100 [] instead",
    ),
    # The issue's case: rank 1 skipped the barrier. The old reading took rank 0's stale pending #100
    # as the collective it waits in, found rank 1 there too, and blamed the network.
    "skip-stale-completion": (
        IN_BARRIER,
        Answer(PEER, COLLECTIVE_STACK, recorder(101, (100, "all_reduce", GRADIENTS), (101, "all_reduce", GRADIENTS))),
        f"did not arrive at barrier #101 {GRADIENT_WAIT}: it called all_reduce #101 [float[19210]] instead",
    ),
    # Read before it entered its next collective: behind, and where it is.
    "behind": (
        IN_BARRIER,
        Answer(PEER, LOADER_STACK, recorder(100, (100, "all_reduce", GRADIENTS), completed=98)),
        f"did not arrive at barrier #101 {GRADIENT_WAIT}: it is not in a collective (__getitem__",
    ),
    "ahead": (
        IN_GRADIENTS,
        Answer(PEER, COLLECTIVE_STACK, recorder(101, (100, "all_reduce", GRADIENTS), (101, "all_reduce", [[3]]))),
        "its collectives run ahead, to all_reduce #101 [float[3]] (on_train_batch_end at /home/me/my_callback.py:30)",
    ),
    "left-it": (
        IN_GRADIENTS,
        Answer(PEER, LOADER_STACK, recorder(100, (100, "all_reduce", GRADIENTS))),
        "it entered it and is no longer in a collective (__getitem__",
    ),
    "unknown-record": (
        IN_GRADIENTS,
        Answer(PEER, COLLECTIVE_STACK, None),
        "cannot tell whether rank 1 (host node2, pid 200) arrived at all_reduce #100",
    ),
    "no-record-here": (
        {"pg_status": {}, "entries": []},
        Answer(PEER, COLLECTIVE_STACK, recorder(100)),
        "cannot tell whether rank 1 (host node2, pid 200) arrived at a collective",
    ),
    "all-arrived": (
        IN_GRADIENTS,
        Answer(PEER, COLLECTIVE_STACK, recorder(100, (100, "all_reduce", GRADIENTS))),
        f"every rank arrived at all_reduce #100 [float[19210]] {GRADIENT_WAIT} and were still in it 2 s later, "
        "yet it did not complete (rank 0 (host node1, pid 100), rank 1 waited 15 s): the network between them stalled",
    ),
}


@pytest.mark.parametrize(("mine", "answer", "says"), VERDICTS.values(), ids=VERDICTS.keys())
def test_each_answer_gives_its_verdict(mine: dict, answer: Answer, says: str) -> None:
    context = "DDP gradient all-reduce in loss.backward(), train step 9"
    line = describe_hang(ME, mine, context, 15, [answer], "d/", rechecked_s=2)
    assert line.startswith("ddp-app: hang: ") and line.endswith("Stacks and last collectives: d/"), line
    assert says in line, line
    assert "rank 0 (host node1, pid 100)" in line and "waited 15 s" in line, line
    if "every rank arrived" not in says:  # the network is blamed only when no rank's record or stack says otherwise
        assert "network" not in line and "rank 1 (host node2, pid 200)" in line, line


def test_a_rank_whose_own_wait_failed_in_the_same_collective_is_with_the_others() -> None:
    # Its main thread left the collective to write its own report; where it waited says it was in it.
    waited = [Frame("/venv/lib/python3.11/site-packages/torch/_tensor.py", 600, "backward")]
    peer = Answer(PEER, LOADER_STACK, recorder(100, (100, "all_reduce", GRADIENTS)), waited)
    line = describe_hang(ME, IN_GRADIENTS, "x", 15, [peer], "d/")
    assert "every rank arrived at all_reduce #100" in line and "the network between them stalled" in line, line


def test_a_rank_that_reaches_no_one_says_its_own_host_lost_the_network() -> None:
    line = describe_hang(PEER, IN_GRADIENTS, "x", 15, [Answer(ME, problem="unreachable")], "d/")
    assert line.startswith("ddp-app: hang: no other rank is reachable from rank 1 (host node2, pid 200)"), line


def test_the_main_thread_is_the_one_that_runs_the_program() -> None:
    assert [frame.name for frame in main_thread_frames(LOADER_STACK)] == ["<module>", "__next__", "__getitem__"]


@pytest.mark.parametrize("caller", ["/home/me/my_launcher.py", "/repo/tests/helpers/zygote.py"])
def test_whatever_called_ddp_app_is_never_named_as_the_place(caller: str) -> None:
    """A user's wrapper (or the tests' zygote) that calls `app.__main__.main()` sits outside the run: a rank
    waiting inside Lightning is placed in Lightning, not in the wrapper's call."""
    lightning = "/venv/lib/python3.11/site-packages/lightning/pytorch/trainer/trainer.py"
    frames = [
        Frame(caller, 40, "<module>"),
        Frame(caller, 12, "run"),
        Frame("/repo/app/__main__.py", 30, "main"),
        Frame("/repo/app/cli/entry.py", 20, "main"),
        Frame(lightning, 580, "fit"),
        Frame("/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", 3000, "barrier"),
    ]
    assert call_site(frames) == "fit at lightning/pytorch/trainer/trainer.py:580", call_site(frames)
    user = [*frames[:4], Frame("/repo/my_model.py", 77, "training_step"), *frames[4:]]
    assert call_site(user).startswith("training_step at "), call_site(user)


def test_the_collective_a_rank_waits_in_is_the_newest_it_entered_whatever_is_marked_completed() -> None:
    # gloo marks a failed wait completed, and a finished one only after the caller has moved on.
    assert str(waited_collective(recorder(101, (100, "all_reduce", GRADIENTS), (101, "barrier", []), completed=101)))
    assert str(waited_collective(IN_BARRIER)) == "barrier #101"
    assert str(waited_collective(recorder(100, (100, "all_reduce", GRADIENTS), completed=100))) == "all_reduce #100"


# --- the deadlock check (`HangReport._watch_for_mismatch`): each rank's newest collective against the
# others' recent ones (`recent_collectives`, the same shape cut to the newest entries) ---

IN_BARRIER_NEWEST = newest_collectives(IN_BARRIER)  # rank 0: barrier #101


def test_another_operation_at_the_sequence_number_a_rank_waits_at_is_a_deadlock() -> None:
    skipped = recorder(101, (100, "all_reduce", GRADIENTS), (101, "all_reduce", GRADIENTS))
    assert [str(collective) for collective in IN_BARRIER_NEWEST] == ["barrier #101"]
    assert {rank: str(theirs) for rank, theirs in mismatched(IN_BARRIER_NEWEST[0], {1: skipped}).items()} == {
        1: "all_reduce #101"
    }


def with_a_send(record: dict, seq: int) -> dict:
    """`record` with a send after its last collective: the recorder numbers it apart (`p2p_seq_id`)
    and writes the collectives' current number beside it."""
    send = {**record["entries"][-1], "collective_seq_id": seq, "profiling_name": "gloo:send", "is_p2p": True}
    return {**record, "entries": [*record["entries"], send]}


@pytest.mark.parametrize(
    "theirs",
    [
        recorder(100, (100, "all_reduce", GRADIENTS)),  # behind: still in its step, or asleep before #101
        with_a_send(recorder(100, (100, "all_reduce", GRADIENTS)), 101),  # behind, after a send
        recorder(99),  # further behind: a long data load, a checkpoint written before the step
        recorder(101, (100, "all_reduce", GRADIENTS), (101, "barrier", [])),  # arrived: the barrier completes
        None,  # did not answer (stopped, or busy holding the GIL): no evidence either
    ],
    ids=["one-behind", "send-then-behind", "far-behind", "same", "no-answer"],
)
def test_a_rank_that_has_not_reached_the_sequence_number_or_called_the_same_is_no_deadlock(theirs: dict) -> None:
    assert mismatched(IN_BARRIER_NEWEST[0], {1: theirs}) == {}


def deadlock_figures(record: dict) -> str:
    """docs/hangs.md's sentence of figures, from docs/hangs_deadlock.json (as the slow test writes it)."""
    return (
        f"{len(record['runs'])} runs in a row beside {record['busy_processes']} busy-looping processes on this "
        f"{record['cores']}-core VM (load average {record['loadavg_before'][0]:.1f} before), the report written a "
        f"median {record['reported_s']['median']:.1f} s (at most {record['reported_s']['max']:.1f} s) after the "
        f"mismatch, every rank gone a median {record['ended_s']['median']:.1f} s (at most "
        f"{record['ended_s']['max']:.1f} s) after it."
    )


def test_the_docs_quote_the_deadlock_figures_as_measured() -> None:
    record = json.loads((REPO / "docs" / "hangs_deadlock.json").read_text())
    docs = " ".join((REPO / "docs" / "hangs.md").read_text().split())
    assert deadlock_figures(record) in docs, deadlock_figures(record)
    assert len(record["runs"]) == 10 and record["ended_s"]["max"] <= record["bound_s"] == 10, record


# A stopped rank's endpoint accepts no connection; once its queue of connections not accepted is full
# (each ask of it leaves one), a connection times out as to a host that is down.
OTHER = RankAddress(2, "node2", 300, "10.0.0.2", 5002)


@pytest.mark.parametrize(
    ("answers", "problems"),
    [
        ([Answer(PEER, problem="unreachable"), Answer(OTHER, COLLECTIVE_STACK)], ["silent", ""]),  # node2 answers
        ([Answer(RankAddress(1, "node1", 200, "10.0.0.1", 5001), problem="unreachable")], ["silent"]),  # this host
        ([Answer(PEER, problem="unreachable"), Answer(OTHER, problem="unreachable")], ["unreachable"] * 2),
    ],
    ids=["host-reached-by-another-rank", "this-host", "host-down"],
)
def test_a_rank_on_a_host_that_was_reached_is_silent_not_unreachable(answers: list, problems: list) -> None:
    settled = unreachable_only_off_reachable_hosts(answers, ME.host)
    assert [answer.problem for answer in settled] == problems
    line = describe_hang(ME, IN_GRADIENTS, "x", 60, settled[:1], "d/")
    if problems[0] == "silent":
        assert "it does not answer (stopped" in line and "unreachable" not in line, line
