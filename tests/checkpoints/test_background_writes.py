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
from app.checkpoints.staging import HostStaging


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


# `last_checkpoint.overlap_copy`: the parameters and the optimizer state are copied on the writer
# thread while the next step computes; that step's optimizer waits for the copy.


def overlapped_training(tmp_path: Path) -> tuple[BackgroundCheckpointIO, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    step(model, optimizer)  # AdamW's state exists from the first step on
    io = BackgroundCheckpointIO(overlap_copy=True)
    io.writer.in_background = True
    io.writer.watch(model, [optimizer])  # as `start_background_writes` does at fit's train start
    return io, model, optimizer


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.randn(8, 64)).square().mean().backward()  # also moves BatchNorm's running statistics
    optimizer.step()


def lightning_checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """What Lightning hands the checkpoint I/O: the live tensors (state dicts are views of them)."""
    return {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()], "loops": {"step": 1}}


def expected(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    import copy

    return copy.deepcopy({"state_dict": model.state_dict(), "optimizer": optimizer.state_dict()})


def test_an_overlapped_copy_holds_the_state_of_the_save_while_the_next_steps_run(tmp_path: Path) -> None:
    io, model, optimizer = overlapped_training(tmp_path)
    hold = threading.Event()
    io.writer.before_write = lambda: hold.wait(30)  # the late copy has not started when the next step begins
    at_save = expected(model, optimizer)
    io.save_checkpoint(lightning_checkpoint(model, optimizer), tmp_path / "last.ckpt")
    stepping = threading.Thread(target=step, args=(model, optimizer))
    stepping.start()  # its forward changes BatchNorm's buffers (copied at the save); its optimizer waits
    stepping.join(timeout=2)
    assert stepping.is_alive(), "the optimizer stepped before the save's copy of the parameters was made"
    hold.set()
    stepping.join(timeout=30)
    assert not stepping.is_alive() and io.writer.staging_wait_s > 1.0
    step(model, optimizer)
    io.writer.wait()
    saved = safe_load(tmp_path / "last.ckpt")
    for name, tensor in at_save["state_dict"].items():
        assert torch.equal(saved["state_dict"][name], tensor), name
    moved = ("0.weight", "1.running_mean", "2.bias")  # a parameter and a buffer, two steps later
    assert not any(torch.equal(model.state_dict()[name], at_save["state_dict"][name]) for name in moved)
    for index, state in at_save["optimizer"]["state"].items():
        for key, tensor in state.items():
            assert torch.equal(saved["optimizer_states"][0]["state"][index][key], tensor), (index, key)
    io.teardown()


def test_a_parameter_changed_in_place_while_it_is_copied_fails_that_save_in_one_line(tmp_path: Path) -> None:
    io, model, optimizer = overlapped_training(tmp_path)
    io.save_checkpoint(lightning_checkpoint(model, optimizer), tmp_path / "last.ckpt")
    io.writer.wait()
    previous = (tmp_path / "last.ckpt").read_bytes()
    hold = threading.Event()
    io.writer.before_write = lambda: hold.wait(30)
    io.save_checkpoint(lightning_checkpoint(model, optimizer), tmp_path / "last.ckpt")
    with torch.no_grad():
        model[0].weight.clamp_(-0.01, 0.01)  # a user's clamp before the next optimizer step
    hold.set()
    with pytest.raises(CheckpointWriteError) as failure:
        io.writer.wait()
    message = str(failure.value)
    assert "\n" not in message and str(tmp_path / "last.ckpt") in message
    assert "parameter 0.weight changed outside an optimizer step" in message and "overlap_copy: false" in message
    assert (tmp_path / "last.ckpt").read_bytes() == previous
    io.teardown()


def test_without_overlap_nothing_is_copied_late_and_no_step_waits(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    io = in_training(GatedIO())
    io.writer.watch(model, [optimizer])  # watched, but overlap_copy is off: everything is copied at the save
    assert not io.writer.stepped_storages()
    at_save = expected(model, optimizer)
    io.save_checkpoint(lightning_checkpoint(model, optimizer), tmp_path / "last.ckpt")
    step(model, optimizer)  # the write is still held: the step does not wait for it
    assert io.writer.staging_wait_s == 0.0
    io.checkpoint_io.gate.set()
    io.writer.wait()
    assert torch.equal(safe_load(tmp_path / "last.ckpt")["state_dict"]["0.weight"], at_save["state_dict"]["0.weight"])
    io.teardown()


# The host buffers a save copies into are kept for the next save (app/checkpoints/staging.py).


def test_the_next_save_reuses_the_host_buffers_and_each_file_holds_its_own_moment(tmp_path: Path) -> None:
    io = in_training(GatedIO())
    weights = torch.zeros(1000)
    io.save_checkpoint({"state_dict": {"w": weights, "tied": weights}}, tmp_path / "first.ckpt")
    assert io.checkpoint_io.started.wait(10)
    weights.add_(1.0)  # the next step, while the first write holds its buffers
    second = threading.Thread(
        target=io.save_checkpoint, args=({"state_dict": {"w": weights, "tied": weights}}, tmp_path / "second.ckpt")
    )
    second.start()
    second.join(0.5)
    assert second.is_alive(), "the second save copied into the buffers the first write was still reading"
    io.checkpoint_io.gate.set()
    second.join(10)
    io.writer.wait()
    first, latest = safe_load(tmp_path / "first.ckpt")["state_dict"], safe_load(tmp_path / "second.ckpt")["state_dict"]
    assert torch.equal(first["w"], torch.zeros(1000)) and torch.equal(latest["w"], torch.ones(1000))
    assert torch.equal(latest["tied"], latest["w"])
    io.teardown()


def test_host_staging_gives_a_tensor_its_last_buffer_and_a_changed_one_a_new_buffer() -> None:
    staging = HostStaging()
    weights, bias = torch.randn(64, 8), torch.randn(8)
    staging.begin()
    first = [staging.copy(weights), staging.copy(bias), staging.copy(weights[2:])]
    staging.finish()
    weights.mul_(2.0)
    staging.begin()
    again = [staging.copy(weights), staging.copy(bias), staging.copy(weights[2:])]
    staging.finish()
    assert [a.data_ptr() for a in again] == [f.data_ptr() for f in first]  # reused, views apart
    assert torch.equal(again[0], weights) and torch.equal(again[2], weights[2:]) and again[0] is not weights
    staging.begin()
    reshaped = staging.copy(weights.view(8, 64))  # another shape of the same memory: a buffer of its own
    staging.finish()
    assert reshaped.shape == (8, 64) and reshaped.data_ptr() != first[0].data_ptr()
    assert torch.equal(reshaped, weights.view(8, 64))


def test_the_save_plan_says_each_mode_in_fits_words_and_chooses_its_checkpoint_io() -> None:
    """One decision from plain values (app/checkpoints/save_mode.py): the line fit prints at its start and
    the checkpoint I/O the Trainer gets, for each mode, under DDP and under fsdp."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from app.checkpoints.save_mode import SaveMode, save_plan
    from app.checkpoints.sharded_io import ShardedCheckpointIO

    copy = "a save pauses training for a copy of {} to host memory; last_checkpoint.async_save"
    plan = save_plan(async_save=True, overlap_copy=False, plugins=[])
    assert (
        plan.mode == SaveMode.BACKGROUND and plan.line == f"written in the background ({copy.format('the checkpoint')})"
    )
    (io,) = plan.plugins([])
    assert isinstance(io, BackgroundCheckpointIO) and type(io.checkpoint_io) is SafeCheckpointIO
    plan = save_plan(async_save=True, overlap_copy=True, plugins=[], sharded=True)
    assert plan.mode == SaveMode.BACKGROUND_OVERLAPPED and plan.line.startswith(
        "written in the background by every rank (a save pauses training for a copy of this rank's shards less the "
        "parameters and optimizer state"
    )
    (io,) = plan.plugins([TorchCheckpointIO()])  # a config's own I/O cannot write shards: replaced
    assert isinstance(io.checkpoint_io, ShardedCheckpointIO) and io.writer.overlap_copy
    plan = save_plan(async_save=False, overlap_copy=False, plugins=[], sharded=True)
    assert (
        plan.mode == SaveMode.SYNC
        and plan.line == "written before training goes on (last_checkpoint.async_save: false)"
    )
    assert [type(io) for io in plan.plugins([])] == [ShardedCheckpointIO]
    own = TorchCheckpointIO()
    plan = save_plan(async_save=True, overlap_copy=False, plugins=[own])
    assert plan.mode == SaveMode.PLUGIN and plan.plugins([own]) == [own]
    assert plan.line == "written before training goes on, by the config's checkpoint I/O plugin TorchCheckpointIO"
    plan = save_plan(async_save=True, overlap_copy=False, plugins=[], own_writer="deepspeed")
    assert plan.mode == SaveMode.STRATEGY and not plan.mode.in_background
    assert plan.line == "written before training goes on (strategy deepspeed writes its own checkpoints)"
    assert [type(io) for io in plan.plugins([])] == [SafeCheckpointIO]  # as before: unused by such a strategy
