"""Figures the docs quote from a source, checked against that source as written.

Every number the docs (docs/performance.md, usage.md, reliability.md, compression.md, slurm.md)
take from a benchmark's JSON (`docs/bench*.json`) is
formatted here from its JSON field, with the rounding the doc uses, and must appear verbatim; so
must the counts the docs give of test cases and parity checks' siblings (bad-input cases, Slurm
tests) and the bound the rank-failure test asserts. A re-run that changes a JSON, or a test added
without the docs, fails here. Nothing here starts a process.
"""

from __future__ import annotations

import ast
import json
import math
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from app.bench.network_report import markdown_tables
from tests.fault.test_bad_input import CASES
from tests.fault.test_rank_failure import BOUND_S
from tests.fault.test_signal_storm import DEFAULT_RUN_SEEDS, SEEDS
from tests.helpers.run import REPO

DOCS = REPO / "docs"
USAGE, RELIABILITY, COMPRESSION = DOCS / "usage.md", DOCS / "reliability.md", DOCS / "compression.md"
PERFORMANCE = REPO / "docs" / "performance.md"


@cache
def bench(name: str) -> dict[str, Any]:
    return json.loads((REPO / "docs" / f"{name}.json").read_text())


def side(name: str, world_size: int) -> dict[str, Any]:
    return bench(name)["by_world_size"][str(world_size)]


def ratio(summary: dict[str, float], digits: int = 3, range_digits: int = 2) -> str:
    """'1.384 (1.35-2.04)': a paired median with its min and max."""
    return f"{summary['median']:.{digits}f} ({summary['min']:.{range_digits}f}-{summary['max']:.{range_digits}f})"


def this_machine_row(name: str, digits: int) -> str:
    """A row of performance.md's table for this VM, from the first figure to the end of the line."""
    one, two = side(name, 1), side(name, 2)
    efficiency = bench(name)["scaling_efficiency_by_world_size"]
    added = two["lightning_added_ms_per_step"]
    return (
        f"| {one['reference']['step_ms']['median']:.{digits}f} / {one['lightning']['step_ms']['median']:.{digits}f} "
        f"| {two['reference']['step_ms']['median']:.{digits}f} / {two['lightning']['step_ms']['median']:.{digits}f} "
        f"| {ratio(two['lightning_over_reference_step_time'])} "
        f"| {added['median']:+.{digits}f} ({added['min']:+.{digits}f} to {added['max']:+.{digits}f}) "
        f"| {two['reference']['first_step_s']['median']:.1f} / {two['lightning']['first_step_s']['median']:.1f} "
        f"(x{two['first_step_ratio']['median']:.2f}) "
        f"| {efficiency['lightning']['2']['median']:.2f} / {efficiency['reference']['2']['median']:.2f} |"
    )


def earlier_machine_row(name: str) -> str:
    """A row of performance.md's table for the earlier machine, up to its load-average column."""
    one, two = side(name, 1), side(name, 2)
    efficiency = bench(name)["scaling_efficiency_by_world_size"]
    return (
        f"| {one['reference']['step_ms']['median']:.1f} / {one['lightning']['step_ms']['median']:.1f} "
        f"| {two['reference']['step_ms']['median']:.1f} / {two['lightning']['step_ms']['median']:.1f} "
        f"| {ratio(two['lightning_over_reference_step_time'])} "
        f"| {two['lightning_added_ms_per_step']['median']:+.1f} "
        f"| {two['reference']['first_step_s']['median']:.1f} / {two['lightning']['first_step_s']['median']:.1f} "
        f"(x{two['first_step_ratio']['median']:.2f}) "
        f"| {efficiency['lightning']['2']['median']:.2f} / {efficiency['reference']['2']['median']:.2f} "
        f"| {bench(name)['loadavg_before'][0]:.1f} |"
    )


@pytest.mark.parametrize(
    ("name", "digits"), [("bench", 2), ("bench_fixed_order", 2), ("bench_cnn", 1), ("bench_cnn_fixed_order", 1)]
)
def test_this_machine_table_quotes_its_json(name: str, digits: int) -> None:
    text = PERFORMANCE.read_text()
    assert f"(`docs/{name}.json`) {this_machine_row(name, digits)}" in text, this_machine_row(name, digits)


@pytest.mark.parametrize("name", ["bench_cnn_rerun", "bench_resnet18", "bench_cnn_quiet"])
def test_earlier_machine_table_quotes_its_json(name: str) -> None:
    assert f"(`docs/{name}.json`) {earlier_machine_row(name)}" in PERFORMANCE.read_text(), earlier_machine_row(name)


def test_performance_summary_table_quotes_the_json() -> None:
    digits, cnn = side("bench", 2), side("bench_cnn", 2)
    efficiency = {name: bench(name)["scaling_efficiency_by_world_size"] for name in ("bench", "bench_cnn")}
    rows = [
        f"| | digits MLP, {bench('bench')['repeats']} pairs "
        f"| CNN 28x28 (`configs/bench_cnn.yaml`), {bench('bench_cnn')['repeats']} pairs |",
        f"| step ms, reference / Lightning "
        f"| {digits['reference']['step_ms']['median']:.2f} / {digits['lightning']['step_ms']['median']:.2f} "
        f"| {cnn['reference']['step_ms']['median']:.1f} / {cnn['lightning']['step_ms']['median']:.1f} |",
        f"| Lightning / reference step time | {ratio(digits['lightning_over_reference_step_time'])} "
        f"| {ratio(cnn['lightning_over_reference_step_time'])} |",
        f"| Lightning added ms per step | {digits['lightning_added_ms_per_step']['median']:+.2f} "
        f"({side('bench_fixed_order', 2)['lightning_added_ms_per_step']['median']:+.2f} in a second run; ",
        f"| {cnn['lightning_added_ms_per_step']['median']:+.1f} |",
        f"| launch to first step, Lightning / reference | x{digits['first_step_ratio']['median']:.2f} "
        f"| x{cnn['first_step_ratio']['median']:.2f} |",
        "| scaling efficiency, Lightning / reference "
        + "".join(
            f"| {lightning['2']['median']:.2f} / {reference['2']['median']:.2f} "
            for lightning, reference in ((e["lightning"], e["reference"]) for e in efficiency.values())
        )
        + "|",
    ]
    text = PERFORMANCE.read_text()
    for row in rows:
        assert row in text, row


