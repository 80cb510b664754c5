"""ddp-app's launcher for a fault-tolerant run: the lighthouse, the processes of every replica group,
and a dead group started again while the others keep training (docs/fault_tolerance.md).

Unlike a plain launch (app/cluster/launch.py), one group's death does not stop the others: its
processes are forked again (up to `fault_tolerance.group_restarts` times per group) with the same
command line and process names (`ddp-app rank N`, N = group x group_size + its rank in the group),
and it rejoins from a peer's memory. A group whose one process fails restarts whole: the launcher
kills its other processes, which would wait for the dead one in the group's own collectives. Each
group is a run of `group_size` processes to Lightning: its own MASTER_PORT and torchft store port,
`devices=group_size` (one process: strategy `auto`; several: the config's, DDP or FSDP within the
group); group 0 writes the run's logs and checkpoints in `trainer.default_root_dir`,
group N > 0 its checkpoints in `<default_root_dir>/fault_tolerance/group_N` (without a logger),
and every group a line per step in `<default_root_dir>/fault_tolerance/group_N.jsonl`.

On a Slurm cluster (slurm/fault_tolerant.sbatch) srun starts this launcher once per node, with the
lighthouse's address: each starts and restarts its node's groups only (`FaultTolerancePlan.groups_here`),
and each group's store listens on the node's host name, which the other nodes' groups reach.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from app.cluster.exit_codes import STOP_EXIT_CODES
from app.cluster.launch import (
    LAUNCHER_SIGNALS,
    _rank_main,
    describe_exit,
    ended_children,
    with_ckpt_path_last,
    worth_a_restart,
)
from app.cluster.preflight import NODE_LAUNCHER_VARIABLE, visible_gpus
from app.cluster.rendezvous import held_ports_variables, hold_free_port
from app.errors import UserFacingError
from app.parallel.fault_tolerance import (
    GROUP_VARIABLE,
    GROUPS_VARIABLE,
    LIGHTHOUSE_VARIABLE,
    START_VARIABLE,
    STORE_PORT_VARIABLE,
    STORY_VARIABLE,
    FaultTolerance,
    FaultTolerancePlan,
)

STORY_DIRECTORY = "fault_tolerance"


# After a dead group's heartbeat timeout, before it starts again: the lighthouse checks heartbeats every 0.1 s.
RESTART_MARGIN_S = 0.5


def group_arguments(args: list[str], group: int, run_dir: Path, group_size: int = 1) -> list[str]:
    """A group's command line: a run of `group_size` processes to Lightning (one: strategy `auto`; more: the
    config's strategy within the group); groups other than 0 keep their checkpoints apart."""
    own = [f"--trainer.devices={group_size}", "--trainer.num_nodes=1"]
    own += ["--trainer.strategy=auto"] if group_size == 1 else []
    if group:
        own += [f"--trainer.default_root_dir={run_dir / STORY_DIRECTORY / f'group_{group}'}", "--trainer.logger=false"]
    return [*args, *own]


def start_lighthouse(plan: FaultTolerancePlan, settings: FaultTolerance) -> tuple[subprocess.Popen, str]:
    """The lighthouse in a process of its own (app/cluster/lighthouse.py); returns it and its address."""
    command = [
        sys.executable, "-m", "app.cluster.lighthouse",
        "--min_replicas", str(plan.min_replicas),
        "--join_timeout_ms", str(int(settings.join_timeout_s * 1000)),
        "--heartbeat_timeout_ms", str(int(settings.heartbeat_timeout_s * 1000)),
    ]  # fmt: skip
    env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert process.stdout is not None
    address = process.stdout.readline().strip()
    if not address:
        process.kill()
        raise UserFacingError(
            f"the torchft lighthouse did not start (exit code {process.wait()}). Fix: check that torchft imports "
            "(python -c 'import torchft'), or run one yourself and give --fault_tolerance.lighthouse http://HOST:PORT."
        )
    return process, address


def group_gpus(visible: list[str], plan: FaultTolerancePlan, group: int) -> str | None:
    """The GPUs a group's processes see (CUDA_VISIBLE_DEVICES): the node's visible GPUs in order, `group_size`
    for each of the node's groups, so that no two groups train on the same GPU; None (unchanged) where the node
    has fewer GPUs than its groups' processes (none: a CPU run; or groups that share them)."""
    here = plan.groups_here()
    if len(visible) < len(here) * plan.group_size:
        return None
    local = group - here.start
    return ",".join(visible[local * plan.group_size : (local + 1) * plan.group_size])


def visible_gpu_ids(env: Mapping[str, str]) -> list[str]:
    """The node's GPUs as CUDA_VISIBLE_DEVICES names them (else 0..n-1), counted without initialising CUDA."""
    if env.get("CUDA_VISIBLE_DEVICES") is not None:
        return [name.strip() for name in env["CUDA_VISIBLE_DEVICES"].split(",") if name.strip()]
    return [str(index) for index in range(visible_gpus())]


