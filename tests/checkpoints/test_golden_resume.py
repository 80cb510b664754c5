"""Checkpoints written by main b8f6b9f still resume, bit for bit: `configs/digits.yaml` under DDP (one
file) and `configs/gpt_fsdp.yaml` under FSDP2 (sharded: a DCP directory of each rank's shards and
meta.pt). They guard the writer and the loader against a rewrite (issue 55: one checkpoint writer for
both strategies). Each golden's resume is compared with a continuation of the same saved state on
this machine, never with a run computed from scratch here (tests/checkpoints/golden.py says why and
how); tests/golden/README.md has the commands that wrote them."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.checkpoints import state as checkpoint_state
from app.checkpoints.sharded import is_sharded_checkpoint, load_whole
from tests.checkpoints.golden import B8F6B9F_DIGITS_DDP, B8F6B9F_GPT_FSDP, Golden, check_golden_resume


@pytest.mark.distributed
@pytest.mark.parametrize("golden", [B8F6B9F_DIGITS_DDP, B8F6B9F_GPT_FSDP], ids=lambda golden: golden.directory.name)
def test_a_b8f6b9f_checkpoint_resumes_as_its_saved_state_continued(golden: Golden, tmp_path: Path) -> None:
    saved_file = golden.directory / "checkpoints" / "last.ckpt"
    sharded = golden is B8F6B9F_GPT_FSDP
    assert is_sharded_checkpoint(saved_file) == sharded  # the golden is the layout it stands for
    saved = load_whole(saved_file)
    assert saved[checkpoint_state.STATE_KEY]["format_version"] == 2
    assert checkpoint_state.get(saved, "exact_resume")["position"]["batches_done"] > 0  # saved mid-epoch
    straight, _ = check_golden_resume(golden, golden.directory, tmp_path)
    assert is_sharded_checkpoint(tmp_path / "straight" / "checkpoints" / "last.ckpt") == sharded
    if sharded:  # the mesh the shards were written from: 1 replica of 2 shards
        assert checkpoint_state.get(straight, "sharding") == {"replicas": 1, "shards": 2}
