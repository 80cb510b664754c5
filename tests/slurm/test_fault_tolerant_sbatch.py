"""slurm/fault_tolerant.sbatch on the two-node test cluster (issue 57, docs/fault_tolerance.md): one
replica group per node, the lighthouse on the first node. The group of node2 killed with kill -9 mid-run:
node1's group keeps training, node2's ddp-app starts its group again, which heals from node1's and
rejoins; the job ends 0 with the planned steps and the same weights in both groups. The same with a group
of two processes per node (one of node2's killed: its group restarts whole). And the launches fault
tolerance cannot serve on Slurm (srun of one task per rank, torchrun) stop in one line."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from localcluster import LocalSlurmCluster
from test_scripts import CONFIG, CPU_ONLY, FINAL_STATES, SLURM, preempt, submit

from app.checkpoints.io import net_state_dict, safe_load

pytestmark = pytest.mark.slurm

FT = ("--fault_tolerance.enabled=true", "--trainer.enable_progress_bar=false")
# 2 groups of digits: 20 steps per epoch.
DEFAULT_TIMEOUT_S = 10.0  # fault_tolerance.timeout_s's default


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("slurm-ft")
    (path / "logs").mkdir()
    return path


def story(root: Path, group: int) -> list[dict]:
    """A group's per-step record (app/parallel/ft_manager.py), one dict per complete line."""
    path = root / "fault_tolerance" / f"group_{group}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]]


def steps_of(entries: list[dict]) -> list[dict]:
    return [entry for entry in entries if "step" in entry and "sent" not in entry and not entry.get("start")]


def assert_both_groups_end_at(root: Path, steps: int) -> None:
    """Group 0's last.ckpt (the run's) and group 1's hold the planned steps and the same weights."""
    first = safe_load(root / "checkpoints" / "last.ckpt")
    second = safe_load(root / "fault_tolerance" / "group_1" / "checkpoints" / "last.ckpt")
    assert first["global_step"] == second["global_step"] == steps
    ours, theirs = net_state_dict(first), net_state_dict(second)
    assert ours.keys() == theirs.keys()
    assert all(ours[key].equal(theirs[key]) for key in ours), "the groups ended with different weights"


def kill_group_1_at(
    cluster: LocalSlurmCluster, root: Path, step: int, process: int | None, killed: dict[str, float]
) -> Callable[[int], None]:
    """`submit`'s interrupt: once group 1 (node2's) has recorded `step`, kill -9 its process (its `process`-th of
    several, or its one), noting the pid and the time in `killed`."""

    def kill(job_id: int) -> None:
        deadline = time.monotonic() + 240
        while not any(entry["step"] >= step for entry in steps_of(story(root, 1))):
            assert cluster.job_state(job_id) not in FINAL_STATES, f"the job ended before step {step}"
            assert time.monotonic() < deadline, f"group 1 did not reach step {step} within 240 s"
            time.sleep(0.05)
        start = next(entry for entry in story(root, 1) if entry.get("start"))
        killed["pid"] = start["pid"] if process is None else start["pids"][process]
        killed["time"] = time.time()
        os.kill(int(killed["pid"]), signal.SIGKILL)  # the cluster's nodes share the host's process ids

    return kill


