"""`python -m app.plot RUN_DIR [--out curves.png] [--source csv|mlflow]`: a run's learning curves, one PNG.

Every logged metric against the step, epochs named on the top axis, one panel per kind of quantity (`kind_of`,
docs/tracking.md); a series joins the first panel of its kind where all stay readable (app/figures.py `readable`).
Losses and learning rates spanning `LOG_RATIO` or more get a log axis. RUN_DIR is a run's `trainer.default_root_dir`
(the last run, or `--version`); `--source mlflow` reads the history from MLflow (as `run.json` records). Older
directories' per-restart versions are joined (`join_versions`).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.errors import UserFacingError
from app.figures import fits_one_axis, save
from app.tracking.layout import STEP_TIME_METRICS, latest_run

METRICS_FILE = "metrics.csv"

# {step: {column: value}}: a version's (or the joined run's) logged values, one entry per step.
Series = dict[int, dict[str, float]]


class PlotError(UserFacingError):
    """The run directory has nothing to plot, or a metrics file cannot be read."""


def natural_key(path: Path) -> list[int | str]:
    """Sort version_2 before version_10 (and slurm-99 before slurm-100)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def metrics_files(run_dir: Path) -> list[Path]:
    if not run_dir.is_dir():
        raise PlotError(f"run directory {run_dir} does not exist. Fix: pass a run's trainer.default_root_dir.")
    files = sorted(run_dir.rglob(METRICS_FILE), key=natural_key)
    if not files:
        raise PlotError(
            f"no {METRICS_FILE} under {run_dir}: ddp-app writes <default_root_dir>/lightning_logs/version_N/"
            f"{METRICS_FILE}. Fix: pass the run's trainer.default_root_dir (a run with trainer.logger: false "
            "logs nothing)."
        )
    return files


def read_metrics(path: Path) -> Series:
    """One entry per step: Lightning writes a row per `log_metrics` call, several for one step."""
    series: Series = {}
    try:
        with path.open(newline="") as file:
            for row in csv.DictReader(file):
                values = {name: float(value) for name, value in row.items() if name != "step" and value}
                series.setdefault(int(row["step"]), {}).update(values)
    except (KeyError, ValueError, TypeError) as error:
        raise PlotError(
            f"{path} is not a CSVLogger metrics file (a 'step' column with numbers): {error!r}. "
            "Fix: remove it or point RUN_DIR at the run's log directory."
        ) from error
    return series


RESUME_MARKER = "resumed.json"  # written by app.resume.exact.ExactResume into a resumed run's log version


def is_resumed(metrics_path: Path) -> bool:
    return (metrics_path.parent / RESUME_MARKER).is_file()


def join_versions(versions: list[Series], resumed: list[bool] | None = None) -> Series:
    """One series from the versions of a run, in step order, later versions winning overlaps.

    A resumed version (`resumed`) replaces earlier values name by name at the steps it logged, keeping values it did not
    log again; any other version replaces everything from its first step on."""
    flags = resumed or [False] * len(versions)
    joined: Series = {}
    ordered = sorted(((v, r) for v, r in zip(versions, flags, strict=True) if v), key=lambda item: min(item[0]))
    for version, continues in ordered:
        if not continues:
            start = min(version)
            joined = {step: values for step, values in joined.items() if step < start}
        for step, values in version.items():
            joined.setdefault(step, {}).update(values)
    return dict(sorted(joined.items()))


def epoch_spans(series: Series) -> dict[int, tuple[int, int]]:
    """{epoch: (its first step, one past its last)}: an epoch starts one past the last step logged in the previous one
    (the first at step 0) and ends one past its own last logged step."""
    last_step: dict[int, int] = {}
    for step, values in series.items():
        if "epoch" in values:
            last_step[int(values["epoch"])] = step
    spans: dict[int, tuple[int, int]] = {}
    previous_end = -1
    for epoch in sorted(last_step):
        spans[epoch] = (previous_end + 1, last_step[epoch] + 1)
        previous_end = last_step[epoch]
    return spans


def curve(series: Series, name: str) -> tuple[list[int], list[float]]:
    steps = [step for step, values in series.items() if name in values and math.isfinite(values[name])]
    return steps, [series[step][name] for step in steps]


