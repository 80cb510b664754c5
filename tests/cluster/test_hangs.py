"""The hang report's reading of other ranks' answers (app/cluster/hangs.py), on recorded shapes.

The real endpoint and flight recorder are exercised by tests/fault/test_hangs.py (every kind of
hang) and their format by tests/test_private_apis.py; here, each verdict in one line.
"""

from __future__ import annotations

import pytest

from app.cluster.hangs import Answer, Collective, RankAddress, describe_hang, main_thread_frames, waited_collective

ME = RankAddress(0, "node1", 100, "10.0.0.1", 5000)
PEER = RankAddress(1, "node2", 200, "10.0.0.2", 5001)
WAITING = Collective("0", 57, "all_reduce", "float[19210]", 1)
LOADER_STACK = """Thread 0x00007f (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait

Thread 0x00007e (most recent call first):
  File "/home/me/my_dataset.py", line 12 in __getitem__
  File "/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", line 700 in __next__
  File "/venv/bin/ddp-app", line 8 in <module>
"""


def recorder(last_entered: int, *entries: tuple[int, str, list[list[int]]]) -> dict:
    return {
        "pg_status": {"0": {"last_enqueued_collective": str(last_entered), "last_completed_collective": "56"}},
        "entries": [
            {
                "process_group": ["0", "default_pg"], "collective_seq_id": seq, "profiling_name": f"gloo:{op}",
                "input_sizes": sizes, "input_dtypes": ["Float"] * len(sizes), "time_created_ns": seq,
            }
            for seq, op, sizes in entries
        ],
    }  # fmt: skip


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (Answer(PEER, problem="silent"), "rank 1 (host node2, pid 200) did not arrive at all_reduce #57"),
        (Answer(PEER, problem="unreachable"), "its host node2 is unreachable from node1"),
        (Answer(PEER, problem="gone"), "its process has ended"),
        (Answer(PEER, LOADER_STACK, recorder(56)), "it is not in a collective (__getitem__ at /home/me/my_data"),
        (Answer(PEER, LOADER_STACK, recorder(57, (57, "barrier", []))), "it called barrier #57 [] instead"),
        (Answer(PEER, LOADER_STACK, recorder(57, (57, "all_reduce", [[19210]]))), "every rank arrived at all_red"),
    ],
    ids=["stopped", "unreachable", "ended", "loader", "mismatch", "all-arrived"],
)  # fmt: skip
def test_each_answer_gives_its_verdict(answer: Answer, says: str) -> None:
    line = describe_hang(ME, WAITING, "DDP gradient all-reduce in loss.backward(), train step 9", 15, [answer], "d/")
    assert line.startswith("ddp-app: hang: ") and line.endswith("Stacks and last collectives: d/"), line
    assert says in line, line
    assert "rank 0 (host node1, pid 100) waited 15 s" in line or "every rank arrived" in line, line


def test_a_rank_that_reaches_no_one_says_its_own_host_lost_the_network() -> None:
    line = describe_hang(PEER, WAITING, "x", 15, [Answer(ME, problem="unreachable")], "d/")
    assert line.startswith("ddp-app: hang: no other rank is reachable from rank 1 (host node2, pid 200)"), line


def test_the_main_thread_is_the_one_that_runs_the_program() -> None:
    assert [frame.name for frame in main_thread_frames(LOADER_STACK)] == ["<module>", "__next__", "__getitem__"]


def test_a_timed_out_barrier_is_found_as_the_last_collective_entered() -> None:
    # gloo marks a barrier completed when it is enqueued: nothing is pending, the last entry is it.
    found = recorder(57, (56, "all_reduce", [[3]]), (57, "barrier", []))
    found["pg_status"]["0"]["last_completed_collective"] = "57"
    assert str(waited_collective(found)) == "barrier #57"
