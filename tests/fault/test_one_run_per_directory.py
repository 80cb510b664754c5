"""Two fits into one directory: the second is refused in one line naming the first, which trains to
its end undisturbed and says where everything is; a third, started after, is told to continue or
move (app/run/directory.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from app.cli.entry import check_before_launch
from app.run.directory import LOCK_NAME
from tests.helpers.run import BIN, ddp_app, kill_job, start

pytestmark = [pytest.mark.distributed, pytest.mark.fault]

# Long enough (about 20 s on a 2-core VM) that the first fit still trains when the second has
# imported Lightning and parsed its config (about 5 s).
EPOCHS = 80


def test_a_second_fit_into_a_running_directory_is_refused_and_the_first_finishes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    config = ["--config", "configs/digits.yaml", f"--trainer.default_root_dir={root}"]
    first = start([str(BIN / "ddp-app"), "fit", *config, f"--trainer.max_epochs={EPOCHS}"])
    try:
        deadline = time.monotonic() + 60
        while not (root / LOCK_NAME).exists():
            assert first.poll() is None and time.monotonic() < deadline, "the first fit never took the lock"
            time.sleep(0.1)
        second = ddp_app("fit", *config, timeout=60)
        assert first.poll() is None, "the first fit ended before the second was checked: raise EPOCHS"
        assert second.returncode == 2, second.stderr
        lines = (second.stdout + second.stderr).strip().splitlines()
        assert len(lines) <= 3, lines
        assert f"pid {first.pid}" in second.stderr and "in use by a fit started" in second.stderr

        stdout, stderr = first.communicate(timeout=240)
        assert first.returncode == 0, stderr[-3000:]
    finally:
        kill_job(first.pid)
        if first.poll() is None:
            first.kill()
            first.wait()
    last = torch.load(root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["global_step"] == EPOCHS * 20  # the survivor's last.ckpt holds its final step
    assert not (root / LOCK_NAME).exists()  # released at the end

    # The end of the fit says how it went and where everything is.
    summary = stdout[stdout.index("ddp-app: fit done in") :]
    assert f"{EPOCHS} epochs, {EPOCHS * 20} steps on 2 processes" in summary and "samples/s" in summary
    assert "best val_acc=" in summary and str(root / "checkpoints" / "best-epoch=") in summary
    assert f"last checkpoint: {root / 'checkpoints' / 'last.ckpt'}" in summary
    assert f"logs: {root / 'lightning_logs' / 'version_0'}" in summary

    # A later fit into the finished run's directory, without --ckpt_path, would write over its
    # checkpoints: refused before any rank starts, and told to continue it or to move.
    with pytest.raises(SystemExit) as refused:
        check_before_launch(["fit", *config])
    assert refused.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "already holds a run" in error[0] and "--ckpt_path last" in error[0]
