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

from app.cli.resume_check import Case, Runner
from app.data.positioned_streams import WorkerPositionedStream
from app.errors import ResumeError
from tests.helpers.run import ddp_app, fit_runner

pytestmark = [pytest.mark.fault, pytest.mark.distributed]

CONFIG = ["--config", "tests/helpers/stream.yaml"]
# A user's callback that draws from torch's generator at each epoch start: a resume at an epoch's start
# draws the same.
DRAWS = '--trainer.callbacks+={"class_path": "tests.helpers.user_callbacks.DrawsAtEpochStart"}'
VARIANTS = {"sized": [DRAWS], "unsized": ["--data.init_args.sized=false", DRAWS]}
CASES = [
    pytest.param(Case("kill-rank1", "mid-epoch", variant="sized", epoch=1), id="sized-kill-mid-epoch"),
    pytest.param(Case("kill-rank1", "mid-epoch", variant="unsized", epoch=1), id="unsized-kill-mid-epoch"),
    # At the epoch's end (the first hook that knows an unsized stream ran out): the resume starts the
    # next epoch. It once differed from the next epoch's first step on: starting the stream's iterator
    # drew a seed from torch's generator after the uninterrupted run's save but before the resumed
    # run's restore, and the restore came after the epoch-start hooks (DRAWS's draw).
    pytest.param(Case("sigterm", "last-batch", variant="unsized", epoch=0), id="unsized-sigterm-last-batch"),
    pytest.param(
        Case("kill-rank0", "validation", variant="unsized", epoch=1),
        id="unsized-kill-validation",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        Case("max_steps", continues="more-epochs", variant="unsized", epoch=1),
        id="unsized-max-steps-more-epochs",
        marks=pytest.mark.slow,
    ),
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
    return fit_runner(CONFIG, tmp_path_factory.mktemp("streams"), epochs=3, variants=VARIANTS)


@pytest.mark.parametrize("case", CASES)
def test_a_stateful_stream_resumes_exactly(runner: Runner, case: Case) -> None:
    outcome = runner.run(case)
    assert outcome.exact, (case.name, outcome)


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["--data.init_args.stateful=false"], "the training stream Stream has no state_dict/load_state_dict"),
    ],
    ids=["no-state"],
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
    of the samples (`get_worker_info`: interleaved, or `uneven`: contiguous thirds of 1/2, 1/3, 1/6),
    adds fresh noise (torch's generator) and yields (input, sample index); it keeps its position."""

    def __init__(self, samples: int, sized: bool, uneven: bool) -> None:
        self.inputs = torch.randn(samples, 4, generator=torch.Generator().manual_seed(0))
        self.sized, self.uneven = sized, uneven
        self.position = 0

    def _rank_share(self) -> list[int]:
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        return list(range(rank, len(self.inputs), world))

    def _worker_share(self) -> list[int]:
        share, info = self._rank_share(), get_worker_info()
        if info is None:
            return share
        if not self.uneven:
            return share[info.id :: info.num_workers]
        cuts = [0, len(share) // 2, len(share) * 5 // 6, len(share)]  # assumes 3 workers
        return share[cuts[info.id] : cuts[info.id + 1]]

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("a stream without length")
        return len(self._rank_share())

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        share = self._worker_share()
        if self.position >= len(share):  # the previous pass ended: a new one
            self.position = 0
        while self.position < len(share):
            index = share[self.position]
            self.position += 1
            yield self.inputs[index] + 0.1 * torch.randn(4), index

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


class WorkerStreamData(L.LightningDataModule):
    def __init__(
        self, sized: bool = True, uneven: bool = False, num_workers: int = 2, persistent_workers: bool = False
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        self.train_set = WorkerShardedStream(96, self.hparams.sized, self.hparams.uneven)  # 48 per rank
        inputs = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
        self.val_set = TensorDataset(inputs, torch.arange(8))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set,
            batch_size=4,
            num_workers=self.hparams.num_workers,
            persistent_workers=self.hparams.persistent_workers,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=4)


class RecordingNet(L.LightningModule):
    """Appends each training batch's sample indices to `<default_root_dir>/trained-rank<R>.txt`."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, indices = batch
        record = Path(self.trainer.default_root_dir) / f"trained-rank{self.global_rank}.txt"
        with record.open("a") as file:
            file.write(f"{self.current_epoch} {' '.join(map(str, indices.tolist()))}\n")
        loss = self.body(inputs).square().mean()
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        pass

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


WORKER_STREAM = [
    f"--model={__name__}.RecordingNet", f"--data={__name__}.WorkerStreamData", "--trainer.devices=2",
    "--trainer.accelerator=cpu", "--seed_everything=3", "--trainer.log_every_n_steps=2",
]  # fmt: skip


def trained_batches(root: Path, rank: int) -> dict[int, list[list[str]]]:
    """epoch -> the sample indices of each batch rank `rank` trained in it, in order."""
    epochs: dict[int, list[list[str]]] = {}
    for line in (root / f"trained-rank{rank}.txt").read_text().splitlines():
        epoch, *indices = line.split()
        epochs.setdefault(int(epoch), []).append(indices)
    return epochs


@pytest.mark.parametrize(
    "stops",
    [pytest.param([7], id="once"), pytest.param([7, 10], id="twice", marks=pytest.mark.slow)],
)
def test_a_stateful_stream_in_uneven_loader_workers_resumes_with_the_same_batches(
    tmp_path: Path, stops: list[int]
) -> None:
    """3 workers with 24, 16 and 8 samples of each rank's 48 (6, 4 and 2 batches: the last two run out
    mid-epoch), no len(): stopped at step 7, after worker 2 ran out (and at step 10, after worker 1
    did), then resumed to the end. Each epoch trains the batches an uninterrupted epoch trains, in its
    order: the stopped epoch's pieces put together are the next (uninterrupted) epoch's batches."""
    common = [
        "fit", *WORKER_STREAM, "--data.init_args.sized=false", "--data.init_args.uneven=true",
        "--data.init_args.num_workers=3", f"--trainer.default_root_dir={tmp_path}",
        "--trainer.enable_progress_bar=false", "--trainer.max_epochs=2",
    ]  # fmt: skip
    runs = [[f"--trainer.max_steps={stops[0]}"]]
    runs += [[f"--trainer.max_steps={step}", "--ckpt_path=last"] for step in stops[1:]] + [["--ckpt_path=last"]]
    for extra in runs:
        result = ddp_app(*common, *extra, timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "loader workers" not in result.stderr, result.stderr[-3000:]  # positioned: no notice
    for rank in (0, 1):
        epochs = trained_batches(tmp_path, rank)
        assert len(epochs[0]) == len(epochs[1]) == 12
        assert epochs[0] == epochs[1]
        assert sorted(int(index) for batch in epochs[1] for index in batch) == list(range(rank, 96, 2))


@pytest.fixture(scope="module")
def worker_stream_runner(tmp_path_factory: pytest.TempPathFactory) -> Runner:
    return fit_runner(WORKER_STREAM, tmp_path_factory.mktemp("worker-streams"), epochs=2)


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(Case("kill-rank1", "mid-epoch", epoch=1), id="kill-mid-epoch", marks=pytest.mark.slow),
        pytest.param(Case("kill-rank0", "mid-epoch", epoch=0, stops=2), id="kill-twice", marks=pytest.mark.slow),
        pytest.param(Case("sigterm", "last-batch", epoch=0), id="sigterm-last-batch", marks=pytest.mark.slow),
        pytest.param(Case("ctrl-c", "after-epoch-save", epoch=0), id="ctrl-c-after-epoch-save", marks=pytest.mark.slow),
    ],
)
def test_a_stateful_stream_in_loader_workers_killed_mid_epoch_resumes_bit_for_bit(
    worker_stream_runner: Runner, case: Case
) -> None:
    """2 workers per rank, random noise drawn in the stream and dropout in the model: the resumed run
    ends with the uninterrupted run's weights, optimizer state and metrics (33 s each on the 2-core
    VM: slow)."""
    outcome = worker_stream_runner.run(case)
    assert outcome.exact, outcome.detail or outcome
    assert outcome.weights_diff == 0 and outcome.optimizer_diff == 0


@pytest.mark.parametrize("sized", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["sized", "unsized"])
def test_a_stream_in_persistent_workers_resumed_mid_epoch_does_what_the_notice_says(
    tmp_path: Path, sized: bool
) -> None:
    """persistent_workers: ddp-app cannot reach the workers' copies. Stopped after 5 of the epoch's 12
    steps and resumed: the resumed epoch starts its stream over, so its first 5 batches are trained
    twice, and (sized) its last 5 are left out, or (unsized) it runs 5 steps longer. The line at fit
    start says so, and what to use instead."""
    common = [
        "fit", *WORKER_STREAM, f"--data.init_args.sized={str(sized).lower()}",
        "--data.init_args.persistent_workers=true", f"--trainer.default_root_dir={tmp_path}",
        "--trainer.enable_progress_bar=false",
    ]  # fmt: skip
    for extra in (["--trainer.max_steps=5"], ["--trainer.max_epochs=2", "--ckpt_path=last"]):
        result = ddp_app(*common, *extra, timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
        notices = [line for line in result.stderr.splitlines() if "runs in 2 loader workers" in line]
        assert len(notices) == 1, result.stderr[-3000:]
    notice = notices[0]
    assert notice.startswith(
        "ddp-app: the training stream WorkerShardedStream runs in 2 loader workers (persistent_workers: true)"
    )
    assert "persistent_workers: false" in notice and "num_workers: 0" in notice and "map-style Dataset" in notice
    assert "python -m app.data.shard" in notice
    for rank in (0, 1):
        first = trained_batches(tmp_path, rank)[0]
        stopped, resumed = first[:5], first[5:]
        assert resumed[:5] == stopped  # the stream started over
        if sized:
            assert "its last N are left out of that epoch" in notice
            assert len(first) == 12 and len({index for batch in first for index in batch}) == 28  # 20 never
        else:
            assert "N steps more than the uninterrupted run" in notice
            assert len(first) == 17 and len({index for batch in first for index in batch}) == 48


def test_a_checkpoint_of_another_num_workers_is_refused_in_one_line() -> None:
    """Each worker's state is its own share's position: 2 workers' states cannot place 3 workers."""
    saved = {
        "epoch": 0,
        "num_workers": 2,
        "rotation": 1,
        "workers": [{"state": {"position": 4}, "count": 4, "done": False}] * 2,
    }
    stream = WorkerPositionedStream(
        WorkerShardedStream(16, sized=True, uneven=False), 4, 3, list, False,
        start=lambda: (0, 3, saved, False), seed=None, rank=0, world_size=1,
    )  # fmt: skip
    with pytest.raises(ResumeError) as error:
        stream.begin()
    assert str(error.value) == (
        "the checkpoint's training stream was read by 2 loader workers per rank, this run's by 3: each worker's "
        "position is its own. Fix: num_workers: 2 to continue it, or resume from an epoch-end checkpoint."
    )