def group_environments(
    env: Mapping[str, str],
    group: int,
    plan: FaultTolerancePlan,
    lighthouse: str,
    story: Path,
    held: tuple[socket.socket, socket.socket],
    gpus: list[str] | None = None,
) -> list[dict[str, str]]:
    """The variables of a group's processes, one dict per process: a run of `group_size` processes to
    Lightning, with its own MASTER_PORT (the group's own process group), its own torchft store port (the
    ports of the two sockets the launcher `held` for them, app/cluster/rendezvous.py) and, on a node with
    a GPU per process, its own GPUs (`gpus`: the node's, `group_gpus`).
    The store's address is what torchft tells the other groups (the quorum's store address): on several
    nodes the host's name, which they can reach, else the loopback."""
    shared = {
        "MASTER_ADDR": "127.0.0.1" if plan.local_groups is None else socket.gethostname(),
        "NODE_RANK": "0",
        "WORLD_SIZE": str(plan.group_size),
        "PL_GLOBAL_SEED": env["PL_GLOBAL_SEED"],
        GROUP_VARIABLE: str(group),
        GROUPS_VARIABLE: str(plan.groups),
        LIGHTHOUSE_VARIABLE: lighthouse,
        STORY_VARIABLE: str(story),
        "RUST_LOG": env.get("RUST_LOG", "warn"),  # torchft's Rust side logs every quorum at INFO
    }
    master, store = held
    shared.update(held_ports_variables({"MASTER_PORT": master, STORE_PORT_VARIABLE: store}))
    own_gpus = group_gpus(gpus or [], plan, group)
    if own_gpus is not None:
        shared["CUDA_VISIBLE_DEVICES"] = own_gpus
    return [{**shared, "LOCAL_RANK": str(local_rank)} for local_rank in range(plan.group_size)]


# A Slurm job step's variables that would make a group's process a task of the step: SLURM_NTASKS makes
# Lightning pick its SLURMEnvironment (world size: the step's tasks), SLURM_STEP_ID makes ddp-app's
# pre-flight take the group for an srun rank. A group is a run of one process of its own.
SLURM_STEP_VARIABLES = ("SLURM_STEP_ID", "SLURM_NTASKS", "SLURM_NPROCS", NODE_LAUNCHER_VARIABLE)


def as_group(run: Callable[[list[str]], int], arguments: list[str]) -> int:
    """Run a group in its forked process: outside the Slurm step the node's launcher is a task of."""
    for name in SLURM_STEP_VARIABLES:
        os.environ.pop(name, None)
    return run(arguments)


def start_directory_for(plan: FaultTolerancePlan, story: Path, env: Mapping[str, str]) -> Path:
    """Where the first groups say they are ready (START_VARIABLE): on one machine a fresh temporary
    directory; on several nodes one every node sees, in the run's directory, named after the job and
    its restart (a requeued job starts its groups together again)."""
    if plan.local_groups is None:
        return Path(tempfile.mkdtemp(prefix="ddp-app-ft-start-"))
    job = f"{env.get('SLURM_JOB_ID', 'job')}.{env.get('SLURM_RESTART_COUNT', '0')}"
    directory = story / f"start-{job}"
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def fork_group(run_group: Callable[[], int], group_envs: list[dict[str, str]], group: int) -> list[int]:
    """Fork one group's processes (their stderr is the launcher's); returns their pids. Process r of
    group g is named `ddp-app rank g x group_size + r`: the rank it would be under `strategy: ddp`."""
    pids = []
    for group_env in group_envs:
        sys.stdout.flush()
        sys.stderr.flush()
        parent = os.getpid()
        stderr_fd = os.dup(2)
        pid = os.fork()
        if pid == 0:
            name = group * len(group_envs) + int(group_env["LOCAL_RANK"])
            _rank_main(run_group, group_env, parent, stderr_fd, name_rank=name)
        os.close(stderr_fd)
        pids.append(pid)
    return pids


