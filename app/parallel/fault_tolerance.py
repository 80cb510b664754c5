"""Per-step fault tolerance across replica groups (torchft): the `fault_tolerance:` config section and its plan.

With `fault_tolerance.enabled: true`, the ranks of a run form replica groups of `group_size`
processes. Each group trains on its own shard of the data; after every backward pass the groups
average their gradients through torchft's Manager, and a lighthouse forms the quorum of groups at
each step. A group that dies drops out of the next quorum and the others continue without it (a
step with a group missing averages over the groups present); when the launcher starts it again,
it receives the model, optimizer and ddp-app's own state (step, data position, random state) live
from a healthy peer, and rejoins. docs/fault_tolerance.md tells the whole story.

This module imports nothing of torchft: it is the config class (a Lightning callback whose hooks
app/parallel/ft_manager.py implements) and the plan's validation, which runs in the launcher before
any rank exists. Everything that talks to torchft is in app/parallel/ft_manager.py (the ranks) and
app/cluster/ft_launch.py (the lighthouse and the groups' processes).
"""

from __future__ import annotations

import importlib.util
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import lightning as L

from app.errors import UserFacingError

# What ddp-app's launcher gives each group's process (app/cluster/ft_launch.py): its group's index,
# the number of groups, and the lighthouse's address.
GROUP_VARIABLE = "DDP_APP_FT_GROUP"
GROUPS_VARIABLE = "DDP_APP_FT_GROUPS"
LIGHTHOUSE_VARIABLE = "DDP_APP_FT_LIGHTHOUSE"
STORY_VARIABLE = "DDP_APP_FT_STORY"  # the directory of each group's per-step record (JSON lines)
# The port of the group's torchft store (a TCPStore its rank 0 serves): not MASTER_PORT, which the group's own
# process group (Lightning's DDP within a group of several processes) uses.
STORE_PORT_VARIABLE = "DDP_APP_FT_STORE_PORT"
# Given to the groups the launcher starts first (not to a restarted one): a directory where each group
# says it is ready, so that the first quorum waits for every group instead of forming with the first
# one that got there (which would train its first steps alone).
START_VARIABLE = "DDP_APP_FT_START"
SBATCH_HINT = "sbatch slurm/fault_tolerant.sbatch CONFIG --trainer.num_nodes N (docs/fault_tolerance.md)"

INSTALL_HINT = "pip install -c constraints.txt -e '.[ft]' (or: pip install 'torchft>=0.2.0,<0.3')"


class FaultTolerance(L.Callback):
    """The `fault_tolerance:` section of a `ddp-app` config (docs/fault_tolerance.md).

    Args:
        enabled: train in replica groups that survive each other's failures (torchft); off by default.
        group_size: processes per replica group: on one machine, `--trainer.devices 3
            --fault_tolerance.group_size 1` is three groups of one process, `--trainer.devices 4
            --fault_tolerance.group_size 2` two groups of two (DDP within a group, torchft across groups).
        min_replicas: the fewest groups a step may commit with; a step with fewer is not applied
            (its gradients are dropped) and the groups wait for the next quorum.
        lighthouse: the address of a running torchft lighthouse (`http://host:port`); unset, ddp-app's
            launcher starts one beside the groups and stops it at the end. On several Slurm nodes
            slurm/fault_tolerant.sbatch starts one on the first node and gives its address.
        timeout_s: how long a group waits for the others in a gradient all-reduce, a commit decision
            or a state transfer before it gives up on this step (a dead peer is usually seen at once,
            from its closed connection; this bounds a peer that hangs).
        quorum_timeout_s: how long a group waits for a quorum (at the start: for `min_replicas` groups).
        heartbeat_timeout_s: the lighthouse drops a group from the next quorum after this long without
            its heartbeat (sent every 0.1 s): the time the others need to notice a dead group.
        join_timeout_s: how long the lighthouse waits for a live group that has not asked for the next
            quorum yet before it forms the quorum without it.
        group_restarts: how many times ddp-app's launcher starts a dead group's processes again.
    """

    def __init__(
        self,
        enabled: bool = False,
        group_size: int = 1,
        min_replicas: int = 1,
        lighthouse: str | None = None,
        timeout_s: float = 10.0,
        quorum_timeout_s: float = 60.0,
        heartbeat_timeout_s: float = 2.0,
        join_timeout_s: float = 2.0,
        group_restarts: int = 3,
    ) -> None:
        super().__init__()
        self.enabled = enabled
        self.group_size = group_size
        self.min_replicas = min_replicas
        self.lighthouse = lighthouse
        self.timeout_s = timeout_s
        self.quorum_timeout_s = quorum_timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.join_timeout_s = join_timeout_s
        self.group_restarts = group_restarts
        self.runtime: Any = None  # app/parallel/ft_manager.py's GroupRuntime, in a group's process

    # The hooks: app/parallel/ft_manager.py does the work (imported only where torchft runs).
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.runtime is not None:
            self.runtime.on_train_start(trainer, pl_module)

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.runtime is not None:
            self.runtime.after_backward(trainer, pl_module)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self.runtime is not None:
            self.runtime.commit_or_drop(trainer, pl_module, optimizer)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.runtime is not None:
            self.runtime.on_train_batch_end(trainer, pl_module)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.runtime is not None and stage == "fit":
            self.runtime.shutdown()


