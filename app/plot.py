"""`python -m app.plot RUN_DIR [--out curves.png]`: the learning curves of a run, one PNG.

Reads every CSVLogger `metrics.csv` under RUN_DIR (ddp-app logs to
`<default_root_dir>/lightning_logs/version_N/metrics.csv`, under SLURM `slurm-<jobid>`) and plots
the losses and the other metrics against the optimizer step, with the epochs marked on the top axis.

A resumed run logs into a new version directory, so the versions are joined into one curve: ordered
by their first logged step, each version replaces what the versions before it logged from that step
on (a resume redoes the steps after its checkpoint, and the redone values are the ones that count).
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from pathlib import Path

from app.errors import UserFacingError

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


RESUME_MARKER = "resumed.json"  # written by app.resume.ExactResume into a resumed run's log version


def is_resumed(metrics_path: Path) -> bool:
    return (metrics_path.parent / RESUME_MARKER).is_file()


def join_versions(versions: list[Series], resumed: list[bool] | None = None) -> Series:
    """One series from the versions of a run, in step order, later versions winning overlaps.

    `versions` are in version order (the order ties on the first step are broken in). A resumed
    version (`resumed`, from the marker ddp-app writes) continues the series: its values replace the
    earlier ones name by name at the steps it logged, and values it did not log again stay (a step
    whose training row was logged before the checkpoint and whose validation row after the resume).
    Any other version replaces everything from its first step on (a new run into the same directory).
    """
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


def epoch_starts(series: Series) -> dict[int, int]:
    """{epoch: the step at which it starts}: one past the last step logged in the previous epoch."""
    last_step: dict[int, int] = {}
    for step, values in series.items():
        if "epoch" in values:
            last_step[int(values["epoch"])] = step
    starts: dict[int, int] = {}
    previous_end = -1
    for epoch in sorted(last_step):
        starts[epoch] = previous_end + 1
        previous_end = last_step[epoch]
    return starts


def curve(series: Series, name: str) -> tuple[list[int], list[float]]:
    steps = [step for step, values in series.items() if name in values]
    return steps, [series[step][name] for step in steps]


def plot(series: Series, out: Path, title: str, version_starts: list[int]) -> None:
    try:
        import matplotlib
    except ImportError as error:
        raise PlotError("matplotlib is not installed. Fix: pip install 'ddp-app[plot]' (or matplotlib).") from error
    matplotlib.use("Agg")  # files only: no display needed, also on a cluster node
    import matplotlib.pyplot as plt

    columns = sorted({name for values in series.values() for name in values} - {"epoch"})
    losses = [name for name in columns if "loss" in name]
    others = [name for name in columns if "loss" not in name]
    panels = [names for names in (losses, others) if names]
    figure, axes = plt.subplots(len(panels), 1, sharex=True, figsize=(8, 3.2 * len(panels)), squeeze=False)
    for axis, names in zip(axes[:, 0], panels, strict=True):
        for name in names:
            steps, values = curve(series, name)
            axis.plot(steps, values, marker="." if len(steps) < 60 else None, label=name)
        for start in version_starts:  # where a resumed version took over
            axis.axvline(start, color="grey", linestyle=":", linewidth=1)
        if names is losses and all(value > 0 for name in names for value in curve(series, name)[1]):
            axis.set_yscale("log")  # losses fall by orders of magnitude; the late epochs stay readable
        axis.grid(alpha=0.3)
        axis.legend(loc="best", fontsize="small")
    resumed = "; dotted: a resumed version starts" if version_starts else ""
    axes[-1, 0].set_xlabel(f"step (optimizer steps{resumed})")
    starts = epoch_starts(series)
    if starts:
        shown = sorted(starts)[:: max(1, len(starts) // 12)]  # at most about a dozen epoch ticks
        top = axes[0, 0].secondary_xaxis("top")
        top.set_xticks([starts[epoch] for epoch in shown], labels=[str(epoch) for epoch in shown])
        top.set_xlabel("epoch (ticks at its first step)")
    figure.suptitle(title)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m app.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run's trainer.default_root_dir, e.g. runs/digits")
    parser.add_argument("--out", type=Path, help="the PNG to write (default: RUN_DIR/curves.png)")
    args = parser.parse_args(argv)
    out = args.out or args.run_dir / "curves.png"
    try:
        files = metrics_files(args.run_dir)
        versions = [read_metrics(path) for path in files]
        series = join_versions(versions, [is_resumed(path) for path in files])
        if not series:
            raise PlotError(
                f"the {METRICS_FILE} files under {args.run_dir} hold no values yet. Fix: plot after a logged step."
            )
        version_starts = sorted({min(version) for version in versions if version} - {min(series)})
        plot(series, out, str(args.run_dir), version_starts)
    except PlotError as error:
        print(f"app.plot: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    spans = ", ".join(
        f"{path.parent.name} steps {min(version)}-{max(version)}"
        for path, version in zip(files, versions, strict=True)
        if version
    )
    print(f"wrote {out}: {len(series)} logged steps from {len(files)} version(s) ({spans})")


if __name__ == "__main__":
    main()