def run_replica_groups(
    plan: FaultTolerancePlan,
    settings: FaultTolerance,
    args: list[str],
    run: Callable[[list[str]], int],
    run_dir: Path,
    env: Any = None,
) -> int:
    """Start the lighthouse (unless one is given) and every group; start a dead group again; returns
    the exit code: 0 when every group finished, else the first failure that was not restarted."""
    env = os.environ if env is None else env
    env.setdefault("PL_GLOBAL_SEED", str(random.randint(0, 2**31 - 1)))  # one seed: the same initial weights
    story = run_dir / STORY_DIRECTORY
    lighthouse_process = None
    lighthouse = plan.lighthouse
    if lighthouse is None:
        lighthouse_process, lighthouse = start_lighthouse(plan, settings)
    here = plan.groups_here()
    where = f"; groups {here.start}..{here.stop - 1} on {socket.gethostname()}" if plan.local_groups is not None else ""
    print(f"ddp-app: fault tolerance: {plan.describe()}; lighthouse at {lighthouse}{where}", flush=True)
    group_args = {group: group_arguments(args, group, run_dir, plan.group_size) for group in here}
    # A restarted group continues its own run (it heals from a peer when the peers are ahead, which
    # they are unless every group died): as today's in-job restart, with `--ckpt_path last`.
    restart_args = {group: with_ckpt_path_last(arguments) for group, arguments in group_args.items()}
    start_directory = str(start_directory_for(plan, story, env))
    gpus = visible_gpu_ids(env)

    running: dict[int, int] = {}  # pid -> group: every process of every group

    def start(group: int, first: bool = False, barrier: str | None = None) -> None:
        held = (hold_free_port(), hold_free_port())
        try:
            group_envs = group_environments(env, group, plan, lighthouse, story, held, gpus)
            for group_env in group_envs:
                if first or barrier:
                    group_env[START_VARIABLE] = barrier or start_directory
            arguments = group_args[group] if first else restart_args[group]
            for pid in fork_group(lambda: as_group(run, arguments), group_envs, group):
                running[pid] = group
        finally:
            for sock in held:  # the group's rank 0 has its own copies: held until it serves them
                sock.close()

    signal.pthread_sigmask(signal.SIG_BLOCK, LAUNCHER_SIGNALS)
    try:
        for group in here:
            start(group, first=True)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, LAUNCHER_SIGNALS)
    stopping = False

    def forward(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True
        for pid in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    previous = {signum: signal.signal(signum, forward) for signum in LAUNCHER_SIGNALS}
    restarts = dict.fromkeys(here, 0)
    # A dead group's process stays a member to the lighthouse until it misses its heartbeat for
    # heartbeat_timeout_s: one started again before that forms a quorum with that ghost, whose all-reduce then
    # fails and drops the step (seen in tests/fault/test_torchft.py's every-group-killed test). Group -> when.
    restart_at: dict[int, float] = {}
    barriers: list[str] = []
    # A group one of whose processes failed, while its others are still ending (killed by the launcher: a group's
    # processes train together, so a group restarts as a whole). Group -> its first failure's (pid, exit code).
    failing: dict[int, tuple[int, int]] = {}
    code = 0
    try:
        while running or restart_at:
            if stopping:
                restart_at.clear()
            due = [group for group, at in restart_at.items() if time.monotonic() >= at]
            # Every group of the run dead (one machine: the launcher sees them all): they start again together,
            # behind a start barrier as at the run's start, so that the first quorum has every group.
            together = not running and plan.local_groups is None and len(restart_at) == len(here)
            if due and (not together or len(due) == len(restart_at)):
                barrier = tempfile.mkdtemp(prefix="ddp-app-ft-start-") if together else None
                barriers += [barrier] if barrier else []
                for group in due:
                    del restart_at[group]
                    start(group, barrier=barrier)
            ended = ended_children()
            if not ended:
                time.sleep(0.05)
                continue
            for pid, returncode in ended:
                group = running.pop(pid, None)
                if group is None:
                    continue
                if returncode != 0 and group not in failing:  # the group's first failure: its others go too
                    failing[group] = (pid, returncode)
                    for other in [other for other, of in running.items() if of == group]:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(other, signal.SIGKILL)
                if group not in failing or group in running.values():
                    continue  # finished, or the rest of a failing group still ending
                pid, returncode = failing.pop(group)  # the whole group is gone: it restarts, or the run stops
                may_restart = worth_a_restart(returncode) and not stopping and returncode not in STOP_EXIT_CODES
                if may_restart and restarts[group] < settings.group_restarts:  # alone too: it resumes from last.ckpt
                    restarts[group] += 1
                    print(
                        f"ddp-app: fault tolerance: group {group} (pid {pid}) {describe_exit(returncode)}; "
                        f"{'the other groups continue; ' if running else ''}starting it again "
                        f"({restarts[group]} of {settings.group_restarts})",
                        file=sys.stderr,
                        flush=True,
                    )
                    restart_at[group] = time.monotonic() + settings.heartbeat_timeout_s + RESTART_MARGIN_S
                    continue
                if code == 0:
                    code = returncode if returncode > 0 else 128 - returncode
                    if not (returncode in STOP_EXIT_CODES or stopping):
                        print(f"ddp-app: fault tolerance: group {group} (pid {pid}) {describe_exit(returncode)}; "
                              "stopping the other groups.", file=sys.stderr, flush=True)  # fmt: skip
                        stopping = True
                        for other in running:
                            with contextlib.suppress(ProcessLookupError):
                                os.kill(other, signal.SIGKILL)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for directory in [start_directory, *barriers]:
            shutil.rmtree(directory, ignore_errors=True)
        if lighthouse_process is not None:
            with contextlib.suppress(Exception):
                assert lighthouse_process.stdin is not None
                lighthouse_process.stdin.close()
                lighthouse_process.wait(timeout=5)
            if lighthouse_process.poll() is None:
                lighthouse_process.kill()
    return code
