"""Start every local rank at once, the way torchrun does, instead of one after another.

With `strategy: ddp` and N devices, Lightning starts ranks 1..N-1 only when rank 0 reaches
`trainer.fit`, by running the command line again; those ranks then import torch and Lightning
(about 5 s on a 2-core CPU) while rank 0 waits, so the first training step waits for two imports
back to back. `ddp-app` instead starts all N ranks up front from a light parent process (standard
library only) with the variables Lightning's launcher would give them (MASTER_ADDR, MASTER_PORT,
WORLD_SIZE, NODE_RANK, LOCAL_RANK): with LOCAL_RANK set, Lightning starts no processes itself.

The parent stays until the ranks are done, like torchrun's agent: it forwards SIGTERM, SIGUSR1
and SIGINT to them, kills the others as soon as one rank fails (a rank waiting in a collective
would otherwise hang until the collective timeout), and exits with the failing rank's code. Ranks
die with the parent (PR_SET_PDEATHSIG) if it is killed. Every rank reports the same bad input, so
the one-line reports of ranks >= 1 are held back and printed only when rank 0 did not report its own.

Ctrl-C: each rank runs in a session of its own (as torchrun's workers do), so a terminal's SIGINT
reaches the parent only, which forwards exactly one SIGINT to every rank, whether the user pressed
Ctrl-C or sent SIGINT to the parent's pid. The ranks then save last.ckpt at the same step and exit
with 130. A second SIGINT kills the ranks at once; the previous last.ckpt stays intact (atomic saves).
Ranks that stop on purpose (exit codes 3 and 130: preempted or interrupted, all at the same step)
are given time to finish instead of being killed when the first of them exits.

It applies only when it is certain what Lightning would do: a single node, `devices` a number > 1,
a `ddp` strategy that starts processes by running the script (not ddp_spawn), not under srun,
SLURM or torchrun, and a subcommand that trains or evaluates. Otherwise, or with
DDP_APP_LAUNCHER=lightning, Lightning's own launcher starts the ranks as before.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from app.cluster.exit_codes import INTERRUPTED_EXIT_CODE, STOP_EXIT_CODES

SUBCOMMANDS = ("fit", "validate", "test", "predict")
# Set by torchrun, srun or Lightning's own launcher: the ranks already exist.
LAUNCHED_VARIABLES = ("LOCAL_RANK", "RANK", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_PROCID")
TRAINER_KEYS = ("devices", "num_nodes", "accelerator", "strategy")
# Sent to the parent by a scheduler or a user; SIGINT is forwarded by its own handler (once).
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# `ddp-app: error: ...`, `ddp-app fit: error: ...` and `ddp-app: interrupted ...`: one-line reports
# that every rank makes alike, printed once.
REPORT_LINE = re.compile(rb"^[\w.\- ]+: (error: |interrupted )")
# How long ranks that stop on purpose get to finish (the others are saving or exiting) before they are killed.
STOP_GRACE_S = 60.0


def _option(argv: list[str], index: int) -> tuple[str, str | None, int]:
    """(name, value, index of the next argument) for `--name value` and `--name=value`."""
    name, equals, value = argv[index].partition("=")
    if equals:
        return name, value, index + 1
    if index + 1 < len(argv) and not argv[index + 1].startswith("--"):
        return name, argv[index + 1], index + 2
    return name, None, index + 1


def _trainer_settings(argv: list[str]) -> dict[str, Any] | None:
    """devices/num_nodes/accelerator/strategy as the CLI will resolve them, or None when unsure.

    Config files and overrides apply in command-line order, later ones winning, as in jsonargparse.
    """
    import yaml  # PyYAML imports in milliseconds; torch and Lightning are what we avoid here

    settings: dict[str, Any] = {"devices": "auto", "num_nodes": 1, "accelerator": "auto", "strategy": "auto"}
    index = 0
    while index < len(argv):
        if not argv[index].startswith("--"):
            index += 1
            continue
        name, value, index = _option(argv, index)
        if name == "--config":
            path = Path(value or "")
            if not path.is_file():
                return None  # an inline YAML string or a missing file: let the CLI deal with it
            trainer = (yaml.safe_load(path.read_text()) or {}).get("trainer") or {}
            settings.update({key: trainer[key] for key in TRAINER_KEYS if key in trainer})
        elif name in {f"--trainer.{key}" for key in TRAINER_KEYS}:
            settings[name.removeprefix("--trainer.")] = yaml.safe_load(value) if value is not None else None
        elif name == "--trainer" or name.startswith(("--trainer.strategy.", "--trainer.devices.")):
            return None  # a whole trainer config, or a strategy object built piece by piece
    return settings


def _is_script_ddp(strategy: Any) -> bool:
    """A DDP strategy whose launcher runs the script again (not ddp_spawn/ddp_fork/ddp_notebook)."""
    if strategy == "ddp" or strategy == "ddp_find_unused_parameters_true":
        return True
    if isinstance(strategy, dict) and str(strategy.get("class_path", "")).split(".")[-1] == "DDPStrategy":
        return (strategy.get("init_args") or {}).get("start_method", "popen") == "popen"
    return False


def local_ranks_to_start(argv: list[str], env: Mapping[str, str]) -> int:
    """How many ranks `ddp-app <argv>` should start up front; 0 leaves it to Lightning."""
    if env.get("DDP_APP_LAUNCHER", "auto") == "lightning" or any(name in env for name in LAUNCHED_VARIABLES):
        return 0
    positional = [arg for arg in argv if not arg.startswith("-")]
    if not positional or positional[0] not in SUBCOMMANDS:
        return 0
    if any(arg in ("-h", "--help") or arg.startswith("--print_config") for arg in argv):
        return 0
    try:
        settings = _trainer_settings(argv)
    except Exception:  # unreadable YAML and the like: the CLI reports it properly
        return 0
    if settings is None or str(settings["num_nodes"]) != "1" or not _is_script_ddp(settings["strategy"]):
        return 0
    if str(settings["accelerator"]) not in ("auto", "cpu", "gpu", "cuda"):
        return 0
    devices = settings["devices"]
    if isinstance(devices, bool) or not isinstance(devices, int | str) or not str(devices).isdigit():
        return 0  # "auto", -1, or a list of GPU indices: Lightning resolves those
    return int(devices) if int(devices) > 1 else 0


def rank_command() -> list[str]:
    """This command line again, as Lightning's launcher builds it (`python -m app ...` or the script)."""
    import __main__

    spec = getattr(__main__, "__spec__", None)
    if spec is None:
        return [sys.executable, os.path.abspath(sys.argv[0]), *sys.argv[1:]]
    return [sys.executable, "-m", spec.name, *sys.argv[1:]]


