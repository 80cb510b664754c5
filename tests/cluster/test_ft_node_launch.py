"""Fault tolerance's Slurm launch (slurm/fault_tolerant.sbatch) decided without a cluster: srun's one task
per node is ddp-app's launcher of that node's replica groups; each node starts the groups of its own index
range; srun of one task per rank and torchrun stop in one line. tests/slurm/test_fault_tolerant_sbatch.py
runs the script on the two-node cluster."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.cluster.ft_launch import SLURM_STEP_VARIABLES, as_group, group_arguments
from app.cluster.preflight import (
    NODE_LAUNCHER_VARIABLE,
    Launch,
    PreflightError,
    already_launched,
    detect_launch,
    is_node_launcher,
)
from app.cluster.rendezvous import HELD_PORTS_VARIABLE, hold_free_port
from app.errors import UserFacingError
from app.parallel.fault_tolerance import plan_fault_tolerance

# `srun --ntasks-per-node=1 --export=ALL,DDP_APP_FT_NODE_LAUNCHER=1 ddp-app fit ...` on a job of 2 nodes:
# the task on node2 (as Slurm 22.05 sets them on the test cluster).
NODE2_TASK = {
    "SLURM_JOB_ID": "7",
    "SLURM_JOB_NAME": "fault_tolerant.sbatch",
    "SLURM_JOB_NODELIST": "node[1-2]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NNODES": "2",
    "SLURMD_NODENAME": "node2",
    "SLURM_NTASKS": "2",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_TASKS_PER_NODE": "1(x2)",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    NODE_LAUNCHER_VARIABLE: "1",
}


@pytest.fixture
def lighthouse() -> Iterator[str]:
    """An address something listens on (the plan checks that the lighthouse answers)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"


def test_the_node_task_is_a_launcher_of_two_groups_numbered_after_its_node(lighthouse: str) -> None:
    assert is_node_launcher(NODE2_TASK) and already_launched(NODE2_TASK)  # the entry plans before it runs
    launch = detect_launch(NODE2_TASK, devices=2, num_nodes=2)  # 2 groups of 1 process per node
    assert launch == Launch("srun", 4, 2, 0, 1, 2, 2)
    section = {"enabled": True, "group_size": 1, "min_replicas": 1, "lighthouse": lighthouse}
    for key in ("timeout_s", "quorum_timeout_s", "heartbeat_timeout_s", "join_timeout_s"):
        section[key] = 1.0
    plan = plan_fault_tolerance(section, "ddp", "srun", 4, NODE2_TASK, 1, 2, is_node_launcher(NODE2_TASK))
    assert plan is not None and plan.groups == 4 and plan.groups_here() == range(2, 4)
    # Without a lighthouse address the groups of two nodes have nowhere to meet.
    with pytest.raises(UserFacingError, match="needs the address of the lighthouse.*Fix: sbatch slurm/fault"):
        plan_fault_tolerance({**section, "lighthouse": None}, "ddp", "srun", 4, NODE2_TASK, 1, 2, True)
    # srun of one task per rank (no node-launcher variable) is refused with the script to use.
    with pytest.raises(UserFacingError, match="under srun with one task per rank.*Fix: sbatch slurm/fault_tolerant"):
        plan_fault_tolerance(section, "ddp", "srun", 4, NODE2_TASK, 1, 2, False)
    with pytest.raises(UserFacingError, match="fault_tolerance.enabled is false. Fix: --fault_tolerance.enabled true"):
        plan_fault_tolerance({**section, "enabled": False}, "ddp", "srun", 4, NODE2_TASK, 1, 2, True)
    with pytest.raises(UserFacingError, match="under torchrun.*Fix: sbatch slurm/fault_tolerant.sbatch"):
        plan_fault_tolerance(section, "ddp", "torchrun", 4, {}, 0, 1, False)


