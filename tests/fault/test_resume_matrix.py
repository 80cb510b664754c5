"""The stop matrix: resume equals the uninterrupted run from any stop, for any user code and real data.

Cases are generated, not written down: every pair of values across (how it stops, how it
continues, where it stops, the user code) appears in at least one case (greedy pairwise cover,
`pairwise_cases`), and each case is compared with one cached uninterrupted run of its user-code
variant on weights, optimizer and scheduler state, global step, epoch and the joined metric
history (`app.cli.resume_check.compare`). The default run takes `DEFAULT_SUBSET` (every value of every
dimension at least once); `-m slow` runs the whole cover and writes its table to docs/resume.md.

Rows on real data: the CNN on a generated ImageFolder (JPEGs, random crop and flip decoded in loader
workers) and on LitData shards written from it (`DATA_SUBSET`; every stop and moment under `-m slow`).
Rows under `strategy: fsdp`: configs/gpt_fsdp.yaml (FSDP2, sharded checkpoints, AdamW) killed mid-epoch
(every stop and moment under `-m slow`); its resume on 3 ranks is in tests/fsdp/test_fsdp_runs.py.
"""

from __future__ import annotations

import csv
import itertools
import json
from pathlib import Path

import pytest

from app.bench.data import write_image_folder
from app.cli.resume_check import CONTINUES, MOMENTS, STOPS, Case, Outcome, Runner, format_table
from tests.helpers.datasets_on_disk import image_folder_shards
from tests.helpers.run import REPO, fit_runner
from tests.helpers.wandb_files import wandb_history

pytestmark = [pytest.mark.fault, pytest.mark.distributed]

# W&B (offline) in every stopped and resumed run (`Runner.case_args`; the uninterrupted runs are compared
# on metrics.csv only): the one tracker that cannot take a step's values out of order, so each case also
# checks that it shows exactly what metrics.csv shows.
CONFIG = ["--config", "tests/helpers/augmenting.yaml"]
WANDB = ["--tracking.wandb.project=matrix"]
USER_CKPT = {
    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
    "init_args": {"every_n_train_steps": 7, "save_top_k": -1, "filename": "step-{step}"},
}
VARIANTS = {
    "workers0": [],
    "workers2": ["--data.init_args.num_workers=2"],
    "persistent": ["--data.init_args.num_workers=2", "--data.init_args.persistent_workers=true"],
    "user-ckpt": ["--trainer.callbacks+=" + json.dumps(USER_CKPT)],
    "accumulate3": ["--trainer.accumulate_grad_batches=3"],
    "powersgd": ["--gradient_compression.method=powersgd", "--gradient_compression.start_iter=2"],
    "step-lr": ["--model.init_args.step_scheduler=true"],
    "two-val": ["--data.init_args.two_val_loaders=true"],
    # The parameters and AdamW's state copied while the next step runs (issue 44); trains as workers2.
    "overlap": ["--data.init_args.num_workers=2", "--last_checkpoint.overlap_copy=true"],
}
TRAINS_AS = {"overlap": "workers2"}
BUDGETS = ("max_steps", "max_time")


def valid(stop: str, moment: str, continues: str, variant: str) -> bool:
    if stop in BUDGETS:  # a budget stops mid-epoch and must grow to continue
        return moment == "mid-epoch" and continues != "same"
    if moment == "micro-batch":
        return variant == "accumulate3"
    if moment == "background-write":  # under DDP only rank 0 writes
        return stop == "kill-rank0"
    return True


def pairwise_cases() -> list[Case]:
    """A greedy cover of every valid pair of values across the four dimensions."""
    dimensions = [list(STOPS), list(MOMENTS), list(CONTINUES), list(VARIANTS)]
    candidates = [combo for combo in itertools.product(*dimensions) if valid(*combo)]

    def pairs(combo: tuple[str, ...]) -> set[tuple[int, str, int, str]]:
        return {(i, combo[i], j, combo[j]) for i, j in itertools.combinations(range(4), 2)}

    uncovered = set().union(*(pairs(combo) for combo in candidates))
    chosen = []
    while uncovered:
        best = max(candidates, key=lambda combo: len(pairs(combo) & uncovered))
        chosen.append(best)
        uncovered -= pairs(best)

    # Stop in epoch 0 at its end (the last batch, validation), else in epoch 1. After an epoch-end save
    # the stop lands when the next epoch starts: under `more-epochs` the stopped run has one epoch fewer
    # (2 of 3), so epoch 1's save has no next epoch to stop in, and the stop follows epoch 0's.
    def epoch(moment: str, continues: str) -> int:
        at_the_end = moment in ("last-batch", "validation")
        return 0 if at_the_end or (moment == "after-epoch-save" and continues == "more-epochs") else 1

    return [
        Case(stop, moment, continues, variant, epoch=epoch(moment, continues))
        for stop, moment, continues, variant in chosen
    ]