# Everything a launcher (torchrun, srun, Lightning, this module) sets for a rank: a process that
# starts a fresh job must not pass the caller's values on.
LAUNCHER_VARIABLES = (
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
    "LOCAL_WORLD_SIZE", "PL_GLOBAL_SEED", "PL_SEED_WORKERS", "TORCHELASTIC_RUN_ID",
)  # fmt: skip


def env_without_launcher(env: Mapping[str, str]) -> dict[str, str]:
    """`env` minus launcher and SLURM variables: the environment for starting a new, separate job."""
    return {key: value for key, value in env.items() if key not in LAUNCHER_VARIABLES and not key.startswith("SLURM_")}


def describe_exit(returncode: int) -> str:
    """'was killed by SIGKILL' or 'exited with code 1', for a Popen returncode."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def free_port() -> int:
    """A port the OS says is free now, for a launcher that owns the choice."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_environments(nprocs: int, env: Mapping[str, str]) -> list[dict[str, str]]:
    """The variables Lightning's launcher gives the ranks it starts, for all `nprocs` of them."""
    shared = dict(env)
    shared.update(
        MASTER_ADDR=env.get("MASTER_ADDR", "127.0.0.1"),
        MASTER_PORT=env.get("MASTER_PORT") or str(free_port()),
        NODE_RANK="0",
        WORLD_SIZE=str(nprocs),
    )
    # `seed_everything: true` (or no seed) draws a random seed per process; Lightning passes rank
    # 0's to the others in PL_GLOBAL_SEED, so every rank starts from the same one here as well.
    shared.setdefault("PL_GLOBAL_SEED", str(random.randint(0, 2**31 - 1)))
    return [{**shared, "LOCAL_RANK": str(local_rank)} for local_rank in range(nprocs)]


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the launcher dies, so no rank outlives it."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _forward_stderr(stream: IO[bytes], held: list[bytes]) -> None:
    """Copy a rank's stderr through as it comes, holding back its one-line error reports."""
    for line in iter(stream.readline, b""):
        if REPORT_LINE.match(line):
            held.append(line)
        else:
            sys.stderr.buffer.write(line)
            sys.stderr.buffer.flush()
    stream.close()


