"""A sweep's results: DIR/results.csv, results.md and results.png, rewritten as points finish, each point's figures
(best metric and its epoch, mean samples/s, wall time) from its own run's metrics.csv."""

from __future__ import annotations

import csv
import datetime
import io
import math
from pathlib import Path
from typing import Any

from app.checkpoints.io import atomic_write
from app.figures import save
from app.plot import METRICS_FILE, read_metrics, run_version
from app.sweep.spec import SweepSpec
from app.sweep.store import Point, SweepStore, shown_state
from app.tracking.layout import SAMPLES_PER_S


def point_row(store: SweepStore, spec: SweepSpec, point: Point) -> dict[str, Any]:
    row: dict[str, Any] = {"point": point.name, **point.params, "state": shown_state(point)}
    best, epoch, samples = None, None, []
    log_dir = (
        run_version(store.point_dir(point), None) if (store.point_dir(point) / "lightning_logs").is_dir() else None
    )
    if log_dir is not None and (log_dir / METRICS_FILE).is_file():
        for values in read_metrics(log_dir / METRICS_FILE).values():
            value = values.get(spec.metric)
            if value is not None and (best is None or (value > best if spec.direction == "maximize" else value < best)):
                best, epoch = value, int(values.get("epoch", -1))
            if SAMPLES_PER_S in values:
                samples.append(values[SAMPLES_PER_S])
    row[f"best {spec.metric}"] = f"{best:.6g}" if best is not None else ""
    row["epoch"] = epoch if epoch is not None else ""
    row["samples/s"] = f"{sum(samples) / len(samples):.0f}" if samples else ""
    row["wall s"] = f"{wall_seconds(point):.0f}" if point.attempts else ""
    row["attempts"] = len(point.attempts)
    return row


def wall_seconds(point: Point) -> float:
    total = 0.0
    for attempt in point.attempts:
        if attempt.get("ended"):
            start = datetime.datetime.fromisoformat(attempt["started"])
            total += (datetime.datetime.fromisoformat(attempt["ended"]) - start).total_seconds()
    return total


def best_value(row: dict[str, Any], spec: SweepSpec) -> float | None:
    text = row.get(f"best {spec.metric}")
    return float(text) if text else None


def write_results(store: SweepStore, spec: SweepSpec) -> list[dict[str, Any]]:
    points = store.points()
    rows = [point_row(store, spec, point) for point in points]
    columns = list(dict.fromkeys(key for row in rows for key in row))
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
    atomic_write(store.directory / "results.csv", lambda file: file.write(text.getvalue().encode()))
    table = markdown_table(rows, columns)
    atomic_write(store.directory / "results.md", lambda file: file.write(table.encode()))
    plot_results(store.directory / "results.png", spec, points, rows)
    return rows


def markdown_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row.get(column, "")) for column in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _as_number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def plot_results(path: Path, spec: SweepSpec, points: list[Point], rows: list[dict[str, Any]]) -> None:
    """The metric against each swept parameter; for a search, also the optimisation history."""
    try:
        import matplotlib
    except ImportError:
        return  # the table and the CSV carry the results; the plot is for people who have matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(spec.grid) or [dimension.key for dimension in spec.search]
    panels = len(keys) + (1 if spec.is_search else 0)
    figure, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.4), squeeze=False)
    for axis, key in zip(axes[0], keys, strict=False):
        pairs = [(row.get(key, ""), best_value(row, spec)) for row in rows]
        pairs = [(x, y) for x, y in pairs if y is not None]
        numeric = all(_as_number(x) is not None for x, _ in pairs)
        xs = [_as_number(x) if numeric else x for x, _ in pairs]
        axis.scatter(xs, [y for _, y in pairs], label=f"best {spec.metric}")
        if numeric and xs and min(xs) > 0 and max(xs) / min(xs) >= 10:
            axis.set_xscale("log")
        axis.set_xlabel(key.split(".")[-1] if len(key) > 30 else key)
        axis.set_ylabel(f"best {spec.metric}")
        axis.grid(alpha=0.3)
    if spec.is_search:
        axis = axes[0][-1]
        ordered = sorted(zip(points, rows, strict=True), key=lambda item: item[0].trial or 0)
        values = [(point.trial, best_value(row, spec)) for point, row in ordered if best_value(row, spec) is not None]
        best_so_far, running = [], None
        for _, value in values:
            running = value if running is None else (max if spec.direction == "maximize" else min)(running, value)
            best_so_far.append(running)
        axis.scatter([trial for trial, _ in values], [value for _, value in values], label="trial")
        axis.step([trial for trial, _ in values], best_so_far, where="post", color="C1", label="best so far")
        axis.set_xlabel("trial")
        axis.set_ylabel(spec.metric)
        axis.legend(fontsize="small")
        axis.grid(alpha=0.3)
    figure.suptitle(f"{spec.metric} ({spec.direction}), {len(rows)} points")
    figure.tight_layout()
    save(figure, path, dpi=90)