@dataclass(frozen=True)
class FaultTolerancePlan:
    """Fault tolerance as the plan decides it. In the launcher `group` is None; in a group's process
    it is that group's index (0 .. groups - 1), which is also the shard of the data it reads."""

    groups: int
    group_size: int
    min_replicas: int
    lighthouse: str | None  # None in the launcher: it starts one
    group: int | None = None
    # The groups this launcher starts: on one machine all of them; on a Slurm node (one launcher per
    # node) that node's, `first_group` = node index x groups per node.
    first_group: int = 0
    local_groups: int | None = None  # None: every group

    def groups_here(self) -> range:
        """The indices of the groups this launcher starts and restarts."""
        count = self.groups if self.local_groups is None else self.local_groups
        return range(self.first_group, self.first_group + count)

    def describe(self) -> str:
        where = f"lighthouse {self.lighthouse}" if self.lighthouse else "lighthouse started by ddp-app"
        who = f"; this is group {self.group}" if self.group is not None else ""
        return (
            f"{self.groups} replica group(s) of {self.group_size} process(es), at least {self.min_replicas} "
            f"per step, {where}{who}"
        )


def plan_fault_tolerance(
    section: Any,
    strategy_kind: str,
    launcher: str | None,
    world_size: int | None,
    env: Mapping[str, str],
    node_rank: int = 0,
    num_nodes: int = 1,
    node_launcher: bool = False,
) -> FaultTolerancePlan | None:
    """The `fault_tolerance:` section checked and decided, or None when it is off. In the launcher
    (no group variable) bad input stops here in one line: torchft missing, a group size that does
    not divide the ranks, a strategy or launch it cannot serve, a lighthouse that does not answer.
    `node_launcher`: this is slurm/fault_tolerant.sbatch's one task on node `node_rank` of `num_nodes`,
    which starts that node's groups."""
    if section is None or not _get(section, "enabled"):
        if node_launcher and launcher == "srun":  # fault_tolerant.sbatch with the groups turned off
            raise UserFacingError(
                "DDP_APP_FT_NODE_LAUNCHER=1 (slurm/fault_tolerant.sbatch) makes each node's ddp-app the launcher of "
                "its replica groups, but fault_tolerance.enabled is false. Fix: --fault_tolerance.enabled true, or "
                "sbatch slurm/multinode.sbatch for a run without fault tolerance."
            )
        return None
    if not _importable("torchft"):
        raise UserFacingError(
            f"fault_tolerance.enabled: true needs torchft, which is not installed. Fix: {INSTALL_HINT}."
        )
    group_size = int(_get(section, "group_size") or 1)
    min_replicas = int(_get(section, "min_replicas") or 1)
    lighthouse = _get(section, "lighthouse")
    if GROUP_VARIABLE in env:  # a group's process, started by the launcher that checked all of this
        return FaultTolerancePlan(
            groups=int(env[GROUPS_VARIABLE]),
            group_size=group_size,
            min_replicas=min_replicas,
            lighthouse=env[LIGHTHOUSE_VARIABLE],
            group=int(env[GROUP_VARIABLE]),
        )
    if strategy_kind == "fsdp" and group_size == 1:
        raise UserFacingError(
            "fault_tolerance.enabled: true with trainer.strategy fsdp and fault_tolerance.group_size 1: a group of one "
            "process has nothing to shard with. Fix: --fault_tolerance.group_size 2 or more (sharded within a group, "
            "HSDP), or --trainer.strategy ddp."
        )
    if strategy_kind not in ("ddp", "fsdp"):
        raise UserFacingError(
            f"fault_tolerance.enabled: true with trainer.strategy of kind {strategy_kind}: fault tolerance averages "
            "gradients across replica groups as DDP does, and serves DDP and FSDP (sharded within a group) only. "
            "Fix: --trainer.strategy ddp, or --fault_tolerance.enabled false."
        )
    node_launcher = node_launcher and launcher == "srun"
    if launcher == "srun" and not node_launcher:
        raise UserFacingError(
            "fault_tolerance.enabled: true under srun with one task per rank: ddp-app's own launcher on each node "
            "starts that node's replica groups and starts a dead one again, so srun must start one ddp-app per node. "
            f"Fix: {SBATCH_HINT}, which runs `srun --ntasks-per-node=1` with DDP_APP_FT_NODE_LAUNCHER=1."
        )
    if launcher not in (None, "plain", "srun"):
        raise UserFacingError(
            f"fault_tolerance.enabled: true under {launcher}: ddp-app's own launcher starts the replica groups and "
            f"starts a dead one again. Fix: {SBATCH_HINT} on a Slurm cluster, or `ddp-app fit ...` without torchrun on "
            "one machine."
        )
    if node_launcher and not lighthouse:
        raise UserFacingError(
            "fault_tolerance.enabled: true on several Slurm nodes needs the address of the lighthouse every node's "
            f"groups meet at. Fix: {SBATCH_HINT} starts one and passes --fault_tolerance.lighthouse http://HOST:PORT."
        )
    ranks = world_size or 1
    if group_size < 1 or ranks % group_size:
        raise UserFacingError(
            f"fault_tolerance.group_size={group_size} does not divide the run's {ranks} process(es) "
            "(trainer.devices x trainer.num_nodes). Fix: a group size that divides them, such as 1."
        )
    node_processes = ranks // max(num_nodes, 1)
    if group_size != 1 and node_processes % group_size:
        raise UserFacingError(
            f"fault_tolerance.group_size={group_size} does not divide the {node_processes} process(es) of a node "
            "(trainer.devices): a replica group lives on one node. Fix: a group size that divides trainer.devices."
        )
    groups = ranks // group_size
    if groups < 2:
        raise UserFacingError(
            f"fault_tolerance.enabled: true with {ranks} process(es) in groups of {group_size}: {groups} group, "
            "and fault tolerance needs at least 2. Fix: --trainer.devices 2 or more, or "
            "--fault_tolerance.enabled false."
        )
    if not 1 <= min_replicas <= groups:
        raise UserFacingError(
            f"fault_tolerance.min_replicas={min_replicas}: it must be between 1 and the run's {groups} groups. "
            f"Fix: --fault_tolerance.min_replicas 1 (continue while any group lives) up to {groups}."
        )
    for key in ("timeout_s", "quorum_timeout_s", "heartbeat_timeout_s", "join_timeout_s"):
        if float(_get(section, key)) <= 0:
            raise UserFacingError(
                f"fault_tolerance.{key}={_get(section, key)}: it must be positive. Fix: leave it unset."
            )
    if lighthouse:
        check_lighthouse_answers(str(lighthouse))
    address = str(lighthouse) if lighthouse else None
    if not node_launcher:
        return FaultTolerancePlan(groups, group_size, min_replicas, address)
    per_node = groups // num_nodes  # the launch was checked: the same processes on every node
    return FaultTolerancePlan(groups, group_size, min_replicas, address, None, node_rank * per_node, per_node)


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a finder that refuses it, as an import would
        return False


