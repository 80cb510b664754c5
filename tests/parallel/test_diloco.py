"""`strategy: diloco` (app/parallel/diloco.py): resolved once as its own kind, its settings and what it
cannot honour refused in one line before any rank starts, the outer step bit for bit the plain-PyTorch
reference's and DDP's within rounding at sync_every 1, and a kill -9 between two outer steps resumed
bit for bit."""

from __future__ import annotations

import inspect
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from jsonargparse import Namespace

from app.checkpoints import state as checkpoint_state
from app.checkpoints.sharded import load_whole
from app.cli.diagnose import verdict
from app.cli.entry import check_before_launch
from app.cli.resume_check import Case, max_abs_diff
from app.cluster.exit_codes import BAD_INPUT_EXIT_CODE
from app.cluster.launch import rank_plan
from app.models.gpt import GPTLanguageModel
from app.models.lightning import MLPClassifier
from app.parallel.diloco import DiLoCoStrategy, fragments_due
from app.parallel.fragments import blocks, fragment_indices, trainable
from app.parallel.strategy import DILOCO_CLASS_PATH, StrategyKind, resolve_strategy
from app.parity import (
    DILOCO_AS_DDP,
    DILOCO_TOLERANCE,
    OPTIMIZERS,
    compare_states,
    lightning_fit,
    reference_fit,
    relative_difference,
    run_command,
    single_process_fit,
    variant_config,
    write_variant,
)
from app.reference.config import load_config
from app.reference.diloco import DEFAULTS
from tests.helpers.run import REPO, clean_env, ddp_app, fit_runner

DIGITS = str(REPO / "configs" / "digits.yaml")


class UsersOwnDiLoCo(DiLoCoStrategy):
    pass


@pytest.mark.parametrize(
    "written",
    [
        "diloco",
        DILOCO_CLASS_PATH,
        Namespace(class_path=DILOCO_CLASS_PATH, init_args=Namespace(sync_every=5)),
        {"class_path": f"{__name__}.UsersOwnDiLoCo"},
        DiLoCoStrategy(sync_every=3),
    ],
)
def test_every_form_of_diloco_resolves_to_its_kind_and_forks_its_ranks(written) -> None:
    resolved = resolve_strategy(written, 2)
    assert resolved.kind is StrategyKind.DILOCO and resolved.forks_ranks and not resolved.is_sharded
    assert rank_plan(resolved, 2, True, 2).processes == 2


def test_the_issue_command_line_takes_init_args_after_the_name(tmp_path: Path) -> None:
    parsed = check_before_launch(["fit", "--config", DIGITS, f"--trainer.default_root_dir={tmp_path}",
                                  "--trainer.strategy", "diloco",
                                  "--trainer.strategy.init_args.sync_every", "10"])  # fmt: skip
    assert parsed.plan.strategy.kind is StrategyKind.DILOCO
    strategy = parsed.config["trainer"]["strategy"]
    assert strategy["class_path"] == DILOCO_CLASS_PATH and strategy["init_args"]["sync_every"] == 10
    named = tmp_path / "named.yaml"
    named.write_text("trainer:\n  strategy: diloco\n")
    parsed = check_before_launch(["fit", "--config", DIGITS, "--config", str(named),
                                  f"--trainer.default_root_dir={tmp_path}",
                                  "--trainer.strategy.init_args.fragments", "2"])  # fmt: skip
    assert parsed.plan.strategy.kind is StrategyKind.DILOCO
    assert parsed.config["trainer"]["strategy"]["init_args"]["fragments"] == 2