DEFAULT_SUBSET = [
    Case("kill-rank1", "mid-epoch", "same", "workers2"),
    Case("kill-rank0", "validation", "same", "workers0", epoch=0),
    Case("sigterm", "last-batch", "more-epochs", "user-ckpt", epoch=0),
    Case("ctrl-c", "after-epoch-save", "more-steps", "persistent", epoch=0),
    Case("kill-rank1", "micro-batch", "same", "accumulate3"),
    Case("max_steps", "mid-epoch", "more-steps", "powersgd"),
    Case("max_time", "mid-epoch", "more-epochs", "step-lr"),
    Case("kill-rank1", "checkpoint-write", "same", "two-val"),
    Case("kill-rank0", "first-step", "same", "workers0"),
    Case("kill-rank0", "background-write", "same", "overlap"),
]


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Runner:
    workdir = tmp_path_factory.mktemp("matrix")
    return fit_runner(CONFIG, workdir, epochs=3, variants=VARIANTS, case_args=WANDB, trains_as=TRAINS_AS)


def check(runner: Runner, case: Case) -> Outcome:
    outcome = runner.run(case)
    assert outcome.exact, f"{case.describe()} [{case.variant}]: {outcome.detail or outcome}"
    assert outcome.root is not None
    (log_dir,) = (outcome.root / "lightning_logs").iterdir()  # one log version across the attempts
    _, synced = wandb_history(log_dir / "wandb")
    in_wandb = {(name, step): value for name, values in synced.items() for step, value in values}
    assert in_wandb == csv_values(log_dir), f"{case.describe()} [{case.variant}]: W&B differs from metrics.csv"
    return outcome


def csv_values(log_dir: Path) -> dict[tuple[str, int], float]:
    """metrics.csv as {(name, step): value} (`epoch` repeats in a step's rows with one value)."""
    with (log_dir / "metrics.csv").open() as file:
        return {
            (name, int(row["step"])): float(value)
            for row in csv.DictReader(file)
            for name, value in row.items()
            if name != "step" and value
        }


def test_the_default_subset_covers_every_value_of_every_dimension() -> None:
    for index, values in enumerate((STOPS, MOMENTS, CONTINUES, VARIANTS)):
        used = {(case.stop, case.moment, case.continues, case.variant)[index] for case in DEFAULT_SUBSET}
        assert used == set(values), f"values missing from the default subset: {set(values) - used}"


def test_the_generated_cover_has_every_valid_pair() -> None:
    cases = pairwise_cases()
    covered = {
        (i, combo[i], j, combo[j])
        for combo in ((c.stop, c.moment, c.continues, c.variant) for c in cases)
        for i, j in itertools.combinations(range(4), 2)
    }
    dimensions = [list(STOPS), list(MOMENTS), list(CONTINUES), list(VARIANTS)]
    for combo in itertools.product(*dimensions):
        if valid(*combo):
            assert {(i, combo[i], j, combo[j]) for i, j in itertools.combinations(range(4), 2)} <= covered


@pytest.mark.parametrize("case", DEFAULT_SUBSET, ids=lambda case: case.name)
def test_resume_is_exact(runner: Runner, case: Case) -> None:
    check(runner, case)


@pytest.mark.slow
@pytest.mark.timeout(3600)  # 64 cases, about 15 s each here
def test_the_whole_pairwise_matrix_is_exact_and_written_to_the_docs(runner: Runner) -> None:
    outcomes = [runner.run(case) for case in pairwise_cases()]
    table = format_table(outcomes)
    docs = REPO / "docs" / "resume.md"
    text = docs.read_text()
    begin, end = "<!-- matrix begin -->", "<!-- matrix end -->"
    rows = "\n".join(f"    {line}" for line in table.splitlines())
    variants = "\n".join(f"    {outcome.case.variant:<12} {outcome.case.describe()}" for outcome in outcomes)
    docs.write_text(
        text.split(begin)[0] + f"{begin}\n{rows}\n\n  user code per row:\n\n{variants}\n{end}" + text.split(end)[1]
    )
    different = [outcome for outcome in outcomes if not outcome.exact]
    assert not different, "\n".join(f"{o.case.name}: {o.detail}" for o in different)


@pytest.mark.slow
@pytest.mark.parametrize("moment", [moment for moment in MOMENTS if moment != "micro-batch"])
def test_every_stop_moment_on_the_default_config(tmp_path: Path, moment: str) -> None:
    runner = fit_runner(["--config", "configs/digits.yaml"], tmp_path, epochs=3, case_args=WANDB)
    stop = "kill-rank0" if moment == "background-write" else "kill-rank1"  # under DDP only rank 0 writes
    check(runner, Case(stop, moment, epoch=0 if moment in ("last-batch", "validation") else 1))


