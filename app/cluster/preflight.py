"""Which launcher started this process, and whether it agrees with the Trainer, checked before any process group exists
(one line instead of a hang).

    srun      a Slurm job step (SLURM_STEP_ID is set): one task per rank, Lightning's SLURMEnvironment
    torchrun  TorchElastic's variables are set: torchrun started the ranks (Lightning checks it first)
    plain     anything else: Lightning starts ranks 1..devices-1 itself by running the command again

Lightning decides "srun was used" from SLURM_NTASKS, which a batch script or salloc shell also has (the run then waits
until the time limit). Only srun sets SLURM_STEP_ID."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from app.cluster.slurm_env import master_address_and_port
from app.errors import InvalidConfigError

# Job names for which Lightning ignores Slurm and starts the ranks itself (its "interactive mode"); salloc names its
# jobs "interactive" and `srun --pty bash` names them "bash".
INTERACTIVE_JOB_NAMES = ("bash", "interactive")

TORCHRUN_VARIABLES = ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
# Set by slurm/fault_tolerant.sbatch for its `srun --ntasks-per-node=1 ddp-app fit ...`: this Slurm task is
# ddp-app's launcher of its node's replica groups (app/parallel/fault_tolerance.py), not a rank.
NODE_LAUNCHER_VARIABLE = "DDP_APP_FT_NODE_LAUNCHER"  # named in app/parallel/fault_tolerance.py's messages


class PreflightError(InvalidConfigError):
    """The launch and the Trainer's devices/num_nodes disagree, or training would hang."""


@dataclass(frozen=True)
class Launch:
    """How this process was started, as seen before any process group exists."""

    launcher: str  # "srun", "torchrun" or "plain"
    world_size: int
    global_rank: int
    local_rank: int
    node_rank: int
    devices: int  # processes per node
    num_nodes: int


def ranks(env: Mapping[str, str], *names: str) -> list[int]:
    """The launcher's rank variables `names`, each 0 where it is not set."""
    return [int(env.get(name, "0")) for name in names]


def visible_gpus() -> int:
    """CUDA devices this process sees, counted through NVML where it can be, without initialising CUDA: `ddp-app` forks
    its ranks after this check, and CUDA does not survive a fork."""
    import torch

    return torch.cuda.device_count()


def on_gpu(trainer_config: Mapping[str, Any]) -> bool:
    """Whether the Trainer will run on GPUs: accelerator gpu/cuda, or auto with a GPU visible."""
    accelerator = trainer_config.get("accelerator", "auto")
    name = accelerator.lower() if isinstance(accelerator, str) else None
    return name in ("gpu", "cuda") or (name in ("auto", None) and visible_gpus() > 0)


def devices_as_written_count(devices: Any) -> int | None:
    """`trainer.devices` when it is written as a number (2, "2", -1, "-1"); None for a list, "0,1" or "auto"."""
    if isinstance(devices, bool):
        return None
    if isinstance(devices, int):
        return devices
    if isinstance(devices, str) and re.fullmatch(r"-?\d+", devices.strip()):
        return int(devices)
    return None


def resolve_devices(devices: Any, accelerator: Any = "auto") -> int | None:
    """The processes per node that Trainer(devices=...) means (the one place that decides it); None if it cannot be told
    here.

    On GPUs: a count, a list or "0,1", and "auto" or -1 for every visible GPU. On CPU a list means that many processes,
    "auto" one, -1 one per core."""
    if isinstance(devices, (list, tuple)):
        return len(devices)
    text = str(devices).strip()
    if "," in text:  # "0,1" names GPU indices
        return len([part for part in text.split(",") if part.strip()])
    count = devices_as_written_count(devices)
    if count is not None and count >= 0:
        return count
    if text not in ("auto", "-1"):
        return None
    name = str(accelerator).lower() if isinstance(accelerator, str) else None
    if name not in ("auto", "cpu", "gpu", "cuda"):
        return None  # a custom accelerator object: only the Trainer knows
    if name != "cpu" and visible_gpus() > 0:
        return visible_gpus()
    if name in ("gpu", "cuda"):
        return None  # no GPU: check_config says so in one line
    return 1 if text == "auto" else os.cpu_count() or 1


def tasks_per_node(value: str) -> list[int]:
    """Expand Slurm's SLURM_TASKS_PER_NODE format: "2(x3),1" -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for count, repeat in re.findall(r"(\d+)(?:\(x(\d+)\))?", value):
        counts.extend([int(count)] * int(repeat or 1))
    return counts


def is_torchrun(env: Mapping[str, str]) -> bool:
    """torchrun (TorchElastic) started this process; Lightning's TorchElasticEnvironment.detect."""
    return "TORCHELASTIC_RUN_ID" in env or all(name in env for name in TORCHRUN_VARIABLES)


