"""Pre-flight over environments recorded on Slurm 22.05 (tests/slurm's cluster), no cluster needed.

Each case also records what Lightning alone does with the same environment, so that a Lightning
upgrade that starts catching a case (or stops) shows up here.
"""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from lightning.fabric.utilities.warnings import PossibleUserWarning

from app.cluster.preflight import (
    Launch,
    PreflightError,
    already_launched,
    describe_launch,
    detect_launch,
    export_master_address,
    lightning_uses_slurm,
    preflight,
    resolve_devices,
    tasks_per_node,
)
from app.cluster.slurm_env import job_master_port
from tests.helpers.run import clean_env, ddp_app

JOB = {
    "SLURM_JOB_ID": "1",
    "SLURM_JOBID": "1",
    "SLURM_JOB_NAME": "train.sbatch",
    "SLURM_JOB_NODELIST": "node1",
    "SLURM_NODELIST": "node1",
    "SLURM_JOB_NUM_NODES": "1",
    "SLURM_NNODES": "1",
}
# `sbatch -N1 --ntasks-per-node=2`: the batch script itself (no SLURM_STEP_ID).
BATCH = {
    **JOB,
    "SLURMD_NODENAME": "node1",
    "SLURM_NTASKS": "2",
    "SLURM_NPROCS": "2",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_TASKS_PER_NODE": "2",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
}
# ... and `srun` inside it: task 1 of the job step.
STEP = {
    **BATCH,
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_STEPID": "0",
    "SLURM_STEP_NODELIST": "node1",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "2",
}
# `salloc -N1 -n2`: its shell, on the submit host.
SALLOC_SHELL = {
    **JOB,
    "SLURM_JOB_NAME": "interactive",
    "SLURM_NTASKS": "2",
    "SLURM_NPROCS": "2",
    "SLURM_TASKS_PER_NODE": "2",
}
# `salloc -N1 -n2`, then `srun` in it.
SALLOC_SRUN = {
    **{key: value for key, value in STEP.items() if key != "SLURM_NTASKS_PER_NODE"},
    "SLURM_JOB_NAME": "interactive",
}
# `srun --pty bash` (recorded as `srun -n1 bash -c ...`): one task, job name "bash".
PTY_BASH = {
    **STEP,
    "SLURM_JOB_NAME": "bash",
    "SLURM_NTASKS": "1",
    "SLURM_NPROCS": "1",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_TASKS_PER_NODE": "1",
    "SLURM_STEP_NUM_TASKS": "1",
    "SLURM_STEP_TASKS_PER_NODE": "1",
}
del PTY_BASH["SLURM_NTASKS_PER_NODE"]
# torchrun --nnodes=2 --nproc-per-node=2: rank 3, started by `srun --ntasks-per-node=1` on 2 nodes.
TORCHRUN = {
    "TORCHELASTIC_RUN_ID": "1",
    "RANK": "3",
    "LOCAL_RANK": "1",
    "GROUP_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "WORLD_SIZE": "4",
    "MASTER_ADDR": "node1",
    "MASTER_PORT": "29400",
}


def two_node_step(per_node: int = 1) -> dict[str, str]:
    """`sbatch -N2 --ntasks-per-node=per_node` + srun, seen from the first task on node2."""
    tasks = str(2 * per_node)
    return {
        **STEP,
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_NODELIST": "node[1-2]",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_NTASKS": tasks,
        "SLURM_NTASKS_PER_NODE": str(per_node),
        "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x2)",
        "SLURM_TASKS_PER_NODE": f"{per_node}(x2)",
        "SLURM_PROCID": str(per_node),
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "1",
    }


def lightning_sees(env: dict[str, str]):
    """Lightning's own view of an environment: it reads os.environ only (and PATH, for srun)."""
    return mock.patch.dict(os.environ, {"PATH": "", **env}, clear=True)


def srun_installed():
    """Lightning warns that srun "is not used" only where it finds srun on the PATH."""
    return mock.patch("lightning.fabric.plugins.environments.slurm.shutil.which", return_value="/usr/bin/srun")


# --- the launches that are fine ---------------------------------------------------------------


