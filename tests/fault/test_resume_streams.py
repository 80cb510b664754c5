"""A user's training stream (an IterableDataset that shards itself) resumes exactly when it has
state_dict/load_state_dict, saved per rank at the last trained batch; one that cannot be positioned
is named in one line at fit start."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.resume_check import Case, Runner
from tests.helpers.run import ddp_app

pytestmark = [pytest.mark.fault, pytest.mark.distributed]

CONFIG = ["--config", "tests/helpers/stream.yaml"]
VARIANTS = {"sized": [], "unsized": ["--data.init_args.sized=false"]}
CASES = [
    pytest.param(Case("kill-rank1", "mid-epoch", variant="sized", epoch=1), id="sized-kill-mid-epoch"),
    pytest.param(Case("sigterm", "last-batch", variant="unsized", epoch=0), id="unsized-sigterm-last-batch"),
    pytest.param(Case("kill-rank0", "validation", variant="unsized", epoch=1), id="unsized-kill-validation"),
    pytest.param(
        Case("max_steps", continues="more-epochs", variant="unsized", epoch=1), id="unsized-max-steps-more-epochs"
    ),
    pytest.param(
        Case("kill-rank1", "mid-epoch", variant="unsized", epoch=1), id="unsized-kill-mid-epoch", marks=pytest.mark.slow
    ),  # fmt: skip
    pytest.param(
        Case("sigterm", "last-batch", variant="sized", epoch=0), id="sized-sigterm-last-batch", marks=pytest.mark.slow
    ),  # fmt: skip
    pytest.param(
        Case("ctrl-c", "after-epoch-save", variant="sized", epoch=0),
        id="sized-ctrl-c-after-epoch-save",
        marks=pytest.mark.slow,
    ),  # fmt: skip
]


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Runner:
    return Runner(CONFIG, tmp_path_factory.mktemp("streams"), epochs=3, variants=VARIANTS)


@pytest.mark.parametrize("case", CASES)
def test_a_stateful_stream_resumes_exactly(runner: Runner, case: Case) -> None:
    outcome = runner.run(case)
    assert outcome.exact, (case.name, outcome)


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["--data.init_args.stateful=false"], "the training stream Stream has no state_dict/load_state_dict"),
        (["--data.init_args.num_workers=2"], "the training stream StatefulStream runs in 2 loader workers"),
    ],
    ids=["no-state", "workers"],
)
def test_a_stream_that_cannot_be_positioned_is_named_once_at_fit_start(
    tmp_path: Path, overrides: list[str], named: str
) -> None:
    result = ddp_app(
        "fit", *CONFIG, *overrides, "--trainer.max_epochs=1", f"--trainer.default_root_dir={tmp_path}",
        "--trainer.enable_progress_bar=false",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if named in line]
    assert len(lines) == 1 and lines[0].startswith("ddp-app: "), result.stderr[-3000:]