def already_launched(env: Mapping[str, str]) -> bool:
    """This process is one rank of a job that torchrun, srun (a batch job step) or a launcher started: it runs as it is.
    Not so in an interactive `srun --pty bash` or salloc shell, where Lightning ignores Slurm and ddp-app starts the
    ranks."""
    in_slurm_step = "SLURM_STEP_ID" in env and env.get("SLURM_JOB_NAME") not in INTERACTIVE_JOB_NAMES
    return "LOCAL_RANK" in env or is_torchrun(env) or in_slurm_step


def is_node_launcher(env: Mapping[str, str]) -> bool:
    """This process is slurm/fault_tolerant.sbatch's srun task: the launcher of its node's replica groups, not a
    rank. (A group it forks has neither variable: app/cluster/ft_launch.py removes them.)"""
    return NODE_LAUNCHER_VARIABLE in env and "SLURM_STEP_ID" in env


def lightning_uses_slurm(env: Mapping[str, str]) -> bool:
    """Lightning will pick its SLURMEnvironment (and read MASTER_PORT): SLURM_NTASKS set, no torchrun, not a job name of
    its interactive mode. Mirrors lightning.fabric's `_is_srun_used`."""
    return not is_torchrun(env) and "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in INTERACTIVE_JOB_NAMES


def detect_launch(env: Mapping[str, str], devices: int, num_nodes: int) -> Launch:
    """Name the launcher and check it against devices x num_nodes; raises PreflightError."""
    if is_torchrun(env):
        return _torchrun_launch(env, devices, num_nodes)
    if "SLURM_JOB_ID" in env and "SLURM_STEP_ID" in env:
        if env.get("SLURM_JOB_NAME") in INTERACTIVE_JOB_NAMES:
            return _interactive_step_launch(env, devices, num_nodes)
        return _srun_launch(env, devices, num_nodes)
    if "SLURM_JOB_ID" in env and "LOCAL_RANK" not in env:
        # The batch script or salloc's shell. A process with LOCAL_RANK was started by a launcher that checked
        # already: Lightning's or ddp-app's rank 0, or a node's launcher of replica groups (fault_tolerant.sbatch),
        # whose groups run outside the Slurm step as plain runs on that node.
        _refuse_slurm_job_without_srun(env, devices, num_nodes)
    return _plain_launch(env, devices, num_nodes)


def _torchrun_launch(env: Mapping[str, str], devices: int, num_nodes: int) -> Launch:
    world_size = int(env.get("WORLD_SIZE", "1"))
    per_node = int(env.get("LOCAL_WORLD_SIZE", str(world_size)))
    if per_node != devices:
        raise PreflightError(
            f"torchrun started {per_node} processes per node (--nproc-per-node={per_node}) but trainer.devices="
            f"{devices}. HINT: torchrun --nproc-per-node={devices} ..., or --trainer.devices {per_node}."
        )
    # The nodes of this round are torchrun's to decide: with --nnodes=MIN:MAX (elastic) a restart round may have more or
    # fewer than trainer.num_nodes says. Nothing can hang on it (every rank reads WORLD_SIZE from torchrun), so the
    # Trainer follows torchrun (app.cli says so in one line) and the run continues elastically (docs/resume.md).
    nodes = world_size // max(per_node, 1)
    return Launch("torchrun", world_size, *ranks(env, "RANK", "LOCAL_RANK", "GROUP_RANK"), devices, nodes)


def _srun_launch(env: Mapping[str, str], devices: int, num_nodes: int) -> Launch:
    if NODE_LAUNCHER_VARIABLE in env:  # slurm/fault_tolerant.sbatch: one ddp-app per node starts its groups
        return _srun_node_launchers(env, devices, num_nodes)
    ntasks = int(env.get("SLURM_NTASKS", "1"))
    declared = env.get("SLURM_NTASKS_PER_NODE")
    if ntasks > 1 and declared is None:
        # Lightning's SLURMEnvironment raises a RuntimeError (a traceback) for the same case.
        raise PreflightError(
            f"--ntasks={ntasks} was given without --ntasks-per-node, so it is not known how many ranks run on"
            f" each node. HINT: use --ntasks-per-node={devices} (and --nodes={num_nodes}) instead of --ntasks."
        )
    step_counts = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "")
    counts = [int(declared)] if declared is not None else []
    counts += step_counts
    wrong = next((count for count in counts if count != devices), None)
    if wrong is not None:
        raise PreflightError(
            f"srun started {wrong} task(s) per node (--ntasks-per-node={wrong}) but trainer.devices={devices};"
            f" under srun Lightning starts no processes of its own, so the two must match. HINT: --ntasks-per-node="
            f"{devices}, or --trainer.devices {wrong} (in an interactive `srun --pty` shell: --job-name=interactive,"
            f" and Lightning starts the {devices} processes itself)."
        )
    nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or "1")
    if nodes != num_nodes and int(env.get("SLURM_RESTART_COUNT") or 0) > 0:
        # A requeued job that the scheduler started on another number of nodes: the config was accepted on the first
        # start, so the allocation decides now and the run continues elastically (app.cli says so in one line;
        # docs/resume.md). A first start still has to match.
        num_nodes = nodes
    if nodes != num_nodes:
        raise PreflightError(
            f"the job step runs on {nodes} node(s) (--nodes={nodes}) but trainer.num_nodes={num_nodes}."
            f" HINT: --nodes={num_nodes}, or --trainer.num_nodes {nodes}."
        )
    return Launch("srun", ntasks, *ranks(env, "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID"), devices, num_nodes)


