"""`python -m app.bench.errors [--repeats 5] [--json docs/bench_errors.json]`

How long a config error takes to reach the user: the time from starting `ddp-app` to its one-line
error, against `python -c "import lightning"` on the same machine, run alternately (the order
flipped every repeat) so that the machine's slow phases hit both. Target: a ratio <= 1.5, i.e. the
error costs little more than importing Lightning once (it used to take every rank's imports).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from app.cluster.launch import env_without_launcher

CASES = {
    "unknown key": ["--trainer.max_epoch", "3"],
    "wrong type": ["--trainer.max_epochs", "oops"],
    "unknown class": ["--model", "app.models.MLPClasifier"],
    "zero devices": ["--trainer.devices", "0"],
}
IMPORT_LIGHTNING = [sys.executable, "-c", "import lightning"]


def timed(command: list[str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    env = env_without_launcher(os.environ)
    env.pop("DDP_APP_ALLOW_OVERSUBSCRIBE", None)
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    return time.perf_counter() - started, result


def measure(config: str, repeats: int) -> dict[str, dict[str, float | str]]:
    results: dict[str, dict[str, float | str]] = {}
    for name, overrides in CASES.items():
        command = [sys.executable, "-m", "app", "fit", "--config", config, *overrides]
        ratios, error_s, import_s, line = [], [], [], ""
        for repeat in range(repeats):
            order = [command, IMPORT_LIGHTNING] if repeat % 2 == 0 else [IMPORT_LIGHTNING, command]
            times = {}
            for which in order:
                seconds, result = timed(which)
                times[which is command] = seconds
                if which is command:
                    errors = [text for text in result.stderr.splitlines() if "error:" in text]
                    if result.returncode != 2 or len(errors) != 1:
                        raise SystemExit(f"{name}: expected one error line and exit 2, got:\n{result.stderr[-2000:]}")
                    line = errors[0]
            error_s.append(times[True])
            import_s.append(times[False])
            ratios.append(times[True] / times[False])
        results[name] = {
            "error_s": statistics.median(error_s),
            "import_lightning_s": statistics.median(import_s),
            "ratio": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "line": line,
        }
        print(
            f"{name:20s} error {results[name]['error_s']:.2f} s, import lightning "
            f"{results[name]['import_lightning_s']:.2f} s, ratio {results[name]['ratio']:.2f} "
            f"[{min(ratios):.2f}, {max(ratios):.2f}]",
            flush=True,
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--config", default="configs/digits.yaml")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    options = parser.parse_args()
    results = measure(options.config, options.repeats)
    worst = max(float(case["ratio"]) for case in results.values())
    print(f"worst median ratio {worst:.2f} (target <= 1.5)")
    if options.json:
        options.json.write_text(json.dumps({"repeats": options.repeats, "cases": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
