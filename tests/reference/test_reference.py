"""The reference trainer on its own: launchers, snapshots, model parallelism."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from app.cluster.slurm_env import expand_hostlist, first_host, job_master_port, master_address_and_port
from tests.helpers.run import clean_env, run

pytestmark = pytest.mark.distributed


def reference(*args: str, timeout: float = 240, env: dict[str, str] | None = None):
    return run([sys.executable, "-m", "app.reference", *args], timeout=timeout, env=env)


@pytest.mark.slow  # about 45 s; the snapshot resume on another number of ranks below continues a run as well
def test_snapshot_resume_equals_uninterrupted_run(tmp_path: Path) -> None:
    """Rank-0 snapshot + barrier + map_location load: 2 epochs, then 1 more, equals 3 at once."""
    straight = reference("--config", "configs/toy.yaml", "--epochs", "3", "--out", str(tmp_path / "a"))
    assert straight.returncode == 0, straight.stderr[-2000:]
    first = reference("--config", "configs/toy.yaml", "--epochs", "2", "--out", str(tmp_path / "b"))
    assert first.returncode == 0, first.stderr[-2000:]
    resumed = reference("--config", "configs/toy.yaml", "--epochs", "3", "--out", str(tmp_path / "b"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "Resuming training from snapshot at epoch 2" in resumed.stdout
    expected = torch.load(tmp_path / "a" / "final.pt", weights_only=True)
    actual = torch.load(tmp_path / "b" / "final.pt", weights_only=True)
    assert all(torch.equal(expected[key], actual[key]) for key in expected)


def test_a_snapshot_continued_on_another_number_of_ranks_keeps_the_run(tmp_path: Path) -> None:
    """2 epochs on 2 ranks, 1 more on 3 (the global batch split 22+21+21, losses weighted): within
    1e-5 of the largest weight of 3 epochs on 2 ranks, as ddp-app's elastic resume (parity P8)."""
    toy = ("--config", "configs/toy.yaml")
    straight = reference(*toy, "--epochs", "3", "--out", str(tmp_path / "a"))
    assert straight.returncode == 0, straight.stderr[-2000:]
    first = reference(*toy, "--epochs", "2", "--out", str(tmp_path / "b"))
    assert first.returncode == 0, first.stderr[-2000:]
    elastic = reference(*toy, "--epochs", "3", "--out", str(tmp_path / "b"), "--world-size", "3",
                        env=clean_env(DDP_APP_ALLOW_OVERSUBSCRIBE="1"))  # fmt: skip
    assert elastic.returncode == 0, elastic.stderr[-2000:]
    assert "Resuming a 2-rank run on 3 ranks: global micro-batch" in elastic.stdout, elastic.stdout[-2000:]
    expected = torch.load(tmp_path / "a" / "final.pt", weights_only=True)
    actual = torch.load(tmp_path / "b" / "final.pt", weights_only=True)
    scale = max(float(tensor.abs().max()) for tensor in expected.values())
    assert max(float((expected[key] - actual[key]).abs().max()) for key in expected) <= 1e-5 * scale
    assert any(not torch.equal(expected[key], actual[key]) for key in expected)  # 3 ranks did run


def test_model_parallel_halves_train_like_the_single_device_model(tmp_path: Path) -> None:
    """ToyMpModel (two halves, DDP without device_ids) == ToyModel: same init, data and updates."""
    plain = reference("--config", "configs/toy.yaml", "--epochs", "2", "--out", str(tmp_path / "plain"))
    assert plain.returncode == 0, plain.stderr[-2000:]
    split = reference(
        "--config", "configs/toy.yaml", "--epochs", "2", "--out", str(tmp_path / "mp"), "--model-parallel"
    )
    assert split.returncode == 0, split.stderr[-2000:]
    expected = torch.load(tmp_path / "plain" / "final.pt", weights_only=True)
    actual = torch.load(tmp_path / "mp" / "final.pt", weights_only=True)
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[key], actual[key]) for key in expected)


def test_model_parallel_refuses_other_models(tmp_path: Path) -> None:
    result = reference("--config", "configs/digits.yaml", "--out", str(tmp_path), "--model-parallel")
    assert result.returncode != 0
    assert "ToyRegressor" in result.stderr


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("node1", ["node1"]),
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("gpu[01-02,10],login", ["gpu01", "gpu02", "gpu10", "login"]),
    ],
)
def test_hostlist_expansion(hostlist: str, hosts: list[str]) -> None:
    assert expand_hostlist(hostlist) == hosts
    assert first_host(hostlist) == hosts[0]


def test_master_port_is_per_job_and_overridable() -> None:
    # Lightning's 15000 + id % 10000 gives these two jobs the same port; ours does not.
    assert job_master_port("1234567") != job_master_port("1244567")
    assert 10000 <= job_master_port("42") <= 32767
    env = {"SLURM_JOB_NODELIST": "n[3-4]", "SLURM_JOB_ID": "77"}
    assert master_address_and_port(env) == ("n3", job_master_port("77"))
    assert master_address_and_port({**env, "MASTER_PORT": "29999"}) == ("n3", 29999)
