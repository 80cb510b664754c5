"""Background checkpoint writes (`last_checkpoint.async_save`, on by default under DDP) keep every
guarantee of a synchronous save, tested while a write is really in flight: a user's callback with a
100 MB state (tests/helpers/slow_writes.py) makes each write of last.ckpt span several steps, and
stops its rank when the next write's temporary file is in the checkpoint directory."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from app.checkpoints.io import safe_load
from app.checkpoints.sharded import load_whole
from app.cli.resume_check import repeated_values
from app.cluster.exit_codes import PREEMPTED_EXIT_CODE
from app.tracking.layout import JOURNAL_FILE
from tests.fault.test_resume import fit, resume_and_compare, start_fit
from tests.helpers.run import kill_job

pytestmark = [pytest.mark.fault, pytest.mark.distributed]

CONFIG = "configs/digits.yaml"
EPOCHS = 3  # 20 steps each on 2 ranks; last.ckpt every 5 steps and at each epoch's end
OVERLAY = """
trainer:
  max_epochs: {epochs}
  enable_progress_bar: false
  logger: {logger}
  callbacks:
    - class_path: tests.helpers.slow_writes.ReplayBuffer
      init_args: {{megabytes: 100, act: {act}, rank: {rank}}}
last_checkpoint:
  every_n_steps: 5
