"""The console of the README's training command: every line it prints has one of a few known shapes,
each said once; DDP_APP_VERBOSE=1 brings back what is kept quiet (app/run/console.py)."""

from __future__ import annotations

import contextlib
import logging
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.run import clean_env, ddp_app

# What a 1-epoch run of `ddp-app fit --config configs/digits.yaml` prints with stdout not a terminal
# (a pipe, as in a Slurm log): anything new, a library's notice or a line per rank, fails here.
ALLOWED = [
    re.compile(shape)
    for shape in (
        r"",  # before the model summary
        r"ddp-app: launched as a plain command: LightningEnvironment, world size 2 = 1 node\(s\) x 2 process\(es\), "
        r"rendezvous [\d.]+:\d+",
        # How checkpoints are written (app/run/plan.py `checkpoint_save_plan`), once, at fit's start.
        r"ddp-app: checkpoints: written in the background \(.*\)",
        # Rank 0's one line that the ranks met (Lightning's rules and backend line around it: verbose only).
        r"All distributed processes registered\. Starting with 2 processes",
        # The model summary, without its FLOPs column and total: all zeros without example_input_array.
        r"\s+\| Name\s+\| Type\s+\| Params\s+\| Mode\s*",
        r"-+",
        r"\d+ \| \w+\s+\| \w+\s+\| [\d.]+ ?[KMGT]?\s+\| (train|eval)\s*",
        r"[\d.]+ ?[KMGT]?\s+(Trainable params|Non-trainable params|Total params|"
        r"Total estimated model params size \(MB\)|Modules in train mode|Modules in eval mode)",
        # The epoch's line (app.run.callbacks.LogLineProgressBar) and the end.
        r"epoch=0 step=20 batch=20/20 samples/s=\d+ train_loss=[\d.]+ val_loss=[\d.]+ val_acc=[\d.]+",
        r"`Trainer\.fit` stopped: `max_epochs=1` reached\.",
        # The fit's summary (app/run/summary.py).
        r"ddp-app: fit done in [\d.]+ s: 1 epochs, 20 steps on 2 processes, [\d,]+ samples/s \(last epoch\)",
        r"  last: (\w+=[\d.e+-]+ ?)+",
        # Where the step's time went (app/run/step_timing.py), from the same logged values.
        r"  step [\d.]+ ms \(last epoch, mean of the ranks\): data \d+%, compute \d+%, communication \d+%, "
        r"other \d+%; slowest rank [01]: [\d.]+ ms of its own work, median rank [\d.]+ ms",
        r"  best val_acc=[\d.]+ \(max\): \S+\.ckpt",
        r"  last checkpoint: \S+/last\.ckpt \(continue: --ckpt_path last\)",
        r"  logs: \S+ \(curves: python -m app\.plot \S+\)",
        r"  tensorboard: tensorboard --logdir \S+",
    )
]


def readme_command(root: Path, **env: str) -> str:
    environment = clean_env(**env)
    environment.pop("TORCH_CPP_LOG_LEVEL", None)  # ddp-app's own choice is what is tested
    result = ddp_app(
        "fit", "--config", "configs/digits.yaml", "--trainer.max_epochs=1", f"--trainer.default_root_dir={root}",
        env=environment,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    return output


@pytest.mark.distributed
def test_the_readme_command_prints_only_known_lines_each_once(tmp_path: Path) -> None:
    lines = readme_command(tmp_path).splitlines()
    unknown = [line for line in lines if not any(shape.fullmatch(line) for shape in ALLOWED)]
    assert not unknown, "lines of no known shape (new noise, or a shape to add here):\n" + "\n".join(unknown)
    repeated = [line for line, count in Counter(lines).items() if count > 1 and line.strip("-")]
    assert not repeated, f"said more than once (once per rank?): {repeated}"
    said = "\n".join(lines)
    expected_lines = ("ddp-app: launched", "processes registered", "| Name", "epoch=0 step=20", "`Trainer.fit` stopped")
    for expected in (*expected_lines, "  step "):
        assert expected in said, f"{expected!r} missing:\n{said}"


@pytest.mark.distributed
def test_ddp_app_verbose_brings_back_what_is_kept_quiet(tmp_path: Path) -> None:
    output = readme_command(tmp_path, DDP_APP_VERBOSE="1")
    assert "[rank: 1] Seed set to 42" in output, output[-3000:]  # a line per rank
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in output, output[-3000:]
    assert "WorkerServer.cpp" in output, output[-3000:]  # PyTorch's C++ warnings (TORCH_CPP_LOG_LEVEL)
    assert "GPU available: False, used: False" in output, output[-3000:]
    assert f"{'-' * 100}\ndistributed_backend=gloo\nAll distributed processes registered." in output, output[-3000:]
    assert re.search(r"\| Mode\s+\| FLOPs", output) and "Total Flops" in output, output[-3000:]


COLUMNS = [(" ", ["0"]), ("Name", ["net"]), ("Type", ["Linear"]), ("Params", ["650"]), ("Mode", ["train"])]


@pytest.mark.parametrize(
    ("flops", "verbose", "shown"),
    [(0, "", False), (0, "1", True), (1300, "", True)],
)
def test_the_summary_shows_flops_only_when_counted_or_verbose(
    flops: int, verbose: str, shown: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.run.callbacks import PlainModelSummary

    monkeypatch.setenv("DDP_APP_VERBOSE", verbose)
    table_logger = logging.getLogger("lightning.pytorch.callbacks.model_summary")
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    table_logger.addHandler(handler)
    try:
        with patch_level(table_logger, logging.INFO):
            PlainModelSummary().summarize(
                [*COLUMNS, ("FLOPs", [str(flops)])], 650, 650, 0.0026, {"train": 1, "eval": 0}, flops
            )
    finally:
        table_logger.removeHandler(handler)
    (table,) = records
    assert ("| FLOPs" in table) == shown and ("Total Flops" in table) == shown, table
    assert "| Mode" in table and table.splitlines()[-1].endswith("Modules in eval mode" if not shown else "Total Flops")


@contextlib.contextmanager
def patch_level(logger: logging.Logger, level: int) -> Iterator[None]:
    previous = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(previous)
