"""The guarantees on code we did not write: examples/custom's plain LightningModule and DataModule.

Exact evaluation at 1, 2 and 3 ranks, exact mid-epoch resume, one last.ckpt, preemption.
"""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path

import pytest
import torch

from app.checkpoints import state as checkpoint_state
from app.checkpoints.io import safe_load
from app.cluster.exit_codes import PREEMPTED_EXIT_CODE
from tests.fault.test_resume import assert_same_weights, overlay, stop_with_signal
from tests.helpers.isolated import predict_in_isolation
from tests.helpers.run import REPO, clean_env, ddp_app, run

pytestmark = [pytest.mark.distributed, pytest.mark.fault]

CONFIG = "examples/custom/config.yaml"
EPOCHS = 24  # 16 steps per epoch at 2 ranks: 384 steps, long enough to preempt mid-run
FINAL = f"epoch-epoch={EPOCHS - 1}.ckpt"


def fit(extra: Path, root: Path, *args: str):
    return ddp_app(
        "fit", "--config", CONFIG, "--config", str(extra), f"--trainer.default_root_dir={root}", *args, timeout=300
    )


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Uninterrupted, 2 ranks: a checkpoint every 5 steps (mid-epoch), at every epoch end, and last.ckpt."""
    root = tmp_path_factory.mktemp("custom")
    extra = overlay(root, epochs=EPOCHS, every=5)
    result = fit(extra, root / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sync_dist" not in result.stderr  # the example logs torchmetrics objects: no warning
    return extra, root / "run" / "checkpoints"


def test_one_last_checkpoint(baseline) -> None:
    _, checkpoints = baseline
    assert [path.name for path in checkpoints.glob("last*.ckpt")] == ["last.ckpt"]
    assert safe_load(checkpoints / "last.ckpt")["global_step"] == EPOCHS * 16


def validate(ranks: int, checkpoint: Path, root: Path, cwd: Path = REPO, config: str = CONFIG, *args: str):
    env = clean_env(DDP_APP_ALLOW_OVERSUBSCRIBE="1")
    return ddp_app(
        "validate", "--config", config, f"--trainer.devices={ranks}", f"--trainer.default_root_dir={root}",
        "--trainer.enable_progress_bar=false", f"--ckpt_path={checkpoint}", *args, cwd=cwd, env=env, timeout=300,
    )  # fmt: skip


def printed_metrics(output: str) -> dict[str, str]:
    """Lightning's results table, plain or drawn by `rich` where it is installed (then with │ between cells)."""
    return dict(re.findall(r"(val_\w+)[\s│|]+([-\d.e]+)", output))


def test_validation_metrics_are_identical_at_1_2_and_3_ranks(baseline, tmp_path: Path) -> None:
    """203 samples: Lightning's padded sampler would count 1 sample twice at 2 ranks, 1 at 3 ranks."""
    _, checkpoints = baseline
    checkpoint = checkpoints / "step-step=45.ckpt"
    # 1 rank from inside the example's directory, with its local paths, as a user who copied it runs it.
    one = validate(1, checkpoint, tmp_path / "1", REPO / "examples" / "custom", "config.yaml")
    assert one.returncode == 0, one.stderr[-3000:]
    expected = printed_metrics(one.stdout)
    assert set(expected) == {"val_acc", "val_loss"}, one.stdout[-2000:]
    for ranks in (2, 3):
        result = validate(ranks, checkpoint, tmp_path / str(ranks))
        assert result.returncode == 0, result.stderr[-3000:]
        metrics = printed_metrics(result.stdout)
        # Accuracy is a ratio of summed integer counts: exact. The loss is a sum of floats whose
        # order depends on the sharding (per-rank sums, then the all-reduce): equal to float32 rounding.
        assert metrics["val_acc"] == expected["val_acc"], f"{ranks} ranks: {result.stdout[-2000:]}"
        assert float(metrics["val_loss"]) == pytest.approx(float(expected["val_loss"]), rel=1e-6, abs=0)