def test_prose_quotes_the_json() -> None:
    """Figures in sentences: each fragment as the doc writes it, its numbers from the JSON."""
    cnn, cnn_fixed = side("bench_cnn", 2), side("bench_cnn_fixed_order", 2)
    runs = {name: (side(name, 1), side(name, 2)) for name in ("bench_fixed_order", "bench")}
    first_ratio = {
        name: side(name, 2)["first_step_ratio"]["median"]
        for name in ("bench", "bench_fixed_order", "bench_cnn", "bench_cnn_fixed_order")
    }
    efficiency = bench("bench_cnn")["scaling_efficiency_by_world_size"]
    fixed_efficiency = bench("bench_cnn_fixed_order")["scaling_efficiency_by_world_size"]
    digits_efficiencies = [
        bench(name)["scaling_efficiency_by_world_size"][who]["2"]["median"]
        for name in ("bench", "bench_fixed_order")
        for who in ("lightning", "reference")
    ]
    # Lightning's added main-thread CPU per step at 1 rank in the first run, and that halved for the
    # earlier machine, which was 2x faster (a scaled estimate, not a measurement).
    cpu_one_rank = runs["bench_fixed_order"][0]["lightning_added_cpu_ms_per_step"]["median"]
    performance = {
        f"Lightning / reference {ratio(cnn['lightning_over_reference_step_cpu'])} in",
        f"{cnn_fixed['lightning_over_reference_step_cpu']['median']:.3f} in the fixed-order run",
        f"x{first_ratio['bench']:.2f} to x{first_ratio['bench_fixed_order']:.2f} (digits) and "
        f"x{first_ratio['bench_cnn']:.2f} to x{first_ratio['bench_cnn_fixed_order']:.2f} (CNN)",
        f"{runs['bench_fixed_order'][1]['lightning_added_ms_per_step']['median']:+.2f} and "
        f"{runs['bench'][1]['lightning_added_ms_per_step']['median']:+.2f} ms at 2 ranks",
        f"at 1 rank {runs['bench_fixed_order'][0]['lightning_added_ms_per_step']['median']:+.2f} and "
        f"{runs['bench'][0]['lightning_added_ms_per_step']['median']:+.2f}",
        f"({cpu_one_rank:+.2f} ms CPU per step at 1 rank in the first run)",
        f"about {cpu_one_rank / 2:.2f} ms (scaled, not measured)",
        f"CNN {ratio(cnn['lightning_over_reference_step_time'])} at 2 ranks counterbalanced, main-thread CPU "
        f"{cnn['lightning_over_reference_step_cpu']['median']:.3f}; "
        f"  {ratio(side('bench_cnn', 1)['lightning_over_reference_step_time'])} at 1 rank; "
        f"ResNet-18 {ratio(side('bench_resnet18', 2)['lightning_over_reference_step_time'])}",
        f"The fixed-order run's {cnn_fixed['lightning_over_reference_step_time']['median']:.3f} did not reproduce",
        f"(Lightning {efficiency['lightning']['2']['median']:.2f}, "
        f"{efficiency['lightning']['2']['min']:.2f}-{efficiency['lightning']['2']['max']:.2f}; the "
        f"  reference {efficiency['reference']['2']['median']:.2f}, "
        f"{efficiency['reference']['2']['min']:.2f}-{efficiency['reference']['2']['max']:.2f}, in the same run; "
        f"{fixed_efficiency['lightning']['2']['median']:.2f} / {fixed_efficiency['reference']['2']['median']:.2f}",
        f"The digits MLP ({min(digits_efficiencies):.2f} to {max(digits_efficiencies):.2f})",
        f"Lightning added 3.76 -> {runs['bench_fixed_order'][1]['lightning_added_ms_per_step']['median']:.2f} and "
        f"{runs['bench'][1]['lightning_added_ms_per_step']['median']:.2f} ms per step at 2 ranks, 2.23 -> "
        f"{runs['bench_fixed_order'][0]['lightning_added_ms_per_step']['median']:.2f} and "
        f"{runs['bench'][0]['lightning_added_ms_per_step']['median']:.2f} ms at 1 rank",
    }
    readme = {
        f"about {cpu_one_rank:.2f} ms of CPU per step at 1 rank on this VM",
        f"about {cpu_one_rank / 2:.2f} ms on the earlier machine",
    }
    missing = [
        f"{path.name}: {fragment!r}"
        for path, fragments in ((PERFORMANCE, performance), (PERFORMANCE, readme))
        for fragment in fragments
        if " ".join(fragment.split()) not in " ".join(path.read_text().split())
    ]
    assert not missing, "\n".join(missing)