def _srun_node_launchers(env: Mapping[str, str], devices: int, num_nodes: int) -> Launch:
    """srun started ddp-app's launcher once per node (fault tolerance, docs/fault_tolerance.md): each starts
    the `devices` processes of its node itself, so a node has one task, whatever `devices` is."""
    counts = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "")
    declared = env.get("SLURM_NTASKS_PER_NODE")
    wrong = next((count for count in [*counts, *([int(declared)] if declared else [])] if count != 1), None)
    if wrong is not None:
        raise PreflightError(
            f"srun started {wrong} task(s) per node with {NODE_LAUNCHER_VARIABLE} set: it marks the one ddp-app per"
            f" node that starts that node's {devices} replica group process(es). HINT: srun --ntasks-per-node=1"
            " (as slurm/fault_tolerant.sbatch does)."
        )
    nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or "1")
    if nodes != num_nodes:
        raise PreflightError(
            f"the job step runs on {nodes} node(s) (--nodes={nodes}) but trainer.num_nodes={num_nodes}."
            f" HINT: --nodes={num_nodes}, or --trainer.num_nodes {nodes}."
        )
    node = int(env.get("SLURM_NODEID", "0"))
    return Launch("srun", devices * num_nodes, node * devices, 0, node, devices, num_nodes)


def _interactive_step_launch(env: Mapping[str, str], devices: int, num_nodes: int) -> Launch:
    """A job step whose job is named "interactive" or "bash": Lightning ignores Slurm here."""
    name, ntasks = env["SLURM_JOB_NAME"], int(env.get("SLURM_NTASKS", "1"))
    if ntasks > 1:
        # Lightning issue #20776: every task would start its own `devices` processes, on its own port.
        raise PreflightError(
            f"srun started {ntasks} tasks in a job named {name!r} (salloc's and `srun --pty bash`'s default),"
            f" and Lightning ignores srun in jobs of that name: each task would start its own {devices}"
            f" processes (Lightning issue #20776). HINT: srun --job-name=train ..., or salloc --job-name=train."
        )
    # `srun --pty bash`: one task, an interactive shell on a compute node; Lightning starts the ranks.
    return _plain_launch(env, devices, num_nodes)


def _refuse_slurm_job_without_srun(env: Mapping[str, str], devices: int, num_nodes: int) -> None:
    """Inside a Slurm job but not a job step: the batch script itself, or salloc's shell."""
    ntasks = int(env.get("SLURM_NTASKS", "1"))
    job = env["SLURM_JOB_ID"]
    if "SLURMD_NODENAME" not in env:
        # salloc runs its shell on the submit host, outside the nodes it allocated.
        nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "?"
        raise PreflightError(
            f"this is the shell of Slurm allocation {job} (salloc), on the submit host and not on its nodes"
            f" ({nodes}); nothing here starts one process per task. HINT: srun --job-name=train --nodes={num_nodes}"
            f" --ntasks-per-node={devices} ddp-app ... (in a job named 'interactive' Lightning ignores srun)."
        )
    if ntasks > 1:
        raise PreflightError(
            f"job {job} has {ntasks} tasks (SLURM_NTASKS={ntasks}) but ddp-app was started without srun: one"
            f" process would wait at 'Initializing distributed ... MEMBER: 1/{ntasks}' for the other"
            f" {ntasks - 1} until the time limit. HINT: srun ddp-app fit ... (see slurm/train.sbatch)."
        )
    if devices * num_nodes > 1:
        raise PreflightError(
            f"trainer.devices x trainer.num_nodes = {devices * num_nodes} processes, but this Slurm job has one"
            f" task and ddp-app was started without srun. HINT: #SBATCH --nodes={num_nodes}"
            f" --ntasks-per-node={devices} and srun ddp-app fit ... (see slurm/train.sbatch)."
        )