def test_a_node_whose_group_is_killed_rejoins_and_the_job_ends_0(
    slurm_cluster: LocalSlurmCluster, workdir: Path
) -> None:
    # Killed mid-epoch (20 steps per epoch): its own last.ckpt (step 40) is behind node1's group, so it heals.
    # 900 steps: the 850 after the kill outlast the restart (after the lighthouse's heartbeat timeout) under load.
    root, steps, kill_at = workdir / "run", 900, 50
    killed: dict[str, float] = {}
    kill_node2_group = kill_group_1_at(slurm_cluster, root, kill_at, None, killed)

    args = (CONFIG, f"--trainer.max_epochs={steps // 20}", f"--trainer.default_root_dir={root}")
    job = submit(
        slurm_cluster,
        workdir,
        SLURM / "fault_tolerant.sbatch",
        *CPU_ONLY,
        "--time=6",
        args=(*args, *FT),
        timeout=420,
        interrupt=(root, kill_node2_group),
    )
    output = job.output
    assert job.state == "COMPLETED" and job.info["ExitCode"] == "0:0", output[-4000:]
    assert "pid" in killed, output[-4000:]
    # One launcher per node, each with its own group; the lighthouse on node1.
    assert "one replica group per node, lighthouse http://node1:" in output, output[-4000:]
    assert "groups 0..0 on node1" in output and "groups 1..1 on node2" in output, output[-4000:]
    assert f"group 1 (pid {killed['pid']})" in output and "starting it again (1 of 3)" in output, output[-4000:]
    assert "(2 of 3)" not in output and "ddp-app bug" not in output, output[-6000:]  # it rejoined at once
    assert output.count(" ended: ") == 2, output[-4000:]  # one story line per group, the restarted one's
    # Node1's group never stopped: no gap between two of its steps beyond the timeout; it ended with both.
    times = [entry["time"] for entry in steps_of(story(root, 0))]
    gaps = [later - earlier for earlier, later in zip(times, times[1:], strict=False)]
    print(f"two-node torchft: node1's longest pause {max(gaps):.2f} s; job {job.seconds:.0f} s")
    assert max(gaps) < DEFAULT_TIMEOUT_S, f"group 0 stopped for {max(gaps):.1f} s"
    assert steps_of(story(root, 0))[-1]["step"] == steps
    assert steps_of(story(root, 0))[-1]["replicas"] == 2
    # Node2's group rejoined from node1's memory, with the weights node1 sent at that step.
    restarted = [entry for entry in story(root, 1) if entry.get("start")][1]
    assert restarted["time"] > killed["time"] and restarted["step"] > kill_at, restarted
    sent = [entry for entry in story(root, 0) if entry.get("sent") == restarted["step"]]
    assert sent and all(entry["digest"] == restarted["digest"] for entry in sent), (restarted, sent)
    assert steps_of(story(root, 1))[-1]["step"] == steps
    # Both groups end with the planned steps and the same weights; group 0 wrote the run's checkpoint.
    assert_both_groups_end_at(root, steps)
    assert not (root / "fault_tolerance" / "group_1" / "lightning_logs").exists()  # group 0 alone logs


def test_groups_of_two_processes_one_per_node_survive_a_killed_process_and_end_with_equal_weights(
    slurm_cluster: LocalSlurmCluster, workdir: Path
) -> None:
    """`--trainer.devices 2 --fault_tolerance.group_size 2`: each node's ddp-app forks a group of two processes
    (DDP inside the group, torchft across the nodes). One process of node2's group killed -9: its node's
    launcher ends the group's other process and starts both again; they heal from node1's processes of the same
    rank, node1's group never stops, and both groups end with the planned steps and equal weights."""
    # 1200 steps, as the test above has 900: the steps after the kill outlast the group's restart under load.
    root, steps, kill_at = workdir / "groups-of-two", 1200, 50
    killed: dict[str, float] = {}
    # The group's second process: not the one that keeps its record.
    kill_one_process_of_node2 = kill_group_1_at(slurm_cluster, root, kill_at, 1, killed)

    args = (
        CONFIG, f"--trainer.max_steps={steps}", "--trainer.max_epochs=1000", f"--trainer.default_root_dir={root}",
        "--trainer.devices=2", "--fault_tolerance.group_size=2",
    )  # fmt: skip
    job = submit(
        slurm_cluster, workdir, SLURM / "fault_tolerant.sbatch", *CPU_ONLY, "--cpus-per-task=2", "--time=6",
        args=(*args, *FT), timeout=420, interrupt=(root, kill_one_process_of_node2),
    )  # fmt: skip
    output = job.output
    assert job.state == "COMPLETED" and job.info["ExitCode"] == "0:0", output[-4000:]
    assert "pid" in killed, output[-4000:]
    assert "groups 0..0 on node1" in output and "groups 1..1 on node2" in output, output[-4000:]
    assert "starting it again (1 of 3)" in output and "(2 of 3)" not in output, output[-6000:]
    assert "ddp-app bug" not in output, output[-6000:]
    times = [entry["time"] for entry in steps_of(story(root, 0))]
    gaps = [later - earlier for earlier, later in zip(times, times[1:], strict=False)]
    print(f"two nodes, groups of two: node1's longest pause {max(gaps):.2f} s; job {job.seconds:.0f} s")
    assert max(gaps) < DEFAULT_TIMEOUT_S, f"group 0 stopped for {max(gaps):.1f} s"
    restarted = [entry for entry in story(root, 1) if entry.get("start")]
    assert len(restarted) == 2 and killed["pid"] not in restarted[1]["pids"], restarted
    assert restarted[1]["time"] > killed["time"] and restarted[1]["step"] > kill_at, restarted
    for group in (0, 1):
        assert steps_of(story(root, group))[-1]["step"] == steps
    assert_both_groups_end_at(root, steps)