def test_a_per_rank_mean_logged_with_sync_dist_is_reported_once(baseline, tmp_path: Path) -> None:
    env = clean_env()
    result = ddp_app(
        "validate", "--config", CONFIG, "--model=tests.helpers.user_modules.PerRankMeanNet",
        f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false", env=env, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if "per-rank means" in line]
    assert len(warnings) == 1 and "'val_loss_mean'" in warnings[0], result.stderr[-3000:]


@pytest.mark.slow  # about 20 s each; `ddp-app resume-check` on this example is the default run's resume
@pytest.mark.parametrize(
    "checkpoint", ["step-step=45.ckpt", "epoch-epoch=3.ckpt"], ids=["epoch2-after-batch13", "end-of-epoch3"]
)
def test_resume_is_bit_exact(baseline, checkpoint: str, tmp_path: Path) -> None:
    """Mid-epoch: the sampler skips the batches done. Epoch end: the model has dropout, and the
    next epoch's iterator must not draw from the generator whose state the checkpoint holds."""
    extra, checkpoints = baseline
    result = fit(extra, tmp_path, f"--ckpt_path={checkpoints / checkpoint}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "not resumable" not in result.stderr
    assert_same_weights(checkpoints / FINAL, tmp_path / "checkpoints" / FINAL)


def test_powersgd_state_follows_the_users_parameter_names_and_resumes_bit_exact(tmp_path: Path) -> None:
    """gradient_compression on a module whose parameters are its own attributes (`hidden.*`, `output.*`,
    beside torchmetrics' states): PowerSGD's per-rank state is saved under those names and a resume
    from the middle of an epoch ends with the weights of the run that was never interrupted."""
    powersgd = ("--gradient_compression.method=powersgd", "--gradient_compression.powersgd_rank=2",
                "--gradient_compression.start_iter=3")  # fmt: skip
    extra = overlay(tmp_path, epochs=4, every=5)
    first = fit(extra, tmp_path / "run", *powersgd)
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoints = tmp_path / "run" / "checkpoints"
    state = checkpoint_state.get(
        safe_load(checkpoints / "step-step=25.ckpt"), "gradient_compression"
    )  # epoch 1, batch 9 of 16
    ranks = [rank["powersgd"] for rank in state["per_rank"]]
    assert len(ranks) == 2 and ranks[0]["iter"] == ranks[1]["iter"] == 25
    # hidden.weight (64 x 16) is compressed at rank 2: its warm-start Q and error feedback are kept.
    assert "hidden.weight" in ranks[0]["q"] and "hidden.weight" in ranks[0]["error"], ranks[0]["q"].keys()
    resumed = fit(extra, tmp_path / "resumed", *powersgd, f"--ckpt_path={checkpoints / 'step-step=25.ckpt'}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "fresh state" not in resumed.stderr
    final = "epoch-epoch=3.ckpt"
    assert_same_weights(checkpoints / final, tmp_path / "resumed" / "checkpoints" / final)


@pytest.mark.slow  # about 30 s; SIGUSR1 preemption is tests/fault/test_resume.py's, this example resume-check's
def test_preemption_saves_at_a_step_boundary_and_resumes_bit_exactly(baseline, tmp_path: Path) -> None:
    extra, checkpoints = baseline
    code, log = stop_with_signal(CONFIG, extra, tmp_path / "run", signal.SIGUSR1, at_step=60)
    assert code == PREEMPTED_EXIT_CODE, log[-3000:]
    step = int(re.search(r"preempted at global step (\d+)", log).group(1))
    assert step < EPOCHS * 16, "training ended before the signal"
    assert safe_load(tmp_path / "run" / "checkpoints" / "last.ckpt")["global_step"] == step
    resumed = fit(extra, tmp_path / "run", "--ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(checkpoints / FINAL, tmp_path / "run" / "checkpoints" / FINAL)


def test_the_example_exports_to_a_program_that_runs_without_its_code(baseline, tmp_path: Path) -> None:
    """`python -m app.export --format exported-program`, run from elsewhere: the user's module is found
    where the run imported it from, and the .pt2 runs where neither it nor `app` can be imported."""
    _, checkpoints = baseline
    out = tmp_path / "model.pt2"
    result = run(
        [sys.executable, "-m", "app.export", "--ckpt", str(checkpoints / "last.ckpt"), "--out", str(out),
         "--format", "exported-program", "--config", str(REPO / CONFIG)],
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    sys.path.insert(0, str(REPO / "examples" / "custom"))
    try:
        from mymodels import MyNet
    finally:
        sys.path.remove(str(REPO / "examples" / "custom"))
    checkpoint = safe_load(checkpoints / "last.ckpt")
    module = MyNet(**{key: value for key, value in checkpoint["hyper_parameters"].items() if not key.startswith("_")})
    module.load_state_dict(checkpoint["state_dict"])
    inputs = torch.randn(5, 16)
    with torch.no_grad():
        expected = module.eval()(inputs)
    assert torch.equal(predict_in_isolation(out, inputs, tmp_path / "isolated"), expected)
