"""When `LastCheckpoint` writes last.ckpt, recorded in-process on real (1-rank) fits of the digits job."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import lightning as L
import pytest

from app.checkpoints.last import LastCheckpoint, agreed_last_checkpoint
from app.cli import DDPAppCLI
from app.cluster.exit_codes import PREEMPTED_EXIT_CODE
from app.cluster.launch import run_local_ranks
from app.cluster.preemption import PREEMPTION_SIGNALS, STOP_SIGNAL_FLAG, Stopped, resume_command
from app.run.coordinator import RunCoordinator
from tests.helpers.run import REPO

DIGITS = str(REPO / "configs" / "digits.yaml")
STEPS_PER_EPOCH = 40  # digits at 1 rank, batch 32


class SaveRecorder(L.Callback):
    """(global step, micro-batches done in the epoch) at each checkpoint save."""

    def __init__(self) -> None:
        self.saves: list[tuple[int, int]] = []

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self.saves.append((trainer.global_step, trainer.fit_loop.epoch_loop.batch_progress.current.processed))


def fit_recording_saves(tmp_path: Path, *overrides: str) -> list[tuple[int, int]]:
    cli = DDPAppCLI(
        args=[
            "--config", DIGITS, f"--trainer.default_root_dir={tmp_path}", "--trainer.devices=1",
            "--trainer.enable_progress_bar=false", "--trainer.logger=false", "--trainer.max_epochs=2",
            "--last_checkpoint.check_interval_s=0", *overrides,
        ],
        run=False,
    )  # fmt: skip
    recorder = SaveRecorder()
    cli.trainer.callbacks.append(recorder)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return recorder.saves


def test_every_epoch_end_saves_last_even_when_the_monitored_metric_does_not_improve(tmp_path: Path) -> None:
    # mode=min on an accuracy that rises: the best-k callback saves at epoch 0 only.
    saves = fit_recording_saves(
        tmp_path, "--last_checkpoint.every_n_seconds=0", "--trainer.callbacks.init_args.mode=min"
    )
    assert [step for step, _ in saves] == [STEPS_PER_EPOCH, STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH]
    assert len(list((tmp_path / "checkpoints").glob("best-*.ckpt"))) == 1


def test_a_step_interval_adds_saves_within_the_epoch(tmp_path: Path) -> None:
    saves = fit_recording_saves(tmp_path, "--last_checkpoint.every_n_seconds=0", "--last_checkpoint.every_n_steps=15")
    last_saves = sorted({step for step, _ in saves})
    assert last_saves == [15, 30, 40, 45, 60, 75, 80]


def test_a_due_time_interval_saves_at_the_next_check_and_never_between_accumulated_batches(tmp_path: Path) -> None:
    # Due at every check, checked every batch: a save after every optimizer step and none between
    # the accumulated micro-batches, whose summed gradients no checkpoint holds.
    saves = fit_recording_saves(
        tmp_path, "--last_checkpoint.every_n_seconds=1e-9", "--trainer.accumulate_grad_batches=3",
        "--trainer.strategy=auto",
    )  # fmt: skip
    within_epoch = [batches for _, batches in saves if batches % STEPS_PER_EPOCH]
    assert within_epoch and all(batches % 3 == 0 for batches in within_epoch), saves
    steps = [step for step, _ in saves]
    assert steps == sorted(steps) and max(steps) == 2 * 14  # 40 batches = 13 full groups + a tail of 1


def test_checkpointing_off_writes_no_last_checkpoint_and_keeps_the_coordinator(tmp_path: Path) -> None:
    cli = DDPAppCLI(
        args=["--config", DIGITS, f"--trainer.default_root_dir={tmp_path}", "--trainer.devices=1",
              "--trainer.enable_checkpointing=false", "--trainer.callbacks=[]", "--trainer.max_epochs=1",
              "--trainer.logger=false", "--trainer.enable_progress_bar=false"],
        run=False,
    )  # fmt: skip
    coordinators = [callback for callback in cli.trainer.callbacks if isinstance(callback, RunCoordinator)]
    assert len(coordinators) == 1 and coordinators[0].last_checkpoint is None
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == STEPS_PER_EPOCH
    assert not list(tmp_path.rglob("*.ckpt"))


def test_a_bad_interval_is_one_line_naming_the_key() -> None:
    with pytest.raises(ValueError, match="last_checkpoint.every_n_seconds must be >= 0"):
        LastCheckpoint(every_n_seconds=-1)


def test_the_resume_command_replaces_any_ckpt_path_with_last() -> None:
    argv = ["/venv/bin/ddp-app", "fit", "--config", "a b.yaml", "--ckpt_path", "x.ckpt", "--ckpt_path=y"]
    assert resume_command(argv) == "ddp-app fit --config 'a b.yaml' --ckpt_path last"


class SigtermInSanityCheck(L.Callback):
    """A preemption that arrives while the sanity check runs (after Lightning's Trainer set up its run)."""

    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        os.kill(os.getpid(), signal.SIGTERM)


def test_a_preemption_during_the_sanity_check_stops_when_training_starts_with_nothing_saved(tmp_path: Path) -> None:
    """Lightning's own SIGTERM handler ended this fit with SystemExit(0) untrained (and, with 2 ranks and
    the signal on one, hung in a broadcast inside the handler); ddp-app's flag stops it with exit 3."""
    STOP_SIGNAL_FLAG.install(PREEMPTION_SIGNALS)  # what app.cli.entry.run does as a rank starts
    try:
        cli = DDPAppCLI(
            args=[
                "--config", DIGITS, f"--trainer.default_root_dir={tmp_path}", "--trainer.devices=1",
                "--trainer.enable_progress_bar=false", "--trainer.logger=false",
            ],
            run=False,
        )  # fmt: skip
        cli.trainer.callbacks.append(SigtermInSanityCheck())
        with pytest.raises(Stopped) as stopped:
            cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    finally:
        STOP_SIGNAL_FLAG.restore()
    assert stopped.value.exit_code == PREEMPTED_EXIT_CODE
    assert str(stopped.value).startswith("preempted before training started (SIGTERM): nothing new to save.")
    assert cli.trainer.global_step == 0
    assert not (tmp_path / "checkpoints" / "last.ckpt").exists()


def report_the_agreed_last_checkpoint() -> int:
    """A rank of a 2-rank DDP Trainer whose checkpoint directory holds another last.ckpt than rank 0's:
    the different answers that nodes may get from a network filesystem, made real with one directory per rank."""
    root = Path(os.environ["AGREE_DIR"])
    rank = os.environ["LOCAL_RANK"]
    (root / f"rank{rank}" / "checkpoints").mkdir(parents=True)
    (root / f"rank{rank}" / "checkpoints" / "last.ckpt").write_bytes(b"")  # found by name and age only
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", default_root_dir=root / f"rank{rank}", logger=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    (root / f"answer{rank}").write_text(str(agreed_last_checkpoint(trainer)))
    return 0


@pytest.mark.distributed
def test_every_rank_resumes_from_the_last_checkpoint_rank_0_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("AGREE_DIR", str(tmp_path))
    assert run_local_ranks(2, report_the_agreed_last_checkpoint, {}) == 0, capfd.readouterr().err[-3000:]
    rank_0_found = str(tmp_path / "rank0" / "checkpoints" / "last.ckpt")
    assert [(tmp_path / f"answer{rank}").read_text() for rank in (0, 1)] == [rank_0_found] * 2
