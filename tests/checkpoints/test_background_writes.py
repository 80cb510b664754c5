"""BackgroundCheckpointIO on real files and its real writer thread: the save is a snapshot, one write
is in flight at most, and a failed write is said once, in one line naming the path, and stops
every later change on disk."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from app.checkpoints.io import safe_load
from app.checkpoints.plugin import BackgroundCheckpointIO, CheckpointWriteError, SafeCheckpointIO


class GatedIO(SafeCheckpointIO):
    """SafeCheckpointIO whose writes wait for `gate`: a write kept in flight as long as a test needs."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        self.started.set()
        assert self.gate.wait(30)
        super().save_checkpoint(checkpoint, path, storage_options)


def in_training(checkpoint_io: SafeCheckpointIO | None = None) -> BackgroundCheckpointIO:
    """The plugin as fit's training has it (`start_background_writes`)."""
    io = BackgroundCheckpointIO(checkpoint_io)
    io.writer.in_background = True
    return io


def test_a_save_outside_training_is_on_disk_when_it_returns(tmp_path: Path) -> None:
    io = BackgroundCheckpointIO()  # a script's own trainer.save_checkpoint(path), then a load
    io.save_checkpoint({"step": 1}, tmp_path / "saved.ckpt")
    assert safe_load(tmp_path / "saved.ckpt")["step"] == 1 and not io.writer.writing()


def test_a_save_holds_the_state_of_its_moment_not_of_the_steps_after(tmp_path: Path) -> None:
    io = in_training(GatedIO())
    weights = torch.zeros(1000)
    state = {"state_dict": {"w": weights}, "loops": {"step": [1]}}
    io.save_checkpoint(state, tmp_path / "last.ckpt")
    weights.add_(1.0)  # the next optimizer step, in place, while the write waits
    state["loops"]["step"].append(2)
    io.checkpoint_io.gate.set()
    io.writer.wait()
    saved = safe_load(tmp_path / "last.ckpt")
    assert torch.equal(saved["state_dict"]["w"], torch.zeros(1000)) and saved["loops"]["step"] == [1]
    io.teardown()


def test_the_next_save_waits_for_the_write_in_flight(tmp_path: Path) -> None:
    io = in_training(GatedIO())
    io.save_checkpoint({"step": 1}, tmp_path / "last.ckpt")
    assert io.checkpoint_io.started.wait(10)
    second = threading.Thread(target=io.save_checkpoint, args=({"step": 2}, tmp_path / "last.ckpt"))
    second.start()
    second.join(0.5)
    assert second.is_alive(), "a second save was taken while the first was still being written"
    assert not (tmp_path / "last.ckpt").exists()
    io.checkpoint_io.gate.set()
    second.join(10)
    io.teardown()
    assert safe_load(tmp_path / "last.ckpt")["step"] == 2


def test_a_failed_write_is_one_line_at_the_next_save_and_nothing_changes_after_it(tmp_path: Path) -> None:
    """A write that cannot happen (its directory is a file: the same for root as for anyone) is said at
    the next save; the removal queued behind it (a ModelCheckpoint's previous best) does not happen."""
    io = in_training()
    io.save_checkpoint({"step": 1}, tmp_path / "best.ckpt")
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the checkpoint directory should be")
    io.save_checkpoint({"step": 2}, blocked / "last.ckpt")  # returns: the write fails in the background
    io.remove_checkpoint(tmp_path / "best.ckpt")
    with pytest.raises(CheckpointWriteError) as raised:
        io.save_checkpoint({"step": 3}, tmp_path / "last.ckpt")
    message = str(raised.value)
    assert str(blocked / "last.ckpt") in message and "\n" not in message and "Fix:" in message
    io.teardown()  # said once: not again at the end
    assert safe_load(tmp_path / "best.ckpt")["step"] == 1
    assert not (tmp_path / "last.ckpt").exists()


def test_teardown_raises_a_failed_last_write(tmp_path: Path) -> None:
    io = in_training()
    (tmp_path / "file").write_text("")
    io.save_checkpoint({"step": 1}, tmp_path / "file" / "last.ckpt")
    with pytest.raises(CheckpointWriteError, match="could not write the checkpoint"):
        io.teardown()


def test_a_save_counts_as_written_only_once_on_disk_and_a_failed_one_never(tmp_path: Path) -> None:
    """`saves_written` is what app/tracking/run.py waits for before it calls a save's values final."""
    io = in_training(GatedIO())
    io.save_checkpoint({"step": 1}, tmp_path / "last.ckpt")
    assert io.checkpoint_io.started.wait(10)
    assert (io.writer.saves_started, io.writer.saves_written) == (1, 0)  # in flight: a kill now keeps no file
    io.checkpoint_io.gate.set()
    io.writer.wait()
    assert (io.writer.saves_started, io.writer.saves_written) == (1, 1) and (tmp_path / "last.ckpt").exists()
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the checkpoint directory should be")
    io.save_checkpoint({"step": 2}, blocked / "last.ckpt")
    with pytest.raises(CheckpointWriteError):
        io.writer.wait()
    assert (io.writer.saves_started, io.writer.saves_written) == (2, 1)
    io.teardown()