def test_slow_networks_section_quotes_the_network_bench() -> None:
    """performance.md's "Slow networks": the tables as `markdown_tables` renders the JSON, and the prose."""
    report = bench("bench_network")
    text = PERFORMANCE.read_text()
    missing = [line for line in markdown_tables(report).splitlines() if line not in text]
    assert not missing, "\n".join(missing)
    slow, unlimited = report["links"]["100mbit"], report["links"]["unlimited"]
    none, powersgd = slow["settings"]["none@25MB"], slow["settings"]["powersgd@25MB"]
    targets = {name: target["value"] for name, target in report["targets"].items()}
    one_rank = [entry["one_rank"]["step_ms"] for entry in report["links"].values()]
    megabytes = {name: figures["bytes_per_step"]["median"] / 1e6 for name, figures in slow["settings"].items()}
    chosen = {name: entry["settings"]["auto@25MB"]["chosen"] for name, entry in report["links"].items()}
    spread_ratio = max(
        figures["step_ms"]["max"] / figures["step_ms"]["min"]
        for entry in report["links"].values()
        for figures in entry["settings"].values()
    )
    at_1gbit = report["links"]["1gbit"]["settings"]
    fragments = [
        f"`docs/bench_network.json`: {report['bench_seconds']:.0f} s for the whole run",
        f"(load average {report['loadavg_before'][0]:.1f} at the start, {report['loadavg_after'][0]:.1f} at the end)",
        f"spread by up to {(spread_ratio - 1) * 100:.0f}% (max / min {spread_ratio:.2f}; the 1-rank step alone: "
        f"{min(s['min'] for s in one_rank):.1f} to {max(s['max'] for s in one_rank):.1f} ms)",
        f"met**, x{targets['powersgd_bytes_reduction_over_none_at_100mbit']:.2f} "
        f"({megabytes['powersgd@25MB']:.3f} vs {megabytes['none@25MB']:.3f} MB per rank and step)",
        "**PowerSGD >= 4x faster per step than no hook: met**, "
        f"x{targets['powersgd_speedup_over_none_at_100mbit']:.2f} "
        f"(the median of the paired ratios): {powersgd['step_ms']['median']:.1f} against "
        f"{none['step_ms']['median']:.1f} ms",
        f"({megabytes['none@25MB']:.3f} MB at 100 Mbit/s take at least "
        f"{none['bytes_per_step']['median'] * 8 / 100e6 * 1e3:.0f} ms); PowerSGD's "
        f"{megabytes['powersgd@25MB']:.3f} MB take {powersgd['bytes_per_step']['median'] * 8 / 100e6 * 1e3:.0f} ms",
        f"**PowerSGD scaling efficiency >= 0.7 at 100 Mbit/s: not met here, by a little** "
        f"({targets['powersgd_scaling_efficiency_at_100mbit']:.2f})",
        f"2-rank step of {powersgd['step_ms']['median']:.1f} ms against the 1-rank step's "
        f"{slow['one_rank']['step_ms']['median']:.1f} ms",
        f"({unlimited['settings']['powersgd@25MB']['step_ms']['median']:.1f} ms on the unlimited link)",
        f"met at {sum(target['met'] for name, target in report['targets'].items() if name.startswith('auto'))} "
        "of 3 links here",
        f"{targets['auto_over_best_at_100mbit']:.2f} at 100 Mbit/s, where it chose powersgd in all "
        f"{chosen['100mbit']['powersgd']} repeats, the same hook as the best setting",
        f"({slow['auto_over_best']['min']:.2f} to {slow['auto_over_best']['max']:.2f} between repeats); "
        f"{targets['auto_over_best_at_1gbit']:.2f} at 1 Gbit/s (powersgd twice, bf16 once; best: "
        f"{report['links']['1gbit']['best'].partition('@')[0]}); {targets['auto_over_best_at_unlimited']:.2f} at the "
        f"unlimited link, where the best was {unlimited['best'].partition('@')[0]}",
        f"it chose bf16 all {chosen['unlimited']['bf16']} times",
        f"({megabytes['none@25MB']:.3f} MB for 4.80 MB of gradients)",
        f"({at_1gbit['none@25MB']['bytes_per_step']['median'] / 1e6:.3f} MB at 1 Gbit/s)",
        f"halve the bytes ({megabytes['bf16@25MB']:.3f} vs {megabytes['none@25MB']:.3f} MB here) for one rounding "
        f"per value: x{slow['settings']['bf16@25MB']['speedup_over_none']['median']:.2f} and "
        f"x{slow['settings']['fp16@25MB']['speedup_over_none']['median']:.2f} at 100 Mbit/s",
        f"different rooms): {targets['powersgd_bytes_reduction_over_none_at_100mbit']:.0f}x fewer bytes here",
        f"{at_1gbit['powersgd@1MB']['step_ms']['median']:.1f} ms at `bucket_cap_mb=1` against "
        f"{at_1gbit['powersgd@25MB']['step_ms']['median']:.1f} at 25 MB (1 Gbit/s)",
        f"6 timed; {slow['settings']['auto@25MB']['probe_steps']['median']:.0f} steps here with the switch)",
        f"(the same arithmetic: {at_1gbit['none@25MB']['step_ms']['median']:.1f} and "
        f"{at_1gbit['none@100MB']['step_ms']['median']:.1f} ms without a hook at 1 Gbit/s are noise apart)",
        f"{at_1gbit['none@1MB']['step_ms']['median']:.1f} ms instead of "
        f"{at_1gbit['none@25MB']['step_ms']['median']:.1f} "
        f"without a hook, {at_1gbit['bf16@1MB']['step_ms']['median']:.1f} instead of "
        f"{at_1gbit['bf16@25MB']['step_ms']['median']:.1f} with bf16",
    ]
    # The prose names auto's choices and which settings were fastest in words.
    assert chosen["1gbit"] == {"powersgd": 2, "bf16": 1} and chosen["unlimited"] == {"bf16": 3}
    assert slow["best"] == report["links"]["1gbit"]["best"] == "powersgd@25MB"
    flat = " ".join(text.split())
    missing = [fragment for fragment in fragments if " ".join(fragment.split()) not in flat]
    assert not missing, "\n".join(missing)


