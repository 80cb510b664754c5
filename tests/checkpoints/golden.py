"""Resume a golden run (tests/golden/README.md) and judge the resume, not the CPU that wrote the golden.

A golden's steps were computed on another machine: float kernels differ between CPUs in the last bits
(docs/resume.md, Golden runs, has the measured difference), so a golden's resume is never compared with
a run computed from scratch on the test machine. It is compared with a continuation of the same saved
state by another path on this machine, bit for bit: `straight` resumes the golden to the end of epoch 1;
`interrupted` resumes it too, stops midway on a step budget and resumes again from the checkpoint that
stop wrote. The two end bit-equal only if the golden's state was restored whole: `interrupted` loads a
checkpoint twice and `straight` once, so a part a load drops (weights, optimizer or scheduler state,
data position, per-rank random and metric state) ends them apart. Counters no CPU changes catch a part
dropped the same way by both paths: the global step where max_epochs ends (a dropped data position
trains epoch 1 again from its start) and the optimizer's step count (a dropped optimizer state counts
from the resume).
"""

from __future__ import annotations

import io
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.checkpoints import state as checkpoint_state
from app.checkpoints.io import atomic_torch_save, safe_load
from app.checkpoints.sharded import SafeFileSystemReader, is_sharded_checkpoint, load_whole
from tests.helpers.run import REPO, ddp_app

GOLDEN = REPO / "tests" / "golden"


@dataclass(frozen=True)
class Golden:
    """A golden run directory and how it was written (tests/golden/README.md has the commands)."""

    directory: Path
    args: tuple[str, ...]  # its config and overrides, less the step budget that stopped it
    saved_step: int  # the global step its checkpoints/last.ckpt holds, in the middle of epoch 1
    end_step: int  # the global step at the end of epoch 1, where `--trainer.max_epochs 2` stops

    @property
    def midway_step(self) -> int:
        return (self.saved_step + self.end_step) // 2


DIGITS = ("--config", "configs/digits.yaml")
FORMAT_1_DIGITS = Golden(GOLDEN / "format1-digits", DIGITS, saved_step=30, end_step=40)
B8F6B9F_DIGITS_DDP = Golden(GOLDEN / "b8f6b9f-digits-ddp", DIGITS, saved_step=30, end_step=40)
B8F6B9F_GPT_FSDP = Golden(
    GOLDEN / "b8f6b9f-gpt-fsdp",
    ("--config", "configs/gpt_fsdp.yaml", "--model.init_args.d_model", "32"),
    saved_step=24,
    end_step=32,
)


def copy_run(source: Path, destination: Path) -> Path:
    """A writable copy of a run directory; a sharded last.ckpt stays a link to its shards' directory."""
    return Path(shutil.copytree(source, destination, symlinks=True))


