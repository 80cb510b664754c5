"""Per-rank timings for `python -m app.bench`, recorded from outside the training code.

The bench sets `APP_BENCH_DIR` (each rank writes `<side>-rank<r>.json`) and `APP_BENCH_LAUNCH_TIME`; without them
nothing is recorded (`StepRecorder.from_env()` returns None). The reference gets a recorder from `app.bench.reference`,
Lightning from `app.bench.callback.BenchTimer`. No Lightning here, so timing the reference does not slow its start.
"""

from __future__ import annotations

import cProfile
import json
import os
import resource
import time
from pathlib import Path
from typing import Any

import torch

from app.bench.profiles import parse_profile_steps

DIR_VARIABLE = "APP_BENCH_DIR"
LAUNCH_TIME_VARIABLE = "APP_BENCH_LAUNCH_TIME"
# "FIRST:COUNT" (`python -m app.bench --profile`): rank 0 runs cProfile, started in its main thread, from the start of
# step FIRST to the start of step FIRST + COUNT, and writes `<side>-rank0.prof`.
PROFILE_VARIABLE = "APP_BENCH_PROFILE"


class StepRecorder:
    """Start and end of every training step (perf_counter), and this rank's peak memory."""

    def __init__(self, out_dir: Path, side: str, rank: int, world_size: int) -> None:
        self.path = out_dir / f"{side}-rank{rank}.json"
        self.side, self.rank, self.world_size = side, rank, world_size
        # One (wall clock, perf_counter) anchor converts step times into wall-clock times, which the bench can compare
        # with its own launch time and exit time (other processes).
        self.wall_anchor, self.perf_anchor = time.time(), time.perf_counter()
        self.epochs: list[int] = []
        self.starts: list[float] = []
        self.ends: list[float] = []
        # This thread's CPU time at each step start: the work a step does, without the waiting (for a peer rank, for a
        # core), which wall-clock step times mix in.
        self.cpu_starts: list[float] = []
        # On a GPU, a timing event queued at each step start times what the GPU did (host-side starts run ahead of it
        # by the driver's queue depth). Whether the process uses CUDA is decided at its first step (None until then).
        self.uses_cuda: bool | None = None
        self.gpu_events: list[torch.cuda.Event] = []
        profile = os.environ.get(PROFILE_VARIABLE) if rank == 0 else None
        self.profile_steps = parse_profile_steps(profile) if profile else None
        self.profiler: cProfile.Profile | None = None

    @classmethod
    def from_env(cls, side: str, rank: int, world_size: int) -> StepRecorder | None:
        out_dir = os.environ.get(DIR_VARIABLE)
        return cls(Path(out_dir), side, rank, world_size) if out_dir else None

    def step_start(self, epoch: int) -> None:
        self.epochs.append(epoch)
        self.starts.append(time.perf_counter())
        self.cpu_starts.append(time.thread_time())
        if self.uses_cuda is None:
            self.uses_cuda = torch.cuda.is_initialized()
        if self.uses_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()  # on the current stream, where the step's work is queued
            self.gpu_events.append(event)
        if self.profile_steps is not None:
            first, count = self.profile_steps
            if len(self.starts) - 1 == first:
                self.profiler = cProfile.Profile()
                self.profiler.enable()
            elif len(self.starts) - 1 == first + count and self.profiler is not None:
                self.profiler.disable()

    def step_end(self) -> None:
        self.ends.append(time.perf_counter())

    def finish(self, device: torch.device | None = None) -> None:
        """Write this rank's record (atomically: the bench reads it after the process exits)."""
        if self.profiler is not None:
            self.profiler.disable()  # if the run had fewer steps than asked for
            self.profiler.dump_stats(self.path.with_suffix(".prof"))
        record: dict[str, Any] = {
            "side": self.side,
            "rank": self.rank,
            "world_size": self.world_size,
            "launch_time": float(os.environ.get(LAUNCH_TIME_VARIABLE, "nan")),
            "wall_anchor": self.wall_anchor,
            "perf_anchor": self.perf_anchor,
            "finish_time": time.time(),
            "epochs": self.epochs,
            "starts": self.starts,
            "ends": self.ends,
            "cpu_starts": self.cpu_starts,
            # Linux reports ru_maxrss in KiB.
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "cuda_max_allocated_mb": None,
        }
        if device is not None and device.type == "cuda":
            record["cuda_max_allocated_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
        if self.gpu_events:
            torch.cuda.synchronize()
            first = self.gpu_events[0]
            # Seconds, from the first step's event: a clock of their own, like cpu_starts.
            record["gpu_starts"] = [first.elapsed_time(event) / 1e3 for event in self.gpu_events]
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(record))
        os.replace(temporary, self.path)