def run_local_ranks(nprocs: int, command: list[str], env: Mapping[str, str]) -> int:
    """Start `nprocs` ranks of `command`, wait for all of them; returns the exit code to use."""
    # stderr only: Lightning's progress bar writes to stdout, which the ranks share with us.
    # A session per rank: a terminal's Ctrl-C reaches this parent only, which forwards it once.
    processes = [
        subprocess.Popen(
            command, env=rank_env, stderr=subprocess.PIPE, preexec_fn=_die_with_parent, start_new_session=True
        )
        for rank_env in rank_environments(nprocs, env)
    ]
    held: list[list[bytes]] = [[] for _ in processes]
    readers = [
        threading.Thread(target=_forward_stderr, args=(process.stderr, lines), daemon=True)
        for process, lines in zip(processes, held, strict=True)
    ]
    for reader in readers:
        reader.start()
    running = {process.pid: process for process in processes}
    killed: set[int] = set()
    interrupts = 0

    def kill_running() -> None:
        # SIGKILL: a rank blocked in a collective does not react to SIGTERM (Lightning does the same).
        for process in running.values():
            if process.pid not in killed:
                process.kill()
                killed.add(process.pid)

    def forward_signal(signum: int, frame: Any) -> None:
        for process in running.values():
            process.send_signal(signum)

    def on_interrupt(signum: int, frame: Any) -> None:
        nonlocal interrupts
        interrupts += 1
        if interrupts == 1:  # the ranks save last.ckpt at the same step and exit with 130
            forward_signal(signum, frame)
        else:  # the user does not want to wait for that
            kill_running()

    previous = {signum: signal.signal(signum, forward_signal) for signum in FORWARDED_SIGNALS}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, on_interrupt)
    first_failure: int | None = None
    stop_deadline = float("inf")
    try:
        while running:
            # poll(), not os.waitpid(-1): Popen.send_signal and kill reap an exited rank themselves.
            for pid, process in list(running.items()):
                if process.poll() is None:
                    continue
                del running[pid]
                if process.returncode != 0 and first_failure is None and pid not in killed:
                    first_failure = processes.index(process)
                    if process.returncode in STOP_EXIT_CODES:  # the others stop at the same step: let them finish
                        stop_deadline = time.monotonic() + STOP_GRACE_S
                    else:
                        kill_running()
            if time.monotonic() > stop_deadline:
                kill_running()
            time.sleep(0.05)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    for reader in readers:
        reader.join(timeout=5)
    # Rank 0's report if it made one, else the others' (it may have been killed before its own).
    reports = held[0] or [line for lines in held[1:] for line in lines]
    for line in dict.fromkeys(reports):  # the same report from several ranks, once
        sys.stderr.buffer.write(line)
    sys.stderr.buffer.flush()
    if interrupts > 1:
        sys.stderr.write(
            "ddp-app: second Ctrl-C: stopped the ranks without saving; the previous last.ckpt is intact.\n"
        )
        sys.stderr.flush()
        return INTERRUPTED_EXIT_CODE
    if first_failure is None:
        return 0
    code = processes[first_failure].returncode
    if code in STOP_EXIT_CODES:  # rank 0 printed where it saved and how to resume
        return code
    if code < 0 or not reports:  # died without saying why (kill -9, OOM killer, segfault): name it
        failed = processes[first_failure]
        sys.stderr.write(
            f"ddp-app: rank {first_failure} (pid {failed.pid}) {describe_exit(code)}; stopped the other ranks.\n"
        )
        sys.stderr.flush()
    return code if code > 0 else 128 - code  # killed by signal N: 128 + N, as a shell reports it


def launch_local_ranks(argv: list[str]) -> None:
    """If this command should start its ranks up front, do so and exit with their status."""
    nprocs = local_ranks_to_start(argv, os.environ)
    if nprocs:
        raise SystemExit(run_local_ranks(nprocs, rank_command(), os.environ))
