"""`python -m app.bench.network`'s figures from its records: the JSON report, the table and the plot."""

from __future__ import annotations

import collections
import statistics
from pathlib import Path
from typing import Any

from app.bench.netns import Link
from app.bench.report import spread, whiskers
from app.figures import save

# The targets for PowerSGD against no hook on the CNN at 100 Mbit/s, and for auto at every link.
POWERSGD_SPEEDUP_TARGET = 4.0
POWERSGD_BYTES_REDUCTION_TARGET = 20.0
POWERSGD_EFFICIENCY_TARGET = 0.7
AUTO_OVER_BEST_TARGET = 1.05


def setting_key(method: str, bucket_cap_mb: float) -> str:
    """'powersgd@25MB': a compression method with a DDP bucket size."""
    return f"{method}@{bucket_cap_mb:g}MB"


def paired(
    runs: dict[int, dict[str, Any]], others: dict[int, dict[str, Any]], figure: str, inverse: bool = False
) -> dict[str, float]:
    """others[figure] / runs[figure] (or the inverse) per repeat: both ran within the same minute."""
    values = [
        (runs[repeat][figure] / others[repeat][figure]) if inverse else (others[repeat][figure] / runs[repeat][figure])
        for repeat in sorted(runs.keys() & others.keys())
        if runs[repeat][figure] > 0 and others[repeat][figure] > 0
    ]
    return spread(values)


def link_figures(records: list[dict[str, Any]], link: Link, default_bucket: float) -> dict[str, Any]:
    """Every setting measured at one link, its 1-rank baseline, and which setting was fastest."""
    mine = [record for record in records if record["link"]["name"] == link.name]
    one_rank = {record["repeat"]: record for record in mine if record["world_size"] == 1}
    by_setting: dict[str, dict[int, dict[str, Any]]] = {}
    for record in mine:
        if record["world_size"] == 2:
            by_setting.setdefault(setting_key(record["method"], record["bucket_cap_mb"]), {})[record["repeat"]] = record
    settings: dict[str, Any] = {}
    for key, runs in by_setting.items():
        first = next(iter(runs.values()))
        method, bucket = first["method"], first["bucket_cap_mb"]
        figures: dict[str, Any] = {
            "method": method,
            "bucket_cap_mb": bucket,
            "step_ms": spread([run["step_ms"] for run in runs.values()]),
            "samples_per_s": spread([run["samples_per_s"] for run in runs.values()]),
            # throughput(2) / (2 x throughput(1)) = 1-rank step / 2-rank step at the same per-rank batch.
            "scaling_efficiency": paired(runs, one_rank, "step_ms"),
            "bytes_per_step": spread([run["bytes_per_step"] for run in runs.values()]),
        }
        none = by_setting.get(setting_key("none", bucket))
        if none is not None and method != "none":
            figures["speedup_over_none"] = paired(runs, none, "step_ms")
            figures["bytes_reduction_over_none"] = paired(runs, none, "bytes_per_step")
        if method == "auto":
            figures["chosen"] = dict(collections.Counter(run["chosen"] for run in runs.values()))
            figures["decisions"] = [runs[repeat]["decision"] for repeat in sorted(runs)]
            figures["probe_steps"] = spread([run["probe_steps"] for run in runs.values()])
        settings[key] = figures
    entry: dict[str, Any] = {
        "label": link.label,
        "rate_mbit": link.rate_mbit,
        "one_rank": {
            "step_ms": spread([run["step_ms"] for run in one_rank.values()]),
            "samples_per_s": spread([run["samples_per_s"] for run in one_rank.values()]),
        },
        "settings": settings,
    }
    fixed = {
        key: figures
        for key, figures in settings.items()
        if figures["method"] != "auto" and figures["bucket_cap_mb"] == default_bucket
    }
    if fixed:
        best = min(fixed, key=lambda key: fixed[key]["step_ms"]["median"])
        entry["best"] = best
        auto = by_setting.get(setting_key("auto", default_bucket))
        if auto is not None:
            # auto's step over the best fixed setting's, repeat by repeat (the goal: within 5%).
            entry["auto_over_best"] = paired(auto, by_setting[best], "step_ms", inverse=True)
    return entry


