"""A search's results.png, drawn from its points' own metrics.csv files: one readable panel per swept
key and one for the optimisation history, each recording what it draws."""

from __future__ import annotations

import json
import time
from pathlib import Path

from app.sweep.results import write_results
from app.sweep.spec import build_spec
from app.sweep.store import DONE, SweepStore
from app.tracking.history import Call
from app.tracking.sinks import CsvView
from tests.helpers.plots import drawn_panels, names_by_panel
from tests.helpers.run import REPO

CONFIG = str(REPO / "configs" / "digits.yaml")
# The best val_acc of four trials; the second had a hopeless learning rate.
TRIALS = {"0.003": 0.93, "0.0001": 0.12, "0.01": 0.96, "0.03": 0.95}


def finished_point(store: SweepStore, lr: str, trial: int, best: float) -> None:
    point = store.add({"optimizer.init_args.lr": lr}, trial=trial)
    point.state = DONE
    point.attempts = [{"started": "2026-11-27T00:00:00+00:00", "ended": "2026-11-27T00:00:30+00:00"}]
    store.save(point)
    log_dir = store.point_dir(point) / "lightning_logs" / "version_0"
    log_dir.mkdir(parents=True)
    identity = {"run_id": f"run{trial}", "log_version": "version_0", "created": "2026-11-27T00:00:00+00:00"}
    (log_dir / "run.json").write_text(json.dumps(identity))
    calls = [
        Call(epoch, 20 * epoch + 19, time.time(), {"epoch": float(epoch), "val_acc": best - 0.05 * (2 - epoch)})
        for epoch in range(3)
    ]
    CsvView(log_dir).rewrite(calls)


def test_a_searchs_plot_draws_each_panel_readably(tmp_path: Path) -> None:
    search = ["optimizer.init_args.lr=loguniform:1e-4:1e-1"]
    spec = build_spec(["--config", CONFIG], [], search, 4, "val_acc", "maximize", "median", 0)
    store = SweepStore(tmp_path)
    for trial, (lr, best) in enumerate(TRIALS.items()):
        finished_point(store, lr, trial, best)
    rows = write_results(store, spec)
    assert [float(row["best val_acc"]) for row in rows] == list(TRIALS.values())
    panels = drawn_panels(tmp_path / "results.png")
    assert names_by_panel(panels) == [{"best val_acc"}, {"trial", "best so far"}]
    assert panels[0]["xscale"] == "log" and panels[0]["xlabel"] == "optimizer.init_args.lr"
    history = {series["name"]: series for series in panels[1]["series"]}
    assert (history["trial"]["min"], history["best so far"]["max"]) == (0.12, 0.96)