def check_lighthouse_answers(address: str, timeout_s: float = 3.0) -> None:
    """A lighthouse address that no process answers on is refused before any group starts."""
    parsed = urlparse(address if "://" in address else f"http://{address}")
    if parsed.hostname is None or parsed.port is None:
        raise UserFacingError(
            f"fault_tolerance.lighthouse={address!r} is not an address. Fix: http://HOST:PORT of a running "
            "torchft lighthouse, or leave it unset and ddp-app starts one."
        )
    try:
        with socket.create_connection((parsed.hostname, parsed.port), timeout=timeout_s):
            pass
    except OSError as error:
        raise UserFacingError(
            f"fault_tolerance.lighthouse {address} does not answer ({error.strerror or error}). Fix: start it "
            "(torchft_lighthouse --min_replicas 1 --bind [::]:PORT) or leave fault_tolerance.lighthouse unset "
            "and ddp-app starts one."
        ) from None


def training_shard(world_size: int, rank: int, env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """The (number of shards, shard) a training sampler reads: in a replica group's process, its rank
    among every group's ranks (each group its own shard, at the same step as the others); else as given."""
    env = os.environ if env is None else env
    if GROUP_VARIABLE not in env:
        return world_size, rank
    return int(env[GROUPS_VARIABLE]) * world_size, int(env[GROUP_VARIABLE]) * world_size + rank


def _get(container: Any, key: str) -> Any:
    if isinstance(container, Mapping):
        return container.get(key)
    getter = getattr(container, "get", None)
    return getter(key) if callable(getter) else getattr(container, key, None)
