"""`ddp-app` commands for the tests, forked from a process that has already imported what the command
imports, instead of a new interpreter that imports it again.

Why: every `ddp-app` command spends about 10 s of CPU importing torch, torchvision, Lightning and
torchmetrics before it reads its config, more than a short 2-rank fit spends training; the default
run starts a few hundred commands on 2 cores (README, Tests, has the measurement). `ddp-app` itself
already works this way: its launcher forks the ranks after the imports (app/cluster/launch.py).

How: one zygote per test process (`python tests/helpers/zygote.py SOCKET`) imports `PRELOADED` and
waits. Each command is one connection: the test sends argv, cwd, environment and its
stdin/stdout/stderr file descriptors (SCM_RIGHTS); the zygote forks a child that takes them,
starts a session of its own (as `start_new_session=True`), runs `app.__main__.main()` as the
console script would, and ends the way the interpreter ends (non-daemon threads joined, atexit
handlers run, exit status from SystemExit, traceback and status 1 for an uncaught exception, death
by SIGINT for an uncaught KeyboardInterrupt). The zygote sends the child's pid, then its wait status.

What differs from a new interpreter, and how the tests stay honest about it:
- What the interpreter, torch or Lightning read from the environment while importing cannot change
  per command: a command whose environment differs from the zygote's in such a variable
  (`STARTUP_VARIABLES`) is started as a new interpreter instead. So is everything that is neither
  `ddp-app` nor `python -m` of the project's own packages (`FORKED_MODULES`): torchrun, srun,
  `python -c`, `python -I ...`; and every command when DDP_APP_TESTS_EXEC=1.
- /proc/PID/environ shows the zygote's environment, not the command's: the job's processes are
  found by a pipe every one of them holds (`marker`), see tests/helpers/run.py `live_job_processes`.
- The README's commands, the Slurm tier and torchrun still start real interpreters
  (tests/test_readme_tour.py, tests/slurm/), as do the product's own launches: the reference's
  `mp.spawn` ranks, and the fits `ddp-app resume-check`, sweeps and benches start themselves.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

# Read while Python, torch or Lightning import (Lightning's rank_zero_only reads the rank variables,
# torch TORCH_CPP_LOG_LEVEL), or by the launcher before it forks: a difference starts a new interpreter.
STARTUP_VARIABLES = ("PYTHON", "TORCH", "PL_", "LIGHTNING", "DDP_APP_VERBOSE", "SLURM", "RANK", "LOCAL_RANK",
                     "WORLD_SIZE", "GROUP_RANK", "JSM_", "PMI", "OMPI_", "OMP_", "MKL_", "KMP_", "LD_", "CUDA",
                     "NCCL", "MALLOC", "HOME", "TMPDIR")  # fmt: skip
FDS = 4  # stdin, stdout, stderr, the job marker
# What `ddp-app` imports first, and TensorBoard's writer, which most commands import later once per rank
# (not sklearn's datasets: importing them starts jemalloc's background thread, see `serve`).
PRELOADED = ("app.__main__", "app.cli.entry", "torch.utils.tensorboard")


# `python -m MODULE` for these packages is forked too: the project's own tools (app.reference, app.bench,
# app.sweep, app.plot, ...) and the tests' helper programs, which import what `ddp-app` imports.
FORKED_MODULES = ("app", "tests")


def startup_environment(env: Mapping[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items() if key.startswith(STARTUP_VARIABLES)}


def python_module(argv: list[str]) -> str | None:
    """MODULE of `PYTHON -m MODULE ...` (exactly that: no other interpreter option), else None."""
    if len(argv) >= 3 and argv[1] == "-m" and argv[2].split(".")[0] in FORKED_MODULES:
        return argv[2]
    return None


# ---- the zygote (this file run as a script) ----


def _exit_like_the_interpreter(run: Callable[[], object]) -> None:
    """Run `run()` and end this process as `python script` would end after it."""
    code, interrupted = 0, False
    try:
        run()
    except SystemExit as request:
        if request.code is None:
            code = 0
        elif isinstance(request.code, int):
            code = request.code
        else:
            print(request.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        interrupted = True
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # the interpreter joins non-daemon threads first (private; docs/private_apis.md)
    atexit._run_exitfuncs()  # then runs atexit (private; docs/private_apis.md)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    if interrupted:  # since 3.8 an uncaught KeyboardInterrupt ends the process by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _child(request: dict, fds: list[int], bin_dir: str) -> None:
    os.setsid()
    from app.cluster.launch import recreate_thread_pools

    recreate_thread_pools()  # as a forked rank does, before any thread: the first use after a fork races
    for number, fd in enumerate(fds[:3]):
        os.dup2(fd, number)
    for fd in fds[:3]:
        if fd > 2:
            os.close(fd)
    os.set_inheritable(fds[3], False)  # kept by forked ranks and loader workers, not by exec'd programs
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    module = python_module(request["argv"])
    if module is None:  # the console script
        sys.argv = request["argv"]
        sys.path[0] = bin_dir  # a console script's first sys.path entry is its own directory
        from app.__main__ import main

        _exit_like_the_interpreter(main)
    else:
        # `python -m MODULE ARGS` as the interpreter runs it: the working directory first on sys.path,
        # the module executed as __main__ (not the copy `PRELOADED` imported), sys.argv[0] its file.
        sys.argv = [module, *request["argv"][3:]]
        sys.path[0] = os.getcwd()
        for name in (module, f"{module}.__main__"):
            sys.modules.pop(name, None)
        _exit_like_the_interpreter(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True))


def serve(socket_path: str) -> None:
    threads = os.listdir("/proc/self/task")
    if len(threads) != 1:  # a fork copies only the calling thread: a library's own thread would be missing
        names = [Path(f"/proc/self/task/{thread}/comm").read_text().strip() for thread in threads]
        raise SystemExit(f"the test zygote must fork from one thread; the imports started {names}")
    bin_dir = str(Path(sys.executable).parent)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    print("ready", flush=True)
    jobs: dict[int, socket.socket] = {}
    while True:
        readable, _, _ = select.select([listener, wake_read], [], [])
        if wake_read in readable:
            os.read(wake_read, 4096)
        while jobs:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            connection = jobs.pop(pid, None)
            if connection is not None:
                connection.sendall(json.dumps({"status": status}).encode() + b"\n")
                connection.close()
        if listener in readable:
            connection, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(connection, 1 << 20, FDS)
            request = json.loads(message)
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in jobs.values():
                    other.close()
                connection.close()
                os.close(wake_read)
                os.close(wake_write)
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                _child(request, fds, bin_dir)
            for fd in fds:
                os.close(fd)
            jobs[pid] = connection
            connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")


# ---- the tests' side ----


class Zygote:
    """The zygote of this test process, started on first use and stopped by `stop` (tests/conftest.py)."""

    def __init__(self, env: Mapping[str, str], directory: Path) -> None:
        self.env = dict(env)
        self.socket_path = str(directory / "zygote.sock")
        self.log = directory / "zygote.log"
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                [sys.executable, __file__, self.socket_path], env=self.env, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=log, start_new_session=True,
            )  # fmt: skip
        ready = self.process.stdout.readline()
        if ready.strip() != b"ready":
            self.stop()
            raise RuntimeError(f"the test zygote did not start: {self.log.read_text()[-2000:]}")

    def serves(self, args: list[str], env: Mapping[str, str]) -> bool:
        command = Path(args[0]) if args else None
        return (
            self.process.poll() is None
            and (
                command == Path(sys.executable).parent / "ddp-app"
                or (command == Path(sys.executable) and python_module(args) is not None)
            )
            and startup_environment(env) == startup_environment(self.env)
        )

    def start(self, args: list[str], env: Mapping[str, str], cwd: Path, stdin: int, stdout: int, stderr: int):
        """Fork the command; returns (pid, the connection its wait status comes on, the marker's /proc link)."""
        marker_read, marker_write = os.pipe()
        marker = f"pipe:[{os.fstat(marker_read).st_ino}]"
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.connect(self.socket_path)
            request = {"argv": list(args), "cwd": str(cwd), "env": dict(env)}
            socket.send_fds(connection, [json.dumps(request).encode()], [stdin, stdout, stderr, marker_read])
            reply = json.loads(_read_line(connection))
        except BaseException:
            connection.close()
            raise
        finally:
            os.close(marker_read)  # this process must not hold the marker: kill_job would count it in
            os.close(marker_write)
        return reply["pid"], connection, marker

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.process.stdout.close()


def _read_line(connection: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = connection.recv(4096)
        if not chunk:
            raise ConnectionError("the test zygote closed the connection")
        data += chunk
    return data


class ForkedCommand:
    """The part of `subprocess.Popen` the tests use, for a command the zygote forked (text pipes)."""

    def __init__(
        self, args: list[str], zygote: Zygote, env: Mapping[str, str], cwd: Path, stdout: Any, stderr: Any
    ) -> None:
        """`stdout`, `stderr`: as Popen's (PIPE, STDOUT for stderr, DEVNULL, or an open file)."""
        self.args = args
        self.returncode: int | None = None
        self.stdout: Any = None
        self.stderr: Any = None
        pipes: dict[str, int] = {}  # name: read end
        with open(os.devnull, "r+b") as devnull:
            targets = []
            for name, target in (("stdout", stdout), ("stderr", stderr)):
                if target == subprocess.PIPE:
                    pipes[name], write = os.pipe()
                    targets.append(write)
                elif target == subprocess.STDOUT:
                    targets.append(targets[0])
                elif target == subprocess.DEVNULL or target is None:
                    targets.append(devnull.fileno())
                else:
                    targets.append(target.fileno())
            try:
                self.pid, self._connection, self.marker = zygote.start(args, env, cwd, devnull.fileno(), *targets)
            finally:
                for name in pipes:
                    os.close(targets[0 if name == "stdout" else 1])
        for name, read in pipes.items():
            setattr(self, name, open(read, encoding="utf-8", errors="replace"))  # noqa: SIM115 - closed by _drain
        self._chunks: dict[str, list[str]] = {name: [] for name in pipes}
        self._readers: list[threading.Thread] = []  # started by communicate, as Popen reads only there

    def _drain(self, name: str) -> None:
        stream = getattr(self, name)
        self._chunks[name].append(stream.read())
        stream.close()

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._connection], [], [], 0)[0]:
            self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._connection], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read_status()
        return self.returncode

    def _read_status(self) -> None:
        status = json.loads(_read_line(self._connection))["status"]
        self._connection.close()
        self.returncode = os.waitstatus_to_exitcode(status)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        if not self._readers:
            for name in self._chunks:
                self._readers.append(threading.Thread(target=self._drain, args=(name,), daemon=True))
                self._readers[-1].start()
        self.wait(timeout)
        for reader in self._readers:  # the pipes close when the last process holding them ends
            reader.join(timeout)
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        return "".join(self._chunks.get("stdout", [])), "".join(self._chunks.get("stderr", []))

    def send_signal(self, number: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, number)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


if __name__ == "__main__":
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # what app.__main__ sets before torch loads
    for name in PRELOADED:
        importlib.import_module(name)
    serve(sys.argv[1])