@pytest.mark.parametrize(
    ("script", "env", "message"),
    [
        ("multinode.sbatch", None, "fault_tolerance.enabled: true under srun with one task per rank"),
        # MAX_RESTARTS=0: torchrun starts its ranks again after any failure, bad input included (docs/slurm.md).
        (
            "torchrun.sbatch",
            {"NPROC_PER_NODE": "1", "MAX_RESTARTS": "0"},
            "fault_tolerance.enabled: true under torchrun",
        ),
    ],
    ids=["srun-one-task-per-rank", "torchrun"],
)
def test_a_launch_fault_tolerance_cannot_serve_stops_in_one_line(
    slurm_cluster: LocalSlurmCluster, workdir: Path, script: str, env: dict[str, str] | None, message: str
) -> None:
    root = workdir / f"refused-{script}"
    args = (CONFIG, "--trainer.devices=1", "--trainer.num_nodes=2", f"--trainer.default_root_dir={root}", *FT)
    options = (*CPU_ONLY, "--ntasks-per-node=1")  # one rank per node: what the node launchers look like, but not them
    job = submit(slurm_cluster, workdir, SLURM / script, *options, args=args, env=env, timeout=90)
    print(f"fault tolerance under {script}: refused in {job.seconds:.1f} s")
    assert job.state == "FAILED", job.output[-3000:]
    errors = {line.strip() for line in job.output.splitlines() if "ddp-app: error:" in line}
    assert len(errors) == 1, job.output[-3000:]  # the same line from every rank
    line = errors.pop()
    assert message in line and "Fix: sbatch slurm/fault_tolerant.sbatch" in line, line
    assert "Initializing distributed" not in job.output and not (root / "fault_tolerance").exists()


def test_a_preempted_fault_tolerant_job_is_requeued_and_ends_with_the_same_weights_in_both_groups(
    slurm_cluster: LocalSlurmCluster, workdir: Path
) -> None:
    """scancel --signal=USR1: each node's launcher passes it to its group, which saves and stops; the job
    is requeued and every group resumes with `--ckpt_path last` (the one behind heals from the other)."""
    root, steps = workdir / "preempted", 300
    args = (CONFIG, f"--trainer.max_epochs={steps // 20}", f"--trainer.default_root_dir={root}")
    job = submit(
        slurm_cluster, workdir, SLURM / "fault_tolerant.sbatch", *CPU_ONLY, "--time=6", args=(*args, *FT),
        timeout=420, interrupt=preempt(slurm_cluster, root),
    )  # fmt: skip
    output = job.output
    assert job.state == "COMPLETED" and job.info["Restarts"] == "1", output[-4000:]
    assert f"job {job.job_id} (restart 1)" in output, output[-4000:]
    assert_both_groups_end_at(root, steps)
