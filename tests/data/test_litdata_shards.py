"""LitData shards: `python -m app.data.shard` writes a generated ImageFolder (JPEGs in class folders)
as shards, `StreamingDataModule` trains from them with 2 loader workers, random crop and flip; a 2-rank
fit killed twice resumes bit for bit, and resumed on 3 ranks ends within rounding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from app.bench.data import write_image_folder
from app.cli.resume_check import Case, Runner
from app.data.datasets import DataNotFoundError
from app.data.image_datasets import read_layout
from app.data.litdata_shards import StreamingDataModule
from app.data.samplers import chunked_shard
from app.data.shard import main as shard_main
from tests.helpers.datasets_on_disk import image_folder_shards
from tests.helpers.run import float64_runner, resume_on_3_ranks

CHUNK = 16  # samples per chunk: 200 training images in 2 writers give 2 x 7 chunks


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """200 random 32x32 JPEGs in 4 class folders under train/, one per class under val/."""
    return write_image_folder(tmp_path_factory.mktemp("images"), images=200, classes=4, pixels=32)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory, images: Path) -> Path:
    return image_folder_shards(tmp_path_factory, images, "tests/helpers/imagefolder.yaml", CHUNK, "--workers", "2")


def test_the_shards_hold_every_image_file_once_with_its_class(images: Path, shards: Path) -> None:
    from litdata import StreamingDataset

    layout = read_layout(str(images))
    for split, files in (("train", layout.train), ("val", layout.val)):
        written = StreamingDataset(str(shards / split))
        samples = [written[index] for index in range(len(written))]
        source = sorted((path.read_bytes(), target) for path, target in files)
        assert sorted((sample["image"], sample["label"]) for sample in samples) == source, split
        if split == "val":  # evaluation splits keep their order; training is written shuffled
            assert [sample["image"] for sample in samples] == [path.read_bytes() for path, _ in files]
    manifest = json.loads((shards / "ddp_app_shards.json").read_text())
    assert manifest["splits"]["train"]["samples"] == 200 and manifest["splits"]["train"]["chunks"] == 14
    assert manifest["classes"] == [f"class_{index}" for index in range(4)]


def test_litdata_still_describes_its_chunks_as_shard_samples_reads_them(shards: Path) -> None:
    """`StreamingDataset.region_of_interest` (undocumented; docs/private_apis.md): one (start, end) per chunk
    in index order, whose lengths are the chunks' sample counts in LitData's own index.json."""
    from litdata import StreamingDataset

    chunks = json.loads((shards / "train" / "index.json").read_text())["chunks"]
    region = StreamingDataset(str(shards / "train")).region_of_interest
    assert [end - start for start, end in region] == [chunk["chunk_size"] for chunk in chunks], (
        "LitData's StreamingDataset.region_of_interest no longer gives each chunk's samples in index order: "
        "ShardSamples.chunk_sizes (app/data/litdata_shards.py) and the chunked training order depend on it "
        "(see docs/private_apis.md)"
    )


def test_a_data_set_of_tensors_is_written_as_its_samples(tmp_path: Path) -> None:
    """The digits (a TensorDataset split three ways): every split's samples, as tensors, each once."""
    from app.data.digits import DigitsDataModule

    assert shard_main(["--config", "configs/digits.yaml", "--out", str(tmp_path), "--chunk-size", "256"]) == 0
    source = DigitsDataModule()
    source.setup("fit")
    module = StreamingDataModule(data_dir=str(tmp_path))
    module.setup("fit")
    for split in ("train_dataset", "val_dataset", "test_dataset"):
        ours, theirs = getattr(module, split), getattr(source, split)
        assert len(ours) == len(theirs) and module.test_dataset is not module.val_dataset

        def rows(dataset: torch.utils.data.Dataset) -> list[tuple[float, ...]]:
            return sorted((*dataset[i][0].tolist(), float(dataset[i][1])) for i in range(len(dataset)))

        assert rows(ours) == rows(theirs), split


