"""Run the project's commands as a user would: as subprocesses, with a deadline."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.cluster.launch import env_without_launcher
from tests.helpers.zygote import ForkedCommand, Zygote

if TYPE_CHECKING:
    from app.cli.resume_check import Runner

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


# Every process a test starts inherits this variable with a value of its own, by which
# `live_job_processes` finds them all, wherever they were re-parented.
JOB_TAG = "DDP_APP_TEST_JOB"


def clean_env(**extra: str) -> dict[str, str]:
    env = env_without_launcher(os.environ)
    env[JOB_TAG] = uuid.uuid4().hex
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


_zygote: Zygote | None = None
EXEC_ONLY = os.environ.get("DDP_APP_TESTS_EXEC") == "1"


def zygote() -> Zygote | None:
    """This test process's zygote (tests/helpers/zygote.py), started on first use; None when
    DDP_APP_TESTS_EXEC=1 asks for a new interpreter per command."""
    global _zygote
    if EXEC_ONLY:
        return None
    if _zygote is None:
        env = clean_env()
        del env[JOB_TAG]
        _zygote = Zygote(env, Path(tempfile.mkdtemp(prefix="ddp-app-zygote-")))
    return _zygote


def stop_zygote() -> None:
    """Called at the end of the session (tests/conftest.py)."""
    if _zygote is not None:
        _zygote.stop()
        shutil.rmtree(Path(_zygote.socket_path).parent, ignore_errors=True)


def start(
    args: list[str],
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    stdout: Any = subprocess.PIPE,
    stderr: Any = subprocess.PIPE,
) -> subprocess.Popen[str]:
    """Start a command in the background in its own session (its output piped, as text, unless
    `stdout`/`stderr` say otherwise, as Popen's do); stop it with `kill_job`. A `ddp-app` command is
    forked from the zygote where it can be (tests/helpers/zygote.py says why)."""
    env = env or clean_env()
    forker = zygote()
    if forker is not None and forker.serves(args, env):
        command = ForkedCommand(args, forker, env, cwd or REPO, stdout, stderr)
        _job_tags[command.pid] = (f"{JOB_TAG}={env[JOB_TAG]}".encode() if JOB_TAG in env else None, command.marker)
        return command  # type: ignore[return-value]  # Popen's interface, as far as the tests use it
    return start_interpreter(args, env, cwd, stdout, stderr)


def start_interpreter(
    args: list[str],
    env: dict[str, str],
    cwd: Path | None = None,
    stdout: Any = subprocess.PIPE,
    stderr: Any = subprocess.PIPE,
) -> subprocess.Popen[str]:
    """`start` as a new process that runs `args`, never forked from the zygote."""
    return subprocess.Popen(
        args, cwd=cwd or REPO, env=env, stdout=stdout, stderr=stderr, text=True, start_new_session=True
    )


def run(
    args: list[str], timeout: float = 300, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a command in its own process group; on timeout kill the whole group (all ranks)."""
    process = start(args, env=env, cwd=cwd)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_job(process.pid)
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise AssertionError(f"{args} did not finish in {timeout} s\n{stdout[-3000:]}\n{stderr[-3000:]}") from None
    finally:
        if process.poll() is None:
            kill_job(process.pid)
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    check_marked_distributed(stdout)
    return subprocess.CompletedProcess(args, process.returncode, stdout, stderr)


# The markers of the running test, set by an autouse fixture in tests/conftest.py.
CURRENT_MARKERS: set[str] = set()
# Rank 0's launch line: "ddp-app: launched as a plain command: ..., world size 2 = ...".
MULTI_RANK_LAUNCH = re.compile(r"ddp-app: launched .*world size ([2-9]|\d{2,})")


def check_marked_distributed(stdout: str) -> None:
    """A test whose command started several ranks must say so with the `distributed` marker, so that
    `-m "not distributed"` (and the quick tier) stay fast and free of process groups."""
    if MULTI_RANK_LAUNCH.search(stdout) and "distributed" not in CURRENT_MARKERS:
        raise AssertionError("this test started several ranks: mark it @pytest.mark.distributed")


def ddp_app(*args: str, timeout: float = 300, cwd: Path | None = None, env: dict[str, str] | None = None):
    return run([str(BIN / "ddp-app"), *args], timeout=timeout, cwd=cwd, env=env)


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat fields after the command name (state, ppid, pgrp, session, ...), or None if gone."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _environ(pid: int) -> list[bytes]:
    try:
        return (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return []


# {job's first pid: (its JOB_TAG entry, the /proc fd link of its zygote marker)}
_job_tags: dict[int, tuple[bytes | None, str | None]] = {}


def _holds(pid: int, marker: str) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}") == marker:
                return True
    return False


def live_job_processes(root: int) -> list[int]:
    """PIDs of the job started as `root` that are still running (zombies are not counted).

    A job's processes are found by the JOB_TAG variable they all inherit from `clean_env()`: the
    ddp-app launcher starts each rank in a session of its own, and a rank whose launcher was killed
    is no longer its child, but it must be counted until it is gone. A command forked from the test
    zygote has the zygote's /proc environ: its processes are found by the marker pipe they hold.
    """
    if root not in _job_tags:
        tags = [entry for entry in _environ(root) if entry.startswith(JOB_TAG.encode() + b"=")]
        if not tags:
            return [root] if (_stat(root) or ["Z"])[0] != "Z" else []
        _job_tags[root] = (tags[0], None)
    tag, marker = _job_tags[root]
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        if (tag is not None and tag in _environ(pid)) or (marker is not None and _holds(pid, marker)):
            fields = _stat(pid)
            if fields is not None and fields[0] != "Z":
                members.append(pid)
    return members


def local_rank_of(pid: int) -> int | None:
    """A rank's local rank: from its name (ddp-app forks its ranks, see `rank_process_name`), or
    from LOCAL_RANK in the environment it was started with (torchrun, srun, Lightning's launcher)."""
    try:
        name = (Path("/proc") / str(pid) / "comm").read_text().strip()
    except OSError:
        return None
    if name.startswith("ddp-app rank "):
        return int(name.removeprefix("ddp-app rank "))
    for entry in _environ(pid):
        if entry.startswith(b"LOCAL_RANK="):
            return int(entry.split(b"=", 1)[1].decode())
    return None


def rank_pids(root: int) -> dict[int, int]:
    """{local rank: pid} for the job's rank processes."""
    return {rank: pid for pid in live_job_processes(root) if (rank := local_rank_of(pid)) is not None}


def seconds_to_exit(process: subprocess.Popen, timeout: float) -> float:
    """Wait for `process` to exit (at most `timeout` s); the seconds it took."""
    start = time.monotonic()
    process.wait(timeout=timeout)
    return time.monotonic() - start


def kill_job(root: int) -> None:
    """SIGKILL every process of the job (cleanup in a `finally`)."""
    for pid in live_job_processes(root):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def train(config: str, root: Path, epochs: int, *overrides: str, timeout: float = 240) -> Path:
    """`ddp-app fit` for a short run that must succeed; returns its last.ckpt."""
    result = ddp_app(
        "fit", "--config", config, f"--trainer.max_epochs={epochs}", "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={root}", *overrides, timeout=timeout,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "checkpoints" / "last.ckpt"


def copy_of(run_directory: Path, destination: Path) -> Path:
    """A writable copy of a shared run directory (a test that runs ddp-app in it, or changes a file)."""
    shutil.copytree(run_directory, destination)
    return destination


def resume_on_3_ranks(runner: Runner, root: Path, stop: str) -> int:
    """`runner`'s 2-rank fit stopped mid-run by `stop` (a max_steps budget), resumed on 3 ranks with
    `--ckpt_path last`: the global batch of 32 is kept, and the weights end within rounding of the
    uninterrupted run's (its other summation order). Returns the global step both ended at."""
    from app.checkpoints.io import safe_load  # torch: only for the tests that call this

    expected = safe_load(runner.baseline("default") / "checkpoints" / "last.ckpt")
    env = clean_env(DDP_APP_ALLOW_OVERSUBSCRIBE="1")  # 3 ranks with 2 workers each on a 2-core machine
    common = ["fit", *runner.base_args, f"--trainer.default_root_dir={root}", "--trainer.enable_progress_bar=false"]
    common.append(f"--trainer.max_epochs={runner.epochs}")
    for extra in ([stop], ["--trainer.devices=3", "--ckpt_path=last"]):
        result = ddp_app(*common, *extra, timeout=300, env=env)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    line = "ddp-app: resuming a 2-rank run on 3 ranks: global batch 32 kept (11+11+10 per micro-step)"
    assert line in result.stderr, result.stderr[-3000:]
    actual = safe_load(root / "checkpoints" / "last.ckpt")
    assert actual["global_step"] == expected["global_step"]
    for name, value in expected["state_dict"].items():
        scale = float(value.abs().max()) or 1.0
        assert float((actual["state_dict"][name] - value).abs().max()) / scale <= 1e-5, name
    return actual["global_step"]


def run_logged(args: list[str], log: Path, timeout: float) -> int:
    """`ddp-app ARGS`, its output appended to `log`, started by `start`; its exit code. The `run_command`
    of the resume harness's fits in the tests (`fit_runner`)."""
    with log.open("a") as out:
        process = start([str(BIN / "ddp-app"), *args], stdout=out, stderr=subprocess.STDOUT)
    try:
        return process.wait(timeout=timeout)
    finally:
        if process.poll() is None:
            kill_job(process.pid)
            process.wait()


def fit_runner(*args: Any, **kwargs: Any) -> Runner:
    """`app.cli.resume_check.Runner` whose fits are forked from the zygote where they can be."""
    from app.cli.resume_check import Runner

    return Runner(*args, run_command=run_logged, **kwargs)


def float64_runner(config: str, data_dir: Path, root: Path, epochs: int) -> Runner:
    """A resume `Runner` of `config` on `data_dir`, without dropout and in float64, so that a resume on
    3 ranks (another summation order, `resume_on_3_ranks`) stays at rounding level
    (tests/fault/test_elastic_resume.py says why); the exact resume depends on neither."""
    overrides = ["--model.init_args.dropout=false", "--trainer.precision=64-true"]
    return fit_runner(["--config", config, f"--data.init_args.data_dir={data_dir}", *overrides], root, epochs=epochs)
