"""Run one training command (reference or Lightning) and turn its ranks' timings into figures."""

from __future__ import annotations

import copy
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from app.bench.recorder import DIR_VARIABLE, LAUNCH_TIME_VARIABLE, PROFILE_VARIABLE
from app.cluster.launch import env_without_launcher

SIDES = ("reference", "lightning")
# The framework-free limit (app/bench/bare.py), run at world size 1 beside each pair.
BARE = "bare"
TIMER_CALLBACK = {"class_path": "app.bench.callback.BenchTimer"}


@dataclass
class RunResult:
    """One launch of one side at one world size."""

    side: str
    world_size: int
    repeat: int
    steps: int  # timed steps on rank 0 (after warm-up)
    step_ms: float  # median over epochs of the epoch's mean step time: includes periodic costs
    step_median_ms: float  # median over single steps: hides costs paid every N steps (logging)
    step_cpu_ms: float  # like step_ms, in rank 0's main-thread CPU time: the work without the waiting
    step_host_ms: float  # like step_ms, between the host's step starts (on a GPU step_ms is the GPU's)
    first_step_ms: float  # rank 0's first training step (to the second's start): includes compiling
    samples_per_s: float
    first_step_s: float  # launch -> the last rank starts its first training step
    teardown_s: float  # the last rank's last training step -> every process has exited
    total_s: float
    peak_rss_mb: list[float] = field(default_factory=list)  # per rank
    cuda_max_allocated_mb: list[float] = field(default_factory=list)  # per rank, GPUs only


def variant_config(base: dict[str, Any], world_size: int, accelerator: str, max_epochs: int | None, path: Path) -> Path:
    """The config both sides run at one world size: the user's, plus the Lightning timing callback."""
    config = copy.deepcopy(base)
    trainer = config.setdefault("trainer", {})
    trainer.update(devices=world_size, num_nodes=1, accelerator=accelerator)
    if max_epochs is not None:
        trainer["max_epochs"] = max_epochs
    callbacks = trainer.get("callbacks") or []
    trainer["callbacks"] = [*(callbacks if isinstance(callbacks, list) else [callbacks]), TIMER_CALLBACK]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def command(side: str, config: Path, world_size: int, run_dir: Path) -> list[str]:
    if side == BARE:
        return [sys.executable, "-m", "app.bench.bare", "--config", str(config)]
    if side == "reference":
        return [
            sys.executable,
            "-m",
            "app.bench.reference",
            "--config",
            str(config),
            "--out",
            str(run_dir / "reference"),
            "--world-size",
            str(world_size),
            "--save-every",
            "1",  # a snapshot every epoch, as Lightning's ModelCheckpoint saves every epoch
        ]
    return [sys.executable, "-m", "app", "fit", "--config", str(config), f"--trainer.default_root_dir={run_dir}"]


@functools.cache
def gpus_present() -> bool:
    """Whether this machine shows CUDA devices (the bench's own process; the runs are other processes)."""
    import torch

    return torch.cuda.device_count() > 0


def run_env(accelerator: str, timings: Path, profile: str | None = None) -> dict[str, str]:
    env = env_without_launcher(os.environ)
    if profile:
        env[PROFILE_VARIABLE] = profile
    env.setdefault("OMP_NUM_THREADS", "1")
    if accelerator == "cpu" and gpus_present():
        # The reference picks CUDA whenever it sees a GPU. Only then: on a machine without GPUs the variable would also
        # hide a cost users pay there (`app.cli.entry.allow_plain_cuda_availability_checks`).
        env["CUDA_VISIBLE_DEVICES"] = ""
    env[DIR_VARIABLE] = str(timings)
    return env


