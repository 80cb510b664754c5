"""A user's training stream (an IterableDataset that shards itself) resumes exactly when it has
state_dict/load_state_dict, saved per rank at the last trained batch; one that cannot be positioned
is named in one line at fit start, and a stateful one read by loader workers does on resume what
that line says."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, get_worker_info

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


class WorkerShardedStream(IterableDataset):
    """A user's stream done right for loader workers: each rank, then each worker, takes its own share
    of the samples (`get_worker_info`); it yields (input, sample index) and keeps its position."""

    def __init__(self, samples: int, sized: bool) -> None:
        self.inputs = torch.randn(samples, 4, generator=torch.Generator().manual_seed(0))
        self.sized = sized
        self.position = 0

    def _rank_share(self) -> range:
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        return range(rank, len(self.inputs), world)

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("a stream without length")
        return len(self._rank_share())

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        info = get_worker_info()
        share = list(self._rank_share())[info.id :: info.num_workers] if info else list(self._rank_share())
        if self.position >= len(share):
            self.position = 0
        while self.position < len(share):
            index = share[self.position]
            self.position += 1
            yield self.inputs[index], index

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


class WorkerStreamData(L.LightningDataModule):
    def __init__(self, sized: bool = True) -> None:
        super().__init__()
        self.sized = sized

    def setup(self, stage: str) -> None:
        self.train_set = WorkerShardedStream(96, self.sized)  # 48 per rank: 12 batches of 4
        inputs = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
        self.val_set = TensorDataset(inputs, torch.arange(8))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=4, num_workers=2)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=4)


class RecordingNet(L.LightningModule):
    """Appends each training batch's sample indices to `<default_root_dir>/trained-rank<R>.txt`."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, indices = batch
        record = Path(self.trainer.default_root_dir) / f"trained-rank{self.global_rank}.txt"
        with record.open("a") as file:
            file.write(f"{self.current_epoch} {' '.join(map(str, indices.tolist()))}\n")
        return self.body(inputs).square().mean()

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        pass

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("sized", [True, False], ids=["sized", "unsized"])
def test_a_stateful_stream_in_loader_workers_resumed_mid_epoch_does_what_the_notice_says(
    tmp_path: Path, sized: bool
) -> None:
    """2 ranks, 2 workers each, stopped after 5 of the epoch's 12 steps (max_steps) and resumed: the
    resumed epoch starts its stream over, so its first 5 batches are trained twice, and (sized) its
    last 5 are left out, or (unsized) it runs 5 steps longer; the next epoch is whole. The line at
    fit start says so, and what to use instead."""
    common = [
        "fit", f"--model={__name__}.RecordingNet", f"--data={__name__}.WorkerStreamData",
        f"--data.init_args.sized={str(sized).lower()}", "--trainer.devices=2", "--trainer.accelerator=cpu",
        f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false", "--seed_everything=3",
    ]  # fmt: skip
    for extra in (["--trainer.max_steps=5"], ["--trainer.max_epochs=2", "--ckpt_path=last"]):
        result = ddp_app(*common, *extra, timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
        notices = [line for line in result.stderr.splitlines() if "runs in 2 loader workers" in line]
        assert len(notices) == 1, result.stderr[-3000:]
    notice = notices[0]
    assert notice.startswith("ddp-app: the training stream WorkerShardedStream runs in 2 loader workers")
    assert "num_workers: 0" in notice and "map-style Dataset" in notice and "python -m app.data.shard" in notice
    for rank in (0, 1):
        batches = [line.split() for line in (tmp_path / f"trained-rank{rank}.txt").read_text().splitlines()]
        first = [batch[1:] for batch in batches if batch[0] == "0"]
        second = [batch[1:] for batch in batches if batch[0] == "1"]
        assert len(second) == 12 and sorted(int(index) for batch in second for index in batch) == list(
            range(rank, 96, 2)
        )
        stopped, resumed = first[:5], first[5:]
        assert stopped == second[:5]  # the interrupted epoch ran as an epoch does
        if sized:
            assert "its last N are left out of that epoch" in notice
            assert resumed == second[:7]  # 5 trained again, then 2 new, and the last 5 never
        else:
            assert "N steps more than the uninterrupted run" in notice
            assert resumed == second  # 5 trained again, then the whole epoch
