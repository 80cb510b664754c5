"""Start the local ranks of a plain launch, and supervise them: the one launch path of `ddp-app`.

`ddp-app fit ...` started by hand (not by srun or torchrun) first parses and checks the whole
config once, in this process: a bad key, type, class path or device count is reported once, in
about the time it takes to import Lightning, before any rank exists. It then forks one process
per local rank (`fork` after the imports: the ranks do not import torch and Lightning again) with
the variables a launcher gives a rank (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, NODE_RANK,
LOCAL_RANK); with LOCAL_RANK set, Lightning starts no processes itself. A port it picks itself it
holds until rank 0 serves the rendezvous on it (app/cluster/rendezvous.py). Every `devices` form
(a number, "auto", -1, a list of GPU indices) and every DDP-family strategy takes this path.

The parent stays until the ranks are done, like torchrun's agent:
- it kills the others as soon as one rank fails (a rank waiting in a collective would otherwise
  hang until the collective timeout), names a rank that died without saying why, and exits with
  the failing rank's code;
- ranks die with it (PR_SET_PDEATHSIG) if it is killed;
- it forwards SIGTERM, SIGUSR1 and SIGINT. Each rank runs in a session of its own (as torchrun's
  workers do), so a terminal's Ctrl-C reaches the parent only, which forwards exactly one SIGINT
  to every rank: the ranks save last.ckpt at the same step and exit with 130. A second SIGINT
  kills the ranks at once; the previous last.ckpt stays intact (saves are atomic).
- ranks that stop on purpose (exit codes 3 and 130: preempted or interrupted, all at the same
  step) are given time to finish instead of being killed when the first of them exits;
- every rank reports the same bad input, so the one-line reports of ranks >= 1 are held back and
  printed only when rank 0 did not report its own.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import re
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from app.cluster.exit_codes import BAD_INPUT_EXIT_CODE, HANG_EXIT_CODE, INTERRUPTED_EXIT_CODE, STOP_EXIT_CODES
from app.cluster.preflight import devices_as_written_count
from app.cluster.rendezvous import HELD_PORTS_VARIABLE, held_ports_variables, hold_free_port, serve_held
from app.errors import UserFacingError
from app.parallel.strategy import ResolvedStrategy
from app.private_apis import require

# Sent to the parent by a scheduler or a user; SIGINT is forwarded by its own handler (once).
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
LAUNCHER_SIGNALS = (*FORWARDED_SIGNALS, signal.SIGINT)  # the ones the launcher handles
# `ddp-app: error: ...`, `ddp-app fit: error: ...`, `ddp-app: interrupted ...` and `ddp-app: hang: ...`:
# one-line reports, held back and printed last (once; rank 0's if it made one).
REPORT_LINE = re.compile(rb"^[\w.\- ]+: (error: |interrupted |hang: )")
HANG_LINE = re.compile(rb"^ddp-app: hang: ")
# How long ranks that stop on purpose get to finish (the others are saving or exiting) before they are killed.
STOP_GRACE_S = 60.0

# Everything a launcher (torchrun, srun, Lightning, this module) sets for a rank: a process that
# starts a fresh job must not pass the caller's values on.
LAUNCHER_VARIABLES = (
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
    "LOCAL_WORLD_SIZE", "PL_GLOBAL_SEED", "PL_SEED_WORKERS", HELD_PORTS_VARIABLE,
)  # fmt: skip
LAUNCHER_PREFIXES = ("SLURM_", "TORCHELASTIC_")


def env_without_launcher(env: Mapping[str, str]) -> dict[str, str]:
    """`env` minus launcher, torchrun and SLURM variables: the environment for starting a new, separate job."""
    return {
        key: value
        for key, value in env.items()
        if key not in LAUNCHER_VARIABLES and not key.startswith(LAUNCHER_PREFIXES)
    }


@dataclass(frozen=True)
class RankPlan:
    """What the parent of a plain launch does: fork `processes` local ranks (0: run here)."""

    processes: int
    extra_args: tuple[str, ...] = ()  # appended to the ranks' command line (they win over the rest)
    notice: str = ""
    devices: int | None = None  # the trainer.devices the ranks get instead of the config's, if any


def rank_plan(strategy: ResolvedStrategy, processes_per_node: int, on_cpu: bool, devices: Any) -> RankPlan:
    """How many local ranks to fork for this (parsed) trainer config, and what they need changed.

    DDP strategies (any DDPStrategy, a user's subclass too) and FSDP2 fork their ranks; others ("auto"
    on one device, or a strategy of another kind) run in this process, as Lightning would run them.
    """
    if not strategy.forks_ranks:
        return RankPlan(0)
    extra: list[str] = []
    notes: list[str] = []
    replaced_devices = None
    if strategy.runs_as is not None:
        extra.append(f"--trainer.strategy={strategy.runs_as}")
        notes.append(f"strategy {strategy.written} runs as {strategy.runs_as}: ddp-app starts the processes itself")
    elif strategy.start_method is not None:
        extra.append("--trainer.strategy.init_args.start_method=popen")
        notes.append(f"start_method {strategy.start_method} runs as popen: ddp-app starts the processes itself")
    written_count = devices_as_written_count(devices)
    if on_cpu and not (written_count is not None and written_count > 0):
        # Lightning's CPUAccelerator takes only a positive count; a GPU config's [0, 1], "0,1", -1
        # or "auto" on a CPU machine means that many CPU processes.
        extra.append(f"--trainer.devices={processes_per_node}")
        replaced_devices = processes_per_node
        notes.append(f"trainer.devices={devices!r} on CPU: {processes_per_node} process(es)")
    notice = f"ddp-app: {'; '.join(notes)}." if notes else ""
    return RankPlan(processes_per_node, tuple(extra), notice, replaced_devices)


def with_ckpt_path_last(args: list[str]) -> list[str]:
    """A ddp-app command line (without the program) with `--ckpt_path last` in place of any ckpt_path."""
    kept: list[str] = []
    skip_value = False
    for arg in args:
        if skip_value:
            skip_value = False
        elif arg == "--ckpt_path":
            skip_value = True
        elif not arg.startswith("--ckpt_path="):
            kept.append(arg)
    return [*kept, "--ckpt_path", "last"]


def worth_a_restart(exit_code: int) -> bool:
    """A failure that running again may not repeat (a rank killed, a node lost, a crash), as opposed
    to success, a deliberate stop, or a deterministic one that exits 2 (bad input, a non-finite
    loss, a checkpoint that does not load)."""
    return exit_code not in (0, BAD_INPUT_EXIT_CODE, *STOP_EXIT_CODES)


def ended_children() -> list[tuple[int, int]]:
    """(pid, exit code) of every child that has ended since the last call, a rank killed by a signal first.

    A rank killed with SIGKILL makes its peers fail within milliseconds ("lost the connection"); when
    the launcher's poll finds both ended, `waitpid` may return a peer first, and the peer would be named
    as the culprit. Collected together, the one a signal killed is the cause and comes first.
    """
    ended = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # no child left
            break
        if pid == 0:
            break
        ended.append((pid, os.waitstatus_to_exitcode(status)))
    return sorted(ended, key=lambda item: item[1] >= 0)  # stable: otherwise in the order waitpid gave


def describe_exit(returncode: int) -> str:
    """'was killed by SIGKILL' or 'exited with code 1', for a Popen returncode."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def rank_environments(
    nprocs: int, env: Mapping[str, str], num_nodes: int = 1, held: socket.socket | None = None
) -> list[dict[str, str]]:
    """The variables a launcher gives the `nprocs` local ranks of this node (NODE_RANK from `env`).
    The rendezvous is at `env`'s MASTER_PORT, else at the port of the socket the launcher `held`."""
    if num_nodes > 1 and not env.get("MASTER_PORT"):
        raise UserFacingError(
            "a multi-node plain launch needs MASTER_ADDR and MASTER_PORT set on every node. Fix: set both "
            "(the same on every node), or use srun or torchrun."
        )
    if not env.get("MASTER_PORT") and held is None:  # a caller's bug
        raise ValueError("no MASTER_PORT and no held port: the caller holds one (app.cluster.rendezvous)")
    users_port = env.get("MASTER_PORT")
    shared = {
        "MASTER_ADDR": env.get("MASTER_ADDR", "127.0.0.1"),
        **({"MASTER_PORT": users_port} if users_port else held_ports_variables({"MASTER_PORT": held})),
        "NODE_RANK": env.get("NODE_RANK", "0"),
        "WORLD_SIZE": str(nprocs * num_nodes),
        # `seed_everything: true` (or no seed) draws a random seed per process; Lightning passes rank
        # 0's to the others in PL_GLOBAL_SEED, so every rank starts from the same one here as well.
        "PL_GLOBAL_SEED": env.get("PL_GLOBAL_SEED") or str(random.randint(0, 2**31 - 1)),
    }
    return [{**shared, "LOCAL_RANK": str(local_rank)} for local_rank in range(nprocs)]


