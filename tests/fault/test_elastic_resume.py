"""Elastic resume: a run stopped mid-epoch continues on another number of ranks with the same global
batch, the same sample order and the same optimizer steps per epoch, and ends within float rounding
of the uninterrupted run (models without BatchNorm or dropout: docs/resume.md says why)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from app.bench.recovery import clock_arguments, kill_rank
from app.bench.recovery import wait_for_step as wait_for_clock_step
from app.checkpoints.io import safe_load
from app.resume.position import saved_position
from tests.helpers.ports import unused_port
from tests.helpers.run import BIN, REPO, clean_env, ddp_app, kill_job

pytestmark = [pytest.mark.fault, pytest.mark.distributed]

TOLERANCE = 1e-5  # relative max |diff| of the weights, fp32
DIGITS = ["--config", "configs/digits.yaml", "--trainer.max_epochs=2"]  # 20 steps per epoch at 2 x 32
CNN = [
    "--config",
    "configs/bench_cnn.yaml",
    "--trainer.max_epochs=2",
    "--model.init_args.dropout=false",
    "--data.init_args.train_size=640",
    "--data.init_args.eval_size=64",
    "--data.init_args.batch_size=16",
    # In float64: in float32 the other summation order's rounding (1e-7) sooner or later flips a
    # ReLU/max-pool decision of this CNN (a conv2 output of 3.7e-8 vs -3.7e-9 at step 76 of the
    # 1 -> 2 resume on one machine), and the runs then drift apart step after step (4.4e-5 at
    # step 80; 1.7e-2 for a resume at step 5). The sample order and the loss weighting are what is
    # tested, and in float64 they leave the weights within 1e-15, far from the kinks.
    "--trainer.precision=64-true",
]  # fmt: skip  (20 steps per epoch at 2 x 16)
# A user's own LightningModule and LightningDataModule (examples/custom: its own DataLoaders, which
# ddp-app shards; `train_loss` logged every step with `prog_bar=True`), without its dropout.
CUSTOM = ["--config", "examples/custom/config.yaml", "--trainer.max_epochs=2", "--model.init_args.dropout=0.0"]
QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]


def env() -> dict[str, str]:
    return clean_env(DDP_APP_ALLOW_OVERSUBSCRIBE="1")  # 3 and 4 ranks on a 2-core machine


def fit(root: Path, args: list[str], *extra: str) -> str:
    result = ddp_app("fit", *args, *QUIET, f"--trainer.default_root_dir={root}", *extra, timeout=600, env=env())
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stderr


def relative_difference(expected: dict, actual: dict) -> float:
    return max(
        float((expected[name].double() - actual[name].double()).abs().max() / expected[name].double().abs().max())
        for name in expected
        if expected[name].is_floating_point()
    )


UNINTERRUPTED = {  # workload: (arguments, ranks)
    "digits": (DIGITS, 2), "cnn": (CNN, 2), "digits-1": (DIGITS, 1), "cnn-1": (CNN, 1), "custom": (CUSTOM, 2)
}  # fmt: skip


class UninterruptedRuns:
    """Each workload's uninterrupted run, trained the first time a test asks for it (the default run
    selects a few of the cases below and so trains only their workloads)."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.tmp_path_factory, self.roots = tmp_path_factory, {}

    def __getitem__(self, workload: str) -> Path:
        if workload not in self.roots:
            args, devices = UNINTERRUPTED[workload]
            root = self.tmp_path_factory.mktemp(f"uninterrupted-{workload}")
            fit(root, args, f"--trainer.devices={devices}")
            self.roots[workload] = root
        return self.roots[workload]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> UninterruptedRuns:
    return UninterruptedRuns(tmp_path_factory)


def stopped(root: Path, args: list[str], devices: int) -> None:
    """Stopped by a max_steps budget in the middle of epoch 1 (step 30 of 40; of the custom
    example's 32, batch 14 of 16)."""
    fit(root, args, f"--trainer.devices={devices}", "--trainer.max_steps=30")


