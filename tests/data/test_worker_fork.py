"""app/data/worker_fork.py: a DataLoader worker that hangs before its first line is forked again, and a loader whose
every fork hangs ends in bounded time with one line (the guard of the multiprocessing extension points it overrides:
tests/test_private_apis.py).

The hang is made here by an at-fork hook in the child (it runs inside `os.fork`, where CPython's own deadlock of
gh-112275 happens: before the child's first line). The real one needs a thread creating a Python thread state within
microseconds of the fork; CI's slow shard 2 met it twice (docs/resume.md), a loop of 2,000 forks beside gloo's run
loop did not."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, SequentialSampler, TensorDataset

from app.data import worker_fork
from app.data.rank_loaders import shard_all_loaders
from app.data.worker_fork import FIRST_LINE_FORK, WorkerDidNotStart, fork_workers_safely
from tests.helpers.user_modules import BlobsDataModule, MyNet

# The children the hook below hangs: while this names a directory, each fork that can create a file there (one per
# slot) sleeps instead of returning from os.fork.
_hang: dict[str, object] = {"directory": None, "forks": 0}


def _hang_in_child() -> None:
    directory = _hang["directory"]
    if directory is None:
        return
    for slot in range(int(_hang["forks"])):  # type: ignore[call-overload]
        try:
            os.close(os.open(Path(str(directory), f"hung-{slot}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        Path(str(directory), f"pid-{slot}").write_text(str(os.getpid()))
        time.sleep(3600)


os.register_at_fork(after_in_child=_hang_in_child)  # a no-op while `_hang["directory"]` is None


@pytest.fixture
def hang_forks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Hang the next forks of this process (set `_hang["forks"]`), with short waits for a first line."""
    monkeypatch.setattr(worker_fork, "FIRST_LINE_S", 0.5)
    _hang["directory"] = str(tmp_path)
    try:
        yield tmp_path
    finally:
        _hang["directory"], _hang["forks"] = None, 0


def loader(workers: int = 2) -> DataLoader:
    data = TensorDataset(torch.arange(96, dtype=torch.float32).reshape(48, 2))
    context = FIRST_LINE_FORK if workers else None
    return DataLoader(data, batch_size=4, num_workers=workers, multiprocessing_context=context)


def batches(data: DataLoader) -> list[torch.Tensor]:
    return [batch[0] for batch in data]


def gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()


def test_a_worker_hung_before_its_first_line_is_forked_again(
    hang_forks: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Long enough that a healthy worker on a loaded machine is never taken for a hung one (exactly one line below).
    monkeypatch.setattr(worker_fork, "FIRST_LINE_S", 2.0)
    expected = batches(DataLoader(loader().dataset, batch_size=4))
    _hang["forks"] = 1
    got = batches(loader())
    assert [batch.tolist() for batch in got] == [batch.tolist() for batch in expected]
    hung = int((hang_forks / "pid-0").read_text())
    assert gone(hung), "the hung child was killed and reaped"
    lines = [line for line in capfd.readouterr().err.splitlines() if "hung before its first line" in line]
    # The hook sleeps in time.sleep: the kernel shows the child sleeping (in a timer), as it shows a deadlocked one
    # sleeping in a futex.
    assert len(lines) == 1 and lines[0].startswith(
        f"ddp-app: a DataLoader worker (pid {hung}) hung before its first line (sleeping"
    ), lines
    assert lines[0].endswith("; CPython before 3.12, gh-112275): forked it again"), lines


def test_a_worker_that_never_starts_ends_the_loader_in_bounded_time_with_one_line(hang_forks: Path) -> None:
    _hang["forks"] = worker_fork.ATTEMPTS
    started = time.monotonic()
    with pytest.raises(WorkerDidNotStart, match="Fix: Python 3.12 or later, or multiprocessing_context='forkserver'"):
        batches(loader(workers=1))
    waited_s = sum(0.5 * 2**attempt for attempt in range(worker_fork.ATTEMPTS))
    assert time.monotonic() - started < waited_s + 10
    assert all(gone(int((hang_forks / f"pid-{slot}").read_text())) for slot in range(worker_fork.ATTEMPTS))


def test_loaders_that_fork_get_the_check_where_cpython_needs_it_and_others_stay_as_they_are() -> None:
    forking, spawning, inline = loader(), loader(), loader(workers=0)
    forking.multiprocessing_context = None
    spawning.multiprocessing_context = "spawn"
    result = fork_workers_safely({"a": [forking, spawning], "b": inline})
    assert result["a"][0] is forking and result["b"] is inline
    expected = FIRST_LINE_FORK if worker_fork.FORK_NEEDS_CHECK else None
    assert forking.multiprocessing_context is expected
    assert spawning.multiprocessing_context.get_start_method() == "spawn"
    assert inline.multiprocessing_context is None


class WorkersDataModule(BlobsDataModule):
    """A user's DataModule whose loaders use workers: one plain (ddp-app rebuilds it), one with its own sampler
    (left as returned)."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=1)

    def val_dataloader(self) -> DataLoader:
        sampler = SequentialSampler(self.val_set)
        return DataLoader(self.val_set, batch_size=self.batch_size, sampler=sampler, num_workers=1)


class RecordContexts(L.Callback):
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.contexts = [
            trainer.train_dataloader.multiprocessing_context,
            trainer.val_dataloaders.multiprocessing_context,
        ]


def test_a_runs_loaders_ours_and_left_as_returned_fork_through_the_check() -> None:
    data, recorder = WorkersDataModule(train_size=64, val_size=32), RecordContexts()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder],
    )  # fmt: skip
    shard_all_loaders(trainer, data, MyNet())
    trainer.fit(MyNet(), data)
    expected = FIRST_LINE_FORK if worker_fork.FORK_NEEDS_CHECK else None
    assert recorder.contexts == [expected, expected]
