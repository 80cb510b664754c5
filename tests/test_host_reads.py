"""No host read of a tensor value in a steady-state training step, except at the logging cadence.

On a GPU every such read stalls the CPU until the device catches up, so it adds to every step; on an
H100 the NaN guard's per-step `.item()` alone was a third of Lightning's added time (issue 22). The
reads are counted on the CPU (tests/helpers/host_reads.py), so CI catches a new one without a GPU;
the `gpu` tier checks the same with `torch.cuda.set_sync_debug_mode("error")`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from app.cli import DDPAppCLI
from app.errors import NonFiniteLossError
from app.run.callbacks import NonFiniteGuard
from tests.helpers.host_reads import HostReadCounter
from tests.helpers.run import REPO

pytestmark = pytest.mark.quick

DIGITS = str(REPO / "configs" / "digits.yaml")
LOG_EVERY = 10


def reads_per_batch(tmp_path: Path, *overrides: str) -> tuple[HostReadCounter, int]:
    """Fit 2 epochs of the digits job in this process (1 rank) and count host reads per batch."""
    cli = DDPAppCLI(
        args=[
            "--config", DIGITS, f"--trainer.default_root_dir={tmp_path}", "--trainer.devices=1",
            "--trainer.max_epochs=2", f"--trainer.log_every_n_steps={LOG_EVERY}",
            # The ranks' once-a-second agreement on stop signals and save intervals is a read by
            # design (LastCheckpoint), not a per-step one: out of this count.
            "--last_checkpoint.check_interval_s=3600", *overrides,
        ],
        run=False,
    )  # fmt: skip
    counter = HostReadCounter()
    cli.trainer.callbacks.insert(0, counter)
    with counter:
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return counter, cli.trainer.num_training_batches


@pytest.mark.parametrize(
    "overrides, accumulate",
    [
        ([], 1),
        (["--trainer.accumulate_grad_batches=2", "--trainer.gradient_clip_val=1.0"], 2),
        (["--trainer.precision=bf16-mixed", "--trainer.enable_progress_bar=true"], 1),
    ],
    ids=["default", "accumulate-and-clip", "bf16-with-progress-bar"],
)
def test_training_steps_read_no_device_value_between_logging_steps(
    tmp_path: Path, overrides: list[str], accumulate: int
) -> None:
    counter, batches = reads_per_batch(tmp_path, *overrides)
    assert len(counter.global_steps) == 2 * batches  # every batch was watched
    found = counter.steady_state(batches, LOG_EVERY, accumulate)
    assert not found, f"{len(found)} steady-state batches read device values, e.g. {next(iter(found.items()))}"
    # The logging steps do read (the NaN guard's verdict, Lightning's logged values): the counter sees them.
    assert any(counter.found.values())


def test_a_non_finite_gradient_is_named_at_its_step_and_no_checkpoint_holds_what_followed(tmp_path: Path) -> None:
    """The verdict is read late, but exactly: the step is named and last.ckpt predates it."""
    cli = DDPAppCLI(
        args=[
            "--config", DIGITS, f"--trainer.default_root_dir={tmp_path}", "--trainer.devices=1",
            "--trainer.max_epochs=3", "--trainer.enable_progress_bar=false", "--trainer.logger=false",
            f"--trainer.log_every_n_steps={LOG_EVERY}", "--last_checkpoint.every_n_steps=7",
            "--last_checkpoint.check_interval_s=0",
        ],
        run=False,
    )  # fmt: skip
    bad_step = 23  # between two saves (21, 28) and two reads (20, 30)
    original = cli.model.training_step

    def diverging_step(batch, batch_idx):  # noqa: ANN001, ANN202
        loss = original(batch, batch_idx)
        return loss * float("nan") if cli.trainer.global_step == bad_step else loss

    cli.model.training_step = diverging_step
    with pytest.raises(NonFiniteLossError, match=f"at global step {bad_step} ") as raised:
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert isinstance(next(cb for cb in cli.trainer.callbacks if isinstance(cb, NonFiniteGuard)), NonFiniteGuard)
    last = Path(tmp_path) / "checkpoints" / "last.ckpt"
    assert str(last) in str(raised.value)
    import torch

    saved = torch.load(last, weights_only=True, map_location="cpu")
    assert saved["global_step"] <= bad_step, saved["global_step"]
    assert all(torch.isfinite(value).all() for value in saved["state_dict"].values() if value.is_floating_point())