@pytest.mark.parametrize(
    "workload, started, resumed",
    [
        # The default run: more ranks with uneven shares, on a user's own module. Fewer ranks is the
        # torchrun elastic round's test; both directions of every workload are in the slow tier.
        ("custom", 2, 3),
        pytest.param("digits", 2, 1, marks=pytest.mark.slow),
        pytest.param("cnn", 2, 3, marks=pytest.mark.slow),
        # The rest of the cover (slow tier): each workload both ways, and 4 ranks.
        pytest.param("digits", 2, 3, marks=pytest.mark.slow),
        pytest.param("digits", 2, 4, marks=pytest.mark.slow),
        pytest.param("digits-1", 1, 2, marks=pytest.mark.slow),
        pytest.param("cnn", 2, 1, marks=pytest.mark.slow),
        pytest.param("cnn", 2, 4, marks=pytest.mark.slow),
        pytest.param("cnn-1", 1, 2, marks=pytest.mark.slow),
    ],  # fmt: skip
)
def test_a_run_resumed_on_another_number_of_ranks_matches_the_uninterrupted_run(
    uninterrupted: UninterruptedRuns, tmp_path: Path, workload: str, started: int, resumed: int
) -> None:
    args = UNINTERRUPTED[workload][0]
    stopped(tmp_path, args, started)
    stderr = fit(tmp_path, args, f"--trainer.devices={resumed}", "--ckpt_path=last")
    expected = safe_load(uninterrupted[workload] / "checkpoints" / "last.ckpt")
    actual = safe_load(tmp_path / "checkpoints" / "last.ckpt")
    assert actual["global_step"] == expected["global_step"]
    assert saved_position(actual)["batches_per_epoch"] == saved_position(expected)["batches_per_epoch"]
    assert saved_position(actual)["global_batch_size"] == saved_position(expected)["global_batch_size"]
    assert relative_difference(expected["state_dict"], actual["state_dict"]) <= TOLERANCE
    global_batch = saved_position(expected)["global_batch_size"]
    line = f"ddp-app: resuming a {started}-rank run on {resumed} ranks: global batch {global_batch} kept ("
    assert line in stderr and "sample order kept" in stderr, stderr[-3000:]


def refused_resume(tmp_path: Path, args: list[str], devices: int, *extra: str) -> str:
    """`--ckpt_path last` on `devices` ranks must stop in one line (no traceback); its stderr."""
    result = ddp_app("fit", *args, *QUIET, f"--trainer.default_root_dir={tmp_path}", f"--trainer.devices={devices}",
                     *extra, "--ckpt_path=last", timeout=300, env=env())  # fmt: skip
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.stderr


def test_a_global_batch_too_small_for_the_ranks_is_one_line(tmp_path: Path) -> None:
    args = [*DIGITS, "--data.init_args.batch_size=1"]
    fit(tmp_path, args, "--trainer.devices=2", "--trainer.max_steps=3")
    stderr = refused_resume(tmp_path, args, 3)
    assert "cannot be split over 3 ranks" in stderr and "Fix: resume on at most 2 ranks" in stderr
    assert "or accept a new global batch knowingly: --exact_resume.global_batch_size N (at least 3" in stderr


