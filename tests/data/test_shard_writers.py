"""`python -m app.data.shard` when a LitData writer process dies without a word (killed by a signal):
one line and exit code 2, no shards, and no process it forked left running."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from app.bench.data import write_image_folder
from app.data import shard
from tests.helpers.run import REPO


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
        left = shard._holders_of(marker)
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


def test_shards_written_after_torch_used_threads_in_this_process_are_complete(tmp_path: Path) -> None:
    import torch

    torch.nn.Linear(256, 256)(torch.randn(512, 256)).sum().backward()  # the intra-op pools in use
    folder = write_image_folder(tmp_path / "images", images=20, classes=10, pixels=16)
    out = tmp_path / "shards"
    config = str(REPO / "configs" / "imagefolder_resnet18.yaml")
    assert (
        shard.main(["--config", config, "--out", str(out), f"--data.init_args.data_dir={folder}", "--workers=2"]) == 0
    )
    assert shard.samples_in_index(out / "train") == 20