def _plain_launch(env: Mapping[str, str], devices: int, num_nodes: int) -> Launch:
    if num_nodes > 1 and "NODE_RANK" not in env:
        raise PreflightError(
            f"trainer.num_nodes={num_nodes} but nothing started this command on the other nodes (no srun,"
            f" no torchrun, no NODE_RANK): rank 0 would wait for them forever. HINT: sbatch slurm/multinode.sbatch,"
            f" or torchrun --nnodes={num_nodes}, or set NODE_RANK, MASTER_ADDR and MASTER_PORT on every node."
        )
    # Ranks >= 1 that Lightning started itself carry LOCAL_RANK and NODE_RANK.
    local_rank, node_rank = ranks(env, "LOCAL_RANK", "NODE_RANK")
    return Launch(
        "plain", devices * num_nodes, node_rank * devices + local_rank, local_rank, node_rank, devices, num_nodes
    )


def fresh_store_for_this_round(env: MutableMapping[str, str], timeout_s: float) -> None:
    """Under torchrun, give every round of the worker group a rendezvous store of its own.

    torchrun's agent keeps its TCPStore across restarts and gloo files its keys under "default_pg", so restarted ranks
    would read the dead round's addresses. Global rank 0 serves a new store on a port it holds from the moment it is
    picked (app/cluster/rendezvous.py) and publishes that port under a fresh random tag in the agent's store; every rank
    waits for a tag it has not met under yet (TORCHELASTIC_RESTART_COUNT differs between nodes, so it cannot name the
    round) and connects to the new store as a client, rank 0 too (TORCHELASTIC_USE_AGENT_STORE stays "True").
    MASTER_PORT changes for this process only."""
    if not is_torchrun(env) or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    import datetime
    import secrets
    import time

    from torch.distributed import TCPStore

    from app.cluster.rendezvous import serve_fresh_store

    agent_store = TCPStore(
        env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
    )
    prefix = f"ddp-app/{env.get('TORCHELASTIC_RUN_ID', '')}"
    rank = env.get("RANK", "0")
    if rank == "0":
        port = serve_fresh_store(timeout_s)
        tag = secrets.token_hex(8)
        agent_store.set(f"{prefix}/store", f"{tag} {port}")
    else:
        met_under = f"{prefix}/rank-{rank}/met-under"
        previous = agent_store.get(met_under).decode() if agent_store.check([met_under]) else None
        deadline = time.monotonic() + timeout_s
        while True:
            tag, port_text = agent_store.get(f"{prefix}/store").decode().split()  # waits for a first rank 0
            if tag != previous:
                break
            if time.monotonic() > deadline:
                raise PreflightError(
                    f"rank {rank}: global rank 0 published no rendezvous for this round within {timeout_s:.0f} s"
                    " (collective_timeout_s). Fix: check that rank 0 runs; its own output says why not."
                )
            time.sleep(0.05)  # the previous round's: rank 0 of this one has not started yet
        agent_store.set(met_under, tag)
        port = int(port_text)
    env["MASTER_PORT"] = str(port)


def export_master_address(env: MutableMapping[str, str]) -> None:
    """Give Lightning's SLURMEnvironment our per-job MASTER_ADDR and MASTER_PORT (`job_master_port`) before it reads
    them; a MASTER_PORT already set wins."""
    if lightning_uses_slurm(env) and (env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")):
        address, port = master_address_and_port(dict(env))
        env["MASTER_ADDR"], env["MASTER_PORT"] = address, str(port)


def describe_launch(
    launch: Launch, cluster_environment: object, env: Mapping[str, str] | None = None, mesh: str | None = None
) -> str:
    """One line for the log: who started the ranks, which environment Lightning chose, and where they meet (and, under
    strategy fsdp, `mesh`: how the ranks shard the model, "2 replicas x 2 shards")."""
    env = os.environ if env is None else env
    meeting = f", rendezvous {env['MASTER_ADDR']}:{env['MASTER_PORT']}" if "MASTER_PORT" in env else ""
    how = "as a plain command" if launch.launcher == "plain" else f"by {launch.launcher}"
    sharded = f", sharded as {mesh}" if mesh else ""
    return (
        f"ddp-app: launched {how}: {type(cluster_environment).__name__}, world size"
        f" {launch.world_size} = {launch.num_nodes} node(s) x {launch.devices} process(es){sharded}{meeting}"
    )


def preflight(trainer_config: Mapping[str, Any], env: MutableMapping[str, str] | None = None) -> Launch | None:
    """Check the launch against the Trainer's devices/num_nodes and export the rendezvous address; None (nothing
    checked) when `devices` cannot be resolved before the Trainer exists."""
    env = os.environ if env is None else env
    devices = resolve_devices(trainer_config.get("devices", "auto"), trainer_config.get("accelerator", "auto"))
    num_nodes = int(trainer_config.get("num_nodes") or 1)
    if devices is None:
        return None
    launch = detect_launch(env, devices, num_nodes)
    export_master_address(env)
    return launch
