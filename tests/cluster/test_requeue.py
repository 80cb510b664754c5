"""When a Slurm batch job requeues itself after its step failed (app/cluster/requeue.py); the real
requeue, on the two-node cluster, is in tests/slurm/test_scripts.py."""

from __future__ import annotations

import pytest

from app.cluster.exit_codes import PEER_LOST_EXIT_CODE
from app.cluster.requeue import (
    DEFAULT_MAX_REQUEUES,
    describe_step_exit,
    max_requeues,
    requeue_decision,
    slurm_batch_job_id,
)
from app.slurm import main


@pytest.mark.parametrize(
    ("exit_code", "restart_count", "allowed", "requeue", "reason"),
    [
        (137, 0, True, True, "requeue 1 of 3: it starts again from last.ckpt"),  # srun: a task was SIGKILLed
        (143, 2, True, True, "requeue 3 of 3"),  # srun ended the other tasks with SIGTERM
        (1, 0, True, True, "requeue 1 of 3"),  # a crash
        (PEER_LOST_EXIT_CODE, 0, True, True, "requeue 1 of 3"),
        (137, 3, True, False, "requeued 3 time(s), the budget is DDP_APP_MAX_REQUEUES=3"),
        (2, 0, True, False, "exit code 2 is bad input"),
        (143, 0, False, False, "may not be requeued (Requeue=0): a rank stopped on bad input"),
        (3, 0, True, False, "the ranks stopped on a signal after saving last.ckpt"),  # preempted: rank 0 requeued
        (130, 0, True, False, "the ranks stopped on a signal"),
    ],
)
def test_requeue_decision(exit_code: int, restart_count: int, allowed: bool, requeue: bool, reason: str) -> None:
    decided, why = requeue_decision(exit_code, restart_count, 3, allowed)
    assert decided == requeue
    assert reason in why


def test_the_budget_comes_from_the_environment() -> None:
    assert max_requeues({}) == DEFAULT_MAX_REQUEUES == 3
    assert max_requeues({"DDP_APP_MAX_REQUEUES": "0"}) == 0
    with pytest.raises(ValueError, match="DDP_APP_MAX_REQUEUES='two' is not a count"):
        max_requeues({"DDP_APP_MAX_REQUEUES": "two"})


@pytest.mark.parametrize(
    ("env", "job_id"),
    [
        ({}, None),
        ({"SLURM_JOB_ID": "12", "SLURM_JOB_NAME": "ddp-app"}, "12"),
        ({"SLURM_JOB_ID": "12", "SLURM_JOB_NAME": "interactive"}, None),  # salloc: nothing to requeue
        ({"SLURM_JOB_ID": "15", "SLURM_ARRAY_JOB_ID": "12", "SLURM_ARRAY_TASK_ID": "3"}, "12_3"),
    ],
)
def test_the_job_to_requeue(env: dict[str, str], job_id: str | None) -> None:
    assert slurm_batch_job_id(env) == job_id


def test_describe_step_exit() -> None:
    assert describe_step_exit(143) == "exit code 143 (128 + SIGTERM)"
    assert describe_step_exit(2) == "exit code 2"


def test_requeue_on_failure_outside_a_job(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    assert main(["requeue-on-failure", "0"]) == 0
    assert capsys.readouterr().out == ""  # a step that succeeded: nothing to say
    assert main(["requeue-on-failure", "137"]) == 0
    assert capsys.readouterr().out == (
        "ddp-app: the step ended with exit code 137 (128 + SIGKILL); not in a Slurm batch job, not requeued\n"
    )
