"""ddp-app's launcher for a fault-tolerant run: the lighthouse, one process per replica group, and
a dead group started again while the others keep training (docs/fault_tolerance.md).

Unlike a plain launch (app/cluster/launch.py), one group's death does not stop the others: its
process is forked again (up to `fault_tolerance.group_restarts` times per group) with the same
command line and process name (`ddp-app rank N`, N the group's index), and it rejoins from a
peer's memory. Each group is a run of one process to Lightning: its own TCPStore port, `devices=1`
and strategy `auto`; group 0 writes the run's logs and checkpoints in `trainer.default_root_dir`,
group N > 0 its checkpoints in `<default_root_dir>/fault_tolerance/group_N` (without a logger),
and every group a line per step in `<default_root_dir>/fault_tolerance/group_N.jsonl`.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
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
    free_port,
    with_ckpt_path_last,
    worth_a_restart,
)
from app.errors import UserFacingError
from app.parallel.fault_tolerance import (
    GROUP_VARIABLE,
    GROUPS_VARIABLE,
    LIGHTHOUSE_VARIABLE,
    START_VARIABLE,
    STORY_VARIABLE,
    FaultTolerance,
    FaultTolerancePlan,
)

STORY_DIRECTORY = "fault_tolerance"


def group_arguments(args: list[str], group: int, run_dir: Path) -> list[str]:
    """A group's command line: one process to Lightning; groups other than 0 keep their checkpoints apart."""
    own = ["--trainer.devices=1", "--trainer.strategy=auto"]
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


def group_environment(
    env: Mapping[str, str], group: int, plan: FaultTolerancePlan, lighthouse: str, story: Path
) -> dict[str, str]:
    """A group's variables: a run of one process to Lightning, with its own store port."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "NODE_RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": str(plan.group_size),
        "PL_GLOBAL_SEED": env["PL_GLOBAL_SEED"],
        GROUP_VARIABLE: str(group),
        GROUPS_VARIABLE: str(plan.groups),
        LIGHTHOUSE_VARIABLE: lighthouse,
        STORY_VARIABLE: str(story),
        "RUST_LOG": env.get("RUST_LOG", "warn"),  # torchft's Rust side logs every quorum at INFO
    }


def fork_group(run_group: Callable[[], int], group_env: dict[str, str], group: int) -> int:
    """Fork one group's process (its stderr is the launcher's); returns its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    stderr_fd = os.dup(2)
    pid = os.fork()
    if pid == 0:
        _rank_main(run_group, group_env, parent, stderr_fd, name_rank=group)
    os.close(stderr_fd)
    return pid


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
    print(f"ddp-app: fault tolerance: {plan.describe()}; lighthouse at {lighthouse}", flush=True)
    group_args = {group: group_arguments(args, group, run_dir) for group in range(plan.groups)}
    # A restarted group continues its own run (it heals from a peer when the peers are ahead, which
    # they are unless every group died): as today's in-job restart, with `--ckpt_path last`.
    restart_args = {group: with_ckpt_path_last(arguments) for group, arguments in group_args.items()}
    start_directory = tempfile.mkdtemp(prefix="ddp-app-ft-start-")

    def start(group: int, first: bool = False) -> int:
        group_env = group_environment(env, group, plan, lighthouse, story)
        if first:
            group_env[START_VARIABLE] = start_directory
        arguments = group_args[group] if first else restart_args[group]
        return fork_group(lambda: run(arguments), group_env, group)

    signal.pthread_sigmask(signal.SIG_BLOCK, LAUNCHER_SIGNALS)
    running: dict[int, int] = {}  # pid -> group
    try:
        for group in range(plan.groups):
            running[start(group, first=True)] = group
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
    restarts = dict.fromkeys(range(plan.groups), 0)
    code = 0
    try:
        while running:
            ended = ended_children()
            if not ended:
                time.sleep(0.05)
                continue
            for pid, returncode in ended:
                group = running.pop(pid, None)
                if group is None or returncode == 0:
                    continue
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
                    running[start(group)] = group
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
        shutil.rmtree(start_directory, ignore_errors=True)
        if lighthouse_process is not None:
            with contextlib.suppress(Exception):
                assert lighthouse_process.stdin is not None
                lighthouse_process.stdin.close()
                lighthouse_process.wait(timeout=5)
            if lighthouse_process.poll() is None:
                lighthouse_process.kill()
    return code
