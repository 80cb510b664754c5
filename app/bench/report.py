"""Paired statistics over the bench's runs, the printed table, the JSON report and the plot."""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.bench.runs import BARE, RunResult
from app.figures import save


def spread(values: list[float]) -> dict[str, float]:
    """Median with min and max: the figures the bench reports for anything measured repeatedly."""
    values = [value for value in values if math.isfinite(value)]
    if not values:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def bench_parser(
    prog: str, doc: str | None, config: str | None, config_help: str | None = None
) -> argparse.ArgumentParser:
    """A bench's command line (its module docstring, with its tables, as the description) and its `--config` (None:
    required)."""
    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = {"required": True} if config is None else {"default": Path(config)}
    parser.add_argument("--config", type=Path, help=config_help, **default)
    return parser


def shown_and_saved(results: dict[str, Any], json_path: Path | None, show: Callable[[dict[str, Any]], None]) -> dict:
    """`results`, printed by `show` and, with `json_path`, written there as JSON."""
    show(results)
    if json_path is not None:
        json_path.write_text(json.dumps(results, indent=2) + "\n")
    return results


def counts(text: str, minimum: int, flag: str) -> list[int]:
    """A command-line list such as `0,1,2,4` (a bench's worker or rank counts), each >= `minimum`."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < minimum:
        raise argparse.ArgumentTypeError(f"{flag} takes numbers >= {minimum} separated by commas, got {text!r}")
    return values


SIDES_REPORTED = ("reference", "lightning")


def find(runs: list[RunResult], side: str, world_size: int, repeat: int) -> RunResult | None:
    for run in runs:
        if (run.side, run.world_size, run.repeat) == (side, world_size, repeat):
            return run
    return None


Pairing = Callable[[RunResult, RunResult], float]


def over_repeats(
    runs: list[RunResult], first: tuple[str, int], second: tuple[str, int], figure: Pairing
) -> dict[str, float]:
    """figure(run of `first`, run of `second`) per repeat, each a (side, world size): the runs of a repeat ran one right
    after the other, so slow phases of a noisy machine hit both."""
    values = []
    for repeat in sorted({run.repeat for run in runs}):
        one, other = find(runs, *first, repeat), find(runs, *second, repeat)
        if one is not None and other is not None:
            values.append(figure(one, other))
    return spread(values)


def paired(runs: list[RunResult], world_size: int, figure: Pairing) -> dict[str, float]:
    """figure(reference run, Lightning run) for each repeat at one world size."""
    return over_repeats(runs, ("reference", world_size), ("lightning", world_size), figure)


def fraction_of_bare(runs: list[RunResult], side: str) -> dict[str, float]:
    """throughput(side) / throughput(framework-free loop) at world size 1, paired per repeat."""
    return over_repeats(runs, (BARE, 1), (side, 1), lambda bare, mine: mine.samples_per_s / bare.samples_per_s)


def efficiency(runs: list[RunResult], side: str, world_size: int) -> dict[str, float]:
    """throughput(N) / (N x throughput(1)), each N-rank run paired with the same repeat's 1-rank run."""
    return over_repeats(
        runs, (side, 1), (side, world_size), lambda one, many: many.samples_per_s / (world_size * one.samples_per_s)
    )


def per_side(runs: list[RunResult], side: str, world_size: int) -> dict[str, Any]:
    mine = [run for run in runs if run.side == side and run.world_size == world_size]
    return {
        "step_ms": spread([run.step_ms for run in mine]),
        "step_median_ms": spread([run.step_median_ms for run in mine]),
        "step_cpu_ms": spread([run.step_cpu_ms for run in mine]),
        "step_host_ms": spread([run.step_host_ms for run in mine]),
        "first_step_ms": spread([run.first_step_ms for run in mine]),
        "samples_per_s": spread([run.samples_per_s for run in mine]),
        "first_step_s": spread([run.first_step_s for run in mine]),
        "teardown_s": spread([run.teardown_s for run in mine]),
        "total_s": spread([run.total_s for run in mine]),
        "peak_rss_mb_max_rank": spread([max(run.peak_rss_mb) for run in mine]),
        "cuda_max_allocated_mb_max_rank": spread(
            [max(run.cuda_max_allocated_mb) for run in mine if run.cuda_max_allocated_mb]
        ),
    }


