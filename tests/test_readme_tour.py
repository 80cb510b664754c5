"""The README's quick start and tour, typed in order as a newcomer would, in a fresh copy of the
repository: every command works as written, one after the other, and writes only under `runs/`.

The commands are read from the README's bash blocks (the sbatch lines are left to the Slurm tier),
so a README edit that breaks the order breaks this test. Every command runs exactly as written, but
the parity command (see NOT_RUN).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.run import BIN, REPO, clean_env, kill_job, start

pytestmark = pytest.mark.distributed

SECTION = ("## Quick start", "## Where things are")
# Run elsewhere: the Slurm tier submits the sbatch scripts to a real cluster, and the parity command
# (5 to 9 minutes; 4 even with one epoch and one optimizer) has its own test in the slow tier
# (tests/parity/test_parity.py).
NOT_RUN = ("sbatch slurm/", "python -m app.parity --config configs/digits.yaml")
TIMEOUT_S = 540  # under pytest-timeout's 600 s, so that a stuck tour says where it stopped


def tour_commands(readme: str) -> list[str]:
    """The shell commands of the README's bash blocks from the quick start to the end of the tour,
    in order, comments and line continuations removed."""
    section = readme[readme.index(SECTION[0]) : readme.index(SECTION[1])]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(shlex.join(words))
    return commands


def running_environment() -> Path | None:
    """The virtual environment whose interpreter runs these tests (sys.prefix), if it is one a shell
    can activate: the quick start's .venv, or any other a developer or CI runs pytest from."""
    prefix = Path(sys.prefix)
    if prefix == Path(sys.base_prefix) or not (prefix / "bin" / "activate").is_file():
        return None
    return prefix


def fresh_copy(destination: Path, environment: Path) -> Path:
    """What a clone holds (the tracked files, with their times), and `environment` as the quick start
    would have left it in .venv: its contents linked, its install stamp new, so quickstart.sh installs
    nothing and `source .venv/bin/activate` puts that environment's ddp-app on the PATH."""
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=60
    ).stdout.split(b"\0")
    for name in filter(None, tracked):
        source = REPO / name.decode()
        if source.is_file():
            target = destination / name.decode()
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    venv = destination / ".venv"
    venv.mkdir()
    for entry in environment.iterdir():
        if entry.name != ".installed":
            (venv / entry.name).symlink_to(entry)
    (venv / ".installed").touch()
    return destination


def test_the_readme_tour_works_typed_in_order(tmp_path: Path) -> None:
    written = tour_commands((REPO / "README.md").read_text())
    for left_out in NOT_RUN:
        assert any(command.startswith(left_out) for command in written), f"no {left_out!r} in the tour: update NOT_RUN"
    commands = [command for command in written if not command.startswith(NOT_RUN)]
    assert commands[:2] == ["./quickstart.sh train", "source .venv/bin/activate"], commands[:2]
    environment = running_environment()
    if environment is None:
        pytest.skip(f"the tour activates .venv, and these tests run from {sys.prefix}, which is no virtual environment")
    repo = fresh_copy(tmp_path / "clone", environment)
    before = {path.name for path in repo.iterdir()}
    lines = ["set -euo pipefail"]
    for number, command in enumerate(commands):
        lines += [command, f'echo "@@ {number} done $SECONDS s" >&2']
    (tmp_path / "tour.sh").write_text("\n".join(lines) + "\n")
    env = clean_env()
    # A newcomer's shell: no virtual environment on the PATH until the tour activates it.
    env["PATH"] = os.pathsep.join(part for part in env["PATH"].split(os.pathsep) if Path(part) != BIN)
    env.pop("VIRTUAL_ENV", None)
    process = start(["bash", str(tmp_path / "tour.sh")], env=env, cwd=repo)
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:  # the assertion below names the command it stopped at
        kill_job(process.pid)
        process.kill()
        stdout, stderr = process.communicate()
    finally:
        kill_job(process.pid)
        if process.poll() is None:
            process.kill()
            process.wait()
    done = re.findall(r"@@ (\d+) done", stderr)
    failed_at = commands[len(done)] if len(done) < len(commands) else None
    assert process.returncode == 0, f"the tour stopped at {failed_at!r}:\n{stdout[-3000:]}\n{stderr[-3000:]}"

    runs = repo / "runs"
    assert {path.name for path in repo.iterdir()} - before == {"runs"}  # nothing loose in the repository root
    assert (runs / "digits" / "predictions.pt").is_file() and (runs / "digits" / "curves.png").is_file()
    # The tour's own run, resumed twice, the second time on one rank: 8 epochs of 20 steps of the global batch.
    tour = torch.load(runs / "tour" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert tour["global_step"] == 8 * 20
    assert (runs / "custom" / "checkpoints" / "last.ckpt").is_file()
    assert (runs / "tracked" / "mlflow.db").is_file() and "mlflow ui --backend-store-uri" in stdout
    assert (runs / "sweeps" / "lr" / "results.csv").is_file()
    assert stdout.count("ddp-app: fit done in") >= 6  # quick start, tour (3), custom, tracked
    assert "ddp-app: validate done in" in stdout and "  metrics: val_acc=" in stdout
    assert "  predictions: runs/digits/predictions.pt" in stdout
