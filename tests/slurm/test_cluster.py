"""Smoke tests for the local two-node Slurm cluster.

They check the Slurm features the training code relies on, against real
daemons: multi-node scheduling, a torch.distributed rendezvous across the two
node network namespaces, signal delivery to job steps (preemption), and
requeueing (SLURM_RESTART_COUNT).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from localcluster import LocalSlurmCluster

pytestmark = pytest.mark.slurm

FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def _wait_for_file(path: Path, timeout: float) -> None:
    """Job side effects land on the shared filesystem; poll with a deadline."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout}s")
        time.sleep(0.1)


def test_sinfo_shows_two_idle_nodes(slurm_cluster: LocalSlurmCluster) -> None:
    out = slurm_cluster.run(["sinfo", "-h", "-N", "-o", "%N %T"]).stdout
    states = dict(line.split() for line in out.splitlines())
    assert states == {"node1": "idle", "node2": "idle"}


def test_srun_runs_on_both_nodes(slurm_cluster: LocalSlurmCluster) -> None:
    out = slurm_cluster.run(["srun", "--time=1", "-N2", "-n2", "hostname"], timeout=60).stdout
    assert sorted(out.split()) == ["node1", "node2"]


ALLREDUCE = """
import datetime, os, socket
import torch, torch.distributed as dist
rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=60))
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
assert t.item() == world * (world + 1) / 2, t
print(f"rank={rank} host={socket.gethostname()} sum={t.item():g}", flush=True)
dist.destroy_process_group()
"""


def test_torch_distributed_allreduce_across_nodes(slurm_cluster: LocalSlurmCluster) -> None:
    # The job resolves the first node through the bind-mounted hosts file, as a
    # Lightning/torchrun launcher would, and runs one gloo rank per node.
    script = f"""#!/bin/bash
set -eu
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
export MASTER_ADDR=$(getent hosts "$head" | awk '{{print $1}}')
export MASTER_PORT=29511
echo "MASTER_ADDR=$MASTER_ADDR"
echo "PYTHON=$(command -v python)"
srun --ntasks-per-node=1 {sys.executable} -c "$ALLREDUCE_CODE"
"""
    job_id = slurm_cluster.sbatch(
        script, "-N2", "--ntasks-per-node=1", "--time=3", env={"ALLREDUCE_CODE": ALLREDUCE}, timeout=150
    )
    out = slurm_cluster.output_path(job_id).read_text()
    assert "MASTER_ADDR=10.77.0.11" in out, out
    assert f"PYTHON={Path(sys.executable).parent}/python" in out, out  # the venv reaches the job
    assert "rank=0 host=node1 sum=3" in out, out
    assert "rank=1 host=node2 sum=3" in out, out


def test_scancel_usr1_reaches_job_step(slurm_cluster: LocalSlurmCluster, tmp_path: Path) -> None:
    # `scancel --signal=USR1 JOB` (no --batch) signals the job's steps, i.e.
    # the srun-launched processes, not the batch shell.
    ready, got = tmp_path / "ready", tmp_path / "got-usr1"
    script = f"""#!/bin/bash
srun -n1 bash -c 'trap "echo usr1 > {got}; exit 0" USR1; touch {ready}; while :; do sleep 0.1; done'
"""
    job_id = slurm_cluster.sbatch(script, "--time=2", wait=False)
    try:
        slurm_cluster.wait_for_state(job_id, "RUNNING", timeout=30)
        _wait_for_file(ready, timeout=30)
        slurm_cluster.run(["scancel", "--signal=USR1", str(job_id)])
        assert slurm_cluster.wait_for_state(job_id, FINAL_STATES, timeout=30) == "COMPLETED"
        assert got.read_text().strip() == "usr1"
    finally:
        slurm_cluster.run(["scancel", str(job_id)], check=False)


def test_requeue_runs_job_again(slurm_cluster: LocalSlurmCluster, tmp_path: Path) -> None:
    ready = tmp_path / "first-run"
    script = f"""#!/bin/bash
echo "SLURM_RESTART_COUNT=${{SLURM_RESTART_COUNT:-0}} host=$(hostname)"
if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then touch {ready}; sleep 120; fi
"""
    # --open-mode=append keeps the first run's output when the job restarts.
    job_id = slurm_cluster.sbatch(script, "--requeue", "--open-mode=append", "--time=3", wait=False)
    try:
        slurm_cluster.wait_for_state(job_id, "RUNNING", timeout=30)
        _wait_for_file(ready, timeout=30)
        slurm_cluster.run(["scontrol", "requeue", str(job_id)])
        # A requeued job waits out cred_expire (5 s here) before it can start.
        assert slurm_cluster.wait_for_state(job_id, FINAL_STATES, timeout=60) == "COMPLETED"
        assert slurm_cluster.job_info(job_id)["Restarts"] == "1"
        out = slurm_cluster.output_path(job_id).read_text()
        assert "DUE TO JOB REQUEUE" in out, out  # slurmstepd's note between the two runs
        runs = [line.split()[0] for line in out.splitlines() if line.startswith("SLURM_RESTART_COUNT=")]
        assert runs == ["SLURM_RESTART_COUNT=0", "SLURM_RESTART_COUNT=1"], out
    finally:
        slurm_cluster.run(["scancel", str(job_id)], check=False)