def test_srun_one_node() -> None:
    assert detect_launch(STEP, devices=2, num_nodes=1) == Launch("srun", 2, 1, 1, 0, 2, 1)


def test_srun_two_nodes() -> None:
    assert detect_launch(two_node_step(), devices=1, num_nodes=2) == Launch("srun", 2, 1, 0, 1, 1, 2)
    assert detect_launch(two_node_step(2), devices=2, num_nodes=2) == Launch("srun", 4, 2, 0, 1, 2, 2)


def test_torchrun_inside_a_slurm_job_is_torchrun() -> None:
    env = {**two_node_step(), **TORCHRUN}
    assert detect_launch(env, devices=2, num_nodes=2) == Launch("torchrun", 4, 3, 1, 1, 2, 2)
    # Lightning too checks TorchElastic before SLURM; SLURMEnvironment.detect() alone would say yes.
    with lightning_sees(env):
        assert TorchElasticEnvironment.detect() and SLURMEnvironment.detect()
    assert not lightning_uses_slurm(env)


def test_plain_command_and_the_ranks_lightning_starts() -> None:
    assert detect_launch({}, devices=2, num_nodes=1) == Launch("plain", 2, 0, 0, 0, 2, 1)
    child = {"LOCAL_RANK": "1", "NODE_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    assert detect_launch(child, devices=2, num_nodes=1).global_rank == 1
    assert detect_launch({"NODE_RANK": "1"}, devices=2, num_nodes=2) == Launch("plain", 4, 2, 0, 1, 2, 2)


def test_pty_shell_is_a_plain_command_that_lightning_launches() -> None:
    """`srun --pty bash`: Lightning ignores Slurm (job name "bash") and starts the ranks itself."""
    assert detect_launch(PTY_BASH, devices=2, num_nodes=1).launcher == "plain"
    with lightning_sees(PTY_BASH), srun_installed(), pytest.warns(PossibleUserWarning, match="srun` command is"):
        assert not SLURMEnvironment.detect()


def test_single_process_in_a_batch_script() -> None:
    one_task = {**BATCH, "SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_TASKS_PER_NODE": "1"}
    assert detect_launch(one_task, devices=1, num_nodes=1).world_size == 1


def test_a_replica_group_of_two_forked_by_a_slurm_nodes_launcher_is_a_plain_run_of_two() -> None:
    """slurm/fault_tolerant.sbatch with --fault_tolerance.group_size 2: the node's launcher (an srun task) forks a
    group of 2 processes outside the step, its variables gone (app/cluster/ft_launch.py), with the group's own
    LOCAL_RANK, WORLD_SIZE and MASTER_PORT. Each is rank LOCAL_RANK of a plain run of 2, not a batch script
    that forgot srun; Lightning does not take it for a Slurm task either."""
    from app.cluster.ft_launch import SLURM_STEP_VARIABLES

    node_launcher = {**STEP, "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "1", "DDP_APP_FT_NODE_LAUNCHER": "1"}
    outside_the_step = {key: value for key, value in node_launcher.items() if key not in SLURM_STEP_VARIABLES}
    for local_rank in (0, 1):
        group = {**outside_the_step, "LOCAL_RANK": str(local_rank), "NODE_RANK": "0", "WORLD_SIZE": "2"}
        launch = detect_launch(group, devices=2, num_nodes=1)
        assert (launch.launcher, launch.world_size, launch.global_rank) == ("plain", 2, local_rank), launch
        assert not lightning_uses_slurm(group)
    # The batch script itself, with the same job but no launcher's LOCAL_RANK, is still refused.
    with pytest.raises(PreflightError, match=r"2 processes, but this Slurm job has one task"):
        detect_launch({**outside_the_step, "SLURM_NTASKS": "1"}, devices=2, num_nodes=1)


# --- the launches that stop, each with Lightning's own behaviour ------------------------------


def test_no_srun_in_a_batch_script_would_hang() -> None:
    with pytest.raises(PreflightError, match=r"has 2 tasks .* started without srun.*HINT: srun ddp-app"):
        detect_launch(BATCH, devices=2, num_nodes=1)
    # Lightning takes SLURM_NTASKS for srun: world size 2, and this lone rank 0 waits for rank 1.
    with lightning_sees(BATCH):
        assert SLURMEnvironment.detect()
        assert SLURMEnvironment().world_size() == 2
        SLURMEnvironment().validate_settings(num_devices=2, num_nodes=1)  # no complaint


def test_no_srun_with_one_task_but_two_devices() -> None:
    one_task = {**BATCH, "SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_TASKS_PER_NODE": "1"}
    with pytest.raises(PreflightError, match=r"2 processes, but this Slurm job has one task"):
        detect_launch(one_task, devices=2, num_nodes=1)


def test_ntasks_per_node_differs_from_devices() -> None:
    with pytest.raises(PreflightError, match=r"srun started 2 task\(s\) per node .* trainer.devices=1"):
        detect_launch(STEP, devices=1, num_nodes=1)
    with lightning_sees(STEP), pytest.raises(ValueError, match="does not match"):
        SLURMEnvironment().validate_settings(num_devices=1, num_nodes=1)


def test_one_task_from_an_unnamed_pty_shell_is_caught() -> None:
    """`srun -J dev --pty bash` + devices=2: Lightning would run world size 1 (Lightning #16730)."""
    shell = {**PTY_BASH, "SLURM_JOB_NAME": "dev"}
    with pytest.raises(PreflightError, match=r"srun started 1 task\(s\) per node .*--job-name=interactive"):
        detect_launch(shell, devices=2, num_nodes=1)
    with lightning_sees(shell):
        SLURMEnvironment().validate_settings(num_devices=2, num_nodes=1)  # Lightning lets it through


def test_nodes_differ_from_num_nodes() -> None:
    with pytest.raises(PreflightError, match=r"runs on 2 node\(s\) \(--nodes=2\) but trainer.num_nodes=1"):
        detect_launch(two_node_step(), devices=1, num_nodes=1)
    with lightning_sees(two_node_step()), pytest.raises(ValueError, match="num_nodes=1"):
        SLURMEnvironment().validate_settings(num_devices=1, num_nodes=1)


def test_ntasks_without_ntasks_per_node() -> None:
    env = {key: value for key, value in STEP.items() if key != "SLURM_NTASKS_PER_NODE"}
    with pytest.raises(PreflightError, match=r"--ntasks=2 was given without --ntasks-per-node"):
        detect_launch(env, devices=2, num_nodes=1)
    # Lightning refuses it too, but with a RuntimeError: a traceback, not a one-line error.
    with lightning_sees(env), pytest.raises(RuntimeError, match="--ntasks-per-node=2"):
        SLURMEnvironment()


def test_srun_inside_salloc_is_misread_by_lightning() -> None:
    """Lightning #20776: in a job named "interactive" Lightning ignores srun, and each task launches."""
    with pytest.raises(PreflightError, match=r"2 tasks in a job named 'interactive'.*--job-name=train"):
        detect_launch(SALLOC_SRUN, devices=2, num_nodes=1)
    # ... and warns that srun "is not used", inside srun.
    with lightning_sees(SALLOC_SRUN), srun_installed(), pytest.warns(PossibleUserWarning, match="srun` command is"):
        assert not SLURMEnvironment.detect()


def test_salloc_shell_is_not_a_node_of_the_allocation() -> None:
    with pytest.raises(PreflightError, match=r"shell of Slurm allocation 1 \(salloc\), on the submit host"):
        detect_launch(SALLOC_SHELL, devices=2, num_nodes=1)
    with pytest.raises(PreflightError, match="salloc"):
        detect_launch({**SALLOC_SHELL, "SLURM_NTASKS": "1"}, devices=1, num_nodes=1)


def test_multi_node_without_a_launcher() -> None:
    with pytest.raises(PreflightError, match=r"trainer.num_nodes=2 but nothing started this command"):
        detect_launch({}, devices=2, num_nodes=2)
    with pytest.raises(PreflightError, match="nothing started this command"):
        detect_launch(PTY_BASH, devices=2, num_nodes=2)


def test_torchrun_shape_differs_from_the_trainer() -> None:
    with pytest.raises(PreflightError, match=r"torchrun started 2 processes per node .* trainer.devices=4"):
        detect_launch(TORCHRUN, devices=4, num_nodes=1)
    # The nodes are torchrun's (--nnodes=MIN:MAX rounds differ): the launch carries its count, and
    # the CLI sets trainer.num_nodes from it (tests/fault/test_elastic_resume.py runs such a round).
    assert detect_launch(TORCHRUN, devices=2, num_nodes=1).num_nodes == 2
    with lightning_sees(TORCHRUN), pytest.raises(ValueError, match="does not match the world size"):
        TorchElasticEnvironment().validate_settings(num_devices=2, num_nodes=1)


# --- the rendezvous port ----------------------------------------------------------------------


def test_master_port_is_exported_for_lightnings_slurm_environment() -> None:
    env = dict(STEP)
    export_master_address(env)
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("node1", str(job_master_port("1")))
    # Lightning then reads ours instead of 15000 + job id % 10000.
    with lightning_sees(env):
        assert SLURMEnvironment().main_port == job_master_port("1")
        assert SLURMEnvironment().main_address == "node1"


def test_master_port_from_the_environment_wins() -> None:
    env = {**STEP, "MASTER_PORT": "29999"}
    export_master_address(env)
    assert env["MASTER_PORT"] == "29999"


@pytest.mark.parametrize("env", [{}, PTY_BASH, SALLOC_SRUN, {**STEP, **TORCHRUN}], ids=["plain", "pty", "salloc", "tr"])
def test_master_port_is_left_alone_where_lightning_does_not_use_slurm(env: dict[str, str]) -> None:
    exported = dict(env)
    export_master_address(exported)
    assert exported == env


# --- helpers ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("devices", "accelerator", "count"),
    [
        (2, "auto", 2),
        ("2", "cpu", 2),
        ([0, 1], "gpu", 2),
        ("0,1", "gpu", 2),
        ("auto", "cpu", 1),
        (-1, "cpu", os.cpu_count()),
    ],
)
def test_resolve_devices(devices: object, accelerator: str, count: int) -> None:
    assert resolve_devices(devices, accelerator) == count


def test_resolve_devices_unknown() -> None:
    assert resolve_devices("auto", object()) is None
    assert resolve_devices("auto", "tpu") is None


def test_tasks_per_node() -> None:
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("4") == [4]
    assert tasks_per_node("") == []


def test_preflight_reads_the_trainer_config_and_exports_the_port() -> None:
    env = dict(STEP)
    launch = preflight({"devices": 2, "num_nodes": 1, "accelerator": "cpu"}, env)
    assert launch == Launch("srun", 2, 1, 1, 0, 2, 1)
    assert env["MASTER_PORT"] == str(job_master_port("1"))
    assert preflight({"devices": "auto", "accelerator": object()}, dict(BATCH)) is None


def test_describe_launch() -> None:
    line = describe_launch(Launch("srun", 2, 0, 0, 0, 2, 1), SLURMEnvironment.__new__(SLURMEnvironment), STEP)
    assert line == "ddp-app: launched by srun: SLURMEnvironment, world size 2 = 1 node(s) x 2 process(es)"


def test_ddp_app_stops_in_one_line_before_any_process_group(tmp_path: Path) -> None:
    """The CLI hook: every rank prints one `ddp-app: error:` line and exits 2, without a traceback."""
    args = ("fit", "--config", "configs/digits.yaml", f"--trainer.default_root_dir={tmp_path}")
    result = ddp_app(*args, env=clean_env(**BATCH), timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("ddp-app: error: job 1 has 2 tasks"), result.stderr
    assert "Traceback" not in result.stderr
    assert "Initializing distributed: GLOBAL_RANK" not in result.stdout + result.stderr


@pytest.mark.parametrize(
    ("env", "launched"),
    [
        ({}, False),
        ({"LOCAL_RANK": "1"}, True),
        ({"TORCHELASTIC_RUN_ID": "x"}, True),
        ({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_JOB_NAME": "train"}, True),
        ({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_JOB_NAME": "interactive"}, False),
        ({"SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "train"}, False),  # the batch script itself
    ],
)
def test_a_rank_that_was_started_runs_as_it_is(env: dict[str, str], launched: bool) -> None:
    assert already_launched(env) is launched