def resume(golden: Golden, run: Path, *extra: str) -> None:
    """`ddp-app fit ... --ckpt_path last` in `run`, to the end of epoch 1 unless `extra` says otherwise."""
    result = ddp_app(
        "fit", *golden.args, "--trainer.max_epochs", "2", "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(run), "--ckpt_path", "last", *extra, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "resuming from" in result.stdout, result.stdout[-2000:]


def resume_two_ways(
    golden: Golden, source: Path, workdir: Path, prepare: Callable[[Path], None] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The last checkpoints of `straight` and `interrupted` (the module's docstring), both resumed from
    a copy of `source` (a golden run directory, or a changed copy of one); `prepare(last.ckpt)` changes
    `interrupted`'s copy first (the same state in another form)."""
    straight = copy_run(source, workdir / "straight")
    resume(golden, straight)
    interrupted = copy_run(source, workdir / "interrupted")
    if prepare is not None:
        prepare(interrupted / "checkpoints" / "last.ckpt")
    resume(golden, interrupted, "--trainer.max_steps", str(golden.midway_step))
    assert load_whole(interrupted / "checkpoints" / "last.ckpt")["global_step"] == golden.midway_step
    resume(golden, interrupted)
    return load_whole(straight / "checkpoints" / "last.ckpt"), load_whole(interrupted / "checkpoints" / "last.ckpt")


def assert_identical(actual: Any, expected: Any, where: str) -> None:
    """Bit-equal, through nested dicts, lists and tuples of tensors, arrays and plain values."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype, where
        assert torch.equal(actual, expected), where
    elif isinstance(expected, np.ndarray):
        assert np.array_equal(actual, expected), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), f"{where}: {set(actual) ^ set(expected)}"
        for key, value in expected.items():
            assert_identical(actual[key], value, f"{where}[{key!r}]")
    elif isinstance(expected, list | tuple):
        assert isinstance(actual, list | tuple) and len(actual) == len(expected), where
        for index, (left, right) in enumerate(zip(actual, expected, strict=True)):
            assert_identical(left, right, f"{where}[{index}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def optimizer_step_counts(checkpoint: dict[str, Any]) -> set[float]:
    """The step counts in every optimizer's per-parameter state (Adam's `step`): a file keeps one dict
    per parameter, a sharded checkpoint (`load_whole`) one flat key per tensor."""
    counts = set()
    for optimizer in checkpoint["optimizer_states"]:
        for key, value in optimizer["state"].items():
            if isinstance(value, dict):
                value = value.get("step")
            elif not str(key).endswith(".step"):
                continue
            if value is not None:
                counts.add(float(value))
    return counts


def assert_the_same_continuation(
    golden: Golden, saved: dict[str, Any], straight: dict[str, Any], interrupted: dict[str, Any]
) -> None:
    """`straight` and `interrupted` continued `saved` (the golden's last.ckpt) alike and whole."""
    for ended in (straight, interrupted):
        # A dropped data position would train epoch 1 again from its first batch: 20 more steps.
        assert ended["global_step"] == golden.end_step, f"ended at step {ended['global_step']}"
        # A dropped optimizer state would count only the steps since the resume.
        assert optimizer_step_counts(ended) == {float(golden.end_step)}, optimizer_step_counts(ended)
        # One epoch ended since the save: each epoch-wise scheduler stepped once more.
        epochs = [scheduler["last_epoch"] for scheduler in ended["lr_schedulers"]]
        assert epochs == [scheduler["last_epoch"] + 1 for scheduler in saved["lr_schedulers"]], epochs
        assert ended[checkpoint_state.STATE_KEY]["format_version"] == checkpoint_state.FORMAT_VERSION
        # The tracked run continued: the same log version, not a new one.
        assert checkpoint_state.get(ended, "tracking")["run"]["log_version"] == "version_0"
    assert_identical(straight["state_dict"], interrupted["state_dict"], "state_dict")
    assert_identical(straight["optimizer_states"], interrupted["optimizer_states"], "optimizer_states")
    assert_identical(straight["lr_schedulers"], interrupted["lr_schedulers"], "lr_schedulers")
    assert_identical(straight["epoch"], interrupted["epoch"], "epoch")
    # The data position, every rank's random state and per-rank metric state.
    assert_identical(
        checkpoint_state.get(straight, "exact_resume"),
        checkpoint_state.get(interrupted, "exact_resume"),
        "exact_resume",
    )


MOMENTS = ("exp_avg", "exp_avg_sq")  # Adam's float state per parameter (its `step` is a count)


def flip_last_bit(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` with the lowest mantissa bit of every element flipped: one unit in the last place, the
    size of the difference another CPU's float kernels make."""
    as_integers = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16}
    integers = tensor.contiguous().view(as_integers[tensor.dtype])
    return (integers ^ 1).view(tensor.dtype)


def as_if_written_on_another_cpu(checkpoint: Path) -> None:
    """Rewrite a checkpoint (a file, or a sharded checkpoint's directory) with the last bit of every
    saved weight and every optimizer moment (Adam's `exp_avg`, `exp_avg_sq`) flipped: the same run, its
    float results from another machine. Step counts, data position and random states stay."""
    if is_sharded_checkpoint(checkpoint):
        flip_shards(checkpoint.resolve())
        return
    saved = safe_load(checkpoint)
    saved["state_dict"] = {name: flip_last_bit(tensor) for name, tensor in saved["state_dict"].items()}
    for optimizer in saved["optimizer_states"]:
        for parameter_state in optimizer["state"].values():
            for name in MOMENTS:
                parameter_state[name] = flip_last_bit(parameter_state[name])
    atomic_torch_save(saved, checkpoint)


def flip_shards(directory: Path) -> None:
    """`as_if_written_on_another_cpu` of a DCP directory: each shard of a weight or moment is its own
    torch.save record at the offset DCP's index gives; it is rewritten in place, at the same length.
    DCP's index entries (`_StorageInfo`) are private: docs/private_apis.md, guarded by
    tests/checkpoints/test_golden_resume.py."""
    for index, where in SafeFileSystemReader(directory).read_metadata().storage_data.items():
        if not (index.fqn.startswith("state_dict.") or index.fqn.rsplit(".", 1)[-1] in MOMENTS):
            continue
        with open(directory / where.relative_path, "r+b") as file:
            file.seek(where.offset)
            shard = torch.load(io.BytesIO(file.read(where.length)), weights_only=True)
            record = io.BytesIO()
            torch.save(flip_last_bit(shard), record)
            assert len(record.getvalue()) == where.length, index.fqn
            file.seek(where.offset)
            file.write(record.getvalue())


def check_another_cpus_golden(
    golden: Golden, workdir: Path, unperturbed: dict[str, Any], prepare: Callable[[Path], None] | None = None
) -> None:
    """Issue 55/56's acceptance: a copy of the golden with its saved floats' last bits flipped, as if its
    steps had run on another CPU, passes the same check (`interrupted` changed by `prepare` first, as
    for the golden itself); and the flipped bits reach the end of the continuation (its weights differ
    from `unperturbed`, the golden's own `straight`), so a comparison with one machine's end weights
    could not have passed for both."""
    perturbed = copy_run(golden.directory, workdir / "perturbed-golden")
    as_if_written_on_another_cpu(perturbed / "checkpoints" / "last.ckpt")
    original = load_whole(golden.directory / "checkpoints" / "last.ckpt")
    saved = load_whole(perturbed / "checkpoints" / "last.ckpt")
    for name, tensor in original["state_dict"].items():
        assert not torch.equal(saved["state_dict"][name], tensor), name
        assert torch.allclose(saved["state_dict"][name], tensor, rtol=1e-6, atol=1e-30), name
    straight, interrupted = resume_two_ways(golden, perturbed, workdir, prepare)
    assert_the_same_continuation(golden, saved, straight, interrupted)
    reached = [
        name
        for name, tensor in unperturbed["state_dict"].items()
        if not torch.equal(straight["state_dict"][name], tensor)
    ]
    assert reached, "the flipped bits did not reach the end: this check cannot tell one CPU from another"