def targets(links: dict[str, Any], default_bucket: float) -> dict[str, Any]:
    """The issue's targets, where the run measured what they need: value, target, met."""
    found: dict[str, Any] = {}

    def check(name: str, value: float, target: float, at_least: bool) -> None:
        found[name] = {"value": value, "target": target, "met": value >= target if at_least else value <= target}

    slow = next((name for name, entry in links.items() if entry["rate_mbit"] == 100), None)
    powersgd = links[slow]["settings"].get(setting_key("powersgd", default_bucket)) if slow else None
    if powersgd is not None and "speedup_over_none" in powersgd:
        for figure, target in (
            ("speedup_over_none", POWERSGD_SPEEDUP_TARGET),
            ("bytes_reduction_over_none", POWERSGD_BYTES_REDUCTION_TARGET),
            ("scaling_efficiency", POWERSGD_EFFICIENCY_TARGET),
        ):
            check(f"powersgd_{figure}_at_100mbit", powersgd[figure]["median"], target, at_least=True)
    for name, entry in links.items():
        if "auto_over_best" in entry:
            check(f"auto_over_best_at_{name}", entry["auto_over_best"]["median"], AUTO_OVER_BEST_TARGET, at_least=False)
    return found


def build_report(records: list[dict[str, Any]], links: list[Link], context: dict[str, Any]) -> dict[str, Any]:
    default_bucket = context["default_bucket_cap_mb"]
    by_link = {link.name: link_figures(records, link, default_bucket) for link in links}
    return {**context, "targets": targets(by_link, default_bucket), "links": by_link, "records": records}


def _range(figure: dict[str, float], fmt: str, scale: float = 1.0) -> str:
    if not figure["n"]:
        return "-"
    median, low, high = (figure[key] * scale for key in ("median", "min", "max"))
    return f"{median:{fmt}} ({low:{fmt}}-{high:{fmt}})"


def _speedup(figures: dict[str, Any]) -> str:
    speedup = figures.get("speedup_over_none")
    return f"x{speedup['median']:.2f}" if speedup else ""


def _chosen(figures: dict[str, Any]) -> str:
    """auto's choices over the repeats, e.g. 'powersgd x3'."""
    return ", ".join(f"{method} x{count}" for method, count in figures.get("chosen", {}).items())