def test_slow_networks_section_quotes_the_slower_vm_run() -> None:
    """The second network run (docs/bench_network_slow_vm.json), quoted beside the first."""
    report, first = bench("bench_network_slow_vm"), bench("bench_network")
    targets = {name: target["value"] for name, target in report["targets"].items()}
    slow = report["links"]["100mbit"]
    fragments = [
        f"(`docs/bench_network_slow_vm.json`: {report['bench_seconds']:.0f} s; load average "
        f"{report['loadavg_before'][0]:.1f} at the start; the 1-rank step "
        f"{slow['one_rank']['step_ms']['median']:.1f} ms at 100 Mbit/s, against "
        f"{first['links']['100mbit']['one_rank']['step_ms']['median']:.1f} ms above)",
        f"PowerSGD x{targets['powersgd_speedup_over_none_at_100mbit']:.2f} faster than no hook at 100 Mbit/s "
        f"({slow['settings']['powersgd@25MB']['step_ms']['median']:.1f} against "
        f"{slow['settings']['none@25MB']['step_ms']['median']:.1f} ms; the 4x target is not met there)",
        f"x{targets['powersgd_bytes_reduction_over_none_at_100mbit']:.2f} fewer bytes, scaling efficiency "
        f"{targets['powersgd_scaling_efficiency_at_100mbit']:.2f}; auto / best "
        f"{targets['auto_over_best_at_100mbit']:.2f}, "
        f"{targets['auto_over_best_at_1gbit']:.2f} and {targets['auto_over_best_at_unlimited']:.2f} at the three links",
    ]
    assert not report["targets"]["powersgd_speedup_over_none_at_100mbit"]["met"]
    flat = " ".join(PERFORMANCE.read_text().split())
    missing = [fragment for fragment in fragments if " ".join(fragment.split()) not in flat]
    assert not missing, "\n".join(missing)


def test_usage_doc_quotes_the_error_bench_worst_ratio() -> None:
    """`python -m app.bench.errors`: time to a config error / time to `import lightning`, worst case."""
    worst = max(case["ratio"] for case in bench("bench_errors")["cases"].values())
    assert math.isfinite(worst)
    assert f"({worst:.2f}x measured here, `python -m app.bench.errors`" in " ".join(USAGE.read_text().split())


def test_reliability_doc_counts_the_signal_storm_seeds() -> None:
    text = " ".join(RELIABILITY.read_text().split())
    assert f"{len(SEEDS)} seeds ({len(DEFAULT_RUN_SEEDS)} in the default run, all with `-m fault`)" in text


def test_reliability_doc_counts_the_bad_input_cases() -> None:
    assert f"({len(CASES)} cases in `tests/fault/test_bad_input.py`" in RELIABILITY.read_text()


def collected_tests(path: Path) -> int:
    """How many tests pytest collects from a file: each test function times its parametrize lists."""
    count = 0
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            cases = 1
            for decorator in node.decorator_list:
                if isinstance(decorator, ast.Call) and ast.unparse(decorator.func).endswith("parametrize"):
                    argvalues = decorator.args[1]
                    assert isinstance(argvalues, ast.List | ast.Tuple), ast.unparse(decorator)
                    cases *= len(argvalues.elts)
            count += cases
    return count


def test_slurm_doc_counts_the_slurm_tests() -> None:
    total = sum(collected_tests(path) for path in (REPO / "tests" / "slurm").glob("test_*.py"))
    assert f"the whole `pytest -m slurm` ({total} tests:" in (REPO / "docs" / "slurm.md").read_text()


def test_reliability_doc_states_the_rank_failure_bound() -> None:
    text = " ".join(RELIABILITY.read_text().split())
    assert f"within the {BOUND_S} s that `tests/fault/test_rank_failure.py` allows" in text


RECOVERY_PATHS = {
    "ddp-app": "`ddp-app fit ... --restarts 1` (the launcher, one node)",
    "torchrun": "`torchrun --standalone --nproc_per_node=2 --max-restarts=1`",
    "slurm": "Slurm requeue (`multinode.sbatch`, 2 nodes x 1 rank)",
    "slurm-torchrun": "`torchrun.sbatch` (2 nodes x 1 rank, `--max-restarts`)",
}


def recovery_table() -> list[str]:
    """The table of `python -m app.bench.recovery`'s figures (docs/recovery.json) that docs/reliability.md and
    docs/slurm.md quote, row by row."""
    figures = bench("recovery")
    (interval,) = {figures[path]["checkpoint_interval_steps"] for path in RECOVERY_PATHS}
    rows = [
        f"| how the ranks come back | recovery: kill to the next training step | steps redone (interval: {interval}) |",
        "|---|---|---|",
    ]
    for path, label in RECOVERY_PATHS.items():
        seconds, redone = figures[path]["recovery_s"], figures[path]["steps_redone"]
        rows.append(
            f"| {label} | {seconds['median']:.1f} s ({seconds['min']:.1f} to {seconds['max']:.1f}) "
            f"| {redone['median']:g} ({redone['min']:g} to {redone['max']:g}) |"
        )
    return rows


