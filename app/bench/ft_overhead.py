"""`python -m app.bench.ft_overhead [--repeats 3] [--json docs/bench_ft_overhead.json]`

What fault tolerance (docs/fault_tolerance.md) costs per step when nothing fails: the same fit,
`configs/bench_cnn.yaml` on 2 CPU processes, as `strategy: ddp` and as 2 replica groups of 1
process (`fault_tolerance.enabled: true`, `min_replicas: 2`), run alternately. The figure is
StepTiming's `step_ms` of the last epoch (logged by rank 0, or group 0), the median of the runs.
A fault-tolerant step asks the lighthouse for a quorum, all-reduces the gradients once after
backward (DDP overlaps its buckets with backward) and asks its group's manager whether to commit.
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


def last_epoch_step_ms(root: Path) -> float:
    """StepTiming's step time of the last epoch, from the run's metrics.csv (group 0's in a fault-tolerant run)."""
    rows = [row for row in csv.DictReader((root / "lightning_logs" / "version_0" / "metrics.csv").open())]
    return float([row for row in rows if row.get("step_ms")][-1]["step_ms"])


def run(mode: str, root: Path) -> float:
    env = env_without_launcher(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    command = [
        str(Path(sys.executable).parent / "ddp-app"), "fit", "--config", CONFIG, *RUN, *MODES[mode],
        f"--trainer.default_root_dir={root}",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"{mode} exited with {result.returncode}:\n{result.stderr[-3000:]}")
    return last_epoch_step_ms(root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    options = parser.parse_args()
    load_before = os.getloadavg()[0]
    step_ms: dict[str, list[float]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="ddp-app-ft-overhead-") as workdir:
        for repeat in range(options.repeats):
            for mode in MODES:  # alternately, so that a change of load hits both
                step_ms[mode].append(round(run(mode, Path(workdir) / f"{mode}-{repeat}"), 2))
                print(f"{mode} #{repeat + 1}: {step_ms[mode][-1]} ms per step", flush=True)
    medians = {mode: statistics.median(values) for mode, values in step_ms.items()}
    overhead = 100 * (medians["torchft"] / medians["ddp"] - 1)
    figures = {
        "config": CONFIG,
        "run": list(RUN),
        "cpus": os.cpu_count(),
        "loadavg_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "step_ms": step_ms,
        "median_step_ms": medians,
        "overhead_pct": round(overhead, 1),
    }
    print(f"step: ddp {medians['ddp']:.1f} ms, torchft {medians['torchft']:.1f} ms ({overhead:+.1f}%)", flush=True)
    if options.json:
        options.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