def format_table(report: dict[str, Any]) -> str:
    """One row per link and setting: medians over repeats with their min-max."""
    lines = [
        f"{report['config']}: 2 ranks in 2 network namespaces, gloo, {report['repeats']} repeats x "
        f"{report['steps']} timed steps, per-rank batch {report['per_rank_batch_size']}, loadavg "
        f"{report['loadavg_before'][0]:.2f} before / {report['loadavg_after'][0]:.2f} after",
        "",
    ]
    header = (
        f"{'link':<12}{'setting':<22}{'step ms (min-max)':<26}{'samples/s':>10}{'eff.':>7}"
        f"{'MB/step':>9}{'vs none':>9}  auto chose"
    )
    lines += [header, "-" * len(header)]
    for entry in report["links"].values():
        one = entry["one_rank"]["step_ms"]
        lines.append(f"{entry['label']:<12}{'1 rank':<22}{_range(one, '.1f'):<26}")
        for key, figures in entry["settings"].items():
            lines.append(
                f"{'':<12}{key:<22}{_range(figures['step_ms'], '.1f'):<26}"
                f"{figures['samples_per_s']['median']:>10.0f}{figures['scaling_efficiency']['median']:>7.2f}"
                f"{figures['bytes_per_step']['median'] / 1e6:>9.3f}"
                f"{_speedup(figures):>9}  {_chosen(figures)}"
            )
        if "auto_over_best" in entry:
            lines.append(f"{'':<12}auto / best ({entry['best']}): {_range(entry['auto_over_best'], '.3f')}")
    if report["targets"]:
        lines += ["", "targets:"]
        for name, target in report["targets"].items():
            verdict = "met" if target["met"] else "NOT met"
            lines.append(f"  {name}: {target['value']:.3f} (target {target['target']:g}): {verdict}")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """Left: step time against link speed, a line per compression method (default bucket size), the 1-rank step as the
    floor; right: step time against bucket size at the bucket-sweep link."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    default_bucket = report["default_bucket_cap_mb"]
    links = list(report["links"].values())
    methods = list(dict.fromkeys(f["method"] for entry in links for f in entry["settings"].values()))
    sweep = report["links"].get(report["bucket_link"])
    figure, axes = plt.subplots(1, 2 if sweep else 1, figsize=(12 if sweep else 7, 4.5), squeeze=False)
    left = axes[0][0]
    positions = range(len(links))
    for method in methods:
        stats = [entry["settings"].get(setting_key(method, default_bucket), {}).get("step_ms") for entry in links]
        xs = [x for x, stat in zip(positions, stats, strict=True) if stat]
        medians, errors = whiskers([stat for stat in stats if stat])
        left.errorbar(xs, medians, yerr=errors, marker="o", capsize=4, label=method)
    floor = statistics.median(entry["one_rank"]["step_ms"]["median"] for entry in links)
    left.axhline(floor, linestyle="--", color="grey", label=f"1 rank, no communication ({floor:.0f} ms)")
    left.set(
        xticks=list(positions),
        xticklabels=[entry["label"] for entry in links],
        xlabel="link speed (tc tbf on a veth pair between 2 network namespaces)",
        ylabel="ms per training step (2 ranks)",
        title=f"step time, bucket_cap_mb={default_bucket:g} (median; whiskers: min, max)",
        yscale="log",
    )
    left.legend(fontsize="small")
    if sweep:
        right = axes[0][1]
        for method in methods:
            rows = sorted(
                (figures["bucket_cap_mb"], figures["step_ms"])
                for figures in sweep["settings"].values()
                if figures["method"] == method
            )
            medians, errors = whiskers([stat for _, stat in rows])
            right.errorbar([bucket for bucket, _ in rows], medians, yerr=errors, marker="o", capsize=4, label=method)
        right.set(
            xscale="log",
            xlabel="DDP bucket_cap_mb",
            ylabel="ms per training step (2 ranks)",
            title=f"bucket size at {sweep['label']}",
        )
        right.legend(fontsize="small")
    figure.suptitle(f"{report['config']}: DDP over a rate-limited link, 2 ranks, gloo")
    figure.tight_layout()
    save(figure, path, dpi=110)


def markdown_tables(report: dict[str, Any]) -> str:
    """The tables docs/performance.md quotes (tests/test_docs_numbers.py pins them to the JSON): every setting at the
    default bucket size per link, then the bucket sweep."""
    default_bucket = report["default_bucket_cap_mb"]
    lines = [
        "| link | setting | step ms, median (min-max) | samples/s | scaling efficiency | MB sent per step and rank "
        "| step time: no hook / this | auto chose |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for entry in report["links"].values():
        one = entry["one_rank"]["step_ms"]
        lines.append(f"| {entry['label']} | 1 rank, no communication | {_range(one, '.1f')} | | | | | |")
        for figures in entry["settings"].values():
            if figures["bucket_cap_mb"] != default_bucket:
                continue
            lines.append(
                f"| {entry['label']} | {figures['method']} | {_range(figures['step_ms'], '.1f')} "
                f"| {figures['samples_per_s']['median']:.0f} | {figures['scaling_efficiency']['median']:.2f} "
                f"| {figures['bytes_per_step']['median'] / 1e6:.3f} | {_speedup(figures)} | {_chosen(figures)} |"
            )
    sweep = report["links"].get(report["bucket_link"] or "")
    if sweep:
        buckets = sorted({figures["bucket_cap_mb"] for figures in sweep["settings"].values()})
        lines += [
            "",
            f"| {sweep['label']}, step ms | " + " | ".join(f"bucket_cap_mb={bucket:g}" for bucket in buckets) + " |",
            "|---|" + "---|" * len(buckets),
        ]
        methods = list(dict.fromkeys(figures["method"] for figures in sweep["settings"].values()))
        for method in methods:
            cells = [sweep["settings"].get(setting_key(method, bucket)) for bucket in buckets]
            lines.append(f"| {method} | " + " | ".join(_range(c["step_ms"], ".1f") if c else "-" for c in cells) + " |")
    return "\n".join(lines)
