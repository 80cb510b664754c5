"""No collective per training step on the Lightning side: the count does not grow with the steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.run import REPO, clean_env, ddp_app

pytestmark = pytest.mark.distributed


def collectives(tmp_path: Path, batch_size: int, *overrides: str) -> dict[str, int]:
    counts_dir = tmp_path / f"counts-{batch_size}"
    counts_dir.mkdir()
    env = clean_env(
        PYTHONPATH=str(REPO / "tests" / "helpers" / "count_collectives"), COUNT_COLLECTIVES_DIR=str(counts_dir)
    )
    result = ddp_app(
        "fit", "--config", "configs/digits.yaml", "--trainer.max_epochs=2", "--trainer.enable_progress_bar=false",
        f"--data.init_args.batch_size={batch_size}", f"--trainer.default_root_dir={tmp_path / str(batch_size)}",
        *overrides, env=env, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    per_rank = [json.loads(path.read_text()) for path in counts_dir.glob("*.json")]
    assert len(per_rank) == 2, per_rank  # the two ranks (the launcher makes none)
    return {name: max(counts.get(name, 0) for counts in per_rank) for name in ("broadcast", "all_reduce")}


def test_four_times_the_steps_make_no_more_collectives(tmp_path: Path) -> None:
    few, many = collectives(tmp_path, batch_size=32), collectives(tmp_path, batch_size=8)  # 40 vs 160 steps
    # The preemption check adds one small all-reduce per second of training, so allow a few.
    assert many["broadcast"] == few["broadcast"], (few, many)
    assert many["all_reduce"] - few["all_reduce"] <= 3, (few, many)
