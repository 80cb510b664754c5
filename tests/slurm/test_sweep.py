"""A sweep as a Slurm job array on the two-node test cluster: 4 grid points, 2 at a time, one of
them preempted mid-run, requeued and continued from its checkpoint to the weights of an
uninterrupted run of that point; the table lists all 4."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from localcluster import LocalSlurmCluster

from app.checkpoints.io import safe_load
from tests.helpers.run import BIN, ddp_app

pytestmark = [pytest.mark.slurm, pytest.mark.fault, pytest.mark.distributed]

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "digits.yaml")
# Each point trains 6 epochs of 20 steps at 2 ranks (one node); the learning rate is swept.
OVERRIDES = ["--trainer.max_epochs=6", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
LRS = ["0.001", "0.002", "0.004", "0.008"]
SBATCH = ["--sbatch=--gpus-per-node=0", "--sbatch=--cpus-per-task=1", "--sbatch=--time=5"]


def sweep(slurm_cluster: LocalSlurmCluster, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        **slurm_cluster.env,
        "PATH": f"{BIN}{os.pathsep}{slurm_cluster.env.get('PATH', os.environ['PATH'])}",
    }
    return subprocess.run([sys.executable, "-m", "app.sweep", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def rank_of_point(pid: int, point_dir: Path) -> bool:
    """Whether process `pid` is a ddp-app rank of the point run in `point_dir`."""
    try:
        command = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"app" in command and f"--trainer.default_root_dir={point_dir}".encode() in command


def points(directory: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(directory.glob("points/*/point.json"))]


def test_a_sweep_array_with_a_preempted_task_completes_every_point(
    slurm_cluster: LocalSlurmCluster, tmp_path: Path
) -> None:
    out = tmp_path / "sweep"
    (tmp_path / "logs").mkdir()
    grid = f"--grid=optimizer.init_args.lr={','.join(LRS)}"
    slurm = ["--slurm", str(REPO / "slurm" / "sweep.sbatch"), "--array-parallel", "2", *SBATCH]
    submitted = sweep(
        slurm_cluster, "run", "--config", CONFIG, "--out", str(out), grid, *slurm, *OVERRIDES, cwd=tmp_path
    )
    assert submitted.returncode == 0, submitted.stderr
    array_job = submitted.stdout.split("job array ")[1].split(":")[0]
    try:
        # Preempt the first point to have trained an epoch, through its array task's own job id.
        deadline, victim = time.monotonic() + 180, None
        while victim is None:
            assert time.monotonic() < deadline, f"no point trained an epoch within 180 s: {points(out)}"
            for point in points(out):
                if (
                    point["state"] == "running"
                    and (out / "points" / f"{point['number']:03d}" / "checkpoints" / "last.ckpt").exists()
                ):
                    victim = point
                    break
            time.sleep(0.2)
        # SIGUSR1 to the point's ranks, as Slurm's --signal delivers it before a preemption. (Not
        # `scancel --signal`: it retries while the job is being requeued, "Job can not be altered now",
        # and its retry reaches the requeued attempt's ranks before they handle signals.)
        point_dir = out / "points" / f"{victim['number']:03d}"
        ranks = [pid for pid in os.listdir("/proc") if pid.isdigit() and rank_of_point(int(pid), point_dir)]
        assert ranks, f"no rank of point {victim['number']} found"
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGUSR1)
        deadline = time.monotonic() + 600
        while True:
            queue = slurm_cluster.run(["squeue", "-h", "-o", "%i", "-j", array_job], check=False).stdout.split()
            if not queue:
                break
            assert time.monotonic() < deadline, f"the array did not finish within 600 s: {queue}"
            time.sleep(1)
    finally:
        slurm_cluster.run(["scancel", array_job], check=False)

    status = sweep(slurm_cluster, "status", str(out), cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    assert status.stdout.strip().endswith("4 point(s): 4 done"), status.stdout
    final = points(out)
    assert [point["state"] for point in final] == ["done"] * 4
    preempted = next(point for point in final if point["number"] == victim["number"])
    # The requeue ends the first attempt's batch script before it notes an exit code.
    first, second = preempted["attempts"]
    assert first["requeued"] and first["slurm_job"] == second["slurm_job"] and second["exit_code"] == 0, preempted
    with (out / "results.csv").open() as file:
        rows = list(csv.DictReader(file))
    assert [row["optimizer.init_args.lr"] for row in rows] == LRS and all(row["best val_acc"] for row in rows)
    assert (out / "results.md").read_text().count("| done |") == 4

    # The preempted point ends with the weights of an uninterrupted run of the same point.
    lr = victim["params"]["optimizer.init_args.lr"]
    alone = tmp_path / "alone"
    result = ddp_app("fit", "--config", CONFIG, *OVERRIDES, f"--optimizer.init_args.lr={lr}",
                     f"--trainer.default_root_dir={alone}", timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    expected = safe_load(alone / "checkpoints" / "last.ckpt")["state_dict"]
    actual = safe_load(out / "points" / f"{victim['number']:03d}" / "checkpoints" / "last.ckpt")["state_dict"]
    assert expected.keys() == actual.keys()
    assert all(expected[name].equal(actual[name]) for name in expected), "the requeued point's weights differ"


def test_a_bad_sweep_spec_is_one_line_and_submits_nothing(slurm_cluster: LocalSlurmCluster, tmp_path: Path) -> None:
    script = str(REPO / "slurm" / "sweep.sbatch")
    for spec, message in (
        (["--grid=optimizer.init_args.lrr=0.1,0.2"], "lrr"),
        (["--search=optimizer.init_args.lr=uniform:0.1:0.1", "--trials=2"], "empty range"),
        (["--search=optimizer.init_args.lr=gaussian:0:1", "--trials=2"], "unknown distribution 'gaussian'"),
    ):
        bad = ["run", "--config", CONFIG, "--out", str(tmp_path / "bad"), *spec, "--slurm", script]
        result = sweep(slurm_cluster, *bad, cwd=tmp_path)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and message in lines[0], result.stderr
        assert lines[0].startswith("app.sweep: error: ")
    assert not (tmp_path / "bad").exists()
    assert slurm_cluster.run(["squeue", "-h", "-o", "%i"]).stdout.strip() == ""