"""


def overlay(directory: Path, act: str = "none", rank: int = 0, epochs: int = EPOCHS, logger: bool = False) -> Path:
    path = directory / f"overlay-{act}-{rank}.yaml"
    path.write_text(OVERLAY.format(epochs=epochs, act=act, rank=rank, logger=str(logger).lower()))
    return path


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the overlay without a stop, the uninterrupted run's last.ckpt)."""
    root = tmp_path_factory.mktemp("uninterrupted")
    plain = overlay(root)
    result = fit(CONFIG, plain, root / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "checkpoints: written in the background" in result.stdout, result.stdout[-2000:]
    return plain, root / "run" / "checkpoints" / "last.ckpt"


def acted_at(root: Path) -> int:
    (marker,) = root.glob("acted-at-step-*")
    return int(marker.name.rsplit("-", 1)[1])


def test_kill_9_of_the_writer_mid_write_keeps_the_previous_last_ckpt_and_resumes_bit_exact(
    uninterrupted, tmp_path: Path
) -> None:
    """With the run tracked: the journal never calls a write in flight saved (it would settle the
    values logged up to it, which the resume from the previous last.ckpt then logs a second time)."""
    plain, expected = uninterrupted
    run = tmp_path / "run"
    result = fit(CONFIG, overlay(tmp_path, act="kill", rank=0, logger=True), run)
    assert result.returncode != 0
    last = run / "checkpoints" / "last.ckpt"
    killed_at, previous = acted_at(run), safe_load(last)["global_step"]  # loads: complete
    assert previous < killed_at and previous % 5 == 0, (previous, killed_at)
    assert list(last.parent.glob(".last.ckpt.*.tmp")), "no write was cut: the kill proved nothing"
    (journal,) = run.rglob(JOURNAL_FILE)
    saved = [event["step"] for event in map(json.loads, journal.read_text().splitlines()) if "saved" in event]
    assert saved and max(saved) <= previous, f"saved steps {saved}, last.ckpt on disk holds step {previous}"
    resume_and_compare(CONFIG, plain, run, expected)
    assert not list(last.parent.glob("*.tmp")), "the resumed run's first save removes the cut write"
    assert repeated_values(run) == ""


# About 130 s on the loaded 2-core VM (a stopped run and its resume); the writer's kill above is the harder case.
@pytest.mark.slow
def test_kill_9_of_the_other_rank_mid_write_resumes_bit_exact(uninterrupted, tmp_path: Path) -> None:
    plain, expected = uninterrupted
    run = tmp_path / "run"
    result = fit(CONFIG, overlay(tmp_path, act="kill", rank=1), run)
    assert result.returncode != 0
    assert safe_load(run / "checkpoints" / "last.ckpt")["global_step"] <= acted_at(run)
    resume_and_compare(CONFIG, plain, run, expected)


# About 130 s each on the loaded 2-core VM; the default run's signal tests run with background saves too.
@pytest.mark.slow
@pytest.mark.parametrize("act", ["sigusr1", "sigterm"])
def test_preemption_mid_write_waits_for_it_saves_the_final_state_and_resumes_bit_exact(
    uninterrupted, tmp_path: Path, act: str
) -> None:
    plain, expected = uninterrupted
    run = tmp_path / "run"
    result = fit(CONFIG, overlay(tmp_path, act=act, rank=1), run)
    log = result.stdout + result.stderr
    assert result.returncode == PREEMPTED_EXIT_CODE, log[-3000:]
    step = int(re.search(r"preempted at global step (\d+)", log).group(1))
    assert step >= acted_at(run)
    last = run / "checkpoints" / "last.ckpt"
    assert safe_load(last)["global_step"] == step  # the final state, not the write that was in flight
    assert not list(last.parent.glob("*.tmp")) and "Traceback" not in log
    resume_and_compare(CONFIG, plain, run, expected)


# About 65 s each on the loaded 2-core VM; the same one line on real files: tests/checkpoints/test_background_writes.py.
@pytest.mark.slow
@pytest.mark.parametrize("config", [CONFIG, "configs/gpt_fsdp.yaml"], ids=["ddp", "fsdp"])
def test_a_save_directory_made_read_only_mid_run_is_one_line_naming_it(tmp_path: Path, config: str) -> None:
    """The checkpoint directory is a tmpfs, remounted read-only once last.ckpt is on it (under fsdp a
    link to the directory of shards every rank wrote in the background)."""
    if shutil.which("mount") is None or subprocess.run(["mount", "--version"], capture_output=True).returncode:
        pytest.skip("needs mount")
    run = tmp_path / "run"
    checkpoints = run / "checkpoints"
    checkpoints.mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512m", "tmpfs", str(checkpoints)]).returncode:
        pytest.skip("mounting a tmpfs needs root")
    process = start_fit(config, overlay(tmp_path, epochs=30), run)
    try:
        deadline = time.monotonic() + 180
        while not (checkpoints / "last.ckpt").exists():
            assert process.poll() is None and time.monotonic() < deadline, "no last.ckpt was written"
            time.sleep(0.05)
        # Remounting fails while a file is open for writing (a write in flight): try between writes.
        while subprocess.run(["mount", "-o", "remount,ro", str(checkpoints)], capture_output=True).returncode:
            assert process.poll() is None, "training ended before the directory became read-only"
            time.sleep(0.05)
        previous = load_whole(checkpoints / "last.ckpt")["global_step"]
        process.wait(timeout=180)
        log = (tmp_path / "run.log").read_text()
        errors = sorted({line for line in log.splitlines() if "error:" in line})
        assert process.returncode != 0 and len(errors) == 1, log[-3000:]
        assert f"could not write the checkpoint {checkpoints}/" in errors[0] and "read-only" in errors[0], errors
        assert "Traceback" not in log and "last checkpoint:" not in log, log[-3000:]
        assert load_whole(checkpoints / "last.ckpt")["global_step"] == previous  # still loads, unchanged
    finally:
        kill_job(process.pid)
        process.wait()
        subprocess.run(["umount", str(checkpoints)], check=False)


@pytest.mark.parametrize(
    ("config", "rank"),
    [
        # The same check on the writer thread is in tests/checkpoints/test_background_writes.py (in-process).
        pytest.param(CONFIG, 0, id="ddp-writer", marks=pytest.mark.slow),
        pytest.param("configs/gpt_fsdp.yaml", 1, id="fsdp-other-rank"),
    ],
)
def test_a_parameter_clamped_before_its_overlapped_copy_fails_that_save_in_one_line(
    tmp_path: Path, config: str, rank: int
) -> None:
    """`last_checkpoint.overlap_copy`: a user's callback clamps a parameter in `on_before_optimizer_step`
    after the second save, before that save's late copy is made (tests/helpers/user_callbacks.py
    `ClampBeforeTheCopy`). The run stops in one line naming the parameter and the fix, and last.ckpt
    stays the first save's. Under fsdp the clamp is on rank 1 and rank 0 publishes the
    link: every rank agrees before any publishes."""
    clamp = json.dumps({"class_path": "tests.helpers.user_callbacks.ClampBeforeTheCopy", "init_args": {"rank": rank}})
    result = fit(
        config, overlay(tmp_path), tmp_path / "run", "--last_checkpoint.overlap_copy=true",
        f"--trainer.callbacks+={clamp}", "--trainer.max_epochs=2",
    )  # fmt: skip
    output = result.stdout + result.stderr
    errors = sorted({line for line in output.splitlines() if "error:" in line})
    assert result.returncode == 2 and len(errors) == 1, output[-3000:]
    assert "changed outside an optimizer step while the save copied it" in errors[0], errors
    assert "Fix: set last_checkpoint.overlap_copy: false" in errors[0] and "Traceback" not in output, output[-3000:]
    assert "parameter " in errors[0], errors  # this rank's own name for it, or the rank that changed it
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert load_whole(last)["global_step"] == 5, "the first save is not what last.ckpt holds"  # the torn one: step 10
