"""torchrun --max-restarts, and ddp-app --restarts, bring a job back from a rank killed with kill -9,
bit-exactly; a deterministic failure is not retried."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from app.bench.recovery import KILL_AT_STEP, clock_arguments, kill_rank
from app.bench.recovery import wait_for_step as wait_for_clock_step
from tests.fault.test_resume import assert_same_weights, start_fit, wait_for_step
from tests.helpers.ports import unused_port
from tests.helpers.run import BIN, REPO, clean_env, ddp_app, kill_job, rank_pids

pytestmark = [pytest.mark.fault, pytest.mark.distributed]


def kill_rank_1_and_wait(process: subprocess.Popen, last: Path) -> None:
    """Once last.ckpt holds step 200, kill -9 rank 1; wait for the job (and its restarts) to end."""
    try:
        wait_for_step(last, 200, process)
        os.kill(rank_pids(process.pid)[1], signal.SIGKILL)
        process.wait(timeout=240)
    finally:
        kill_job(process.pid)
        process.wait()


def test_torchrun_restarts_the_group_after_kill_9_and_ends_bit_exact(uninterrupted, tmp_path: Path) -> None:
    overlay, expected = uninterrupted
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    command = [
        str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", "--max-restarts=2",
        "-m", "app", "fit", "--config", "configs/digits.yaml", "--config", str(overlay),
        f"--trainer.default_root_dir={tmp_path / 'run'}", "--ckpt_path", "last",
    ]  # fmt: skip
    with open(tmp_path / "torchrun.log", "w") as log:
        process = subprocess.Popen(
            command, cwd=REPO, env=clean_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    kill_rank_1_and_wait(process, last)
    output = (tmp_path / "torchrun.log").read_text()
    assert process.returncode == 0, output[-4000:]
    assert "--ckpt_path last: none yet, starting fresh" in output  # the first round
    assert f"--ckpt_path last: resuming from {last}" in output, output[-4000:]  # the restarted round
    assert_same_weights(expected, last)


@pytest.mark.slow  # about 50 s; torchrun's restart of the whole group is the test above, with one agent
def test_torchrun_with_two_agents_restarts_after_kill_9_and_ends_bit_exact(uninterrupted, tmp_path: Path) -> None:
    """Two agents, one rank each, meeting at a c10d rendezvous as on two nodes (torchrun.sbatch): the
    agent whose rank died counts a restart, the other does not, and the ranks still meet."""
    overlay, expected = uninterrupted
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    clock = tmp_path / "clock.txt"
    endpoint = f"127.0.0.1:{unused_port()}"
    command = [
        str(BIN / "torchrun"), "--nnodes=2", "--nproc-per-node=1", "--max-restarts=1", "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}", "--rdzv-id=two-agents", "-m", "app", "fit", "--config", "configs/digits.yaml",
        "--config", str(overlay), f"--trainer.default_root_dir={tmp_path / 'run'}", "--trainer.devices=1",
        "--trainer.num_nodes=2", "--ckpt_path", "last", *clock_arguments(clock),
    ]  # fmt: skip
    env = clean_env()  # one JOB_TAG for both agents: kill_job ends both
    agents = []
    for node in range(2):
        with open(tmp_path / f"agent{node}.log", "w") as log:
            agents.append(
                subprocess.Popen(
                    command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
    try:
        wait_for_clock_step(clock, KILL_AT_STEP, lambda: all(agent.poll() is None for agent in agents))
        kill_rank(clock, 1)
        for agent in agents:
            agent.wait(timeout=240)
    finally:
        for agent in agents:
            kill_job(agent.pid)
            agent.wait()
    output = "".join((tmp_path / f"agent{node}.log").read_text() for node in range(2))
    assert [agent.returncode for agent in agents] == [0, 0], output[-4000:]
    assert f"--ckpt_path last: resuming from {last}" in output, output[-4000:]
    assert_same_weights(expected, last)


def test_the_launcher_restarts_every_rank_from_last_after_kill_9(uninterrupted, tmp_path: Path) -> None:
    overlay, expected = uninterrupted
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    process = start_fit("configs/digits.yaml", overlay, tmp_path / "run", "--restarts=1")
    kill_rank_1_and_wait(process, last)
    output = (tmp_path / "run.log").read_text()
    assert process.returncode == 0, output[-4000:]
    assert "ddp-app: rank 1 (pid" in output and "was killed by SIGKILL" in output  # the failure is named
    assert "ddp-app: restart 1 of 1 after exit code 137: every rank starts again from last.ckpt" in output
    assert f"--ckpt_path last: resuming from {last}" in output, output[-4000:]
    assert_same_weights(expected, last)


def test_a_deterministic_failure_is_not_restarted(tmp_path: Path) -> None:
    # A diverging loss exits 2 on every attempt: running it again would only repeat it.
    result = ddp_app(
        "fit", "--config", "configs/digits.yaml", "--restarts=2", "--optimizer=torch.optim.SGD",
        "--optimizer.init_args.lr=1e30", f"--trainer.default_root_dir={tmp_path}",
        "--trainer.enable_progress_bar=false",
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert "diverged" in result.stderr and "restart" not in result.stderr
