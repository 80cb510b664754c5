"""ddp-app's checkpoint state has one key and one format version (app/checkpoints/state.py): a
checkpoint written in the previous format (main at 689925d, one top-level key per part) still
resumes, bit for bit, and a checkpoint of a format this version does not know is one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from app.checkpoints import state as checkpoint_state
from app.checkpoints.io import safe_load
from app.errors import ResumeError
from tests.helpers.run import REPO, ddp_app

# `ddp-app fit --config configs/digits.yaml --trainer.max_steps 30 --trainer.max_epochs 2` run by
# commit 689925d (format 1): stopped by its step budget in the middle of epoch 1 (20 steps per epoch).
FORMAT_1_RUN = REPO / "tests" / "golden" / "format1-digits"


def test_a_format_1_checkpoint_reads_as_its_parts() -> None:
    checkpoint = safe_load(FORMAT_1_RUN / "checkpoints" / "last.ckpt")
    assert checkpoint_state.STATE_KEY not in checkpoint  # the golden file really is the old format
    parts = checkpoint_state.parts_of(checkpoint)
    assert parts["exact_resume"]["position"]["global_step"] == 30
    assert len(parts["exact_resume"]["per_rank"]) == 2
    assert parts["tracking"]["run"]["log_version"] == "version_0"
    assert set(parts["tracking"]["epoch_throughput"]) == {"epoch", "samples", "seconds"}


def test_a_checkpoint_of_an_unknown_format_is_one_line_naming_both_versions() -> None:
    checkpoint = {"ddp_app": {"format_version": 7, "parts": {}}}
    with pytest.raises(ResumeError, match=r"format 7, and this ddp-app reads formats 1 to 2") as raised:
        checkpoint_state.get(checkpoint, "exact_resume")
    assert "\n" not in str(raised.value)


def test_only_the_parts_in_the_table_are_written() -> None:
    checkpoint: dict = {}
    checkpoint_state.put(checkpoint, "tracking", {"run": None})
    assert checkpoint == {"ddp_app": {"format_version": 2, "parts": {"tracking": {"run": None}}}}
    with pytest.raises(KeyError, match="add it to PARTS"):
        checkpoint_state.put(checkpoint, "my_new_state", {})


@pytest.mark.distributed
def test_a_format_1_run_resumes_with_the_uninterrupted_runs_weights(tmp_path: Path) -> None:
    """The acceptance line: main's (689925d) checkpoint of configs/digits.yaml, resumed with
    `--ckpt_path last` by this version, ends with the weights of this version's uninterrupted run, and
    its new checkpoint is written in format 2."""
    resumed = shutil.copytree(FORMAT_1_RUN, tmp_path / "resumed")
    common = ("fit", "--config", "configs/digits.yaml", "--trainer.max_epochs", "2")
    result = ddp_app(*common, "--trainer.default_root_dir", str(resumed), "--ckpt_path", "last", cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from" in result.stdout
    uninterrupted = ddp_app(*common, "--trainer.default_root_dir", str(tmp_path / "uninterrupted"), cwd=REPO)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    ended = safe_load(resumed / "checkpoints" / "last.ckpt")
    expected = safe_load(tmp_path / "uninterrupted" / "checkpoints" / "last.ckpt")
    assert ended["global_step"] == expected["global_step"] == 40
    for name, tensor in expected["state_dict"].items():
        assert torch.equal(ended["state_dict"][name], tensor), name
    assert ended[checkpoint_state.STATE_KEY]["format_version"] == checkpoint_state.FORMAT_VERSION
    # The tracked run continued: the same log version, not a new one.
    assert checkpoint_state.get(ended, "tracking")["run"]["log_version"] == "version_0"
