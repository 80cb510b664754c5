"""strategy: fsdp against the plain-PyTorch FSDP2 reference (app/reference/fsdp.py) and against DDP."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

from app.parity import fsdp_stage_plan, lightning_fit, run_command, write_variant
from tests.helpers.run import REPO
from tests.parity.test_parity import assert_counted_once

pytestmark = [pytest.mark.parity, pytest.mark.distributed]


def test_lightning_fsdp2_trains_the_same_weights_as_the_reference_bit_for_bit(tmp_path: Path) -> None:
    """P9a: configs/gpt_fsdp.yaml, 1 epoch (16 AdamW steps) on 2 ranks, fp32, each side launched as a user would."""
    config = yaml.safe_load((REPO / "configs" / "gpt_fsdp.yaml").read_text())
    config["trainer"]["max_epochs"] = 1
    path = write_variant(config, tmp_path / "config.yaml")
    lightning = lightning_fit(path, tmp_path / "lightning", "ddp-app", world_size=2)
    command = [sys.executable, "-m", "app.reference.fsdp", "--config", str(path), "--out", str(tmp_path / "reference")]
    run_command([*command, "--save-every", "0"], tmp_path / "reference.log")
    reference = torch.load(tmp_path / "reference" / "final.pt", map_location="cpu", weights_only=True)
    assert reference.keys() == lightning.keys()
    different = [name for name, tensor in reference.items() if not torch.equal(tensor, lightning[name])]
    assert not different, f"differ: {different[:3]}"
    log = (tmp_path / "reference.log").read_text()
    # ... after the whole epoch: 512 sequences in 16 steps of 2 x 16.
    assert "epoch 0 | steps 16" in log
    # run_command raised on a non-zero exit; a rank that aborts at exit also says so (docs/fsdp.md).
    assert "terminate called" not in log


@pytest.mark.slow
def test_the_parity_command_passes_every_fsdp_row(tmp_path: Path) -> None:
    """`python -m app.parity --config configs/gpt_fsdp.yaml`: P9a to P9e (about 3 minutes here)."""
    command = [sys.executable, "-m", "app.parity", "--config", "configs/gpt_fsdp.yaml", "--epochs", "1"]
    out = tmp_path / "parity"  # a directory of its own: the command refuses one that holds files (its log here)
    run_command([*command, "--out", str(out)], tmp_path / "parity.log", timeout=900)
    report = json.loads((out / "parity.json").read_text())
    assert [check["name"] for check in report["checks"]] == ["P9a", "P9b", "P9c", "P9d", "P9e"]
    assert_counted_once((tmp_path / "parity.log").read_text(), len(fsdp_stage_plan(2)))
    assert report["passed"], report["checks"]
