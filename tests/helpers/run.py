"""Run the project's commands as a user would: as subprocesses, with a deadline."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from app.cluster.launch import env_without_launcher

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def clean_env(**extra: str) -> dict[str, str]:
    env = env_without_launcher(os.environ)
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


def local_rank_of(pid: int) -> str | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for entry in environ:
        if entry.startswith(b"LOCAL_RANK="):
            return entry.split(b"=", 1)[1].decode()
    return None


def rank_pids(group: int) -> dict[int, int]:
    """{local rank: pid} for the job's rank processes (the one without LOCAL_RANK is rank 0
    when Lightning's own launcher started rank 1 from it)."""
    members = [
        pid
        for pid in live_group_members(group)
        if b"ddp-app" in Path(f"/proc/{pid}/cmdline").read_bytes()
        or b"app" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    ranks = {int(rank): pid for pid in members if (rank := local_rank_of(pid)) is not None}
    if 0 not in ranks and 1 in ranks:
        parent = int(Path(f"/proc/{ranks[1]}/stat").read_text().rsplit(")", 1)[1].split()[1])
        ranks[0] = parent
    return ranks


def train(config: str, root: Path, epochs: int, *overrides: str, timeout: float = 240) -> Path:
    """`ddp-app fit` for a short run that must succeed; returns its last.ckpt."""
    result = ddp_app(
        "fit", "--config", config, f"--trainer.max_epochs={epochs}", "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={root}", *overrides, timeout=timeout,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "checkpoints" / "last.ckpt"