def test_docs_quote_the_recovery_figures() -> None:
    figures = bench("recovery")
    loads = [load for path in RECOVERY_PATHS for load in figures[path]["loadavg_before_after"]]
    (repeats,) = {len(figures[path]["runs"]) for path in RECOVERY_PATHS}
    slurm_doc = " ".join((REPO / "docs" / "slurm.md").read_text().split())
    assert f"Median (min to max) of {repeats} runs each" in slurm_doc
    assert f"(load average {min(loads):.1f} to {max(loads):.1f})" in slurm_doc
    for path in (RELIABILITY, REPO / "docs" / "slurm.md"):
        lines = [line.strip() for line in path.read_text().splitlines()]
        for row in recovery_table():
            assert row in lines, f"{path.name}: {row}"


def test_compression_doc_accuracy_is_the_json() -> None:
    """docs/compression.md's accuracy-cost table, cell by cell, from docs/compression_accuracy.json."""
    report = json.loads((REPO / "docs" / "compression_accuracy.json").read_text())
    readme = COMPRESSION.read_text()
    for workload, label in (
        ("digits MLP", "digits MLP, 15 epochs"),
        ("digits CNN 28x28", "CNN on digits 28x28, 8 epochs"),
    ):
        cells = [
            f"{value:.4f}" if setting == "none" else f"{value:.4f} ({report['points_vs_none'][workload][setting]:+.2f})"
            for setting, value in report["val_acc"][workload].items()
        ]
        assert f"| {label} | {' | '.join(cells)} |" in readme, workload
    assert report["epochs"]["digits CNN 28x28"] == 8 and report["epochs"]["digits MLP"] == 15


def test_performance_doc_states_the_digits_cost_measured_after_the_gpu_round() -> None:
    figures = bench("bench_digits_nov26")
    one = figures["by_world_size"]["1"]["lightning_added_ms_per_step"]
    reference = figures["by_world_size"]["1"]["reference"]["step_ms"]["median"]
    text = " ".join(PERFORMANCE.read_text().split())
    added = f"{one['median']:+.2f} ms ({one['min']:+.2f} to {one['max']:+.2f})"
    assert f"the reference's step {reference:.2f} ms): {added}" in text
    indexed = bench("bench_digits_indexed")["by_world_size"]["1"]
    steps = {side: indexed[side]["step_ms"]["median"] for side in ("reference", "lightning")}
    after = indexed["lightning_added_ms_per_step"]
    assert (
        f"the reference's step {steps['reference']:.2f} ms and Lightning's {steps['lightning']:.2f} ms, added "
        f"{after['median']:+.2f} ms ({after['min']:+.2f} to {after['max']:+.2f})"
    ) in text


def test_performance_doc_states_the_re_measured_digits_cost() -> None:
    figures = bench("bench_digits_nov25")
    one, two = (figures["by_world_size"][size]["lightning_added_ms_per_step"] for size in ("1", "2"))
    reference = figures["by_world_size"]["1"]["reference"]["step_ms"]["median"]
    text = " ".join(PERFORMANCE.read_text().split())
    assert (
        f"the reference's step {reference:.2f} ms at 1 rank): {one['median']:+.2f} ms ({one['min']:+.2f} to "
        f"{one['max']:+.2f}) at 1 rank, {two['median']:+.2f} ms ({two['min']:+.2f} to {two['max']:+.2f}) at 2 ranks"
    ) in text


GPU_RUNS = {"bench_gpu_bf16": "bf16-mixed, channels_last, batch 256", "bench_gpu_fp32": "fp32, batch 16 (as shipped)"}


# The runs after DDP moved to the training stream (app/cluster/ddp_stream.py), on two machines.
GPU_STREAM_RUNS = {
    "bench_gpu_bf16_stream": "bf16-mixed, channels_last, batch 256, both on the DataLoader (first machine)",
    "bench_gpu_ondev": "the same, Lightning's split on the GPU (`on_device`) (second machine)",
    "bench_gpu_fp32_stream": "fp32, batch 16 (second machine)",
}


def gpu_row(name: str) -> str:
    """A row of performance.md's H100 tables, from its JSON."""
    label = GPU_RUNS.get(name) or GPU_STREAM_RUNS[name]
    figures, one = bench(name), side(name, 1)
    steps = " / ".join(f"{one[who]['step_ms']['median']:.2f}" for who in ("reference", "lightning", "bare"))
    rates = " / ".join(f"{one[who]['samples_per_s']['median']:,.0f}" for who in ("reference", "lightning", "bare"))
    return (
        f"| {label} | {figures['repeats']} | {steps} | {ratio(one['lightning_over_reference_step_time'])} "
        f"| {rates} | {ratio(figures['summary']['lightning_fraction_of_framework_free'], 3)} |"
    )


def quoted_gpu_table(names: dict[str, str]) -> str:
    """performance.md's prose on one line, after checking that it has each run's table row."""
    text = PERFORMANCE.read_text()
    for name in names:
        assert bench(name)["accelerator"] == "gpu" and bench(name)["world_sizes"] == [1]
        assert gpu_row(name) in text, name
    return " ".join(text.split())


def test_performance_doc_quotes_the_h100_runs() -> None:
    prose = quoted_gpu_table(GPU_RUNS)
    bf16, fp32 = bench("bench_gpu_bf16"), bench("bench_gpu_fp32")
    samples_per_s = side("bench_gpu_bf16", 1)["lightning"]["samples_per_s"]["median"]
    assert f"from 9,871 to {samples_per_s:,.0f} samples/s" in prose
    assert f"Lightning / reference from 1.422 to {bf16['lightning_over_reference_step_time']:.3f}" in prose
    assert f"Lightning reaches {bf16['lightning_fraction_of_framework_free']:.2f} of the framework-free loop" in prose
    assert f"(the reference at {bf16['reference_fraction_of_framework_free']:.2f})" in prose
    assert f"at batch 16 fp32 it is {fp32['lightning_over_reference_step_time']:.3f} (target 1.05" in prose
    cpu = {who: side("bench_gpu_fp32", 1)[who]["step_cpu_ms"]["median"] for who in ("reference", "lightning")}
    spent = f"main thread spent {cpu['lightning']:.1f} ms per step against the reference's {cpu['reference']:.1f}"
    assert spent in prose