def build_report(runs: list[RunResult], world_sizes: list[int], context: dict[str, Any]) -> dict[str, Any]:
    by_world_size: dict[str, Any] = {}
    for world_size in world_sizes:
        by_world_size[str(world_size)] = {
            "reference": per_side(runs, "reference", world_size),
            "lightning": per_side(runs, "lightning", world_size),
            "lightning_over_reference_step_time": paired(runs, world_size, lambda r, lt: lt.step_ms / r.step_ms),
            "lightning_added_ms_per_step": paired(runs, world_size, lambda r, lt: lt.step_ms - r.step_ms),
            "lightning_over_reference_step_median": paired(
                runs, world_size, lambda r, lt: lt.step_median_ms / r.step_median_ms
            ),
            "lightning_over_reference_step_cpu": paired(runs, world_size, lambda r, lt: lt.step_cpu_ms / r.step_cpu_ms),
            "lightning_added_cpu_ms_per_step": paired(runs, world_size, lambda r, lt: lt.step_cpu_ms - r.step_cpu_ms),
            "first_step_ratio": paired(runs, world_size, lambda r, lt: lt.first_step_s / r.first_step_s),
            "teardown_added_s": paired(runs, world_size, lambda r, lt: lt.teardown_s - r.teardown_s),
        }
        if world_size == 1 and any(run.side == BARE for run in runs):
            figures = by_world_size["1"]
            figures[BARE] = per_side(runs, BARE, 1)
            figures["fraction_of_framework_free"] = {side: fraction_of_bare(runs, side) for side in SIDES_REPORTED}
    largest = max(world_sizes)
    scaling: dict[str, Any] = {"reference": {}, "lightning": {}}
    if 1 in world_sizes:
        for side in scaling:
            for world_size in world_sizes:
                scaling[side][str(world_size)] = efficiency(runs, side, world_size)
    headline = by_world_size[str(largest)]
    summary = {
        "world_size": largest,
        "lightning_over_reference_step_time": headline["lightning_over_reference_step_time"],
        "lightning_added_ms_per_step": headline["lightning_added_ms_per_step"],
        "lightning_added_cpu_ms_per_step": headline["lightning_added_cpu_ms_per_step"],
        "first_step_ratio": headline["first_step_ratio"],
        "scaling_efficiency": scaling["lightning"].get(str(largest), spread([])),
        "scaling_efficiency_reference": scaling["reference"].get(str(largest), spread([])),
    }
    fractions = by_world_size.get("1", {}).get("fraction_of_framework_free")
    if fractions:
        summary["lightning_fraction_of_framework_free"] = fractions["lightning"]
        summary["reference_fraction_of_framework_free"] = fractions["reference"]
    return {
        # The headline figures: medians at the largest world size (efficiency: Lightning's).
        **{key: value["median"] for key, value in summary.items() if isinstance(value, dict)},
        "summary": summary,
        **context,
        "by_world_size": by_world_size,
        "scaling_efficiency_by_world_size": scaling,
        "runs": [vars(run) for run in runs],
    }


def _range(figure: dict[str, float], fmt: str) -> str:
    return f"{figure['median']:{fmt}} [{figure['min']:{fmt}}, {figure['max']:{fmt}}]"


def format_table(report: dict[str, Any]) -> str:
    """Medians per side, and the median [min, max] of the paired Lightning/reference figures."""
    lines = [
        f"{report['config']}: {report['accelerator']}, {report['repeats']} pairs per world size, "
        f"per-rank batch {report['per_rank_batch_size']}, loadavg {report['loadavg_before'][0]:.2f} before "
        f"/ {report['loadavg_after'][0]:.2f} after"
    ]
    header = f"{'':<28}{'reference':>12}{'lightning':>12}   {'paired: lightning vs reference':<34}"
    bare_header = f"{'':<28}{'reference':>12}{'lightning':>12}{'bare':>12}   {'paired: lightning vs reference':<34}"
    rows: list[tuple[str, str, str, str, str]] = [
        ("step time (ms)", "step_ms", ".3f", "lightning_over_reference_step_time", "x"),
        ("  median single step (ms)", "step_median_ms", ".3f", "lightning_over_reference_step_median", "x"),
        ("  main-thread CPU (ms/step)", "step_cpu_ms", ".3f", "lightning_over_reference_step_cpu", "x"),
        *(
            [("  host-side interval (ms)", "step_host_ms", ".3f", "", "")]  # step time is the GPU's
            if report["accelerator"] == "gpu"
            else []
        ),
        ("samples/s", "samples_per_s", ".0f", "", ""),
        ("first step (ms)", "first_step_ms", ".1f", "", ""),
        ("launch -> first step (s)", "first_step_s", ".2f", "first_step_ratio", "x"),
        ("teardown (s)", "teardown_s", ".2f", "teardown_added_s", "s more"),
        ("peak RSS, max rank (MB)", "peak_rss_mb_max_rank", ".0f", "", ""),
    ]
    for world_size, figures in report["by_world_size"].items():
        bare = figures.get(BARE)
        columns = 36 if bare else 24
        heading = bare_header if bare else header
        lines += ["", f"world size {world_size}", heading, "-" * len(heading)]
        for label, key, fmt, paired_key, unit in rows:
            reference, lightning = figures["reference"][key], figures["lightning"][key]
            if not reference["n"]:
                continue
            paired_text = f"{_range(figures[paired_key], '.3f')} {unit}" if paired_key else ""
            bare_text = f"{bare[key]['median']:>12{fmt}}" if bare and bare[key]["n"] else (" " * 12 if bare else "")
            lines.append(
                f"{label:<28}{reference['median']:>12{fmt}}{lightning['median']:>12{fmt}}{bare_text}   {paired_text}"
            )
            if key == "step_ms":
                added = _range(figures["lightning_added_ms_per_step"], "+.3f")
                lines.append(f"{'  lightning added (ms/step)':<28}{'':>{columns}}   {added}")
        if bare:
            fractions = figures["fraction_of_framework_free"]
            lines.append(
                f"{'throughput / framework-free':<28}reference {_range(fractions['reference'], '.3f')}   "
                f"lightning {_range(fractions['lightning'], '.3f')}"
            )
    scaling = report["scaling_efficiency_by_world_size"]
    multi = [size for size in scaling["lightning"] if size != "1"]
    if multi:
        lines += ["", "scaling efficiency = throughput(N) / (N x throughput(1)), paired per repeat"]
        for size in multi:
            lines.append(
                f"  N={size}: reference {_range(scaling['reference'][size], '.3f')}   "
                f"lightning {_range(scaling['lightning'][size], '.3f')}"
            )
    return "\n".join(lines)


