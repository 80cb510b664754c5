"""Run the project's commands as a user would: as subprocesses, with a deadline."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

# Variables a DDP launcher sets; a test must not pass them on to the processes it starts.
DISTRIBUTED_VARIABLES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "PL_GLOBAL_SEED",
    "PL_SEED_WORKERS",
    "TORCHELASTIC_RUN_ID",
)


def clean_env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in DISTRIBUTED_VARIABLES}
    env = {key: value for key, value in env.items() if not key.startswith("SLURM_")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run(
    args: list[str], timeout: float = 300, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a command in its own process group; on timeout kill the whole group (all ranks)."""
    process = subprocess.Popen(
        args,
        cwd=cwd or REPO,
        env=env or clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise AssertionError(f"{args} did not finish in {timeout} s\n{stdout[-3000:]}\n{stderr[-3000:]}") from None
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return subprocess.CompletedProcess(args, process.returncode, stdout, stderr)


def ddp_app(*args: str, timeout: float = 300, cwd: Path | None = None, env: dict[str, str] | None = None):
    return run([str(BIN / "ddp-app"), *args], timeout=timeout, cwd=cwd, env=env)


def live_group_members(pgid: int) -> list[int]:
    """PIDs in process group `pgid` that are still running (zombies, already dead, are not counted)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, group = fields[0], int(fields[2])
        if group == pgid and state != "Z":
            members.append(int(entry.name))
    return members
