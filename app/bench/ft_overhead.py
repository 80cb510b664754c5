"""`python -m app.bench.ft_overhead [--repeats 8] [--json docs/bench_ft_overhead.json]`

What fault tolerance (docs/fault_tolerance.md) costs per step when nothing fails: the same fit,
`configs/bench_cnn.yaml` on 2 CPU processes, as `strategy: ddp` and as 2 replica groups of 1
process (`fault_tolerance.enabled: true`, `min_replicas: 2`), run alternately so that a change of
load hits both. A run's figure is the median of its last two epochs' step times (StepTiming's
per-step record, `step_timing.record_dir`, of rank 0, or of a group): a median, because on a shared
machine another engineer's burst makes a few steps several times longer; the figure of the mode is
the median of its runs. Also kept: each run's 10th percentile step (the step when no one else took
the cores), its last-epoch mean (`step_ms` of its metrics.csv, which a burst moves), each pair's
overhead (a run of each, one after the other), the load average after each run, and from group 0's
record the median quorum, the wait for the all-reduces after backward (backward hides the rest:
app/parallel/ft_buckets.py) and the commit decision.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from app.cluster.launch import env_without_launcher

REPO = Path(__file__).resolve().parents[2]
CONFIG = "configs/bench_cnn.yaml"
RUN = ("--trainer.devices=2", "--trainer.max_epochs=3", "--trainer.enable_progress_bar=false")
MODES = {"ddp": (), "torchft": ("--fault_tolerance.enabled=true", "--fault_tolerance.min_replicas=2")}
PARTS = ("quorum_ms", "allreduce_ms", "commit_ms")
TIMED_STEPS = 62  # the last two epochs: 32 steps each (4096 samples / (2 x 64)), the first of each untimed


def last_epoch_step_ms(root: Path) -> float:
    """StepTiming's step time of the last epoch, from the run's metrics.csv (group 0's in a fault-tolerant run)."""
    rows = [row for row in csv.DictReader((root / "lightning_logs" / "version_0" / "metrics.csv").open())]
    return float([row for row in rows if row.get("step_ms")][-1]["step_ms"])


def step_quantiles_ms(root: Path) -> tuple[float, float]:
    """The median and the 10th percentile of the step times of the last `TIMED_STEPS` steps of rank 0 (of a
    group, in a fault-tolerant run): the 10th percentile is the step when no one else took the cores."""
    steps = json.loads((root / "steps" / "rank0.json").read_text())["steps"][-TIMED_STEPS:]
    times = [1000 * step[0] for step in steps]
    return statistics.median(times), statistics.quantiles(times, n=10)[0]


def parts_ms(root: Path) -> dict[str, float]:
    """Group 0's median quorum, all-reduce wait and commit decision over the last `TIMED_STEPS` steps (its record)."""
    lines = (root / "fault_tolerance" / "group_0.jsonl").read_text().splitlines()
    entries = [entry for entry in map(json.loads, filter(None, lines)) if "allreduce_ms" in entry][-TIMED_STEPS:]
    return {part: round(statistics.median(entry[part] for entry in entries), 2) for part in PARTS}


def run(mode: str, root: Path) -> tuple[float, float, float]:
    """One fit: its median step, its 10th percentile step and its last epoch's mean step (milliseconds)."""
    env = env_without_launcher(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    command = [
        str(Path(sys.executable).parent / "ddp-app"), "fit", "--config", CONFIG, *RUN, *MODES[mode],
        f"--trainer.default_root_dir={root}", f"--step_timing.record_dir={root / 'steps'}",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"{mode} exited with {result.returncode}:\n{result.stderr[-3000:]}")
    return *step_quantiles_ms(root), last_epoch_step_ms(root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None)
    options = parser.parse_args()
    load_before = os.getloadavg()[0]
    step_ms: dict[str, list[float]] = {mode: [] for mode in MODES}
    epoch_ms: dict[str, list[float]] = {mode: [] for mode in MODES}
    p10_ms: dict[str, list[float]] = {mode: [] for mode in MODES}
    parts: dict[str, list[float]] = {part: [] for part in PARTS}
    loads: list[float] = []
    with tempfile.TemporaryDirectory(prefix="ddp-app-ft-overhead-") as workdir:
        for repeat in range(options.repeats):
            for mode in MODES:  # alternately, so that a change of load hits both
                root = Path(workdir) / f"{mode}-{repeat}"
                median, p10, mean = run(mode, root)
                step_ms[mode].append(round(median, 2))
                p10_ms[mode].append(round(p10, 2))
                epoch_ms[mode].append(round(mean, 2))
                loads.append(round(os.getloadavg()[0], 2))
                said = ""
                if mode == "torchft":
                    for part, value in parts_ms(root).items():
                        parts[part].append(value)
                    said = " (" + ", ".join(f"{part} {values[-1]}" for part, values in parts.items()) + ")"
                print(f"{mode} #{repeat + 1}: {median:.2f} ms per step{said}, load {loads[-1]}", flush=True)
    medians = {mode: statistics.median(values) for mode, values in step_ms.items()}
    overhead = 100 * (medians["torchft"] / medians["ddp"] - 1)
    paired = [round(100 * (ft / ddp - 1), 1) for ft, ddp in zip(step_ms["torchft"], step_ms["ddp"], strict=True)]
    figures = {
        "config": CONFIG,
        "run": list(RUN),
        "cpus": os.cpu_count(),
        "loadavg_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "loadavg_after_each_run": loads,
        "step_ms": step_ms,  # per run: the median of its last two epochs' steps
        "median_step_ms": medians,
        "overhead_pct": round(overhead, 1),
        "paired_overhead_pct": paired,  # per repeat: its torchft run against its ddp run
        "median_paired_overhead_pct": statistics.median(paired),
        "min_step_ms": {mode: min(values) for mode, values in step_ms.items()},
        "p10_step_ms": p10_ms,  # per run: the 10th percentile of its last two epochs' steps
        "median_p10_step_ms": {mode: statistics.median(values) for mode, values in p10_ms.items()},
        "last_epoch_mean_step_ms": epoch_ms,
        "torchft_parts_median_ms": parts,  # per run: group 0's record, median over the timed steps
    }
    print(
        f"step: ddp {medians['ddp']:.1f} ms, torchft {medians['torchft']:.1f} ms ({overhead:+.1f}%); pairs "
        f"{paired} (median {statistics.median(paired):+.1f}%)",
        flush=True,
    )
    if options.json:
        options.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