KIND_TITLES = {
    "loss": "losses",
    "bounded": "metrics in [0, 1]",
    "throughput": "throughput (per second)",
    "lr": "learning rate",
    "other": "other metrics",
}
THROUGHPUT = re.compile(r"(per_?s|per_?sec|per_?second|/s)(_step|_epoch)?$")
LEARNING_RATE = re.compile(r"(^|/)(lr|learning_rate)($|[-_/])")
LOG_RATIO = 10.0  # values spanning this factor or more are drawn on a log axis


def kind_of(name: str, values: list[float]) -> str:
    """Which panel kind a series goes on (the module's docstring lists the kinds)."""
    lowered = name.lower()
    if "loss" in lowered:
        return "loss"
    if THROUGHPUT.search(lowered):
        return "throughput"
    if LEARNING_RATE.search(lowered):
        return "lr"
    return "bounded" if all(0.0 <= value <= 1.0 for value in values) else "other"


@dataclass
class Panel:
    kind: str
    names: list[str]
    log: bool = False


def log_axis(kind: str, values: list[float]) -> bool:
    """Losses and learning rates fall by orders of magnitude: a log axis keeps the late epochs readable. Other kinds
    stay linear, so that series of different scales are split, not stacked by decade."""
    return kind in ("loss", "lr") and min(values) > 0 and max(values) / min(values) >= LOG_RATIO


def panels_of(curves: dict[str, list[float]]) -> list[Panel]:
    """The panels, in kind order: each series on the first panel of its kind that stays readable with it
    (`fits_one_axis`), else on a new one."""
    kinds = {name: kind_of(name, values) for name, values in curves.items()}
    panels: list[Panel] = []
    for name in sorted(curves, key=lambda name: (list(KIND_TITLES).index(kinds[name]), name)):
        for panel in (panel for panel in panels if panel.kind == kinds[name]):
            names = [*panel.names, name]
            log = log_axis(panel.kind, [value for member in names for value in curves[member]])
            if fits_one_axis([(min(curves[member]), max(curves[member])) for member in names], log):
                panel.names, panel.log = names, log
                break
        else:
            panels.append(Panel(kinds[name], [name], log_axis(kinds[name], curves[name])))
    return panels


def mark_epochs(axes: list[Any], spans: dict[int, tuple[int, int]], logged_steps: list[int]) -> None:
    """Epoch boundaries as faint vertical lines on every panel; the top panel names each epoch, as the console does,
    over the middle of its steps (at most about 15 names). The x range holds every epoch from its first step (epoch 0
    from step 0, before the first logged value) and every step."""
    first = min(min(start for start, _ in spans.values()), *logged_steps)
    last = max(max(end for _, end in spans.values()), *logged_steps)
    boundaries = sorted({start for start, _ in spans.values()} | {last})
    for axis in axes:
        axis.set_xlim(first - 0.02 * (last - first), last + 0.02 * (last - first))
        axis.set_xticks(boundaries, minor=True)
        axis.grid(which="minor", axis="x", alpha=0.15)
    named = sorted(spans)[:: max(1, math.ceil(len(spans) / 15))]
    top = axes[0].secondary_xaxis("top")
    top.set_xticks([(spans[epoch][0] + spans[epoch][1] - 1) / 2 for epoch in named], labels=[str(e) for e in named])
    top.tick_params(axis="x", length=0)
    top.set_xticks(boundaries, minor=True)
    top.set_xlabel("epoch (as the console numbers it)")


