"""`python -m app.bench.ft_throughput [--kill-every 60] [--steps 3000] [--paths ...] [--json FILE]`

Samples per second of one fit of digits on 3 processes of this machine while one process is killed with kill -9 every
`--kill-every` seconds, for each way of surviving it, beside the same fit with no failure, in one run:

  torchft          3 replica groups of 1 process (`fault_tolerance.enabled: true`); groups 1 and 2 in turn are
                   killed, ddp-app's launcher starts each again and it heals from a peer while the others go on
                   (docs/fault_tolerance.md);
  torchft-nofail   the same without a kill: the throughput the target is measured against;
  ddp-app          `strategy: ddp`, `--restarts N`: the launcher restarts every rank from last.ckpt;
  torchrun         `torchrun --max-restarts N ... --ckpt_path last`: the agent restarts every rank;
  ddp-nofail       `strategy: ddp` without a kill.

A run trains `--steps` optimizer steps. Its samples are each step's batch times the processes that took part in it
(under torchft a step with a group missing averages over the groups present: fewer samples); its time is from its first
step's end to its last. The target (issue 57): torchft with a kill every 60 s keeps at least 90% of torchft-nofail.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.bench.recovery import clock_arguments, kill_rank, run_and_kill

CONFIG = "configs/digits.yaml"
PROCESSES = 3
BATCH = 32  # configs/digits.yaml's per-process batch_size
DDP_APP = str(Path(sys.executable).parent / "ddp-app")
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
RESTARTS = 100  # more than any run here needs: the bench measures recovery, not the bound


def common(root: Path, steps: int) -> list[str]:
    return [
        "--config", CONFIG, f"--trainer.max_steps={steps}", "--trainer.max_epochs=-1",
        "--trainer.enable_progress_bar=false", "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0",
        f"--trainer.default_root_dir={root}",
    ]  # fmt: skip


def group_record(root: Path, group: int) -> list[dict[str, Any]]:
    """A replica group's per-step record (app/parallel/ft_manager.py), whole lines only."""
    path = root / "fault_tolerance" / f"group_{group}.jsonl"
    lines = path.read_text().split("\n") if path.exists() else [""]
    return [json.loads(line) for line in lines[:-1]]


class PeriodicKiller:
    """A `run_and_kill` kill function: `kill_one(index)` (which returns the kill's unix time) every `every` seconds
    until the run ends; `kills` keeps the kills' times."""

    def __init__(self, every: float | None, kill_one: Callable[[int], float]) -> None:
        self.every, self.kill_one, self.kills = every, kill_one, []

    def __call__(self, process: subprocess.Popen) -> float:
        started = time.monotonic()
        while process.poll() is None:
            if self.every is not None and time.monotonic() - started >= self.every * (len(self.kills) + 1):
                # FileNotFoundError and the others: the process to kill is not up yet (restarting): shortly again
                with contextlib.suppress(FileNotFoundError, IndexError, ProcessLookupError):
                    self.kills.append(self.kill_one(len(self.kills)))
            time.sleep(0.2)
        return time.time()


def measure_torchft(workdir: Path, steps: int, kill_every: float | None) -> dict[str, Any]:
    root = workdir / "run"
    command = [DDP_APP, "fit", *common(root, steps), f"--trainer.devices={PROCESSES}", "--fault_tolerance.enabled=true"]
    command.append(f"--fault_tolerance.group_restarts={RESTARTS}")

    def kill_one(index: int) -> float:
        group = 1 + index % (PROCESSES - 1)  # groups 1 and 2 in turn; group 0's record is the run's clock
        pid = [entry["pid"] for entry in group_record(root, group) if entry.get("start")][-1]
        os.kill(pid, signal.SIGKILL)
        return time.time()

    kill = PeriodicKiller(kill_every, kill_one)
    run_and_kill(command, workdir / "torchft.log", kill)
    entries = [entry for entry in group_record(root, 0) if not entry.get("start") and "sent" not in entry]
    samples = sum(entry["replicas"] for entry in entries[1:]) * BATCH
    return {
        "samples_per_s": samples / (entries[-1]["time"] - entries[0]["time"]),
        "kills": len(kill.kills),
        "steps_with_a_group_missing": sum(1 for entry in entries if entry["replicas"] < PROCESSES),
    }


