"""ddp-app's checkpoint state has one key and one format version (app/checkpoints/state.py): a
checkpoint written in the previous format (main at 689925d, one top-level key per part) still
resumes, bit for bit, and a checkpoint of a format this version does not know is one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.checkpoints import state as checkpoint_state
from app.checkpoints.io import atomic_torch_save, safe_load
from app.errors import ResumeError
from tests.checkpoints.golden import (
    FORMAT_1_DIGITS,
    assert_the_same_continuation,
    check_another_cpus_golden,
    resume_two_ways,
)

# `ddp-app fit --config configs/digits.yaml --trainer.max_steps 30 --trainer.max_epochs 2` run by
# commit 689925d (format 1): stopped by its step budget in the middle of epoch 1 (20 steps per epoch).
FORMAT_1_RUN = FORMAT_1_DIGITS.directory


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


def written_in_format_2(checkpoint_file: Path) -> None:
    """Rewrite a format-1 checkpoint file in format 2, by hand from the format-1 layout docs/resume.md
    describes (not through `migrate_format_1`): the same saved state, read by this version's format-2
    path instead of its format-1 one."""
    checkpoint = safe_load(checkpoint_file)
    exact_resume = {
        "position": checkpoint.pop("ddp_app_data_position"),
        "per_rank": checkpoint.pop("rng_states_per_rank"),
        "user_code_directories": checkpoint.pop("user_code_directories"),
    }
    tracking = {"run": checkpoint.pop("ddp_app_run"), "epoch_throughput": checkpoint["callbacks"].pop("Tracking")}
    checkpoint_state.put(checkpoint, "exact_resume", exact_resume)
    checkpoint_state.put(checkpoint, "tracking", tracking)
    atomic_torch_save(checkpoint, checkpoint_file)


@pytest.fixture(scope="module")
def format_1_resumed(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    """The format-1 golden resumed two ways (tests/checkpoints/golden.py): `straight`, read as format 1,
    to the end of epoch 1; `interrupted`, its checkpoint rewritten in format 2 by hand, stopped midway
    and resumed again. The last checkpoints of both."""
    workdir = tmp_path_factory.mktemp("format-1")
    return resume_two_ways(FORMAT_1_DIGITS, FORMAT_1_RUN, workdir, prepare=written_in_format_2)


@pytest.mark.distributed
def test_a_format_1_run_resumes_as_its_saved_state_continued_by_this_version(
    format_1_resumed: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    """The acceptance line: main's (689925d) checkpoint of configs/digits.yaml, resumed with
    `--ckpt_path last` by this version, continues exactly as the same saved state read as format 2 and
    interrupted once on the way: the same weights, optimizer, scheduler, data position and per-rank
    state, bit for bit, and its new checkpoint is written in format 2 (`assert_the_same_continuation`).
    Both paths run here: the golden's own 30 steps, computed on another CPU, are never recomputed."""
    saved = safe_load(FORMAT_1_RUN / "checkpoints" / "last.ckpt")
    assert checkpoint_state.STATE_KEY not in saved  # the golden file really is the old format
    assert saved["global_step"] == FORMAT_1_DIGITS.saved_step
    straight, interrupted = format_1_resumed
    assert_the_same_continuation(FORMAT_1_DIGITS, saved, straight, interrupted)


@pytest.mark.distributed
def test_a_golden_written_on_another_cpu_still_passes(
    tmp_path: Path, format_1_resumed: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    """Issue 55/56's acceptance, on the format-1 golden (`check_another_cpus_golden`): its saved weights
    and Adam moments with their last bit flipped in a copy pass the same check."""
    unperturbed, _ = format_1_resumed
    check_another_cpus_golden(FORMAT_1_DIGITS, tmp_path, unperturbed, prepare=written_in_format_2)