def rank_process_name(local_rank: int) -> str:
    """What `ps`, `top` and /proc/PID/comm show for a rank (at most 15 characters)."""
    return f"ddp-app rank {local_rank}"[:15]


def _become_rank_process(parent: int, local_rank: int) -> None:
    """In a rank: SIGKILL when the launcher dies, so no rank outlives it; a name that says which rank."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        libc.prctl(15, rank_process_name(local_rank).encode())  # PR_SET_NAME
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


def exit_code_of(error: SystemExit) -> int:
    """The process exit code a `SystemExit` stands for (a message: printed, and 1)."""
    if error.code is None:
        return 0
    if isinstance(error.code, int):
        return error.code
    print(error.code, file=sys.stderr)
    return 1


def check_exit_handlers() -> None:
    """Checked by `ddp-app` as it starts (app/cli/entry.py), before any rank: `end_rank` can run the exit
    handlers (private in CPython). Without it a rank's loggers and user code would not flush at exit,
    so a CPython without it stops the launch."""
    require(atexit, "_run_exitfuncs", "python", "running a rank's exit handlers before os._exit")


def end_rank(code: int) -> NoReturn:
    """End a rank's process, whoever started it (this launcher, torchrun, srun): the exit handlers it
    registered (loggers, user code) run as at a normal exit, then os._exit, without the interpreter's
    teardown. Lightning leaves the process group up, and in that teardown a gloo worker thread can
    drop the group's last reference (a communication hook's callback holds one): the group's
    destructor then joins that thread from itself and the process aborts ("terminate called ...")
    after its work is done and saved, which a launcher counts as a failure. os._exit runs no C++
    static destructors either (`outlive_the_interpreter` says why those matter for a process that
    ends through the interpreter instead)."""
    # Private (docs/private_apis.md): there since check_exit_handlers passed as the launch began. It
    # prints a failing handler's traceback itself; nothing may keep the rank from its os._exit below.
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    with contextlib.suppress(BaseException):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def outlive_the_interpreter(handler: Callable[..., Any]) -> Callable[..., Any]:
    """`handler`, kept alive until the process is gone: for a Python callable given to a C++ registry
    that a C++ static destructor frees after the interpreter has finalized.

    PyTorch's debug-endpoint handlers (`torch._C._distributed_c10d._register_handler`, which the hang
    report uses, app/cluster/hangs.py) live in such a registry. A process that ends through the
    interpreter's normal exit (`return` from main, `sys.exit`) finalizes Python, which clears the
    modules and with them every other reference to the handler; then libc's `exit` runs the registry's
    destructor, which drops the last one without the GIL, and the process aborts with "Fatal Python
    error: PyThreadState_Get: the function must be called with the GIL held ... Python runtime state:
    finalizing" (SIGABRT) after its work is done. `end_rank`'s `os._exit` runs no C++ destructors, so
    ranks of ddp-app's own launcher and of torchrun or srun never met it; the ranks Lightning starts
    itself for a `DDPAppCLI` used as a library (`python -m app.parity eval-worker`, a user's script)
    did, 6 of 6 times on an AMD EPYC VM and 3 of 3 here (issue 56). Whether the module still held a
    reference at that point depended on the import graph (689925d exited 0, 472f2b6 aborted); one
    reference that is never released (`Py_IncRef`, CPython's public C API) makes it independent of it.
    """
    import ctypes

    ctypes.pythonapi.Py_IncRef(ctypes.py_object(handler))
    return handler


def _rank_main(
    run_rank: Callable[[], int], rank_env: dict[str, str], parent: int, stderr_fd: int, name_rank: int | None = None
) -> None:
    """The forked child: become a rank with its own session and stderr pipe, run, and never return.
    `name_rank`: the rank its process name shows, if not its LOCAL_RANK (a replica group's index)."""
    code = 1
    try:
        os.setsid()
        recreate_thread_pools()
        _become_rank_process(parent, int(rank_env["LOCAL_RANK"]) if name_rank is None else name_rank)
        os.dup2(stderr_fd, 2)
        os.close(stderr_fd)
        # sys.stderr may be something other than fd 2 (pytest's capture, a notebook): the pipe it is.
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115 (lives as long as the rank)
        for signum in LAUNCHER_SIGNALS:
            signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, LAUNCHER_SIGNALS)  # blocked by the parent while it forks
        os.environ.update(rank_env)
        serve_held(os.environ, serves=rank_env["LOCAL_RANK"] == "0")
        code = run_rank()
    except SystemExit as error:
        code = exit_code_of(error)
    except BaseException:
        traceback.print_exc()
    finally:
        end_rank(code)  # never return: that would run the parent's code (its callers, a test runner)


def recreate_thread_pools() -> None:
    """Re-create torch's intra-op thread pools in a forked child, on its one thread, first thing.

    A fork marks the pools the parent used as lost (torch's pthread_atfork handler) and the first use
    in the child builds them anew. Two threads making that first use at once race: the autograd
    engine's worker thread starting at the first backward while the main thread runs an op, and the
    loser sees no pool (`pool INTERNAL ASSERT FAILED ... ParallelOpenMP.cpp ... Invalid thread pool!`,
    then SIGABRT). Seen in 1 of 3 one-step fits of a rank forked twice (the tests' zygote, then this
    launcher; tests/parallel/test_strategy.py); `torch.set_num_threads` builds them here, before any
    other thread exists.
    """
    import torch

    torch.set_num_threads(torch.get_num_threads())


def _forward_stderr(fd: int, held: list[bytes]) -> None:
    """Copy a rank's stderr through as it comes, holding back its one-line reports."""
    with os.fdopen(fd, "rb") as stream:
        for line in iter(stream.readline, b""):
            if REPORT_LINE.match(line):
                held.append(line)
            else:
                sys.stderr.buffer.write(line)
                sys.stderr.buffer.flush()


@dataclass
class _Rank:
    local_rank: int
    pid: int
    returncode: int | None = None


def _start_ranks(nprocs: int, run_rank: Callable[[], int], env: Mapping[str, str], num_nodes: int) -> list[tuple]:
    """Fork the ranks; returns (rank, stderr read end) pairs."""
    sys.stdout.flush()
    sys.stderr.flush()
    started = []
    parent = os.getpid()
    held = None if env.get("MASTER_PORT") else hold_free_port()
    try:
        for rank_env in rank_environments(nprocs, env, num_nodes, held):
            read_fd, write_fd = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(read_fd)
                for _, other_fd in started:
                    os.close(other_fd)
                _rank_main(run_rank, rank_env, parent, write_fd)
            os.close(write_fd)
            started.append((_Rank(int(rank_env["LOCAL_RANK"]), pid), read_fd))
    finally:
        if held is not None:
            held.close()  # rank 0 has its own copy: the port stays held until it serves the store
    return started


def refuse_cuda_before_fork() -> None:
    """Stop in one line if CUDA is already initialised in this process, before the ranks are forked.

    A forked child cannot use a CUDA context its parent created: every rank would die with "Cannot
    re-initialize CUDA in forked subprocess", a traceback per rank. The launcher itself never touches
    CUDA (it counts GPUs through NVML, as Lightning does), so whatever did ran while the user's
    modules were imported for the config: a tensor created on a GPU at module level,
    `torch.cuda.get_device_properties`, `torch.cuda.manual_seed` or a debugging hook.
    """
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    raise UserFacingError(
        "CUDA was initialised in the ddp-app launcher before it starts the ranks, by code that runs when the "
        "config's modules are imported (a tensor created on a GPU at module level, torch.cuda.get_device_properties, "
        "torch.cuda.manual_seed, a debugging hook); forked ranks cannot use CUDA then. Fix: move that code into a "
        "function your LightningModule calls (__init__, setup or a hook), or start the ranks with torchrun."
    )


def run_local_ranks(nprocs: int, run_rank: Callable[[], int], env: Mapping[str, str], num_nodes: int = 1) -> int:
    """Fork `nprocs` ranks that each call `run_rank()`, wait for all of them; returns the exit code to use."""
    # A signal that comes while the ranks are forked waits until the handlers below forward it: by
    # default it would kill this process (and so, through PR_SET_PDEATHSIG, the ranks just started).
    signal.pthread_sigmask(signal.SIG_BLOCK, LAUNCHER_SIGNALS)
    try:
        started = _start_ranks(nprocs, run_rank, env, num_nodes)
    except BaseException:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, LAUNCHER_SIGNALS)
        raise
    ranks = [rank for rank, _ in started]
    held: list[list[bytes]] = [[] for _ in ranks]
    readers = [
        threading.Thread(target=_forward_stderr, args=(fd, lines), daemon=True)
        for (_, fd), lines in zip(started, held, strict=True)
    ]
    for reader in readers:
        reader.start()
    running = {rank.pid: rank for rank in ranks}
    killed: set[int] = set()
    interrupts = 0

    def kill_running() -> None:
        # SIGKILL: a rank blocked in a collective does not react to SIGTERM (Lightning does the same).
        for rank in running.values():
            if rank.pid not in killed:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rank.pid, signal.SIGKILL)
                killed.add(rank.pid)

    def forward_signal(signum: int, frame: Any) -> None:
        for rank in running.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank.pid, signum)

    def on_interrupt(signum: int, frame: Any) -> None:
        nonlocal interrupts
        interrupts += 1
        if interrupts == 1:  # the ranks save last.ckpt at the same step and exit with 130
            forward_signal(signum, frame)
        else:  # the user does not want to wait for that
            kill_running()

    previous = {signum: signal.signal(signum, forward_signal) for signum in FORWARDED_SIGNALS}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, on_interrupt)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, LAUNCHER_SIGNALS)
    first_failure: _Rank | None = None
    stop_deadline = float("inf")
    try:
        while running:
            ended = ended_children()
            if not ended:
                if time.monotonic() > stop_deadline:
                    kill_running()
                time.sleep(0.05)
                continue
            for pid, returncode in ended:
                rank = running.pop(pid, None)
                if rank is None:
                    continue
                rank.returncode = returncode
                if rank.returncode != 0 and first_failure is None and pid not in killed:
                    first_failure = rank
                    if rank.returncode in STOP_EXIT_CODES:  # the others stop at the same step: let them finish
                        stop_deadline = time.monotonic() + STOP_GRACE_S
                    else:
                        kill_running()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    for reader in readers:
        reader.join(timeout=5)
    # A hang report explains the others' "lost the connection" errors: the first rank's that made one.
    # Else rank 0's report if it made one, else the others' (it may have been killed before its own).
    hangs = [line for lines in held for line in lines if HANG_LINE.match(line)]
    reports = hangs[:1] or held[0] or [line for lines in held[1:] for line in lines]
    for line in dict.fromkeys(reports):  # the same report from several ranks, once
        sys.stderr.buffer.write(line)
    sys.stderr.buffer.flush()
    if interrupts > 1:
        sys.stderr.write("ddp-app: second Ctrl-C: stopped the ranks without saving; the previous last.ckpt is intact\n")
        sys.stderr.flush()
        return INTERRUPTED_EXIT_CODE
    if first_failure is None:
        return 0
    if hangs:
        return HANG_EXIT_CODE
    code = first_failure.returncode
    assert code is not None
    if code in STOP_EXIT_CODES:  # rank 0 printed where it saved and how to resume
        return code
    if code < 0 or not reports:  # died without saying why (kill -9, OOM killer, segfault): name it
        sys.stderr.write(
            f"ddp-app: rank {first_failure.local_rank} (pid {first_failure.pid}) {describe_exit(code)}; "
            "stopped the other ranks.\n"
        )
        sys.stderr.flush()
    return code if code > 0 else 128 - code  # killed by signal N: 128 + N, as a shell reports it
