"""Fault tolerance across replica groups (torchft, issue 57; docs/fault_tolerance.md): a group killed
with kill -9 drops out while the others keep training, is started again and rejoins from a peer's
memory with the peers' weights; without a failure, 2 groups of 1 process equal `strategy: ddp` on
2 processes bit for bit; a whole-job kill resumes exactly with `--ckpt_path last`; bad input stops in
one line before any group starts."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml

from app.checkpoints.io import safe_load
from tests.fault.test_resume import assert_same_weights
from tests.helpers.run import BIN, REPO, clean_env, ddp_app, kill_job, start

pytestmark = [pytest.mark.fault, pytest.mark.distributed]

FT = ["--fault_tolerance.enabled=true", "--trainer.enable_progress_bar=false"]
DEFAULT_TIMEOUT_S = 10.0  # fault_tolerance.timeout_s's default


def story(root: Path, group: int) -> list[dict]:
    """A group's per-step record (app/parallel/ft_manager.py), one dict per line."""
    path = root / "fault_tolerance" / f"group_{group}.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().split("\n")
    return [json.loads(line) for line in lines[:-1]]  # the last piece: empty, or a line being written


def last_val_acc(root: Path) -> float:
    """The last validation accuracy group 0 logged (the run's metrics.csv)."""
    rows = list(csv.DictReader((root / "lightning_logs" / "version_0" / "metrics.csv").open()))
    return float([row for row in rows if row.get("val_acc")][-1]["val_acc"])


def fit_command(root: Path, *args: str, config: str | Path = "configs/digits.yaml") -> list[str]:
    return [str(BIN / "ddp-app"), "fit", "--config", str(config), f"--trainer.default_root_dir={root}", *args]


def digits_config(directory: Path, strategy: str, **init_args: object) -> Path:
    """configs/digits.yaml as it is (`ddp`), or with `strategy: fsdp` (FSDP2Strategy with `init_args`)."""
    if strategy == "ddp":
        return REPO / "configs" / "digits.yaml"
    from app.parity import write_variant

    config = yaml.safe_load((REPO / "configs" / "digits.yaml").read_text())
    fsdp = {"class_path": "app.parallel.fsdp.FSDP2Strategy", "init_args": init_args}
    return write_variant(config, directory / f"digits_fsdp{len(init_args)}.yaml", fsdp)


def net_weights(last: Path) -> dict:
    """The network's weights in a last.ckpt, one file or sharded (joined)."""
    from app.parity import last_weights

    return last_weights(last)


def assert_equal_weights(first: Path, second: Path) -> None:
    """Bit for bit, a checkpoint of one file or sharded."""
    expected, actual = net_weights(first), net_weights(second)
    assert expected.keys() == actual.keys()
    different = [key for key in expected if not torch.equal(expected[key], actual[key])]
    assert not different, f"weights differ, first: {different[0]}"


def global_step(last: Path) -> int:
    return int(safe_load(last / "meta.pt" if last.is_dir() else last)["global_step"])