def plot(series: Series, out: Path, title: str, version_starts: list[int]) -> None:
    try:
        import matplotlib
    except ImportError as error:
        raise PlotError("matplotlib is not installed. Fix: pip install 'ddp-app[plot]' (or matplotlib).") from error
    matplotlib.use("Agg")  # files only: no display needed, also on a cluster node
    import matplotlib.pyplot as plt

    # The per-step time breakdown is a diagnosis, not a training curve: it is in the fit's summary, the trackers, and
    # `ddp-app diagnose`'s chart (docs/performance.md).
    names = sorted({name for values in series.values() for name in values} - {"epoch", *STEP_TIME_METRICS})
    curves = {name: values for name in names if (values := curve(series, name)[1])}
    if not curves:
        raise PlotError(f"{title} has logged steps but no finite values. Fix: plot after a logged metric.")
    panels = panels_of(curves)
    figure, axes = plt.subplots(
        len(panels), 1, sharex=True, figsize=(8, 1.2 + 2.6 * len(panels)), squeeze=False, layout="constrained"
    )
    for axis, panel in zip(axes[:, 0], panels, strict=True):
        for name in panel.names:
            steps, values = curve(series, name)
            axis.plot(steps, values, marker="." if len(steps) < 60 else None, label=name)
        for start in version_starts:  # where a resumed version took over
            axis.axvline(start, color="grey", linestyle=":", linewidth=1)
        if panel.log:
            axis.set_yscale("log")
        axis.set_ylabel(KIND_TITLES[panel.kind])
        axis.grid(alpha=0.3)
        axis.legend(loc="best", fontsize="small")
    resumed = "; dotted: a resumed version starts" if version_starts else ""
    axes[-1, 0].set_xlabel(f"step (optimizer steps{resumed})")
    if spans := epoch_spans(series):
        mark_epochs(list(axes[:, 0]), spans, list(series))
    figure.suptitle(title)
    save(figure, out, dpi=100)


def run_version(run_dir: Path, version: str | None) -> Path | None:
    """The log directory of the run to plot: `--version`, else the latest run's; None for a directory written before run
    identities (`run.json`) existed."""
    logs = run_dir / "lightning_logs"
    if version is not None:
        if not (logs / version).is_dir():
            raise PlotError(
                f"no log version {version} in {logs}. Fix: one of {sorted(p.name for p in logs.iterdir())}."
            )
        return logs / version
    latest = latest_run(logs)
    return logs / latest["log_version"] if latest is not None else None


def mlflow_series(log_dir: Path) -> Series:
    """The run's metric histories from MLflow (the URI and run id its `run.json` records)."""
    run_file = log_dir / "run.json"
    known = json.loads(run_file.read_text()).get("mlflow") if run_file.is_file() else None
    if not known:
        raise PlotError(f"{log_dir} has no MLflow run ({run_file}). Fix: --source csv, or a run with tracking.mlflow.")
    try:
        from mlflow import MlflowClient
    except ImportError as error:
        raise PlotError("mlflow is not installed. Fix: pip install 'ddp-app[mlflow]'.") from error
    client = MlflowClient(known["tracking_uri"])
    series: Series = {}
    for name in client.get_run(known["run_id"]).data.metrics:
        for metric in client.get_metric_history(known["run_id"], name):
            series.setdefault(metric.step, {})[name] = metric.value
    return dict(sorted(series.items()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m app.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run's trainer.default_root_dir, e.g. runs/digits")
    parser.add_argument("--out", type=Path, help="the PNG to write (default: RUN_DIR/curves.png)")
    parser.add_argument("--version", help="the log version to plot (default: the latest run)")
    parser.add_argument("--source", choices=("csv", "mlflow"), default="csv", help="where the history is read from")
    args = parser.parse_args(argv)
    out = args.out or args.run_dir / "curves.png"
    try:
        if not args.run_dir.is_dir():
            raise PlotError(f"run directory {args.run_dir} does not exist. Fix: pass a run's trainer.default_root_dir.")
        log_dir = run_version(args.run_dir, args.version)
        if args.source == "mlflow" and log_dir is None:
            raise PlotError(f"{args.run_dir} has no tracked run (lightning_logs/*/run.json). Fix: --source csv.")
        if log_dir is not None:
            series = mlflow_series(log_dir) if args.source == "mlflow" else read_metrics(metrics_files(log_dir)[0])
            versions, where = [series], f"{log_dir.name} ({args.source})"
        else:
            files = metrics_files(args.run_dir)
            versions = [read_metrics(path) for path in files]
            series = join_versions(versions, [is_resumed(path) for path in files])
            spans = zip(files, versions, strict=True)
            where = ", ".join(f"{path.parent.name} steps {min(v)}-{max(v)}" for path, v in spans if v)
        if not series:
            raise PlotError(f"the run in {args.run_dir} has no logged values yet. Fix: plot after a logged step.")
        version_starts = sorted({min(version) for version in versions if version} - {min(series)})
        plot(series, out, str(log_dir or args.run_dir), version_starts)
    except PlotError as error:
        print(f"app.plot: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {out}: {len(series)} logged steps from {where}")


if __name__ == "__main__":
    main()