def test_an_existing_output_and_an_augmenting_data_set_are_refused_in_one_line(
    tmp_path: Path, shards: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = sorted(path.stat().st_mtime_ns for path in shards.rglob("*"))
    assert shard_main(["--config", "tests/helpers/imagefolder.yaml", "--out", str(shards)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"ddp-app: error: --out {shards} already holds files") and "\n" not in error
    assert sorted(path.stat().st_mtime_ns for path in shards.rglob("*")) == before  # nothing touched

    assert shard_main(["--config", "tests/helpers/augmenting.yaml", "--out", str(tmp_path / "noisy")]) == 2
    error = capsys.readouterr().err.strip()
    assert "the train split (NoisyBlobs) may draw random numbers when a sample is read" in error, error
    assert "\n" not in error and not (tmp_path / "noisy").exists()


def test_a_file_that_does_not_decode_is_named_or_left_out_when_writing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Shards never hold an image training cannot decode: a truncated JPEG (a good header) stops the write
    in one line that names it, leaving no output; with --skip-bad-files it is left out and listed."""
    images = write_image_folder(tmp_path / "images", images=24, classes=4, pixels=32)
    bad = sorted((images / "train" / "class_1").iterdir())[0]
    bad.write_bytes(bad.read_bytes()[:40])
    arguments = ["--config", "tests/helpers/imagefolder.yaml", f"--data.init_args.data_dir={images}"]
    assert shard_main([*arguments, "--out", str(tmp_path / "refused")]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and f"1 files of the train split cannot be decoded, e.g. {bad} cannot" in error, error
    assert "--skip-bad-files" in error and not (tmp_path / "refused").exists()

    assert shard_main([*arguments, "--out", str(tmp_path / "kept"), "--skip-bad-files"]) == 0
    manifest = json.loads((tmp_path / "kept" / "ddp_app_shards.json").read_text())
    assert manifest["splits"]["train"]["samples"] == 23 and str(bad) in manifest["splits"]["train"]["left_out"][0]
    module = StreamingDataModule(data_dir=str(tmp_path / "kept"), image_size=28)
    module.setup("fit")
    assert len(module.train_dataset) == 23


def test_a_sample_damaged_after_writing_is_one_line_naming_it(shards: Path, tmp_path: Path) -> None:
    """A chunk cut short on the way (a copy to object storage interrupted): its samples fail in one line."""
    import shutil

    from app.data.image_datasets import UnreadableImageError

    copy = tmp_path / "shards"
    shutil.copytree(shards, copy)
    chunk = sorted((copy / "val").glob("chunk-*.bin"))[0]
    chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])  # a copy cut short
    module = StreamingDataModule(data_dir=str(copy), image_size=28, resize_size=32)
    module.setup("fit")
    with pytest.raises(UnreadableImageError) as error:
        module.val_dataset[0]  # the first sample of the first chunk
    message = str(error.value)
    assert "\n" not in message and f"sample 0 of the shards at {copy}/val cannot be read from its chunk" in message


def test_shards_streamed_from_a_store_read_as_from_a_folder(shards: Path, tmp_path: Path) -> None:
    """`data_dir` as a store URL (LitData's `local:` store: chunks fetched into `cache_dir` as from s3://),
    read by 2 loader workers in the training order: the same samples as from the folder."""
    from torch.utils.data import DataLoader

    def batches(data_dir: str) -> list[torch.Tensor]:
        module = StreamingDataModule(data_dir=data_dir, cache_dir=str(tmp_path / "cache"), image_size=28)
        module.setup("fit")
        order = chunked_shard(module.train_dataset.chunk_sizes, 0, 2, True, 0, 0, 4)  # rank 0 of 2
        loader = DataLoader(module.val_dataset, batch_size=2, num_workers=2)
        module.val_dataset.transform = module.train_dataset.transform = None  # the decoded images themselves
        train = DataLoader(module.train_dataset, batch_size=16, sampler=order, num_workers=2)
        return [images for images, _ in train] + [images for images, _ in loader]

    from_folder, from_store = batches(str(shards)), batches(f"local:{shards}")
    assert len(from_folder) == len(from_store) == 7 + 2
    assert all(torch.equal(a, b) for a, b in zip(from_folder, from_store, strict=True))
    assert list((tmp_path / "cache").rglob("chunk-*.bin"))  # fetched into cache_dir (LitData evicts read ones)


def test_missing_shards_are_one_line_naming_the_fix(tmp_path: Path) -> None:
    module = StreamingDataModule(data_dir=str(tmp_path / "nowhere"))
    with pytest.raises(DataNotFoundError) as error:
        module.setup("fit")
    assert "\n" not in str(error.value) and "python -m app.data.shard" in str(error.value)


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_chunked_shards_cover_the_set_each_rank_reading_its_own_run_of_chunks(world_size: int) -> None:
    sizes = [16] * 12 + [8]  # 200 samples
    starts = [sum(sizes[:chunk]) for chunk in range(len(sizes))]

    def chunk_of(index: int) -> int:
        return max(chunk for chunk, start in enumerate(starts) if start <= index)

    shards = [chunked_shard(sizes, rank, world_size, True, 7, 3, 2) for rank in range(world_size)]
    per_rank = -(-200 // world_size)
    assert all(len(shard) == per_rank for shard in shards)
    everything = [index for shard in shards for index in shard]
    assert sorted(set(everything)) == list(range(200))  # all samples, the padding repeats some
    assert len(everything) - len(set(everything)) == per_rank * world_size - 200
    for shard in shards:  # a contiguous run of a chunk order: about 1/world_size of the chunks
        assert len({chunk_of(index) for index in shard}) <= -(-len(sizes) // world_size) + 2
    # The order is a function of (seed, epoch) only, changes with the epoch, and is plain without shuffle.
    assert shards[0] == chunked_shard(sizes, 0, world_size, True, 7, 3, 2)
    assert shards[0] != chunked_shard(sizes, 0, world_size, True, 7, 4, 2)
    assert chunked_shard(sizes, 0, 1, False, 7, 3, 2) == list(range(200))


def test_with_a_window_of_one_chunk_each_chunk_is_read_whole_before_the_next(shards: Path) -> None:
    """`shuffle_chunks: 1`: the chunks in a shuffled order, each one's samples shuffled among themselves."""
    module = StreamingDataModule(data_dir=str(shards), batch_size=16, shuffle_chunks=1, image_size=28)
    module.setup("fit")
    sizes = module.train_dataset.chunk_sizes
    ends = torch.tensor(sizes).cumsum(0).tolist()
    order = chunked_shard(sizes, 0, 1, True, 0, 0, module.shuffle_chunks)
    chunks = [sum(index >= end for end in ends) for index in order]
    runs = [chunk for position, chunk in enumerate(chunks) if position == 0 or chunk != chunks[position - 1]]
    assert sorted(runs) == list(range(len(sizes)))  # one run per chunk: never back to a chunk once left
    assert runs != sorted(runs) and order[: sizes[runs[0]]] != sorted(order[: sizes[runs[0]]])  # shuffled
    image, label = module.train_dataset[0]
    assert image.shape == (3, 28, 28) and image.dtype == torch.float32 and 0 <= label < 4


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory, shards: Path) -> Runner:
    """One uninterrupted 2-rank run of 3 epochs (7 steps each)."""
    return float64_runner("tests/helpers/streaming.yaml", shards, tmp_path_factory.mktemp("runs"), epochs=3)


@pytest.mark.fault
@pytest.mark.distributed
@pytest.mark.slow  # about 80 s; tests/fault/test_resume_matrix.py's streaming row kills and resumes shards
def test_a_2_rank_fit_killed_twice_resumes_to_the_same_weights(runner: Runner) -> None:
    """SIGKILL of rank 1 mid-epoch 0, `--ckpt_path last`, SIGKILL again mid-epoch 1, `--ckpt_path last`:
    the uninterrupted run's weights, optimizer state and metric history bit for bit (num_workers 2)."""
    outcome = runner.run(Case("kill-rank1", "mid-epoch", epoch=0, stops=2))
    assert outcome.exact, outcome.detail or outcome
    assert outcome.weights_diff == 0 and outcome.optimizer_diff == 0 and outcome.steps == 21


@pytest.mark.fault
@pytest.mark.distributed
def test_a_2_rank_fit_resumed_on_3_ranks_ends_within_rounding(runner: Runner, tmp_path: Path) -> None:
    """Stopped by a max_steps budget mid-epoch 1, resumed on 3 ranks (global batch 32 as 11+11+10)."""
    assert resume_on_3_ranks(runner, tmp_path, "--trainer.max_steps=10") == 21