def whiskers(stats: list[dict[str, float]]) -> tuple[list[float], list[list[float]]]:
    """Medians, and matplotlib's yerr for [min, max] around them."""
    medians = [stat["median"] for stat in stats]
    return medians, [[stat["median"] - stat["min"] for stat in stats], [stat["max"] - stat["median"] for stat in stats]]


def plot(report: dict[str, Any], path: Path) -> None:
    """Left: throughput against world size with the ideal line; right: per-step time per side."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise SystemExit(
            f"app.bench: --plot needs matplotlib ({error}). Fix: pip install -e '.[plot]', or drop --plot."
        ) from None
    sizes = [int(size) for size in report["by_world_size"]]
    colors = {"reference": "tab:blue", "lightning": "tab:purple"}
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for offset, side in zip((-0.03, 0.03), ("reference", "lightning"), strict=True):
        medians, errors = whiskers([report["by_world_size"][str(size)][side]["samples_per_s"] for size in sizes])
        xs = [size * (1 + offset) for size in sizes]
        left.errorbar(xs, medians, yerr=errors, marker="o", capsize=4, label=side, color=colors[side])
    if 1 in sizes:
        base = report["by_world_size"]["1"]["reference"]["samples_per_s"]["median"]
        left.plot(sizes, [base * size for size in sizes], "--", color="grey", label="ideal: N x reference at N=1")
        base = report["by_world_size"]["1"]["lightning"]["samples_per_s"]["median"]
        left.plot(sizes, [base * size for size in sizes], ":", color="grey", label="ideal: N x lightning at N=1")
    left.set(xlabel="world size (processes)", ylabel="samples / s (all ranks)", title="throughput", xticks=sizes)
    left.set_ylim(bottom=0)
    left.legend()
    width = 0.38
    for shift, side in zip((-width / 2, width / 2), ("reference", "lightning"), strict=True):
        medians, errors = whiskers([report["by_world_size"][str(size)][side]["step_ms"] for size in sizes])
        positions = [index + shift for index in range(len(sizes))]
        right.bar(positions, medians, width, yerr=errors, capsize=4, label=side, color=colors[side])
    for index, size in enumerate(sizes):
        figures = report["by_world_size"][str(size)]
        top = max(figures[side]["step_ms"]["max"] for side in ("reference", "lightning"))
        ratio = figures["lightning_over_reference_step_time"]["median"]
        right.annotate(
            f"lightning/reference x{ratio:.3f}", (index, top), xytext=(0, 4), textcoords="offset points", ha="center"
        )
    right.margins(y=0.12)
    right.set(
        xticks=range(len(sizes)),
        xticklabels=[f"N={size}" for size in sizes],
        ylabel="ms per training step",
        title="per-step time (median over runs; whiskers: min, max)",
    )
    right.legend()
    figure.suptitle(f"{report['config']} on {report['accelerator']}: reference DDP vs Lightning DDP")
    figure.tight_layout()
    save(figure, path, dpi=110)