def test_two_node_launchers_on_one_node_are_refused_before_any_group() -> None:
    env = {**NODE2_TASK, "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    with pytest.raises(PreflightError, match=r"srun started 2 task\(s\) per node with DDP_APP_FT_NODE_LAUNCHER"):
        detect_launch(env, devices=2, num_nodes=2)


def test_a_group_is_a_one_process_run_outside_the_slurm_step(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in NODE2_TASK.items():
        monkeypatch.setenv(name, value)
    seen = {}
    as_group(lambda args: seen.update(args=args, env=dict(os.environ)) or 0, ["fit"])
    assert not set(SLURM_STEP_VARIABLES) & seen["env"].keys()
    # Not a task of the step any more: ddp-app's pre-flight and Lightning see a plain one-process run.
    assert detect_launch(seen["env"], devices=1, num_nodes=1).launcher == "plain"
    assert "--trainer.num_nodes=1" in group_arguments(["fit"], 3, Path("/run"))


def test_the_processes_of_a_group_share_its_ports_and_see_their_own_gpus() -> None:
    """Groups of 2 processes (fault_tolerance.group_size 2): the processes of a group share its MASTER_PORT (its own
    process group) and torchft store port, the ports the launcher holds for the group; other groups have others; on a
    node with a GPU per process each group sees its own GPUs (CUDA_VISIBLE_DEVICES), in the node's order; with fewer,
    the variable is left as it is."""
    from app.cluster.ft_launch import group_environments, visible_gpu_ids
    from app.parallel.fault_tolerance import STORE_PORT_VARIABLE, FaultTolerancePlan

    one_machine = FaultTolerancePlan(groups=2, group_size=2, min_replicas=1, lighthouse=None)
    node2 = FaultTolerancePlan(4, 2, 1, "http://h:1", None, first_group=2, local_groups=2)  # the second of 2 nodes
    env = {"PL_GLOBAL_SEED": "1"}
    with contextlib.ExitStack() as stack:
        held = [(stack.enter_context(hold_free_port()), stack.enter_context(hold_free_port())) for _ in range(2)]
        groups = [
            group_environments(env, group, one_machine, "http://h:1", Path("/s"), held[group], ["0", "1", "2", "3"])
            for group in (0, 1)
        ]
        assert [[process["LOCAL_RANK"] for process in group] for group in groups] == [["0", "1"], ["0", "1"]]
        gpus_seen = [[process["CUDA_VISIBLE_DEVICES"] for process in group] for group in groups]
        assert gpus_seen == [["0,1"] * 2, ["2,3"] * 2]
        for key in ("MASTER_PORT", STORE_PORT_VARIABLE):
            assert all(len({process[key] for process in group}) == 1 for group in groups)
            assert groups[0][0][key] != groups[1][0][key]
        for (master, store), group in zip(held, groups, strict=True):
            assert group[0]["MASTER_PORT"] == str(master.getsockname()[1])
            assert group[0][STORE_PORT_VARIABLE] == str(store.getsockname()[1])
            held_ports = f"MASTER_PORT={master.fileno()},{STORE_PORT_VARIABLE}={store.fileno()}"
            assert group[0][HELD_PORTS_VARIABLE] == held_ports
        assert all(process["WORLD_SIZE"] == "2" for group in groups for process in group)
        # Groups 2 and 3 of 4 on the second node, its GPUs named by CUDA_VISIBLE_DEVICES.
        gpus = visible_gpu_ids({"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
        node2_group3 = group_environments(env, 3, node2, "http://h:1", Path("/s"), held[0], gpus)
        assert node2_group3[1]["CUDA_VISIBLE_DEVICES"] == "6,7"
        # Two GPUs for two groups of two processes: the groups share them, as without fault tolerance.
        fewer_gpus = group_environments(env, 1, one_machine, "http://h:1", Path("/s"), held[1], ["0", "1"])
        assert "CUDA_VISIBLE_DEVICES" not in fewer_gpus[0]