def test_performance_doc_quotes_the_h100_runs_on_the_training_stream() -> None:
    prose = quoted_gpu_table(GPU_STREAM_RUNS)
    fp32, bf16, ondev = bench("bench_gpu_fp32_stream"), bench("bench_gpu_bf16_stream"), bench("bench_gpu_ondev")
    before = {name: bench(name)["lightning_over_reference_step_time"] for name in GPU_RUNS}  # the previous runs
    after = fp32["lightning_over_reference_step_time"]
    assert f"went from {before['bench_gpu_fp32']:.3f} to {after:.3f} (target 1.05)" in prose
    cpu = {who: side("bench_gpu_fp32_stream", 1)[who]["step_cpu_ms"]["median"] for who in ("reference", "lightning")}
    spends = f"main thread now spends {cpu['lightning']:.2f} ms per step against the reference's {cpu['reference']:.2f}"
    assert spends in prose
    bf16_after = bf16["lightning_over_reference_step_time"]
    assert f"went from {before['bench_gpu_bf16']:.3f} to {bf16_after:.3f} (target 1.03)" in prose
    rate = side("bench_gpu_ondev", 1)["lightning"]["samples_per_s"]["median"]
    fraction = ondev["lightning_fraction_of_framework_free"]
    assert f"Lightning reaches {rate:,.0f} samples/s, {fraction:.2f} of the" in prose
    lightning = side("bench_gpu_ondev", 1)["lightning"]
    assert f"Lightning's step ({lightning['step_ms']['median']:.2f} ms)" in prose
    assert f"CPU time ({lightning['step_cpu_ms']['median']:.2f} ms)" in prose
    assert f"GPU-bound step ({side('bench_gpu_ondev', 1)['bare']['step_ms']['median']:.2f} ms)" in prose
    profile = (REPO / "docs" / "profile_gpu_bf16.txt").read_text()
    assert "profile: lightning" in profile and "profile: reference" in profile


def test_performance_doc_quotes_the_per_call_cuts() -> None:
    rows = json.loads((REPO / "docs" / "bench_per_call.json").read_text())
    prose = " ".join(PERFORMANCE.read_text().split())
    ddp, hook = rows["DDP 1 rank"], rows["hook name"]
    assert f"took {ddp['before_us']:.0f} us with the broadcast and {ddp['after_us']:.0f} us without" in prose
    assert f"{hook['before_us']:.2f} against {hook['after_us']:.2f} us per assignment" in prose


def floor_table(name: str = "bench_floor") -> str:
    """performance.md's table of a `python -m app.bench.floor` run (docs/<name>.json)."""
    figures = bench(name)
    lines = ["| side | ms per step | added to the plain loop, ms (median [min, max] of 5 rounds) |", "|---|---|---|"]
    for side, ms in figures["ms_per_step"].items():
        added = figures["added_ms_per_step"].get(side)
        shown = f"{added['median']:+.3f} [{added['min']:+.3f}, {added['max']:+.3f}]" if added else ""
        lines.append(f"| {side} | {ms['median']:.3f} | {shown} |")
    return "\n".join(lines)


def test_performance_doc_quotes_lightnings_floor() -> None:
    text = PERFORMANCE.read_text()
    assert floor_table() in text, floor_table()
    figures = bench("bench_floor")
    prose = " ".join(text.split())
    assert f"a bare Lightning Trainer adds {figures['added_ms_per_step']['lightning']['median']:+.2f} ms" in prose
    assert f"costs about {figures['noop_callback_us_per_step']['median']:.0f} us per step here" in prose
    digits = bench("bench_digits_nov26_floor")["by_world_size"]["1"]
    added = digits["lightning_added_ms_per_step"]
    assert (
        f"the reference's step {digits['reference']['step_ms']['median']:.2f} ms, Lightning's "
        f"{digits['lightning']['step_ms']['median']:.2f} ms): {added['median']:+.2f} ms "
        f"({added['min']:+.2f} to {added['max']:+.2f})"
    ) in prose


def test_performance_doc_quotes_ddp_apps_own_cost_per_step() -> None:
    """The floor bench's ddp-app sides, and the 1- and 2-rank added times, as the JSON has them."""
    text = PERFORMANCE.read_text()
    figures = bench("bench_floor_nov27")
    assert floor_table("bench_floor_nov27") in text
    own = figures["ddp_app_own_ms_per_step"]
    prose = " ".join(text.split())
    assert (
        f"ddp-app's own cost over a bare Trainer: {own['median']:+.3f} ms per step "
        f"({own['min']:+.3f} to {own['max']:+.3f})"
    ) in prose
    by_size = bench("bench_digits_nov27")["by_world_size"]
    one, two = (by_size[size]["lightning_added_ms_per_step"] for size in ("1", "2"))
    assert f"{one['median']:+.2f} ms per step over the reference at 1 rank" in prose
    assert f"and {two['median']:+.2f} ms at 2 ranks" in prose
    assert two["median"] <= one["median"] + 0.2


