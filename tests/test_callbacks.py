"""The progress display when stdout is not a terminal: compact lines, not tqdm's carriage returns."""

from __future__ import annotations

import csv
import re
import time
from pathlib import Path

import lightning as L
import pytest

from app.run.callbacks import LogLineProgressBar
from app.tracking.throughput import TrainingClock, samples_per_s
from tests.helpers.run import ddp_app
from tests.helpers.user_module import SeededRegressionData, TwoLayerRegressor


def fit_user_module(tmp_path: Path, bar: LogLineProgressBar, epochs: int) -> None:
    trainer = L.Trainer(
        devices=1, accelerator="cpu", max_epochs=epochs, default_root_dir=tmp_path, logger=False,
        enable_checkpointing=False, enable_model_summary=False, callbacks=[bar], log_every_n_steps=1,
    )  # fmt: skip
    trainer.fit(TwoLayerRegressor(), datamodule=SeededRegressionData(samples=64, batch_size=8))


def test_one_line_per_epoch_with_the_default_interval(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fit_user_module(tmp_path, LogLineProgressBar(), epochs=2)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:3] for line in lines] == [
        ["epoch=0", "step=8", "batch=8/8"],
        ["epoch=1", "step=16", "batch=8/8"],
    ]
    assert all(re.search(r" samples/s=\d+ train_loss=\d", line) for line in lines), lines


def test_lines_during_the_epoch_at_most_every_interval(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # interval 0: a line after every batch, then the epoch's own line (with the same values).
    fit_user_module(tmp_path, LogLineProgressBar(interval_s=0), epochs=1)
    out = capsys.readouterr().out
    assert "\r" not in out
    assert [line.split()[2] for line in out.splitlines()] == [f"batch={n}/8" for n in range(1, 9)] + ["batch=8/8"]


def test_training_time_is_batches_and_what_lies_between_them_not_validation() -> None:
    """app/tracking/throughput.py's definition: from a batch's start to the last batch's end, less
    the validation between them; a paused clock starts again at the next batch."""
    clock = TrainingClock()
    clock.batch_end(0)  # an end without a start (a resume's first hooks) counts no time
    started = time.perf_counter()
    for _ in range(2):
        clock.batch_start()
        time.sleep(0.05)
        clock.batch_end(16)
    clock.pause()  # validation within the epoch
    paused_from = time.perf_counter()
    time.sleep(0.5)
    paused_until = time.perf_counter()
    clock.pause()
    clock.batch_start()
    time.sleep(0.05)
    clock.batch_end(8)
    ended = time.perf_counter()
    samples, seconds = clock.totals()
    assert samples == 40
    # Bounds from this test's own clock, not from how late a loaded machine wakes a sleeper.
    assert 0.15 <= seconds <= (ended - started) - (paused_until - paused_from), seconds
    assert samples_per_s(samples, seconds) == samples / seconds
    clock.reset()
    assert clock.totals() == (0, 0) and samples_per_s(*clock.totals()) is None


@pytest.mark.distributed
def test_a_two_rank_fit_into_a_pipe_prints_one_line_per_epoch(tmp_path: Path) -> None:
    result = ddp_app(
        "fit", "--config", "configs/digits.yaml", "--trainer.max_epochs=2", f"--trainer.default_root_dir={tmp_path}"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "\r" not in result.stdout and "\r" not in result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("epoch=")]
    assert [line.split()[:2] for line in lines] == [["epoch=0", "step=20"], ["epoch=1", "step=40"]], result.stdout
    for line in lines:
        assert re.search(r" samples/s=\d+ ", line) and re.search(r" val_acc=0\.\d+", line), line
    # Issue 42: one epoch, one samples/s. The epoch's line, the summary and metrics.csv (what
    # `python -m app.plot` and the trackers show) give the same number (app/tracking/throughput.py).
    on_lines = [float(re.search(r" samples/s=(\d+) ", line).group(1)) for line in lines]
    (metrics_csv,) = tmp_path.glob("lightning_logs/*/metrics.csv")
    with metrics_csv.open() as rows:
        logged = [float(row["samples_per_s"]) for row in csv.DictReader(rows) if row["samples_per_s"]]
    assert on_lines == [round(value) for value in logged], (on_lines, logged)
    summary = re.search(r"^ddp-app: fit done .*, ([\d,]+) samples/s \(last epoch\)$", result.stdout, re.MULTILINE)
    assert summary and float(summary.group(1).replace(",", "")) == on_lines[-1], (summary, on_lines)


def test_the_nan_guard_leaves_steps_with_overflowed_gradients_to_a_gradient_scaler(tmp_path: Path) -> None:
    """Under 16-mixed on a GPU a GradScaler skips the steps whose scaled gradients overflow (it finds
    its scale that way in the first steps of every run): those are not a diverged run. A CPU scaler
    with a huge initial scale makes the first steps overflow here."""
    import torch
    from lightning.pytorch.plugins.precision import MixedPrecision

    from app.run.callbacks import NonFiniteGuard

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, default_root_dir=tmp_path,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)], callbacks=[NonFiniteGuard()],
    )  # fmt: skip
    model = TwoLayerRegressor()
    trainer.fit(model, datamodule=SeededRegressionData())
    assert scaler.get_scale() < 2.0**100  # steps overflowed and were skipped by the scaler
    assert all(torch.isfinite(parameter).all() for parameter in model.parameters())


class InfAtOneStep(TwoLayerRegressor):
    """The loss of one optimizer step is made infinite; the steps before and after it are ordinary."""

    def __init__(self, bad_step: int) -> None:
        super().__init__()
        self.bad_step = bad_step

    def training_step(self, batch: tuple, batch_idx: int):  # type: ignore[override]
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if self.global_step == self.bad_step else loss


def test_the_nan_guard_reads_its_verdict_later_and_names_the_first_bad_step(tmp_path: Path) -> None:
    """The verdict stays on the device and is read every log_every_n_steps steps: the error, raised at
    that read, names the first bad step, not the step of the read."""
    from app.errors import NonFiniteLossError
    from app.run.callbacks import NonFiniteGuard

    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        log_every_n_steps=5, callbacks=[NonFiniteGuard()],
    )  # fmt: skip
    with pytest.raises(NonFiniteLossError, match=r"non-finite gradients at global step 3 \(seen at step 5,"):
        trainer.fit(InfAtOneStep(bad_step=3), datamodule=SeededRegressionData())