def run_fit(root: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return ddp_app(*fit_command(root, *args)[1:], timeout=timeout)


def wait_for(condition, what: str, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        assert process.poll() is None, f"the run ended before {what}"
        time.sleep(0.01)
    raise AssertionError(f"no {what} within {timeout} s")


def test_a_killed_group_rejoins_while_the_others_keep_training(tmp_path: Path) -> None:
    root = tmp_path / "run"
    steps = 400
    args = ["--trainer.devices=3", f"--trainer.max_steps={steps}", "--trainer.max_epochs=100", *FT]
    uninterrupted = run_fit(tmp_path / "uninterrupted", *args)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    # Every group paced to 30 ms a step (numerics unchanged): the 350 steps after the kill outlast the restart
    # (the launcher waits out the lighthouse's heartbeat timeout first, docs/fault_tolerance.md), on any machine.
    paced = '--trainer.callbacks+={"class_path": "tests.helpers.user_callbacks.SleepOnRank", "init_args": {"rank": 0}}'
    command = fit_command(root, *args, paced)
    with open(tmp_path / "ft.log", "w") as log:
        process = start(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: any(entry["step"] >= 50 for entry in story(root, 2)), "step 50 of group 2", process)
        pid = next(entry["pid"] for entry in story(root, 2) if entry.get("start"))
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        process.wait(timeout=300)
    finally:
        kill_job(process.pid)
        process.wait()
    output = (tmp_path / "ft.log").read_text()
    assert process.returncode == 0, output[-4000:]
    assert "group 2 (pid" in output and "starting it again (1 of 3)" in output, output[-4000:]
    assert "quorum changed" in output, output[-4000:]
    assert output.count(" ended: ") == 3  # one story line per group, the restarted one included
    for group in (0, 1):  # the survivors never stopped: no gap between two steps beyond the timeout
        times = [entry["time"] for entry in story(root, group) if "step" in entry and "sent" not in entry]
        gaps = [later - earlier for earlier, later in zip(times, times[1:], strict=False)]
        assert max(gaps) < DEFAULT_TIMEOUT_S, f"group {group} stopped for {max(gaps):.1f} s"
        replicas = [entry["replicas"] for entry in story(root, group) if entry.get("time", 0) > killed_at]
        assert replicas[-1] == 3, replicas  # with group 2 again (without it until it was back, if it was slow)
        assert story(root, group)[-1]["step"] == steps
    # Group 2 rejoined from a peer's memory, with the weights the peer sent at that step.
    restarted = [entry for entry in story(root, 2) if entry.get("start")][1]
    assert restarted["step"] > 50
    sent = [entry for group in (0, 1) for entry in story(root, group) if entry.get("sent") == restarted["step"]]
    assert sent and all(entry["digest"] == restarted["digest"] for entry in sent), (restarted, sent)
    assert story(root, 2)[-1]["step"] == steps
    # The tracked metrics of group 0 (the run's logs) say over how many groups each step averaged.
    metrics = (root / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    assert "ft_replicas" in metrics[0].split(","), metrics[0]
    # Validation accuracy within 1% (a point) of the run that was never interrupted.
    assert abs(last_val_acc(root) - last_val_acc(tmp_path / "uninterrupted")) <= 0.01
    # Every group ends with the planned steps and the same weights.
    last = root / "checkpoints" / "last.ckpt"
    assert safe_load(last)["global_step"] == steps
    for group in (1, 2):
        assert_same_weights(last, root / "fault_tolerance" / f"group_{group}" / "checkpoints" / "last.ckpt")


def test_with_min_replicas_every_group_no_step_is_applied_without_one(tmp_path: Path) -> None:
    """`min_replicas: 2` of 2 groups: while group 1 is dead, group 0 waits for it instead of training
    alone; every applied step averaged over both, and both end with the same weights."""
    root = tmp_path / "run"
    args = [
        "--trainer.devices=2",
        "--trainer.max_steps=120",
        "--trainer.max_epochs=100",
        "--fault_tolerance.min_replicas=2",
    ]
    with open(tmp_path / "ft.log", "w") as log:
        process = start(fit_command(root, *args, *FT), stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: any(entry.get("step", 0) >= 40 for entry in story(root, 1)), "step 40 of group 1", process)
        os.kill(next(entry["pid"] for entry in story(root, 1) if entry.get("start")), signal.SIGKILL)
        process.wait(timeout=300)
    finally:
        kill_job(process.pid)
        process.wait()
    assert process.returncode == 0, (tmp_path / "ft.log").read_text()[-4000:]
    steps = [entry for entry in story(root, 0) if not entry.get("start") and "sent" not in entry]
    assert all(entry["replicas"] == 2 for entry in steps if entry["committed"]), steps
    assert steps[-1]["step"] == 120
    assert_same_weights(
        root / "checkpoints" / "last.ckpt", root / "fault_tolerance" / "group_1" / "checkpoints" / "last.ckpt"
    )


def test_a_lighthouse_given_by_address_serves_the_groups(tmp_path: Path) -> None:
    """`fault_tolerance.lighthouse`: the launcher starts none; the groups use the one given."""
    lighthouse = subprocess.Popen(
        [sys.executable, "-m", "app.cluster.lighthouse", "--min_replicas=1", "--join_timeout_ms=2000",
         "--heartbeat_timeout_ms=2000"],
        cwd=REPO, env=clean_env(RUST_LOG="warn"), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        address = lighthouse.stdout.readline().strip()
        result = run_fit(tmp_path / "run", "--trainer.devices=2", "--trainer.max_steps=10", *FT,
                         f"--fault_tolerance.lighthouse={address}")  # fmt: skip
    finally:
        lighthouse.stdin.close()
        lighthouse.wait(timeout=10)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"lighthouse at {address}" in result.stdout
    # Both groups in every quorum through the lighthouse given (a group that came late under load healed at its
    # first quorum and recorded the steps from there), to the last step.
    steps = [entry for entry in story(tmp_path / "run", 0) if not entry.get("start")]
    assert steps and all(entry["replicas"] == 2 for entry in steps) and steps[-1]["step"] == 10, steps


@pytest.mark.parametrize("accumulate", [1, 2], ids=["one-batch-per-step", "accumulating-2"])
def test_two_groups_without_a_failure_equal_ddp_bit_for_bit(tmp_path: Path, accumulate: int) -> None:
    """The sum of two gradients does not depend on its order, and torchft's (a + b) / 2 rounds as DDP's
    a / 2 + b / 2 (a division by 2 is exact): the weights are equal, bit for bit, the gradients sent in
    buckets during backward (with accumulation: only the backward that ends in an optimizer step)."""
    steps = [  # crosses an epoch end (20 batches)
        "--trainer.max_steps=25",
        f"--trainer.accumulate_grad_batches={accumulate}",
        "--trainer.enable_progress_bar=false",
    ]
    ddp = run_fit(tmp_path / "ddp", "--trainer.devices=2", *steps)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    ft = run_fit(tmp_path / "ft", "--trainer.devices=2", *steps, *FT, "--fault_tolerance.min_replicas=2")
    assert ft.returncode == 0, ft.stderr[-3000:]
    # Group 0 speaks for the run: one end-of-fit summary, naming the groups.
    assert ft.stdout.count("ddp-app: fit done") == 1 and "on 2 replica groups of 1 process(es)" in ft.stdout
    gradient_bytes = 4 * sum(
        tensor.numel() for tensor in net_weights(tmp_path / "ft" / "checkpoints" / "last.ckpt").values()
    )
    for group in (0, 1):  # one quorum per optimizer step, every one with both groups
        steps_taken = [entry for entry in story(tmp_path / "ft", group) if not entry.get("start")]
        assert [entry["step"] for entry in steps_taken] == list(range(1, 26))
        assert all(entry["replicas"] == 2 and entry["committed"] for entry in steps_taken)
        # Overlapped as DDP's: every bucket was started by backward's hooks, none after it.
        assert all(entry["buckets"][0] == entry["buckets"][1] >= 1 for entry in steps_taken), steps_taken
        assert all(entry["sent_bytes"] == gradient_bytes for entry in steps_taken), steps_taken  # the whole gradient
    assert_same_weights(tmp_path / "ddp" / "checkpoints" / "last.ckpt", tmp_path / "ft" / "checkpoints" / "last.ckpt")


GROUPS_OF_TWO = ["--trainer.devices=4", "--fault_tolerance.group_size=2", *FT]
# Another summation order of the gradients (docs/parity.md), as tests/fsdp/test_hybrid.py allows.
RELATIVE_TOLERANCE = 1e-5


def oversubscribed() -> dict[str, str]:
    return clean_env(DDP_APP_ALLOW_OVERSUBSCRIBE="1")  # 4 processes on this 2-core machine


def test_two_groups_of_two_without_a_failure_equal_ddp_on_four_within_rounding(tmp_path: Path) -> None:
    """2 groups of 2 processes (DDP within a group, torchft across): each process reads what the DDP rank
    of the same index reads, and the gradients are summed as (a/4 + b/4) + (c/4 + d/4) where DDP on 4
    processes sums the same four in gloo's order: the weights agree within rounding, and both groups
    end with the same weights bit for bit."""
    from app.parity import last_weights, relative_difference

    steps = ["--trainer.max_steps=25", "--trainer.enable_progress_bar=false"]  # crosses two epoch ends
    env = oversubscribed()
    ddp = ddp_app(*fit_command(tmp_path / "ddp", "--trainer.devices=4", *steps)[1:], env=env, timeout=300)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    ft = ddp_app(
        *fit_command(tmp_path / "ft", *GROUPS_OF_TWO, *steps, "--fault_tolerance.min_replicas=2")[1:],
        env=env,
        timeout=300,
    )
    assert ft.returncode == 0, ft.stderr[-3000:]
    assert "on 2 replica groups of 2 process(es)" in ft.stdout
    # Each process of a group sends half of the (same) gradient across the groups; its group all-gathers the halves.
    parameters = sum(tensor.numel() for tensor in net_weights(tmp_path / "ft" / "checkpoints" / "last.ckpt").values())
    for group in (0, 1):
        start_line, *steps_taken = story(tmp_path / "ft", group)
        assert len(start_line["pids"]) == 2  # both processes of the group trained
        assert [entry["step"] for entry in steps_taken] == list(range(1, 26))
        assert all(entry["replicas"] == 2 and entry["committed"] for entry in steps_taken), steps_taken
        assert all(entry["sent_bytes"] == 4 * -(-parameters // 2) for entry in steps_taken), steps_taken
    last = tmp_path / "ft" / "checkpoints" / "last.ckpt"
    assert_same_weights(last, tmp_path / "ft" / "fault_tolerance" / "group_1" / "checkpoints" / "last.ckpt")
    difference, detail = relative_difference(
        last_weights(tmp_path / "ddp" / "checkpoints" / "last.ckpt"), last_weights(last)
    )
    print(f"2 groups of 2 vs ddp on 4: {difference:.2e} of the largest weight")
    assert difference <= RELATIVE_TOLERANCE, detail


# About 55 s each under a CPU hog on this 2-core VM: the acceptance line's case (fsdp, both processes killed) stays in
# the default tier; the ddp case, one process killed, runs in the slow tier.
@pytest.mark.parametrize(
    ("strategy", "killed"),
    [
        pytest.param("ddp", [1], marks=pytest.mark.slow, id="ddp-one-process"),
        pytest.param("fsdp", [0, 1], id="fsdp-both-processes"),
    ],
)
def test_a_killed_group_of_two_restarts_whole_and_rejoins_while_the_other_keeps_training(
    tmp_path: Path, strategy: str, killed: list[int]
) -> None:
    """2 groups of 2 processes (DDP, or FSDP2 sharding within a group: HSDP): both processes of group 1
    killed -9 at step 50 of 600 (or only its rank 1: the launcher kills its rank 0); the launcher starts the
    group again as a whole (both processes, named as before), it heals from group 0 (each process from
    the process of the same rank: its shard under fsdp) and rejoins with its weights, while group 0
    never stops; the run ends with the planned steps, both groups with the same weights, and validation
    accuracy within 1% of an uninterrupted run."""
    root = tmp_path / "run"
    # 600 steps, not 300: the learning rate's schedule ends flat, so the steps group 1 missed weigh less in the
    # final accuracy. Under a CPU hog, ddp at 300 steps ended -0.0111 and -0.0074 from the uninterrupted run (one
    # failure of the 1% line in two); at 600, +0.0000 and -0.0037.
    steps = 600
    config = digits_config(tmp_path, strategy)
    args = [*GROUPS_OF_TWO, f"--trainer.max_steps={steps}", "--trainer.max_epochs=100"]
    env = oversubscribed()
    uninterrupted = ddp_app(*fit_command(tmp_path / "uninterrupted", *args, config=config)[1:], env=env, timeout=300)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    paced = '--trainer.callbacks+={"class_path": "tests.helpers.user_callbacks.SleepOnRank", "init_args": {"rank": 0}}'
    with open(tmp_path / "ft.log", "w") as log:
        process = start(fit_command(root, *args, paced, config=config), stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_for(lambda: any(entry["step"] >= 50 for entry in story(root, 1)), "step 50 of group 1", process)
        pids = next(entry["pids"] for entry in story(root, 1) if entry.get("start"))
        names = [Path(f"/proc/{pid}/comm").read_text().strip() for pid in pids]
        assert names == ["ddp-app rank 2", "ddp-app rank 3"], names
        killed_at = time.time()
        for rank in killed:
            os.kill(pids[rank], signal.SIGKILL)
        wait_for(lambda: len([entry for entry in story(root, 1) if entry.get("start")]) > 1, "group 1 back", process)
        restarted_pids = [entry for entry in story(root, 1) if entry.get("start")][1]["pids"]
        assert not set(restarted_pids) & set(pids), (pids, restarted_pids)  # both processes are new
        names = [Path(f"/proc/{pid}/comm").read_text().strip() for pid in restarted_pids]
        assert names == ["ddp-app rank 2", "ddp-app rank 3"], names
        assert not any(Path(f"/proc/{pid}").exists() for pid in pids), pids  # none of the old group is left
        process.wait(timeout=300)
    finally:
        kill_job(process.pid)
        process.wait()
    output = (tmp_path / "ft.log").read_text()
    assert process.returncode == 0, output[-4000:]
    assert output.count("starting it again (1 of 3)") == 1, output[-4000:]  # one restart: the group, not each process
    times = [entry["time"] for entry in story(root, 0) if "step" in entry and "sent" not in entry]
    gaps = [later - earlier for earlier, later in zip(times, times[1:], strict=False)]
    assert max(gaps) < DEFAULT_TIMEOUT_S, f"group 0 stopped for {max(gaps):.1f} s"
    replicas = [entry["replicas"] for entry in story(root, 0) if entry.get("time", 0) > killed_at]
    assert 1 in replicas and replicas[-1] == 2, replicas
    restarted = [entry for entry in story(root, 1) if entry.get("start")][1]
    assert restarted["step"] > 50
    sent = [entry for entry in story(root, 0) if entry.get("sent") == restarted["step"]]
    assert sent and sent[-1]["digest"] == restarted["digest"], (restarted, sent)
    assert story(root, 0)[-1]["step"] == story(root, 1)[-1]["step"] == steps
    assert abs(last_val_acc(root) - last_val_acc(tmp_path / "uninterrupted")) <= 0.01
    last = root / "checkpoints" / "last.ckpt"
    assert global_step(last) == steps
    assert_equal_weights(last, root / "fault_tolerance" / "group_1" / "checkpoints" / "last.ckpt")


def test_two_fsdp_groups_of_two_without_a_failure_equal_hybrid_sharding_2x2_bit_for_bit(tmp_path: Path) -> None:
    """`strategy: fsdp` in 2 groups of 2 processes (each group shards the model over its 2 processes,
    torchft averages each shard across the groups) against plain hybrid sharding, 2 replicas x 2 shards
    on 4 processes: the same reduce-scatter within a shard group, then a sum of two values across the
    replicas (which does not depend on its order) halved (exact), so the weights are equal bit for bit
    (the hybrid tests allow 1e-5 of the largest weight; none is needed)."""
    steps = ["--trainer.max_steps=25", "--trainer.enable_progress_bar=false"]
    env = oversubscribed()
    hybrid = digits_config(tmp_path, "fsdp", shard_group_size=2)
    plain = ddp_app(*fit_command(tmp_path / "hybrid", "--trainer.devices=4", *steps, config=hybrid)[1:], env=env)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert "sharded as 2 replicas x 2 shards" in plain.stdout
    groups = [*GROUPS_OF_TWO, *steps, "--fault_tolerance.min_replicas=2"]
    ft = ddp_app(*fit_command(tmp_path / "ft", *groups, config=digits_config(tmp_path, "fsdp"))[1:], env=env)
    assert ft.returncode == 0, ft.stderr[-3000:]
    assert "sharded as 1 replica x 2 shards" in ft.stdout and "on 2 replica groups of 2 process(es)" in ft.stdout
    for group in (0, 1):
        steps_taken = [entry for entry in story(tmp_path / "ft", group) if not entry.get("start")]
        assert [entry["step"] for entry in steps_taken] == list(range(1, 26))
        assert all(entry["replicas"] == 2 and entry["committed"] for entry in steps_taken), steps_taken
    last = tmp_path / "ft" / "checkpoints" / "last.ckpt"
    assert last.is_dir()  # sharded, as under strategy fsdp without fault tolerance
    assert_equal_weights(tmp_path / "hybrid" / "checkpoints" / "last.ckpt", last)
    assert_equal_weights(last, tmp_path / "ft" / "fault_tolerance" / "group_1" / "checkpoints" / "last.ckpt")


WHOLE_JOB = ["--trainer.devices=2", "--trainer.max_steps=60", "--last_checkpoint.every_n_steps=7", *FT]


@pytest.fixture(scope="module")
def uninterrupted_two_groups(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The last.ckpt of 2 groups trained 60 steps without a failure (last.ckpt every 7 steps)."""
    root = tmp_path_factory.mktemp("ft-uninterrupted") / "run"
    full = run_fit(root, *WHOLE_JOB)
    assert full.returncode == 0, full.stderr[-3000:]
    return root / "checkpoints" / "last.ckpt"


def kill_at_step_30(tmp_path: Path, root: Path, kill: Callable[[subprocess.Popen], None]) -> subprocess.Popen:
    with open(tmp_path / "killed.log", "w") as log:
        process = start(fit_command(root, *WHOLE_JOB), stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: any(entry.get("step", 0) >= 30 for entry in story(root, 1)), "step 30", process)
        kill(process)
        process.wait(timeout=300)
    finally:
        kill_job(process.pid)
        process.wait()
    return process


def test_a_whole_job_killed_resumes_exactly_with_ckpt_path_last(uninterrupted_two_groups: Path, tmp_path: Path) -> None:
    """kill -9 of every process (the launcher, the lighthouse, every group), then `--ckpt_path last`:
    the same weights as the run that was never stopped."""
    root = tmp_path / "killed"
    kill_at_step_30(tmp_path, root, lambda process: kill_job(process.pid))
    assert safe_load(root / "checkpoints" / "last.ckpt")["global_step"] < 60
    resumed = run_fit(root, *WHOLE_JOB, "--ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(uninterrupted_two_groups, root / "checkpoints" / "last.ckpt")


def test_every_group_killed_at_once_is_started_again_and_ends_exactly(
    uninterrupted_two_groups: Path, tmp_path: Path
) -> None:
    """Every group's process killed -9 together (the launcher lives): with no peer to heal from, each
    group resumes from its own last.ckpt, and the run ends as the uninterrupted one."""
    root = tmp_path / "killed"

    def kill_every_group(process: subprocess.Popen) -> None:
        for group in (0, 1):
            os.kill(next(entry["pid"] for entry in story(root, group) if entry.get("start")), signal.SIGKILL)

    process = kill_at_step_30(tmp_path, root, kill_every_group)
    output = (tmp_path / "killed.log").read_text()
    assert process.returncode == 0, output[-4000:]
    assert output.count("starting it again (1 of 3)") == 2, output[-4000:]
    assert_same_weights(uninterrupted_two_groups, root / "checkpoints" / "last.ckpt")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--trainer.devices=3", "--fault_tolerance.group_size=2"], "fault_tolerance.group_size=2 does not divide"),
        (["--trainer.devices=2", "--trainer.strategy=fsdp"], "a group of one process has nothing to shard with"),
        (["--trainer.devices=2", "--trainer.strategy=diloco"], "serves DDP and FSDP (sharded within a group) only"),
        (
            [
                "--trainer.devices=4",
                "--fault_tolerance.group_size=2",
                "--trainer.strategy=app.parallel.fsdp.FSDP2Strategy",
                "--trainer.strategy.init_args.shard_group_size=4",
            ],
            "does not divide a group's 2 ranks",
        ),  # fmt: skip
        (["--trainer.devices=2", "--fault_tolerance.lighthouse=http://127.0.0.1:9"], "does not answer"),
        (["--trainer.devices=1"], "fault tolerance needs at least 2"),
    ],
    ids=["group-size", "fsdp-one-process", "strategy", "fsdp-shards-beyond-a-group", "lighthouse", "one-group"],
)
def test_bad_input_stops_in_one_line_before_any_group(tmp_path: Path, args: list[str], expected: str) -> None:
    result = run_fit(tmp_path / "run", *args, *FT, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("ddp-app: error:")]
    assert len(lines) == 1 and expected in lines[0] and "Fix:" in lines[0], result.stderr[-2000:]
    assert not (tmp_path / "run" / "fault_tolerance").exists()  # no group started


def test_the_state_a_peer_sends_at_an_epochs_last_step_resumes_exactly(tmp_path: Path) -> None:
    """What a healing group receives is `dump_checkpoint` at a step's end (tests/helpers/dump_at.py takes
    it where app/parallel/ft_manager.py does); at the epoch's last batch (digits on one process: 40 per
    epoch), before validation and the epoch-end hooks, a fit resumed from it ends as the uninterrupted one."""
    one = [
        "--trainer.devices=1",
        "--trainer.strategy=auto",
        "--trainer.max_steps=50",
        "--trainer.enable_progress_bar=false",
    ]
    dump = tmp_path / "sent.ckpt"
    dumper = ["--trainer.callbacks+=tests.helpers.dump_at.DumpAt", "--trainer.callbacks.init_args.step=40"]
    full = run_fit(tmp_path / "full", *one, *dumper, f"--trainer.callbacks.init_args.path={dump}")
    assert full.returncode == 0, full.stderr[-3000:]
    resumed = run_fit(tmp_path / "resumed", *one, f"--ckpt_path={dump}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(
        tmp_path / "full" / "checkpoints" / "last.ckpt", tmp_path / "resumed" / "checkpoints" / "last.ckpt"
    )


def test_each_group_reads_its_own_shard_and_together_the_whole_set() -> None:
    """Step by step, the groups' samplers are the DDP ranks' of the same index: no two groups read
    the same sample in a step, and together they read each sample once per epoch."""
    from app.data.samplers import ResumableDistributedSampler
    from app.parallel.fault_tolerance import GROUP_VARIABLE, GROUPS_VARIABLE, training_shard

    dataset = list(range(100))
    shards = []
    for group in range(3):
        world_size, rank = training_shard(1, 0, {GROUP_VARIABLE: str(group), GROUPS_VARIABLE: "3"})
        assert (world_size, rank) == (3, group)
        shards.append(list(ResumableDistributedSampler(dataset, world_size, rank, True, 42, 4)))
    ddp = [list(ResumableDistributedSampler(dataset, 3, rank, True, 42, 4)) for rank in range(3)]
    assert shards == ddp
    for step in range(len(shards[0]) // 4):
        batches = [set(shard[step * 4 : step * 4 + 4]) for shard in shards]
        assert not (batches[0] & batches[1] or batches[0] & batches[2] or batches[1] & batches[2])
    assert {index for shard in shards for index in shard} == set(dataset)  # padded to equal shards, as DDP


BLOCK_TORCHFT = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torchft" or name.startswith("torchft."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None
sys.meta_path.insert(0, Block())
from app.__main__ import main
main()
"""


def test_without_torchft_one_line_says_how_to_install_it(tmp_path: Path) -> None:
    """An environment where `import torchft` fails, as it does where the `ft` extra is not installed."""
    command = [sys.executable, "-c", BLOCK_TORCHFT, *fit_command(tmp_path / "run", "--trainer.devices=2", *FT)[1:]]
    result = subprocess.run(command, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith("ddp-app: error: fault_tolerance.enabled: true needs")
    assert "pip install" in result.stderr and "[ft]" in result.stderr


def test_the_fault_tolerance_doc_quotes_the_recovery_figures() -> None:
    """docs/fault_tolerance.md's row is docs/recovery.json's `torchft` entry (python -m app.bench.recovery)."""
    figures = json.loads((REPO / "docs" / "recovery.json").read_text())["torchft"]

    def cell(values: dict, unit: str, form: str) -> str:
        return f"{values['median']:{form}}{unit} ({values['min']:{form}} to {values['max']:{form}})"

    row = (
        f"| torchft, 2 groups of 1 process | {cell(figures['recovery_s'], ' s', '.1f')} "
        f"| {cell(figures['steps_redone'], '', 'g')} | {cell(figures['others_stall_s'], ' s', '.1f')} |"
    )
    lines = [line.strip() for line in (REPO / "docs" / "fault_tolerance.md").read_text().splitlines()]
    assert row in lines, row


def test_the_fault_tolerance_doc_quotes_the_per_step_cost() -> None:
    """docs/fault_tolerance.md's per-step cost is docs/bench_ft_overhead.json (python -m app.bench.ft_overhead),
    and what overlapping the all-reduce with backward saved is docs/bench_ft_overlap.json."""
    figures = json.loads((REPO / "docs" / "bench_ft_overhead.json").read_text())
    median, loads = figures["median_step_ms"], figures["loadavg_before_after"]
    text = " ".join((REPO / "docs" / "fault_tolerance.md").read_text().split())
    assert (
        f"{median['ddp']:.1f} ms under `strategy: ddp` and {median['torchft']:.1f} ms as 2 replica groups "
        f"({figures['overhead_pct']:+.1f}%)"
    ) in text
    assert f"(load average {min(loads):.1f} to {max(loads):.1f})" in text
    assert figures["overhead_pct"] == round(100 * (median["torchft"] / median["ddp"] - 1), 1)
    paired = figures["paired_overhead_pct"]  # the spread the figure is read against
    assert (
        f"ranges from {min(paired):+.1f}% to {max(paired):+.1f}% (median {figures['median_paired_overhead_pct']:+.1f}%)"
    ) in text
    overlap = json.loads((REPO / "docs" / "bench_ft_overlap.json").read_text())["median_allreduce_ms"]
    assert f"{overlap['before']:.1f} ms before and {overlap['after']:.1f} ms after" in text


def test_a_group_that_ends_to_heal_exits_with_a_code_its_launcher_restarts() -> None:
    from app.cluster.exit_codes import PEER_LOST_EXIT_CODE
    from app.cluster.launch import worth_a_restart
    from app.parallel.ft_manager import RESTART_TO_HEAL_EXIT_CODE

    assert RESTART_TO_HEAL_EXIT_CODE == PEER_LOST_EXIT_CODE and worth_a_restart(RESTART_TO_HEAL_EXIT_CODE)


def test_the_fault_tolerance_doc_quotes_the_throughput_under_failures() -> None:
    """docs/fault_tolerance.md's table is docs/bench_ft_throughput.json (python -m app.bench.ft_throughput), each
    ratio that run's samples per second over its baseline's."""
    figures = json.loads((REPO / "docs" / "bench_ft_throughput.json").read_text())
    lines = [line.strip() for line in (REPO / "docs" / "fault_tolerance.md").read_text().splitlines()]
    for path, baseline in (("torchft", "torchft-nofail"), ("ddp-app", "ddp-nofail"), ("torchrun", "ddp-nofail")):
        run = figures[path]
        ratio = run["samples_per_s"] / figures[baseline]["samples_per_s"]
        assert run[f"of_{baseline}"] == ratio and run["kills"] >= 3, (path, run)
        cells = f"| {run['samples_per_s']:.0f} | {run['kills']} | {ratio:.2f} of {baseline} | {run['load_after']:.1f} |"
        assert any(line.endswith(cells) for line in lines), cells
    text = " ".join(lines)
    assert f"torchft kept {figures['torchft']['of_torchft-nofail']:.2f} of its throughput" in text
    before = figures["torchft-joined-before-fit"]  # a restarted group joined before fit: its setup paused the others
    assert f"it kept {before['of_torchft-nofail']:.2f} ({before['samples_per_s']:.0f} against" in text
