"""A job built in the test's own process (no launcher, no spawned ranks): for checks of one device."""

from __future__ import annotations

from pathlib import Path

from app.cli import DDPAppCLI
from tests.helpers.run import REPO

DIGITS = str(REPO / "configs" / "digits.yaml")


def digits_cli(root: Path, epochs: int, *overrides: str) -> DDPAppCLI:
    """configs/digits.yaml on one device, without logger or progress bar, parsed and built but not fitted."""
    args = [
        "--config", DIGITS, f"--trainer.default_root_dir={root}", "--trainer.devices=1",
        f"--trainer.max_epochs={epochs}", "--trainer.enable_progress_bar=false", "--trainer.logger=false",
        *overrides,
    ]  # fmt: skip
    return DDPAppCLI(args=args, run=False)
