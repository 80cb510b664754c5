"""gradient_compression: the settings users get wrong fail in one line, PyTorch's compression rule is
the one our state layout assumes, and PowerSGD's state follows the parameters across DDP bucketings."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from app.checkpoints import state as checkpoint_state
from app.checkpoints.io import safe_load
from app.parallel.compression import compressed_matrix
from tests.helpers.run import REPO, ddp_app, run, train


def test_compressed_matrix_is_the_rule_of_powersgd_hook() -> None:
    """Private API guard (docs/private_apis.md): our per-parameter layout of PowerSGD's Q memory
    assumes torch's `_should_compress`; a change of that rule must fail here, not mis-resume."""
    for rows, columns, rank, rate in itertools.product((1, 3, 10, 64, 256), (1, 4, 10, 64, 300), (1, 2, 4, 8), (2, 1)):
        ours = compressed_matrix(torch.Size([rows, columns]), rank, rate)
        theirs = powerSGD_hook._should_compress(rows, columns, min(rows, columns, rank), rate)[0]
        assert (ours is not None) == theirs, (rows, columns, rank, rate)
    assert compressed_matrix(torch.Size([10]), 4, 2) is None  # a bias: all-reduced as it is
    assert compressed_matrix(torch.Size([32, 1, 5, 5]), 4, 2) == (32, 25, 4)  # a conv kernel: rows x rest


# (override, the line's words, id): the more_cases tier.
MORE_BAD_SETTINGS = [
    (
        "--gradient_compression.method=zip",
        "gradient_compression.method must be one of none, fp16, bf16",
        "unknown-method",
    ),
    ("--gradient_compression.start_iter=1", "gradient_compression.start_iter must be >= 2, got 1", "start-iter-1"),
    ("--gradient_compression.powersgd_rank=0", "gradient_compression.powersgd_rank must be >= 1, got 0", "rank-0"),
]


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        *(
            pytest.param(override, expected, id=id_, marks=pytest.mark.more_cases)
            for override, expected, id_ in MORE_BAD_SETTINGS
        ),
        pytest.param(
            "--trainer.strategy.init_args.ddp_comm_hook=torch.distributed.algorithms.ddp_comm_hooks."
            "default_hooks.fp16_compress_hook",
            "gradient_compression.method=bf16 and trainer.strategy.init_args.ddp_comm_hook are both set",
            id="two-hooks",
        ),
    ],
)
def test_bad_compression_settings_fail_in_one_line(override: str, expected: str, tmp_path: Path) -> None:
    method = [] if "method" in override else ["--gradient_compression.method=bf16"]
    result = ddp_app(
        "fit", "--config", "configs/digits.yaml", f"--trainer.default_root_dir={tmp_path}", *method, override,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("ddp-app")]
    assert len(lines) == 1 and expected in lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.distributed
@pytest.mark.parametrize(  # merge: about 20 s, the same move the other way
    ("before", "after"), [(25, 0.01), pytest.param(0.01, 25, marks=pytest.mark.slow)], ids=["split", "merge"]
)
def test_powersgd_state_moves_exactly_between_bucketings(before: float, after: float, tmp_path: Path) -> None:
    """Saved mid-run and restored into a fresh DDP (its initial one-bucket layout, then rebuilt
    buckets; also under another bucket_cap_mb): the weights equal those of the uninterrupted run.
    bucket_cap_mb=0.01 puts every layer in a bucket of its own, which also proves that PowerSGD on
    gloo with several buckets does not hang (it does with torch's hook alone)."""
    command = [sys.executable, "-m", "tests.helpers.compression_worker", str(before), str(after)]
    result = run([*command, str(tmp_path)], timeout=180, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        outcome = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert outcome["saved_errors"] == 6, "every parameter's error feedback is in the saved state"
        assert outcome["iter"] == 16
        assert outcome["equal"], f"rank {rank}: weights differ from the uninterrupted run"


@pytest.mark.distributed
def test_auto_decides_once_on_every_rank_and_a_resume_keeps_the_choice(tmp_path: Path) -> None:
    auto = ["--gradient_compression.method=auto", "--gradient_compression.probe_steps=2"]
    first = train("configs/digits.yaml", tmp_path, 2, *auto)
    state = checkpoint_state.get(safe_load(first), "gradient_compression")
    chosen = {rank["chosen"] for rank in state["per_rank"]}
    assert len(chosen) == 1 and chosen <= {"none", "bf16", "powersgd"}, state["per_rank"]
    decision = state["per_rank"][0]["decision"]
    assert decision.startswith(f"gradient_compression auto: chose {chosen.pop()}"), decision
    assert "timed steps each, slowest rank" in decision
    resumed = ddp_app(
        "fit", "--config", "configs/digits.yaml", f"--trainer.default_root_dir={tmp_path}", "--trainer.max_epochs=3",
        "--trainer.enable_progress_bar=false", *auto, "--ckpt_path=last", timeout=240,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "auto: chose" not in resumed.stderr, "the resumed run probed again instead of keeping its choice"
    assert checkpoint_state.get(safe_load(first), "gradient_compression")["per_rank"][0]["decision"] == decision


@pytest.mark.distributed
def test_powersgd_with_gradient_accumulation_compresses_once_per_optimizer_step(tmp_path: Path) -> None:
    """no_sync() skips the hook on accumulation micro-batches: PowerSGD counts optimizer steps only
    (digits at 2 ranks: 20 batches per epoch in groups of 3, a short last one: 7 steps per epoch)."""
    last = train(
        "configs/digits.yaml", tmp_path, 2, "--trainer.accumulate_grad_batches=3",
        "--gradient_compression.method=powersgd", "--gradient_compression.start_iter=2",
    )  # fmt: skip
    checkpoint = safe_load(last)
    assert checkpoint["global_step"] == 14
    assert {
        rank["powersgd"]["iter"] for rank in checkpoint_state.get(checkpoint, "gradient_compression")["per_rank"]
    } == {14}
