"""`python -m app.data.shard` when a LitData writer process dies without a word (killed by a signal) or
cannot finish (stuck on a file that never answers): one line and exit code 2 in bounded time, no shards,
and no process it forked left running; and a write forked from a process that used torch's threads."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from app.bench.data import write_image_folder
from app.data import shard, shard_watch
from tests.helpers import run
from tests.helpers.run import REPO

CONFIG = str(REPO / "configs" / "imagefolder_resnet18.yaml")


def test_a_writer_killed_mid_split_is_one_line_and_leaves_no_shards_and_no_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = write_image_folder(tmp_path / "images", images=20, classes=10, pixels=16)
    parent = os.getpid()
    record = shard.image_record

    def killed_in_a_writer(samples: list, index: int) -> dict:
        if os.getpid() != parent:  # a forked LitData writer: dies as the OOM killer would make it
            os.kill(os.getpid(), signal.SIGKILL)
        return record(samples, index)

    monkeypatch.setattr(shard, "image_record", killed_in_a_writer)
    read_fd, write_fd = os.pipe()  # held by every process forked from here on
    marker = f"pipe:[{os.fstat(read_fd).st_ino}]"
    out = tmp_path / "shards"
    try:
        config = str(REPO / "configs" / "imagefolder_resnet18.yaml")
        code = shard.main(["--config", config, "--out", str(out), f"--data.init_args.data_dir={folder}"])
        left = shard_watch.holders_of(marker)
    finally:
        os.close(read_fd)
        os.close(write_fd)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert (
        err[-1].startswith("ddp-app: error: writing the train split to ")
        and "ended with 0 of its 20 samples" in err[-1]
    )
    assert not out.exists()
    assert left == []


def test_shards_written_after_torch_used_threads_in_this_process_are_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writers are forked from a process whose OpenMP pool ran (a test process after a fit, or the
    caller's own setup): a sample big enough for a parallel copy (76,800 values) used to wait forever in
    the writer for the pool's threads, which the fork does not copy. And LitData's changes to the caller
    (its SIGINT handler, the start method, the global seeds) are undone, and the machine's shared LitData
    cache folder (TMPDIR/chunks, which `optimize` deletes as it starts) is left alone: the guard of
    DATA_OPTIMIZER_CACHE_FOLDER (docs/private_apis.md)."""
    import tempfile

    from torch.utils.data import TensorDataset

    shared = tmp_path / "machine_tmp"
    (shared / "chunks").mkdir(parents=True)
    (shared / "chunks" / "another_write.bin").write_bytes(b"not ours")
    monkeypatch.setattr(tempfile, "tempdir", str(shared))  # LitData's default cache: gettempdir()/chunks

    torch.nn.Linear(256, 256)(torch.randn(512, 256)).sum().backward()  # the intra-op pools in use
    torch.randn(4_000_000).exp_().sum()
    import litdata  # noqa: F401 - importing it sets the start method (to fork) already: compared after it

    interrupt, start_method = signal.getsignal(signal.SIGINT), multiprocessing.get_start_method(allow_none=True)
    folder = write_image_folder(tmp_path / "images", images=20, classes=10, pixels=16)
    out = tmp_path / "shards"
    assert (
        shard.main(["--config", CONFIG, "--out", str(out), f"--data.init_args.data_dir={folder}", "--workers=2"]) == 0
    )
    assert shard.samples_in_index(out / "train") == 20

    samples = TensorDataset(torch.randn(6, 3, 160, 160), torch.arange(6))
    generator = torch.get_rng_state()
    done = shard.write_split(samples, "val", tmp_path / "big", "64MB", 1, workers=2, seed=0, stall_seconds=60)
    assert done["samples"] == 6
    assert signal.getsignal(signal.SIGINT) is interrupt
    assert multiprocessing.get_start_method(allow_none=True) == start_method
    assert torch.equal(torch.get_rng_state(), generator)
    assert (shared / "chunks" / "another_write.bin").read_bytes() == b"not ours", (
        "LitData's optimize deleted the shared cache folder: it no longer reads DATA_OPTIMIZER_CACHE_FOLDER "
        "(app/data/shard.py optimize_kept_to_itself; docs/private_apis.md)"
    )


def shard_command(folder: Path, out: Path, *extra: str) -> list[str]:
    arguments = ["--config", CONFIG, "--out", str(out), f"--data.init_args.data_dir={folder}", "--workers=2"]
    return [sys.executable, "-m", "app.data.shard", *arguments, "--chunk-size=2", *extra]


def folder_with_a_file_that_never_answers(root: Path) -> Path:
    """40 training images, one of them a FIFO nobody writes to: its writer waits in open() (a hung mount)."""
    folder = write_image_folder(root, images=40, classes=4, pixels=16)
    stuck = sorted((folder / "train" / "class_2").iterdir())[3]
    stuck.unlink()
    os.mkfifo(stuck)
    return folder


def children_of(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            continue
    return children


def ended_in_one_line(process: run.subprocess.Popen, since: float) -> tuple[str, float]:
    _, stderr = process.communicate(timeout=120)
    seconds = time.monotonic() - since
    assert process.returncode == 2, stderr[-3000:]
    line = stderr.strip().splitlines()[-1]
    assert line.startswith("ddp-app: error: writing the train split to ") and " of its 40 samples" in line, line
    assert "Fix: " in line
    return line, seconds


@pytest.mark.more_cases
def test_a_writer_killed_by_pid_mid_write_ends_the_write_in_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    """One writer process SIGKILLed from outside once chunks are being written, while the other waits on a
    file: without the watch LitData would wait for the waiting one forever."""
    out = tmp_path / "shards"
    folder = folder_with_a_file_that_never_answers(tmp_path / "images")
    process = run.start(shard_command(folder, out, "--stall-seconds=20"))
    try:
        deadline = time.monotonic() + 120
        while not list((out / "train").glob("chunk-*.bin")) and time.monotonic() < deadline:
            time.sleep(0.05)
        writer = children_of(process.pid)[0]  # LitData's writers are the command's children
        os.kill(writer, signal.SIGKILL)
        line, seconds = ended_in_one_line(process, time.monotonic())
        left = run.live_job_processes(process.pid)
    finally:
        run.kill_job(process.pid)
    # The watch names the writer when it sees it dead (within 0.05 s). Where LitData reaped it first (it looks
    # once a second), the write ends by the stall deadline if the other writer is the stuck one, or else
    # LitData returns and the index is short.
    causes = (f"writer process {writer} was killed by SIGKILL", "no sample was made for 20 s", "writer process ended")
    assert any(cause in line for cause in causes), line
    assert seconds < 45, f"the write ended {seconds:.1f} s after its writer was killed"
    assert not out.exists() and left == []


@pytest.mark.more_cases
def test_a_writer_stuck_on_a_file_ends_the_write_after_the_stall_deadline_in_one_line(tmp_path: Path) -> None:
    out = tmp_path / "shards"
    started = time.monotonic()
    process = run.start(
        shard_command(folder_with_a_file_that_never_answers(tmp_path / "images"), out, "--stall-seconds=3")
    )
    try:
        line, seconds = ended_in_one_line(process, started)
        left = run.live_job_processes(process.pid)
    finally:
        run.kill_job(process.pid)
    assert "no sample was made for 3 s (a writer process is stuck)" in line and "--stall-seconds" in line, line
    assert seconds < 60 and not out.exists() and left == []