DILOCO = ["--trainer.strategy", "diloco"]


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--trainer.strategy.init_args.sync_every", "0"], "sync_every=0"),
        (["--trainer.strategy.init_args.sync_every", "-3"], "sync_every=-3"),
        (["--trainer.strategy.init_args.sync_every", "2.5"], "trainer.strategy.init_args.sync_every"),
        (["--trainer.strategy.init_args.sync_every", "ten"], "trainer.strategy.init_args.sync_every"),
        # The digits MLP has 2 blocks (its 2 Linear layers): 3 fragments cannot split them.
        (["--trainer.strategy.init_args.sync_every", "12", "--trainer.strategy.init_args.fragments", "3"],
         "does not divide the 2 blocks of MLPClassifier"),
        (["--trainer.strategy.init_args.sync_every", "5", "--trainer.strategy.init_args.fragments", "2"],
         "does not divide trainer.strategy.init_args.sync_every=5"),
        (["--trainer.strategy.init_args.outer_dtype", "float16"], "trainer.strategy.init_args.outer_dtype"),
        # An exchange must arrive before the next starts: overlap_steps below sync_every / fragments (10 / 2).
        (["--trainer.strategy.init_args.fragments", "2", "--trainer.strategy.init_args.overlap_steps", "5"],
         "overlap_steps=5 is not below sync_every / fragments = 5"),
        (["--trainer.strategy.init_args.overlap_steps", "-1"], "overlap_steps=-1"),
        (["--gradient_compression.method", "powersgd"], "gradient_compression.method=powersgd"),
        (["--trainer.sync_batchnorm", "true"], "trainer.sync_batchnorm=true"),
        # A DDP option diloco cannot honour (it has no DDP model to give it to): no such key.
        (["--trainer.strategy.init_args.find_unused_parameters", "true"], "find_unused_parameters"),
    ],
)  # fmt: skip
def test_what_diloco_cannot_run_is_one_line_before_any_rank(
    args: list[str], names: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    with pytest.raises(SystemExit) as exited:
        check_before_launch(["fit", "--config", DIGITS, f"--trainer.default_root_dir={root}", *DILOCO, *args])
    assert exited.value.code == BAD_INPUT_EXIT_CODE
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and names in err, err
    assert not root.exists()


@pytest.mark.distributed
def test_the_command_refuses_a_bad_sync_every_with_exit_2(tmp_path: Path) -> None:
    result = ddp_app("fit", "--config", "configs/digits.yaml", *DILOCO, "--trainer.strategy.init_args.sync_every", "0",
                     "--trainer.default_root_dir", str(tmp_path / "run"),
                     timeout=120, cwd=REPO, env=clean_env())  # fmt: skip
    assert isinstance(result, subprocess.CompletedProcess)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == BAD_INPUT_EXIT_CODE and len(lines) == 1, result.stderr
    assert "sync_every=0" in lines[0] and "Fix:" in lines[0]


def test_fragments_take_turns_every_sync_every_over_fragments_steps() -> None:
    assert [fragments_due(step, 4, 1) for step in range(1, 9)] == [[], [], [], [0], [], [], [], [0]]
    assert [fragments_due(step, 4, 2) for step in range(1, 9)] == [[], [0], [], [1], [], [0], [], [1]]
    assert [fragments_due(step, 1, 1) for step in range(1, 4)] == [[0], [0], [0]]


def test_a_block_is_a_layer_of_a_module_list_or_else_a_layer_with_parameters() -> None:
    """The GPT's 2 transformer blocks (embeddings with the first, the final norm and head with the last);
    the MLP's 2 Linear layers."""
    gpt = GPTLanguageModel()
    names = [name for name, _ in trainable(gpt)]
    first, second = ([names[i] for i in part] for part in fragment_indices(gpt, 2))
    assert blocks(gpt) == ["net.blocks.0", "net.blocks.1"]
    assert first[0] == "net.token_embedding.weight" and all(".blocks.1." not in name for name in first)
    assert second[-1] == "net.head.weight" and all(".blocks.0." not in name for name in second)
    assert blocks(MLPClassifier(in_features=64, hidden=8, num_classes=10)) == ["net.fc1", "net.fc2"]
    with pytest.raises(ValueError):
        fragment_indices(gpt, 3)


def test_the_reference_runs_the_strategys_defaults() -> None:
    parameters = inspect.signature(DiLoCoStrategy).parameters
    assert {key: parameters[key].default for key in DEFAULTS} == DEFAULTS


def diloco_config(tmp_path: Path, name: str, init_args: dict, epochs: int = 1) -> Path:
    config = variant_config(load_config(REPO / "configs" / "digits.yaml"), "sgd", epochs, 2, tmp_path / "base.yaml")
    return write_variant(config, tmp_path / f"{name}.yaml", {"class_path": DILOCO_CLASS_PATH, "init_args": init_args})


@pytest.mark.parity
@pytest.mark.distributed
def test_diloco_at_sync_every_1_equals_the_reference_bit_for_bit_and_ddp_within_rounding(tmp_path: Path) -> None:
    """P10 in small: digits, 1 epoch (20 SGD steps) on 2 ranks; DiLoCo with an outer step after every
    inner step, outer SGD lr 1 without momentum: the reference's DiLoCo bit for bit, and DDP within
    rounding (docs/parity.md). DDP's weights come from one process that accumulates the 2 ranks'
    micro-batches with loss / 2, which is DDP bit for bit (P2a) without a third launch."""
    path = diloco_config(tmp_path, "as_ddp", DILOCO_AS_DDP)
    lightning = lightning_fit(path, tmp_path / "lightning", "ddp-app", world_size=2)
    reference = reference_fit(path, tmp_path / "reference", "mp.spawn", world_size=2)
    difference, first = compare_states(reference, lightning, tolerance=0.0)
    assert not first and difference == 0.0, first
    ddp = single_process_fit(yaml.safe_load(path.read_text()), 2, "accumulate")
    difference, first = relative_difference(ddp, lightning)
    assert difference <= DILOCO_TOLERANCE and not first
    assert difference > 0  # the outer step ran: the mean of lr x gradient is not the mean gradient exactly


@pytest.mark.parity
@pytest.mark.distributed
def test_overlapped_outer_steps_equal_the_reference_bit_for_bit(tmp_path: Path) -> None:
    """overlap_steps 1 in 2 fragments at sync_every 4 (Nesterov outer steps, the defaults): every all-reduce
    starts an inner step before its outer step and runs beside it, and the fragment continues from the
    new anchor plus that step's progress; Lightning's strategy equals the reference's, every weight. The
    overlap changes the training (the progress kept is not the in-line run's): not the in-line result."""
    overlapped = diloco_config(tmp_path, "overlap", {"sync_every": 4, "fragments": 2, "overlap_steps": 1})
    lightning = lightning_fit(overlapped, tmp_path / "lightning", "ddp-app", world_size=2)
    reference = reference_fit(overlapped, tmp_path / "reference", "mp.spawn", world_size=2)
    difference, first = compare_states(reference, lightning, tolerance=0.0)
    assert not first and difference == 0.0, first
    inline = diloco_config(tmp_path, "inline", {"sync_every": 4, "fragments": 2})
    difference, _ = compare_states(reference_fit(inline, tmp_path / "inline", "mp.spawn", world_size=2), lightning, 0.0)
    assert difference > 0


@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.distributed
def test_accumulation_and_bf16_mixed_work_as_under_ddp_bit_for_bit_the_reference(tmp_path: Path) -> None:
    """Adam, accumulate_grad_batches 3 (a short last group steps too), bf16-mixed, outer steps every 3
    optimizer steps: Lightning equals the reference, which accumulates and autocasts as its DDP does."""
    config = variant_config(load_config(REPO / "configs" / "digits.yaml"), "adam", 1, 2, tmp_path / "base.yaml")
    config["trainer"].update(accumulate_grad_batches=3, precision="bf16-mixed")
    strategy = {"class_path": DILOCO_CLASS_PATH, "init_args": {"sync_every": 3}}
    path = write_variant(config, tmp_path / "accumulate.yaml", strategy)
    lightning = lightning_fit(path, tmp_path / "lightning", "ddp-app", world_size=2)
    reference = reference_fit(path, tmp_path / "reference", "mp.spawn", world_size=2)
    difference, first = compare_states(reference, lightning, tolerance=0.0)
    assert not first and difference == 0.0, first


@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.distributed
def test_the_parity_command_passes_its_diloco_rows(tmp_path: Path) -> None:
    """`python -m app.parity` on a diloco config (Nesterov outer steps every 4, 2 fragments): P10a-b."""
    config = load_config(REPO / "configs" / "digits.yaml")
    config["optimizer"] = OPTIMIZERS["adam"]
    config["trainer"]["strategy"] = {"class_path": DILOCO_CLASS_PATH, "init_args": {"sync_every": 4, "fragments": 2}}
    path = tmp_path / "diloco.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "parity"
    command = [sys.executable, "-m", "app.parity", "--config", str(path), "--epochs", "1", "--out", str(out)]
    run_command(command, tmp_path / "parity.log", timeout=600)
    report = json.loads((out / "parity.json").read_text())
    assert [check["name"] for check in report["checks"]] == ["P10a", "P10b"] and report["passed"], report


SYNC_EVERY = 4


@pytest.fixture(scope="module", params=[0, 2], ids=["in-line", "overlap-2"])
def runner(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """digits (Adam inner steps, Nesterov outer steps every 4), 2 epochs of 20 steps on 2 ranks; the
    outer steps in line, or each all-reduce started 2 inner steps before (overlap_steps 2: sent after
    steps 2, 6, ..., 30, so the saves of steps 10 and 30 find one in flight)."""
    args = ["--config", DIGITS, *DILOCO, f"--trainer.strategy.init_args.sync_every={SYNC_EVERY}",
            f"--trainer.strategy.init_args.overlap_steps={request.param}", "--trainer.callbacks=[]"]  # fmt: skip
    fit = fit_runner(args, tmp_path_factory.mktemp("diloco"), epochs=2)
    fit.overlap_steps = request.param
    return fit


def diloco_part(root: Path) -> dict:
    return checkpoint_state.get(load_whole(root / "checkpoints" / "last.ckpt"), "diloco")


@pytest.mark.fault
@pytest.mark.distributed
def test_a_kill_between_two_outer_steps_resumes_bit_for_bit(runner) -> None:
    """kill -9 of rank 1 after step 31 (the last save at step 30: two inner steps after the outer step of
    step 28; with overlap, the all-reduce of step 32's outer step in flight at the save and at the kill),
    then `--ckpt_path last`: weights, optimizer, metrics, and every rank's replica, the anchor and the
    outer momentum as the uninterrupted run's."""
    case = Case("kill-rank1", "mid-epoch", epoch=1)
    outcome = runner.run(case)
    assert outcome.exact, outcome.detail or outcome
    log = (runner.workdir / f"{outcome.root.name}.log").read_text()
    assert "--ckpt_path last: resuming from" in log, log[-2000:]
    expected, actual = diloco_part(runner.baseline("default")), diloco_part(outcome.root)
    assert max_abs_diff(expected, actual) == 0.0
    assert len(actual["per_rank"]) == 2 and actual["inner_steps"] == 40


@pytest.mark.fault
@pytest.mark.distributed
def test_the_saved_state_between_outer_steps_holds_replicas_that_differ(runner, tmp_path: Path) -> None:
    """A max_steps stop at step 30 (mid-H): the checkpoint keeps both replicas, which differ, and the anchor
    of step 28 (with overlap, the exchange sent after step 30: its mean and each rank's parameters then);
    resumed on 3 ranks the run trains on, with the elastic notice and diloco's."""
    root = tmp_path / "elastic"
    log = tmp_path / "elastic.log"
    base = [*runner._args("default", root), "--trainer.max_epochs=2"]
    assert runner.run_command([*base, "--trainer.max_steps=30"], log, runner.timeout) == 0
    part = diloco_part(root)
    assert part["inner_steps"] == 30 and part["inner_steps"] % SYNC_EVERY
    first, second = (replica["parameters"] for replica in part["per_rank"])
    assert max_abs_diff(first, second) > 0
    if runner.overlap_steps:
        (pending,) = part["pending"]
        assert (
            pending["due"] == 32
            and pending["reduced"]
            and len(pending["flat"]) == sum(map(torch.numel, first.values()))
        )
        # Sent right after step 30's save point: each rank's parameters then are its parameters now.
        assert all(max_abs_diff(r["sent"], r["parameters"]) == 0 for r in part["per_rank"])
    else:
        assert part["pending"] == [] and part["per_rank"][0]["sent"] == {}
    code = runner.run_command([*base, "--trainer.devices=3", "--ckpt_path=last"], log, runner.timeout)
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert "resuming a 2-rank run on 3 ranks" in text and "diloco: the checkpoint holds 2 replicas" in text
    resumed = diloco_part(root)
    assert len(resumed["per_rank"]) == 3 and resumed["inner_steps"] > 30
    assert all(math.isfinite(float(tensor.abs().max())) for tensor in resumed["anchor"].values())


def test_diagnose_spreads_the_outer_step_over_its_steps_and_suggests_no_compression() -> None:
    """Every 10th step carries the outer all-reduce (300 ms); spread over the 10 it is 30 ms of a 40 ms
    step. DDP's trimming of the slowest tenth of steps would drop exactly those steps."""

    def records(communication_ms: float, outer_every: int | None) -> list[dict]:
        steps = [[0.010, 0.001, 0.008, 0.0, 0.001] for _ in range(43)]
        for index in range(3 + outer_every - 1 if outer_every else 43, 43, outer_every or 1):
            steps[index] = [0.010 + communication_ms / 1000, 0.001, 0.008, communication_ms / 1000, 0.001]
        base = {"host": "node", "world_size": 2, "gradient_bytes": 80_000, "num_workers": 0, "cpu_count": 2}
        return [{**base, "outer_every": outer_every, "rank": rank, "steps": steps} for rank in range(2)]

    report = verdict({"as_configured": records(300, 10), "batch_in_memory": records(300, 10),
                      "no_communication": records(0, None)})  # fmt: skip
    assert report["verdict"] == "communication-bound" and report["communication_cost"] == "outer step", report
    assert abs(report["shares"]["communication"] - 0.75) < 0.01, report["shares"]
    text = report["verdict_text"]
    assert "every 10 steps" in text and "sync_every" in text and "gradient_compression" not in text


@pytest.mark.slow  # two 2-rank fits, about 30 s here
@pytest.mark.distributed
def test_the_outer_step_is_the_only_collective_of_the_steps(tmp_path: Path) -> None:
    """digits at sync_every 10: 4 times the steps (per-rank batch 8 instead of 32: 158 steps instead of 40)
    make exactly the more outer all-reduces (15 outer steps instead of 4) and no more broadcasts: inner
    steps exchange nothing (and the replicas differ between outer steps: the test above)."""
    from tests.test_per_step_cost import collectives

    counts, outer_steps = {}, {}
    for batch_size in (32, 8):
        counts[batch_size] = collectives(tmp_path, batch_size, *DILOCO, "--trainer.strategy.init_args.sync_every=10")
        last = load_whole(tmp_path / str(batch_size) / "checkpoints" / "last.ckpt")
        outer_steps[batch_size] = last["global_step"] // 10
    few, many = counts[32], counts[8]
    assert outer_steps == {32: 4, 8: 15} and many["broadcast"] == few["broadcast"], (outer_steps, few, many)
    # The preemption check adds one small all-reduce per second of training, so allow a few.
    assert 11 <= many["all_reduce"] - few["all_reduce"] <= 11 + 3, (few, many)