def test_performance_doc_quotes_the_diagnose_report_and_the_step_timing_cost() -> None:
    prose = " ".join(PERFORMANCE.read_text().split())
    assert bench("diagnose_straggler")["verdict_text"] in prose
    assert [round(rank["score"], 2) for rank in bench("diagnose_straggler")["ranks"]] == [1.0, 0.38]
    for report in ("diagnose_data", "diagnose_100mbit", "diagnose_100mbit_powersgd"):
        assert bench(report)["verdict_text"] in prose, report
    digits, digits_compressed = bench("diagnose_100mbit_digits"), bench("diagnose_100mbit_digits_powersgd")
    assert digits["communication_cost"] == "latency" and "gradient_compression" not in digits["verdict_text"]
    assert f"communication-bound too ({digits['shares']['communication']:.0%})" in prose
    assert f"raised its share to {digits_compressed['shares']['communication']:.0%}" in prose
    assert digits_compressed["shares"]["communication"] > digits["shares"]["communication"]
    assert bench("diagnose_data")["tried_num_workers"][-1]["data_share"] < 0.10  # issue 43's acceptance
    for checked in ("diagnose_100mbit_checked", "diagnose_100mbit_digits_checked"):  # compression tried, not guessed
        report = bench(checked)
        assert report["verdict_text"] in prose and "Checked: with gradient_compression.method powersgd" in prose
        assert f"a step took {report['tried_compression']['step_ms']:.1f} ms" in report["verdict_text"], checked
    plain, compressed = (
        bench(name)["shares"]["communication"] for name in ("diagnose_100mbit", "diagnose_100mbit_powersgd")
    )
    assert compressed < plain
    cost = bench("bench_step_timing")
    overhead = cost["overhead_pct"]
    assert f"{cost['off_step_ms_median']:.3f} ms off and {cost['on_step_ms_median']:.3f} ms on" in prose
    assert f"{overhead['median']:+.2f}% [{overhead['min']:+.2f}, {overhead['max']:+.2f}]" in prose
    assert f"{cost['added_pct_of_step']:.2f}% of the {cost['off_step_ms_median']:.3f} ms step" in prose
    assert cost["added_pct_of_step"] < 1.0  # issue 43: the per-step timing costs at most 1%


def test_performance_doc_quotes_the_two_rank_save_bench() -> None:
    """docs/performance.md's table of background saves on 2 ranks and on 1 is docs/bench_save_fits.json."""
    text = (REPO / "docs" / "performance.md").read_text()
    report = json.loads((REPO / "docs" / "bench_save_fits.json").read_text())
    for ranks, name, label in (
        ("2", "ddp", "DDP (rank 0 writes"),
        ("2", "fsdp", "FSDP2 (each rank writes"),
        ("1", "ddp", "DDP (a core spare"),
        ("1", "fsdp", "FSDP2 (a core spare"),
    ):
        figures = report["by_ranks"][ranks][name]
        blocked = figures["blocked_ms_per_save"]
        row = next(line for line in text.splitlines() if line.strip().startswith(f"| {ranks} | {label}"))
        expected = (
            f"| {blocked['sync']:.0f} ms | {blocked['async']:.0f} ms ({blocked['async_over_sync']:.0%}) | "
            f"{blocked['overlap']:.0f} ms ({blocked['overlap_over_sync']:.0%}) |"
        )
        assert expected in row, (row, expected)
        steps = figures["step_ms"]
        assert f"| {steps['no_write']:.0f} ms | {steps['during_over_no_write']:.2f}x |" in row, row
        assert f"| {steps['overlapped_over_no_write']:.2f}x | {steps['write_cpu_per_save']:.0f} ms |" in row, row


def test_performance_doc_quotes_the_one_process_save_bench() -> None:
    """docs/performance.md's table of one process's saves is docs/bench_saves.json."""
    text = (REPO / "docs" / "performance.md").read_text()
    report = json.loads((REPO / "docs" / "bench_saves.json").read_text())
    blocked, steps = report["blocked_ms_per_save"], report["step_ms"]
    row = next(line for line in text.splitlines() if line.startswith("| training blocked per save"))
    assert f"| {blocked['sync']:.0f} ms | {blocked['async']:.0f} ms | {blocked['async_over_sync']:.0%} |" in row, row
    assert f"| {blocked['async_fresh']:.0f} ms | {blocked['async_fresh_over_sync']:.0%} |" in row, row
    assert f"| {blocked['overlap']:.0f} ms | {blocked['overlap_over_sync']:.1%} |" in row, row
    row = next(line for line in text.splitlines() if line.startswith("| step time, no write in flight"))
    assert f"| {steps['no_write']:.0f} ms | {steps['during_background_write']:.0f} ms |" in row, row


def test_diloco_doc_quotes_its_quality_bench() -> None:
    """docs/diloco.md's quality table as `app.bench.diloco_quality.markdown_table` renders its JSON, and the
    figures its prose reads from it."""
    from app.bench.diloco_quality import markdown_table

    report = bench("diloco_quality")
    text = (DOCS / "diloco.md").read_text()
    missing = [line for line in markdown_table(report) if line not in text]
    assert not missing, "\n".join(missing)
    digits, gpt = report["results"]["digits"], report["results"]["gpt"]

    def below(variant: str, ranks: int) -> str:
        return f"{digits[variant][str(ranks)]['value'] - digits['ddp'][str(ranks)]['value']:+.3f}"

    fragments = [
        f"({report['seconds']:.0f} s for the 28 runs",
        f"({below('diloco H10', 2)} at 2 ranks, {below('diloco H10', 4)} at 4",
        f"H 10: within 0.01 at 2 ranks** ({below('avg H10', 2)}), {below('avg H10', 4)} at 4",
        f"H 50 beats H 10 there ({below('diloco H50', 2)} and {below('diloco H50', 4)})",
        f"{gpt['diloco H50']['2']['best']:.4f} against {gpt['ddp']['2']['best']:.4f} at 2 ranks, "
        f"{gpt['diloco H50']['4']['best']:.4f} against {gpt['ddp']['4']['best']:.4f} at 4",
        f"at H 10 {gpt['avg H10']['2']['best']:.4f} and {gpt['avg H10']['4']['best']:.4f}, as good as DDP",
        f"DDP's {gpt['ddp']['2']['value']:.2f} at 2 ranks",
    ]
    assert abs(float(below("avg H10", 2))) <= 0.01  # the prose says "within 0.01"
    flat = " ".join(text.split())
    missing = [fragment for fragment in fragments if " ".join(fragment.split()) not in flat]
    assert not missing, "\n".join(missing)