def measure_restarting(workdir: Path, steps: int, kill_every: float | None, torchrun: bool) -> dict[str, Any]:
    """`strategy: ddp` on 3 processes restarted whole by ddp-app's launcher or by torchrun (or never killed)."""
    clock, restarts = workdir / "clock.txt", RESTARTS
    arguments = [*common(workdir / "run", steps), *clock_arguments(clock), f"--trainer.devices={PROCESSES}"]
    if torchrun:
        command = [TORCHRUN, "--standalone", f"--nproc_per_node={PROCESSES}", f"--max-restarts={restarts}", "-m"]
        command += ["app", "fit", *arguments, "--ckpt_path", "last"]
    else:
        command = [DDP_APP, "fit", *arguments, f"--restarts={restarts}"]
    kill = PeriodicKiller(kill_every, lambda index: kill_rank(clock, 1 + index % (PROCESSES - 1)))
    run_and_kill(command, workdir / "run.log", kill)
    times = [float(line.split()[0]) for line in clock.read_text().splitlines() if not line.startswith("start")]
    # Every one of the run's steps counts once, the redone ones not at all: their time is in the span.
    return {"samples_per_s": (steps - 1) * PROCESSES * BATCH / (times[-1] - times[0]), "kills": len(kill.kills)}


PATHS = {
    "torchft": lambda workdir, steps, every: measure_torchft(workdir, steps, every),
    "torchft-nofail": lambda workdir, steps, every: measure_torchft(workdir, steps, None),
    "ddp-app": lambda workdir, steps, every: measure_restarting(workdir, steps, every, torchrun=False),
    "torchrun": lambda workdir, steps, every: measure_restarting(workdir, steps, every, torchrun=True),
    "ddp-nofail": lambda workdir, steps, every: measure_restarting(workdir, steps, None, torchrun=False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--kill-every", type=float, default=60.0, help="seconds between two kills (default 60)")
    parser.add_argument("--steps", type=int, default=3000, help="optimizer steps of each run (default 3000)")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of: {', '.join(PATHS)}")
    parser.add_argument("--workdir", type=Path, default=Path("runs/ft_throughput"))
    parser.add_argument("--json", type=Path, default=None, help="write the figures here (merged by path)")
    options = parser.parse_args()
    figures: dict[str, Any] = json.loads(options.json.read_text()) if options.json and options.json.exists() else {}
    if figures and (figures["kill_every_s"], figures["steps"]) != (options.kill_every, options.steps):
        raise SystemExit(f"{options.json} holds runs of another --kill-every or --steps: give another --json")
    figures.update(kill_every_s=options.kill_every, steps=options.steps, cpus=os.cpu_count())
    for path in options.paths.split(","):
        workdir = (options.workdir / path).resolve()
        workdir.mkdir(parents=True, exist_ok=False)
        figures[path] = {**PATHS[path](workdir, options.steps, options.kill_every), "load_after": os.getloadavg()[0]}
        print(f"{path}: {figures[path]['samples_per_s']:.0f} samples/s, {figures[path]['kills']} kill(s)", flush=True)
        if options.json:  # after every path: a later failure keeps the figures measured so far
            options.json.write_text(json.dumps(figures, indent=2) + "\n")
    for path, baseline in (("torchft", "torchft-nofail"), ("ddp-app", "ddp-nofail"), ("torchrun", "ddp-nofail")):
        if path in figures and baseline in figures:
            ratio = figures[path]["samples_per_s"] / figures[baseline]["samples_per_s"]
            figures[path][f"of_{baseline}"] = ratio
            print(f"{path}: {ratio:.2f} of {baseline}'s samples per second", flush=True)
    if options.json:
        options.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
