"""Where a run's files are, for the run itself and for the tools that read them (no Lightning here).

<default_root_dir>/lightning_logs/<version>/run.json        the run's identity and attempts
<default_root_dir>/lightning_logs/<version>/journal.jsonl   every logged value and save (app/tracking/history.py)
<default_root_dir>/lightning_logs/<version>/metrics.csv     the values as they stand"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

LOGS_NAME = "lightning_logs"
RUN_FILE = "run.json"
JOURNAL_FILE = "journal.jsonl"
# Logged per epoch by app.tracking.run.Tracking; measured, not computed: no two runs agree on it.
SAMPLES_PER_S = "samples_per_s"
# Logged per epoch by app.run.step_timing.StepTiming: the mean step (ms), its parts (%), the slowest rank by its own
# work and that work's time against the median rank's (ms).
STEP_TIME_METRICS = (
    "step_ms",
    "step_data_pct",
    "step_compute_pct",
    "step_communication_pct",
    "step_other_pct",
    "step_slowest_rank",
    "step_slowest_rank_ms",
    "step_median_rank_ms",
)
MEASURED_METRICS = frozenset({SAMPLES_PER_S, *STEP_TIME_METRICS})


def _natural(name: str) -> list[int | str]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def latest_run(logs: Path) -> dict[str, Any] | None:
    """The identity of the run started last in this log directory (by its `created` time, then its version's number), or
    None. Found by reading every run.json rather than kept in a pointer file: starting a run must not rewrite any file
    of an earlier one."""
    runs = []
    for path in logs.glob(f"*/{RUN_FILE}"):
        try:
            identity = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(identity, dict) and identity.get("log_version") == path.parent.name:
            runs.append(identity)
    return max(runs, key=lambda run: (run.get("created", ""), _natural(run["log_version"])), default=None)