def test_a_new_global_batch_accepted_knowingly_keeps_the_sample_order(tmp_path: Path) -> None:
    """Stopped at step 30 (epoch 1 after 10 batches of 64: 640 samples), resumed on 3 ranks with a
    global batch of 96: the epoch continues at sample 576 (6 x 96; 64 samples read again)."""
    stopped(tmp_path, DIGITS, 2)
    stderr = fit(tmp_path, DIGITS, "--trainer.devices=3", "--exact_resume.global_batch_size=96", "--ckpt_path=last")
    final = safe_load(tmp_path / "checkpoints" / "last.ckpt")
    position = saved_position(final)
    padded = -(-position["dataset_length"] // 2) * 2
    per_epoch = -(-padded // 96)
    line = (
        "ddp-app: resuming a 2-rank run on 3 ranks with global batch 96 instead of 64 (exact_resume.global_batch_size;"
        f" 32+32+32 per micro-step): sample order kept, continuing at sample 576 of epoch 1 (64 trained samples read "
        f"again); {per_epoch} batches per epoch instead of 20"
    )
    assert line in stderr, stderr[-3000:]
    assert position["global_batch_size"] == 96 and position["batches_per_epoch"] == per_epoch
    assert final["global_step"] == 30 + per_epoch - 6  # the rest of epoch 1 in batches of 96
    # Accepted once, the new global batch is the run's: a later resume keeps it without the key.
    stderr = fit(tmp_path, DIGITS, "--trainer.max_epochs=3", "--trainer.devices=2", "--ckpt_path=last")
    assert "ddp-app: resuming a 3-rank run on 2 ranks: global batch 96 kept (48+48 per micro-step)" in stderr
    assert safe_load(tmp_path / "checkpoints" / "last.ckpt")["global_step"] == 30 + 2 * per_epoch - 6


def test_elastic_false_refuses_another_number_of_ranks(tmp_path: Path) -> None:
    stopped(tmp_path, DIGITS, 2)
    assert "exact_resume.elastic is false" in refused_resume(tmp_path, DIGITS, 1, "--exact_resume.elastic=false")


def test_a_changed_per_rank_batch_is_refused_with_the_fix(tmp_path: Path) -> None:
    stopped(tmp_path, DIGITS, 2)
    assert "per-rank batch_size 32 -> 64" in refused_resume(tmp_path, DIGITS, 1, "--data.init_args.batch_size=64")


def wait_for_port(endpoint: str, process: subprocess.Popen, timeout: float = 60) -> None:
    host, port = endpoint.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=1):
            return
        time.sleep(0.05)
    raise AssertionError(f"the rendezvous at {endpoint} did not open")


def test_a_torchrun_elastic_round_with_fewer_workers_continues_the_run(
    uninterrupted: UninterruptedRuns, tmp_path: Path
) -> None:
    """torchrun --nnodes=1:2 with two agents (one rank each, as on two nodes); one agent dies with its
    rank mid-epoch, the other's restart round has one worker, which resumes the 2-rank run elastically."""
    clock = tmp_path / "clock.txt"
    endpoint = f"127.0.0.1:{unused_port()}"
    command = [
        str(BIN / "torchrun"), "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=1", "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}", "--rdzv-id=elastic", "--rdzv-conf=last_call_timeout=5",
        "-m", "app", "fit", *DIGITS, *QUIET, f"--trainer.default_root_dir={tmp_path / 'run'}",
        "--trainer.devices=1", "--trainer.num_nodes=2", "--last_checkpoint.every_n_steps=5", "--ckpt_path", "last",
        *clock_arguments(clock),
    ]  # fmt: skip
    environment = env()  # one JOB_TAG for both agents: kill_job ends both
    agents = []
    try:
        for node in range(2):  # agent 0 first: it hosts the rendezvous store, and it is the one that survives
            with open(tmp_path / f"agent{node}.log", "w") as log:
                agents.append(subprocess.Popen(command, cwd=REPO, env=environment, stdout=log,
                                               stderr=subprocess.STDOUT, start_new_session=True))  # fmt: skip
            if node == 0:
                wait_for_port(endpoint, agents[0])
        wait_for_clock_step(clock, 25, lambda: all(agent.poll() is None for agent in agents))
        os.killpg(agents[1].pid, signal.SIGKILL)  # the node is gone: its agent, then its rank (own session)
        kill_rank(clock, 1)
        agents[0].wait(timeout=300)
    finally:
        for agent in agents:
            kill_job(agent.pid)
            agent.wait()
    output = (tmp_path / "agent0.log").read_text()
    assert agents[0].returncode == 0, output[-4000:]
    assert "ddp-app: torchrun started 1 node(s); trainer.num_nodes 2 -> 1" in output, output[-4000:]
    assert "ddp-app: resuming a 2-rank run on 1 ranks: global batch 64 kept (64 per micro-step)" in output
    expected = safe_load(uninterrupted["digits"] / "checkpoints" / "last.ckpt")
    actual = safe_load(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert actual["global_step"] == expected["global_step"]
    assert relative_difference(expected["state_dict"], actual["state_dict"]) <= TOLERANCE