def test_diloco_doc_quotes_its_studies() -> None:
    """docs/diloco.md's tables of the outer-step and the overlap studies, as `study_table` renders their JSON."""
    from app.bench.diloco_quality import study_table

    text = (DOCS / "diloco.md").read_text()
    for name in ("diloco_outer", "diloco_overlap"):
        missing = [line for line in study_table(bench(name)) if line not in text]
        assert not missing, "\n".join(missing)


def test_diloco_doc_quotes_its_overlap_bench() -> None:
    """docs/diloco.md's overlap figures, from its two runs: in line and overlapped, at 100 Mbit/s (and with
    no cap), and the load."""
    fragments = []
    for name in (
        "bench_network_diloco_overlap_first",
        "bench_network_diloco_overlap",
        "bench_network_diloco_overlap_third",
    ):
        fragments += overlap_bench_figures(bench(name))
    flat = " ".join((DOCS / "diloco.md").read_text().split())
    missing = [fragment for fragment in fragments if " ".join(fragment.split()) not in flat]
    assert not missing, "\n".join(missing)


def overlap_bench_figures(report: dict[str, Any]) -> list[str]:
    assert report["diloco"] == {"sync_every": 50, "outer_dtype": "float32", "overlap_steps": 25}
    before, after = report["loadavg_before"][0], report["loadavg_after"][0]
    fragments = [
        f"{report['repeats']} repeats of {report['steps']} timed steps",
        f"load average {before:.1f} at its start and {after:.1f} at its end",
    ]
    for link in report["links"].values():
        one = link["one_rank"]["step_ms"]
        fragments.append(f"{link['label']}: 1 rank {one['median']:.1f} ms ({one['min']:.1f} to {one['max']:.1f})")
        for method in ("diloco", "diloco_overlap"):
            figures = link["settings"][f"{method}@25MB"]
            step, efficiency = figures["step_ms"], figures["scaling_efficiency"]
            fragments.append(
                f"{method} {step['median']:.1f} ms (efficiency {efficiency['median']:.2f}, "
                f"{efficiency['min']:.2f} to {efficiency['max']:.2f})"
            )
    return fragments


def test_diloco_doc_quotes_its_network_bench() -> None:
    """docs/diloco.md's "Speed over a slow link": bytes, step times and load from the two network runs."""
    first, second = bench("bench_network_diloco"), bench("bench_network_diloco_h100_bf16")
    slow = first["links"]["100mbit"]["settings"]
    none, diloco, powersgd = slow["none@25MB"], slow["diloco@25MB"], slow["powersgd@25MB"]
    bf16 = second["links"]["100mbit"]["settings"]["diloco@25MB"]
    assert first["diloco"] == {"sync_every": 50, "outer_dtype": "float32"}
    assert second["diloco"] == {"sync_every": 100, "outer_dtype": "bfloat16"}
    per_outer = diloco["bytes_per_step"]["median"] * 50
    one_rank = [entry["one_rank"]["step_ms"] for entry in first["links"].values()]
    fragments = [
        f"{diloco['bytes_per_step']['median'] / 1e6:.3f} MB per step and rank against DDP's "
        f"{none['bytes_per_step']['median'] / 1e6:.3f} (x{diloco['bytes_reduction_over_none']['median']:.1f}; "
        f"PowerSGD x{powersgd['bytes_reduction_over_none']['median']:.1f}); at H 100 in bfloat16 "
        f"{bf16['bytes_per_step']['median'] / 1e6:.3f} MB "
        f"(x{none['bytes_per_step']['median'] / bf16['bytes_per_step']['median']:.0f})",
        f"{first['loadavg_before'][0]:.1f} at the start of the first run, {second['loadavg_after'][0]:.1f} at the end",
        f"between {min(s['min'] for s in one_rank):.1f} and {max(s['max'] for s in one_rank):.1f} ms",
        f"DiLoCo {diloco['step_ms']['median']:.1f} ms per step (scaling efficiency "
        f"{diloco['scaling_efficiency']['median']:.2f}), PowerSGD {powersgd['step_ms']['median']:.1f} "
        f"({powersgd['scaling_efficiency']['median']:.2f}), DDP {none['step_ms']['median']:.1f} "
        f"({none['scaling_efficiency']['median']:.2f})",
        f"{per_outer / 1e6:.2f} MB per rank, at least {per_outer * 8 / 100e6 * 1e3:.0f} ms at 100 Mbit/s, "
        f"{per_outer * 8 / 100e6 * 1e3 / 50:.1f} ms per step at H 50",
        f"(H 100 in bfloat16: {bf16['bytes_per_step']['median'] * 8 / 100e6 * 1e3:.1f} ms per step)",
    ]
    flat = " ".join((DOCS / "diloco.md").read_text().split())
    missing = [fragment for fragment in fragments if " ".join(fragment.split()) not in flat]
    assert not missing, "\n".join(missing)