def launch(args: list[str], env: dict[str, str], log: Path, timeout_s: float) -> tuple[float, float]:
    """Run a command in its own process group; returns (launch time, exit time), wall clock."""
    with log.open("w") as output:
        env[LAUNCH_TIME_VARIABLE] = repr(started := time.time())
        process = subprocess.Popen(args, stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            returncode = process.wait(timeout=timeout_s)
        except BaseException:  # timeout, Ctrl-C: take every rank down with it
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise
        exited = time.time()
    if returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-20:])
        raise RuntimeError(f"benchmark run failed (exit code {returncode}): {' '.join(args)}\nlog {log}:\n{tail}")
    return started, exited


def epoch_step_times(
    record: dict[str, Any], warmup_steps: int, clock: str = "starts"
) -> tuple[list[float], list[list[float]]]:
    """(every steady-state step interval, the same grouped by epoch), in seconds of `clock` ("starts", "cpu_starts",
    "gpu_starts").

    A step runs from its start to the next's (batch fetch and hooks included); intervals across an epoch boundary and
    the first `warmup_steps` are left out."""
    epochs, starts = record["epochs"], record[clock]
    by_epoch: dict[int, list[float]] = {}
    for index in range(max(warmup_steps, 0), len(starts) - 1):
        if epochs[index] == epochs[index + 1]:
            by_epoch.setdefault(epochs[index], []).append(starts[index + 1] - starts[index])
    grouped = [intervals for intervals in by_epoch.values() if intervals]
    return [interval for intervals in grouped for interval in intervals], grouped


def wall_time(record: dict[str, Any], perf_time: float) -> float:
    return record["wall_anchor"] + (perf_time - record["perf_anchor"])


def summarize_run(
    side: str,
    world_size: int,
    repeat: int,
    timings: Path,
    started: float,
    exited: float,
    per_rank_batch_size: int,
    warmup_steps: int,
) -> RunResult:
    records = [json.loads((timings / f"{side}-rank{rank}.json").read_text()) for rank in range(world_size)]
    if any(not record["starts"] for record in records):
        raise RuntimeError(f"{side} at world size {world_size} recorded no training step (see {timings.parent}).")
    intervals, grouped = epoch_step_times(records[0], warmup_steps)
    if not intervals:
        raise RuntimeError(
            f"{side} at world size {world_size} ran too few steps to time after {warmup_steps} warm-up steps: "
            "raise trainer.max_epochs (--epochs) or the dataset size."
        )
    host_step_s = statistics.median(sum(epoch) / len(epoch) for epoch in grouped)
    if "gpu_starts" in records[0]:  # on a GPU: when the GPU reached each step (StepRecorder.gpu_events)
        intervals, grouped = epoch_step_times(records[0], warmup_steps, clock="gpu_starts")
    step_s = statistics.median(sum(epoch) / len(epoch) for epoch in grouped)
    _, cpu_grouped = epoch_step_times(records[0], warmup_steps, clock="cpu_starts")
    step_cpu_s = statistics.median(sum(epoch) / len(epoch) for epoch in cpu_grouped)
    first_step = max(wall_time(record, record["starts"][0]) for record in records)
    last_step_end = max(wall_time(record, record["ends"][-1]) for record in records)
    return RunResult(
        side=side,
        world_size=world_size,
        repeat=repeat,
        steps=len(intervals),
        step_ms=step_s * 1e3,
        step_host_ms=host_step_s * 1e3,
        step_median_ms=statistics.median(intervals) * 1e3,
        step_cpu_ms=step_cpu_s * 1e3,
        first_step_ms=(records[0]["starts"][1] - records[0]["starts"][0]) * 1e3 if len(records[0]["starts"]) > 1 else 0,
        samples_per_s=world_size * per_rank_batch_size / step_s,
        first_step_s=first_step - started,
        teardown_s=exited - last_step_end,
        total_s=exited - started,
        peak_rss_mb=[record["peak_rss_mb"] for record in records],
        cuda_max_allocated_mb=[
            record["cuda_max_allocated_mb"] for record in records if record["cuda_max_allocated_mb"] is not None
        ],
    )
