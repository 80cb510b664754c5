"""Figures the docs quote from a source, checked against that source as written.

Every number README.md and docs/performance.md take from a benchmark's JSON (`docs/bench*.json`) is
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

from tests.fault.test_bad_input import CASES
from tests.fault.test_rank_failure import BOUND_S
from tests.helpers.run import REPO

README = REPO / "README.md"
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


def test_readme_performance_table_quotes_the_json() -> None:
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
    text = README.read_text()
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
        for path, fragments in ((PERFORMANCE, performance), (README, readme))
        for fragment in fragments
        if " ".join(fragment.split()) not in " ".join(path.read_text().split())
    ]
    assert not missing, "\n".join(missing)


def test_readme_quotes_the_error_bench_worst_ratio() -> None:
    """`python -m app.bench.errors`: time to a config error / time to `import lightning`, worst case."""
    worst = max(case["ratio"] for case in bench("bench_errors")["cases"].values())
    assert math.isfinite(worst)
    assert f"({worst:.2f}x measured here, `python -m app.bench.errors`" in " ".join(README.read_text().split())


def test_readme_counts_the_bad_input_cases() -> None:
    assert f"({len(CASES)} cases in `tests/fault/test_bad_input.py`" in README.read_text()


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


def test_readme_states_the_rank_failure_bound() -> None:
    text = " ".join(README.read_text().split())
    assert f"within the {BOUND_S} s that `tests/fault/test_rank_failure.py` allows" in text
