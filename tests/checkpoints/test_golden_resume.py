"""Checkpoints written by main b8f6b9f still resume, bit for bit: `configs/digits.yaml` under DDP (one
file) and `configs/gpt_fsdp.yaml` under FSDP2 (sharded: a DCP directory of each rank's shards and
meta.pt). They guard the writer and the loader against a rewrite (issue 55: one checkpoint writer for
both strategies). Each golden's resume is compared with a continuation of the same saved state on
this machine, never with a run computed from scratch here (tests/checkpoints/golden.py says why and
how); tests/golden/README.md has the commands that wrote them."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from app.checkpoints import state as checkpoint_state
from app.checkpoints.sharded import SafeFileSystemReader, SafeLoadPlanner, is_sharded_checkpoint, load_whole
from tests.checkpoints.golden import (
    B8F6B9F_DIGITS_DDP,
    B8F6B9F_GPT_FSDP,
    Golden,
    assert_the_same_continuation,
    check_another_cpus_golden,
    flip_last_bit,
    flip_shards,
    resume_two_ways,
)

Resumed = tuple[Golden, dict[str, Any], dict[str, Any]]


@pytest.fixture(scope="module", params=[B8F6B9F_DIGITS_DDP, B8F6B9F_GPT_FSDP], ids=lambda golden: golden.directory.name)
def resumed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Resumed:
    """A golden resumed two ways (tests/checkpoints/golden.py), with the last checkpoints of both."""
    golden: Golden = request.param
    straight, interrupted = resume_two_ways(golden, golden.directory, tmp_path_factory.mktemp(golden.directory.name))
    return golden, straight, interrupted


@pytest.mark.distributed
def test_a_b8f6b9f_checkpoint_resumes_as_its_saved_state_continued(resumed: Resumed) -> None:
    golden, straight, interrupted = resumed
    saved_file = golden.directory / "checkpoints" / "last.ckpt"
    sharded = golden is B8F6B9F_GPT_FSDP
    assert is_sharded_checkpoint(saved_file) == sharded  # the golden is the layout it stands for
    saved = load_whole(saved_file)
    assert saved[checkpoint_state.STATE_KEY]["format_version"] == 2
    assert saved["global_step"] == golden.saved_step
    assert checkpoint_state.get(saved, "exact_resume")["position"]["batches_done"] > 0  # saved mid-epoch
    assert_the_same_continuation(golden, saved, straight, interrupted)
    if sharded:  # the mesh the shards were written from, and the continuation's: 1 replica of 2 shards
        assert checkpoint_state.get(saved, "sharding") == checkpoint_state.get(straight, "sharding")
        assert checkpoint_state.get(straight, "sharding") == {"replicas": 1, "shards": 2}


@pytest.mark.distributed
@pytest.mark.slow  # the format-1 golden's case in the default run (test_state_format.py), here for each layout
def test_a_b8f6b9f_golden_written_on_another_cpu_still_passes(resumed: Resumed, tmp_path: Path) -> None:
    golden, straight, _ = resumed
    check_another_cpus_golden(golden, tmp_path, straight)


def test_dcp_keeps_each_shard_as_the_torch_save_record_its_index_points_to(tmp_path: Path) -> None:
    """The private layout `flip_shards` rewrites (docs/private_apis.md): DCP's index gives each tensor's
    record as a `_StorageInfo` (relative_path, offset, length), and the record is a torch.save of it."""
    weights = {"weight": torch.linspace(-1, 1, 12).reshape(3, 4), "bias": torch.zeros(3)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled": one process, as meant
        dcp.save({"state_dict": weights}, checkpoint_id=tmp_path, no_dist=True)
        try:
            flip_shards(tmp_path)
        except AttributeError as error:
            raise AssertionError(
                f"DCP's index entries changed ({error}): fix flip_shards (docs/private_apis.md)"
            ) from error
        loaded = {name: torch.empty_like(tensor) for name, tensor in weights.items()}
        dcp.load(
            {"state_dict": loaded},
            storage_reader=SafeFileSystemReader(tmp_path),
            planner=SafeLoadPlanner(),
            no_dist=True,
        )
    for name, tensor in weights.items():
        assert torch.equal(loaded[name], flip_last_bit(tensor)), f"flip_shards did not flip {name} in place"
