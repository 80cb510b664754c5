"""Runs the fault tests share: each trained once per test session, as long as its cases need."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from app.checkpoints.io import safe_load
from tests.fault.test_resume import fit

EPOCHS = 30  # 20 steps each on digits at 2 ranks: 600 steps; the kills and signals come at step 110 to 300
# A user's config with only a monitored ModelCheckpoint(save_last=True). mode=min on val_acc makes
# an early epoch the best one, after which Lightning alone never rewrites last.ckpt again.
MONITORED_ONLY = f"""
trainer:
  max_epochs: {EPOCHS}
  enable_progress_bar: false
  logger: false
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{monitor: val_acc, mode: min, save_top_k: 1, save_last: true, filename: "best-{{epoch}}"}}
"""


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """(the overlay config, the uninterrupted run's last.ckpt) of the digits job with MONITORED_ONLY:
    the baseline of tests/fault/test_last_checkpoint.py and tests/fault/test_restart.py."""
    root = tmp_path_factory.mktemp("uninterrupted")
    overlay = root / "monitored-only.yaml"
    overlay.write_text(MONITORED_ONLY)
    result = fit("configs/digits.yaml", overlay, root / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    last = root / "run" / "checkpoints" / "last.ckpt"
    assert safe_load(last)["global_step"] == EPOCHS * 20
    yield overlay, last
