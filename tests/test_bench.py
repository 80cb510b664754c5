"""`python -m app.bench`, run as a user would on a tiny budget: the report has its figures, not targets."""

from __future__ import annotations

import itertools
import json
import math
import sys
from pathlib import Path

import pytest

from app.bench.__main__ import pair_order
from app.bench.report import spread
from app.bench.runs import epoch_step_times, summarize_run
from tests.helpers.run import run

pytestmark = pytest.mark.distributed


def test_bench_writes_the_table_json_and_plot(tmp_path: Path) -> None:
    report_path, plot_path = tmp_path / "bench.json", tmp_path / "bench.png"
    result = run(
        [
            sys.executable,
            "-m",
            "app.bench",
            "--config",
            "configs/digits.yaml",
            "--world-sizes",
            "1,2",
            "--repeats",
            "1",
            "--epochs",
            "1",
            "--warmup-steps",
            "2",
            "--no-warmup",
            "--out",
            str(tmp_path / "runs"),
            "--json",
            str(report_path),
            "--plot",
            str(plot_path),
        ],
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(report_path.read_text())
    for key in (
        "lightning_over_reference_step_time",
        "lightning_added_ms_per_step",
        "first_step_ratio",
        "scaling_efficiency",
    ):
        assert isinstance(report[key], float) and math.isfinite(report[key]), (key, report[key])
        assert set(report["summary"][key]) >= {"median", "min", "max"}
    for key in ("lightning_over_reference_step_time", "first_step_ratio", "scaling_efficiency"):
        assert report[key] > 0, (key, report[key])
    for side in ("reference", "lightning"):
        figures = report["by_world_size"]["2"][side]
        for name in ("step_ms", "samples_per_s", "first_step_s", "teardown_s", "peak_rss_mb_max_rank"):
            assert figures[name]["median"] > 0, (side, name, figures[name])
    assert len(report["runs"]) == 5  # (reference, Lightning) x world sizes 1, 2, and the framework-free loop
    # The framework-free limit at world size 1: the same network and batch, no framework.
    bare = report["by_world_size"]["1"]["bare"]
    assert bare["step_ms"]["median"] > 0 and bare["first_step_ms"]["median"] > 0
    for side in ("reference", "lightning"):
        fraction = report["by_world_size"]["1"]["fraction_of_framework_free"][side]["median"]
        # A ratio of two timings, not a timed test: the other test worker's load can slow either side
        # several-fold (6x seen); the bound catches a unit mix-up (ms against s), not a slow machine.
        assert 0 < fraction < 20, (side, fraction)
    assert report["summary"]["lightning_fraction_of_framework_free"]["n"] == 1
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for row in ("step time (ms)", "scaling efficiency", "throughput / framework-free", "first step (ms)"):
        assert row in result.stdout, row


def test_step_times_leave_out_warm_up_and_epoch_boundaries() -> None:
    record = {"epochs": [0, 0, 0, 0, 1, 1, 1], "starts": [0.0, 1.0, 1.5, 2.0, 10.0, 10.5, 11.0]}
    intervals, by_epoch = epoch_step_times(record, warmup_steps=1)
    assert by_epoch == [[0.5, 0.5], [0.5, 0.5]]  # 2.0 -> 10.0 spans validation: not a step
    assert intervals == [0.5, 0.5, 0.5, 0.5]


def test_on_a_gpu_a_step_lasts_until_the_gpu_reaches_the_next(tmp_path: Path) -> None:
    # The host queues a step every 1 ms, ahead of the GPU, which reaches one every 3 ms: the GPU's
    # pace is the throughput (StepRecorder.gpu_events); the host's is kept beside it.
    steps = 6
    record = {
        "epochs": [0] * steps,
        "starts": [0.001 * step for step in range(steps)],
        "ends": [0.001 * step + 0.0005 for step in range(steps)],
        "cpu_starts": [0.001 * step for step in range(steps)],
        "gpu_starts": [0.003 * step for step in range(steps)],
        "wall_anchor": 100.0,
        "perf_anchor": 0.0,
        "peak_rss_mb": 1.0,
        "cuda_max_allocated_mb": 1.0,
    }
    (tmp_path / "lightning-rank0.json").write_text(json.dumps(record))
    result = summarize_run("lightning", 1, 0, tmp_path, 99.0, 101.0, per_rank_batch_size=30, warmup_steps=1)
    assert result.step_ms == pytest.approx(3.0) and result.step_host_ms == pytest.approx(1.0)
    assert result.samples_per_s == pytest.approx(10_000)


def test_spread_ignores_non_finite_values() -> None:
    assert spread([3.0, 1.0, float("nan"), 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert spread([])["n"] == 0


def test_each_side_runs_first_in_half_of_the_pairs() -> None:
    orders = [pair_order(repeat) for repeat in range(4)]
    assert all(sorted(order) == ["lightning", "reference"] for order in orders)
    assert [order[0] for order in orders].count("lightning") == 2


def test_per_call_bench_times_every_cut_before_and_after(capsys: pytest.CaptureFixture[str]) -> None:
    from app.bench.per_call import main

    main(["--calls", "50", "--repeats", "1"])
    rows = {line[:18].strip(): line[18:].split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert set(rows) == {"train accuracy", "NaN-guard grads", "profiler", "hook name", "DDP 1 rank"}
    for before, after, _ in rows.values():
        assert float(before) > 0 and float(after) > 0


def test_floor_bench_reports_every_side_and_what_each_lightning_side_adds(tmp_path: Path) -> None:
    from app.bench.floor import SIDES, main

    out = tmp_path / "floor.json"
    main(["--batches", "4", "--epochs", "2", "--repeats", "1", "--json", str(out)])
    figures = json.loads(out.read_text())
    assert list(figures["ms_per_step"]) == list(SIDES)
    assert all(side["median"] > 0 for side in figures["ms_per_step"].values())
    assert list(figures["added_ms_per_step"]) == list(SIDES[1:])


def test_save_bench_times_sync_and_background_saves_side_by_side(tmp_path: Path) -> None:
    from app.bench.saves import main

    out = tmp_path / "saves.json"
    main(["--hidden", "256", "--layers", "2", "--saves", "1", "--dir", str(tmp_path), "--json", str(out)])
    figures = json.loads(out.read_text())
    blocked = figures["blocked_ms_per_save"]
    assert all(blocked[mode] > 0 for mode in ("sync", "async", "async_fresh", "overlap")), blocked
    assert figures["step_ms"]["no_write"] > 0 and figures["checkpoint_mb"] > 1
    assert not [path for path in tmp_path.iterdir() if path.is_dir()], "the bench leaves its checkpoints behind"


@pytest.mark.slow  # about 3 min: twelve tiny fits; the figures in docs/performance.md come from its full size
@pytest.mark.distributed
def test_save_fits_bench_times_both_strategies_sync_background_and_overlapped(tmp_path: Path) -> None:
    out, plot_path = tmp_path / "save_fits.json", tmp_path / "save_fits.png"
    result = run(
        [sys.executable, "-m", "app.bench.save_fits", "--ranks", "2,1", "--d-model", "64", "--layers", "2",
         "--saves", "2", "--every", "2", "--out", str(tmp_path), "--json", str(out), "--plot", str(plot_path)],
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert list(report["by_ranks"]) == ["2", "1"], list(report["by_ranks"])
    for ranks, strategy in itertools.product(("2", "1"), ("ddp", "fsdp")):
        figures = report["by_ranks"][ranks][strategy]
        for mode in ("sync", "async", "overlap"):
            run_figures = figures["runs"][mode]
            assert run_figures["ranks"] == int(ranks) and run_figures["saves"] >= 2, (ranks, strategy, mode)
            assert figures["blocked_ms_per_save"][mode] is not None and run_figures["step_ms_no_write"] > 0
            assert figures["blocked_with_next_step_ms"][mode] is not None
        assert figures["step_ms"]["during_background_write"] > 0  # the step after a save runs during its write
        assert figures["step_ms"]["write_cpu_per_save"] > 0  # the writer thread's own CPU time, per write
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [path for path in tmp_path.iterdir() if path.is_dir()], "the bench leaves its runs behind"