# Real data: (config, the data_dir it reads: the generated image folder or the shards written from it).
DATA_CONFIGS = {"imagefolder": "tests/helpers/imagefolder.yaml", "streaming": "tests/helpers/streaming.yaml"}
DATA_VARIANTS = {  # both configs read with 2 loader workers
    "workers2": [],
    "workers0": ["--data.init_args.num_workers=0"],
    "persistent": ["--data.init_args.persistent_workers=true"],
    "accumulate3": ["--trainer.accumulate_grad_batches=3"],
}
# The default run's rows (one uninterrupted run each); the kill mid-epoch, twice for the shards, and the
# resume on 3 ranks are in tests/data/test_imagefolder.py and tests/data/test_litdata_shards.py.
DATA_SUBSET = {
    "imagefolder": Case("sigterm", "last-batch", "more-epochs", "persistent", epoch=0),
    "streaming": Case("kill-rank0", "validation", "same", "workers2", epoch=0),
}


@pytest.fixture(scope="module")
def data_runners(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Runner]:
    """One Runner per data module: 200 random 32x32 JPEGs in 4 classes (7 steps an epoch on 2 ranks), and
    their LitData shards in chunks of 16 samples."""
    images = write_image_folder(tmp_path_factory.mktemp("images"), images=200, classes=4, pixels=32)
    shards = image_folder_shards(tmp_path_factory, images, DATA_CONFIGS["imagefolder"], 16)
    data_dirs = {"imagefolder": images, "streaming": shards}
    return {
        name: fit_runner(
            ["--config", config, f"--data.init_args.data_dir={data_dirs[name]}"],
            tmp_path_factory.mktemp(name),
            epochs=3,
            variants=DATA_VARIANTS,
            case_args=WANDB,
        )
        for name, config in DATA_CONFIGS.items()
    }


@pytest.mark.parametrize("data", list(DATA_SUBSET))
def test_resume_is_exact_on_real_data(data_runners: dict[str, Runner], data: str) -> None:
    check(data_runners[data], DATA_SUBSET[data])


def data_cases() -> list[Case]:
    """Every stop at mid-epoch and every moment of a kill, each with another loader variant."""
    cases = []
    variants = list(DATA_VARIANTS.keys() - {"accumulate3"})
    for index, stop in enumerate(STOPS):
        continues = "more-epochs" if stop in BUDGETS else "same"
        cases.append(Case(stop, "mid-epoch", continues, sorted(variants)[index % len(variants)]))
    for moment in MOMENTS:
        variant = "accumulate3" if moment == "micro-batch" else "workers2"
        stop = "kill-rank0" if moment == "background-write" else "kill-rank1"  # under DDP only rank 0 writes
        cases.append(Case(stop, moment, "same", variant, epoch=0 if moment in ("last-batch", "validation") else 1))
    return cases


@pytest.mark.slow
@pytest.mark.timeout(3600)  # 13 cases per data module, about 30 s each here
@pytest.mark.parametrize("data", list(DATA_CONFIGS))
def test_every_stop_and_moment_on_real_data(data_runners: dict[str, Runner], data: str) -> None:
    outcomes = [data_runners[data].run(case) for case in data_cases()]
    different = [outcome for outcome in outcomes if not outcome.exact]
    assert not different, "\n".join(f"{o.case.name}: {o.detail}" for o in different)


FSDP_CONFIG = ["--config", "configs/gpt_fsdp.yaml"]
FSDP_VARIANTS = {"fsdp": [], "fsdp-overlap": ["--last_checkpoint.overlap_copy=true"]}


@pytest.fixture(scope="module")
def fsdp_runner(tmp_path_factory: pytest.TempPathFactory) -> Runner:
    """configs/gpt_fsdp.yaml on 2 ranks, 3 epochs of 16 steps; checkpoints sharded by every rank."""
    return fit_runner(
        FSDP_CONFIG,
        tmp_path_factory.mktemp("fsdp"),
        epochs=3,
        variants=FSDP_VARIANTS,
        case_args=WANDB,
        trains_as={"fsdp-overlap": "fsdp"},
    )


def test_fsdp_resume_after_a_kill_while_every_rank_writes_its_shards_in_the_background_is_exact(
    fsdp_runner: Runner,
) -> None:
    """Rank 1 killed while its `dcp.async_save` is in flight: the link still names the previous
    complete checkpoint, and the resume from it is exact (a kill mid-epoch at any moment: -m slow)."""
    check(fsdp_runner, Case("kill-rank1", "background-write", "same", "fsdp-overlap"))


@pytest.mark.slow
@pytest.mark.timeout(3600)  # 13 cases, about 30 s each here
def test_every_stop_and_moment_under_fsdp(fsdp_runner: Runner) -> None:
    cases = [Case(case.stop, case.moment, case.continues, "fsdp", case.epoch) for case in data_cases()]
    outcomes = [fsdp_runner.run(case) for case in cases if case.moment != "micro-batch"]
    different = [outcome for outcome in outcomes if not outcome.exact]
    assert not different, "\n".join(f"{o.case.name}: {o.detail}" for o in different)
