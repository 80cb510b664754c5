"""ImageFolderDataModule on generated image files in the real layout: splits, classes, one-line errors,
augmentation that is a function of (seed, epoch, index), and a 2-rank fit killed and resumed exactly."""

from __future__ import annotations

import inspect
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
import yaml
from PIL import Image
from torch.utils.data import DataLoader, Subset

from app.cli.resume_check import Case, Runner
from app.data.image_datasets import (
    ImageFiles,
    UnreadableImageError,
    image_format_problem,
    imagefolder_splits,
    unreadable_files,
)
from app.data.imagefolder import ImageFolderDataModule
from app.data.seeding import PerSampleSeeded, SampleKey
from app.errors import UserFacingError
from app.models import ResNetClassifier
from app.models.nets import resnet_classifier_parts
from app.reference.config import build_job, load_config
from tests.helpers.run import ddp_app, fit_runner, float64_runner, resume_on_3_ranks, run

CLASSES = ("cat", "dog", "fish", "owl")
SMALL = {"image_size": 12, "resize_size": 16}


def make_image_folder(root: Path, per_class: dict[str, int], size: int = 16, seed: int = 0) -> Path:
    """`root/<split>/<class>/<n>.png|jpg`: random RGB images, PNG and JPEG alternating."""
    generator = np.random.default_rng(seed)
    for split, count in per_class.items():
        for name in CLASSES:
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for index in range(count):
                pixels = generator.integers(0, 256, (size, size, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{index:03d}.{'png' if index % 2 else 'jpg'}")
    return root


def one_line(error: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    assert isinstance(error.value, UserFacingError)
    return message


def test_train_and_val_folders_give_the_splits_and_classes(tmp_path: Path) -> None:
    root = make_image_folder(tmp_path, {"train": 12, "val": 3})
    datamodule = ImageFolderDataModule(str(root), **SMALL, batch_size=4)
    datamodule.setup("fit")
    assert datamodule.classes == list(CLASSES)
    assert len(datamodule.train_dataset) == 48 and len(datamodule.val_dataset) == 12
    assert datamodule.test_dataset is datamodule.val_dataset  # no test/ folder
    image, target = datamodule.val_dataset[3]
    assert image.shape == (3, 12, 12) and image.dtype == torch.float32 and target == 1
    # Evaluation images are never augmented.
    assert torch.equal(datamodule.val_dataset[5][0], datamodule.val_dataset[5][0])


def test_without_val_a_fraction_of_train_is_held_out_the_same_way_every_time(tmp_path: Path) -> None:
    root = make_image_folder(tmp_path, {"train": 10})
    first = imagefolder_splits(str(root), val_fraction=0.25, **SMALL)
    second = imagefolder_splits(str(root), val_fraction=0.25, **SMALL)
    train, val, test = first
    assert isinstance(train, Subset) and isinstance(val, Subset) and test is val
    assert (len(train), len(val)) == (30, 10)
    assert train.indices == second[0].indices and val.indices == second[1].indices
    assert not set(train.indices) & set(val.indices)
    assert val.dataset.samples == train.dataset.samples  # the same files, the val view without augmentation
    other_seed = imagefolder_splits(str(root), val_fraction=0.25, split_seed=1, **SMALL)
    assert other_seed[1].indices != val.indices


def test_missing_data_dir_or_train_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(UserFacingError) as error:
        imagefolder_splits(str(tmp_path / "nowhere"))
    assert "does not exist" in one_line(error) and "data.init_args.data_dir" in str(error.value)
    (tmp_path / "val").mkdir()
    with pytest.raises(UserFacingError) as error:
        imagefolder_splits(str(tmp_path))
    assert "has no train/ folder" in one_line(error)


def test_an_empty_class_folder_is_named(tmp_path: Path) -> None:
    root = make_image_folder(tmp_path, {"train": 2})
    (root / "train" / "zebra").mkdir()
    (root / "train" / "zebra" / "notes.txt").write_text("not an image")
    with pytest.raises(UserFacingError) as error:
        imagefolder_splits(str(root))
    assert f"class folder {root / 'train' / 'zebra'} holds no image" in one_line(error)


def test_val_classes_that_differ_from_train_are_named(tmp_path: Path) -> None:
    root = make_image_folder(tmp_path, {"train": 2, "val": 1})
    (root / "val" / "owl").rename(root / "val" / "owls")
    with pytest.raises(UserFacingError) as error:
        imagefolder_splits(str(root))
    message = one_line(error)
    assert "missing from val/: owl" in message and "not in train/: owls" in message


@pytest.mark.parametrize("content", [b"", b"<html>404 Not Found</html>"], ids=["empty", "not-an-image"])
def test_check_files_names_or_skips_and_counts_an_unreadable_image(
    tmp_path: Path, content: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_image_folder(tmp_path, {"train": 4, "val": 1})
    bad = root / "train" / "dog" / "broken.jpg"
    bad.write_bytes(content)
    with pytest.raises(UnreadableImageError) as error:
        imagefolder_splits(str(root), check_files=True, **SMALL)
    message = one_line(error)
    assert message.startswith(f"{bad} ") and "skip_bad_files=true" in message
    datamodule = ImageFolderDataModule(str(root), skip_bad_files=True, check_files=True, **SMALL)
    datamodule.setup("fit")
    assert len(datamodule.train_dataset) == 16 and datamodule.skipped_files == 1
    lines = [line for line in capsys.readouterr().out.splitlines() if "skipped" in line]
    assert lines == [f"ddp-app: skipped 1 unreadable image files in {root} (data.init_args.skip_bad_files=true)"]


def test_by_default_setup_reads_no_file_and_a_bad_one_is_named_when_it_is_decoded(tmp_path: Path) -> None:
    """No scan before training (every rank of an ImageNet run would read 1.28 M files): the file that is
    not an image is in the split, and decoding it is the one-line error."""
    root = make_image_folder(tmp_path, {"train": 2})
    bad = root / "train" / "dog" / "broken.jpg"
    bad.write_bytes(b"<html>404 Not Found</html>")
    datamodule = ImageFolderDataModule(str(root), val_fraction=0.25, **SMALL)
    datamodule.setup("fit")
    files = datamodule.train_dataset.dataset
    assert len(files) == 9 and files.samples.index((bad, 1)) == 4
    with pytest.raises(UnreadableImageError) as error:
        files[4]
    assert one_line(error).startswith(f"{bad} cannot be decoded")


def test_the_scan_reads_every_file_of_a_large_folder_in_threads(tmp_path: Path) -> None:
    """3000 files, one bad in each split: all found, and the threads make it no slower than one thread."""
    root = make_image_folder(tmp_path, {"train": 500, "val": 250}, size=4)
    (root / "train" / "owl" / "x.png").write_bytes(b"GIF7")
    (root / "val" / "cat" / "y.jpg").write_bytes(b"")
    paths = [path for path in sorted(root.rglob("*")) if path.is_file()]
    assert len(paths) == 3002
    started = time.perf_counter()
    problems = unreadable_files(paths)
    threaded = time.perf_counter() - started
    assert problems == {
        str(root / "train" / "owl" / "x.png"): "is not a JPEG, PNG, GIF or WebP image (it starts with b'GIF7')",
        str(root / "val" / "cat" / "y.jpg"): "is empty (0 bytes)",
    }
    started = time.perf_counter()
    assert {str(path): image_format_problem(path) for path in paths if image_format_problem(path)} == problems
    assert threaded < 3 * (time.perf_counter() - started) + 0.5


def test_a_worker_error_reaches_the_user_as_its_one_line(tmp_path: Path) -> None:
    """DataLoader re-raises a worker's exception with the worker's traceback in its message: the user
    reads our line only."""
    root = make_image_folder(tmp_path, {"train": 2})
    damaged = root / "train" / "cat" / "001.png"
    damaged.write_bytes(damaged.read_bytes()[:60])
    train, _, _ = imagefolder_splits(str(root), val_fraction=0.25, **SMALL)
    with pytest.raises(UnreadableImageError) as error:
        list(DataLoader(train.dataset, batch_size=2, num_workers=1))
    message = one_line(error)
    assert message.startswith(f"{damaged} cannot be decoded (Out of bound read in decode_png.")
    assert message.endswith(
        "Fix: remove or replace it, or set data.init_args.skip_bad_files=true to skip unreadable images and count them."
    )
    assert "Traceback" not in message and "DataLoader worker process" not in message


def test_an_image_that_fails_to_decode_is_named_or_replaced_by_the_next(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A damaged body behind a valid JPEG header fails when decoded; with skip_bad_files the next file
    takes its place, and the file is flagged where the loader's workers and this process both see it."""
    root = make_image_folder(tmp_path, {"train": 2})
    damaged = root / "train" / "cat" / "000.jpg"
    damaged.write_bytes(damaged.read_bytes()[:20])
    train, _, _ = imagefolder_splits(str(root), val_fraction=0.25, check_files=True, **SMALL)
    files = train.dataset
    with pytest.raises(UnreadableImageError) as error:
        files[0]
    assert one_line(error).startswith(f"{damaged} cannot be decoded")
    skipping = ImageFiles(files.samples, files.transform, skip_bad_files=True)
    torch.manual_seed(0)
    substitute = skipping[0]
    torch.manual_seed(0)
    assert torch.equal(substitute[0], skipping[1][0]) and substitute[1] == skipping[1][1]
    assert skipping.replaced_files() == [damaged]
    fresh = ImageFiles(files.samples, files.transform, skip_bad_files=True)
    batches = list(DataLoader(fresh, batch_size=4, num_workers=2))
    assert sum(len(batch[1]) for batch in batches) == 8  # the epoch keeps its length
    assert fresh.replaced_files() == [damaged]  # flagged in a worker, read here
    said = [line for line in capfd.readouterr().err.splitlines() if str(damaged) in line]
    assert len(said) == 2 and said[-1].endswith(
        "The next image of the split is trained in its place (data.init_args.skip_bad_files=true)."
    )


def test_a_samples_augmentation_depends_on_seed_epoch_and_index_only(tmp_path: Path) -> None:
    """The same crop and flip in the main process, in 2 workers, in another order and another batch size."""
    root = make_image_folder(tmp_path, {"train": 8, "val": 1}, size=32)
    train, _, _ = imagefolder_splits(str(root), image_size=16, crop_scale=(0.2, 1.0))
    seeded = PerSampleSeeded(train, seed=7)
    keys = [SampleKey(epoch, index) for epoch in (0, 1) for index in range(len(train))]

    def load(order: list[SampleKey], num_workers: int, batch_size: int) -> dict[SampleKey, torch.Tensor]:
        loader = DataLoader(seeded, sampler=order, batch_size=batch_size, num_workers=num_workers)
        images = torch.cat([batch[0] for batch in loader])
        return dict(zip(order, images, strict=True))

    in_process = load(keys, 0, 4)
    in_workers = load(keys[::-1], 2, 3)
    assert all(torch.equal(in_process[key], in_workers[key]) for key in keys)
    # ...and it is random: another epoch crops the same image differently.
    assert not torch.equal(in_process[SampleKey(0, 0)], in_process[SampleKey(1, 0)])


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Runner:
    """One uninterrupted 2-rank run (2 epochs of 8 steps), shared by the resume tests below."""
    root = make_image_folder(tmp_path_factory.mktemp("images"), {"train": 64, "val": 8}, size=32)
    return float64_runner("tests/helpers/imagefolder.yaml", root, tmp_path_factory.mktemp("runs"), epochs=2)


@pytest.mark.fault
@pytest.mark.distributed
@pytest.mark.slow  # about 55 s; tests/fault/test_resume_matrix.py's imagefolder row kills and resumes this data
def test_a_2_rank_fit_killed_mid_epoch_resumes_to_the_same_weights(runner: Runner) -> None:
    """SIGKILL of rank 1 mid-epoch, `--ckpt_path last`: the uninterrupted run's weights bit for bit, with
    num_workers 2 and random crop and flip (tests/helpers/imagefolder.yaml)."""
    outcome = runner.run(Case("kill-rank1", "mid-epoch", epoch=1))
    assert outcome.exact, outcome.detail or outcome
    assert outcome.weights_diff == 0 and outcome.optimizer_diff == 0 and outcome.steps == 16


@pytest.mark.fault
@pytest.mark.distributed
@pytest.mark.slow  # about 30 s; the LitData shards of the same images resume on 3 ranks in the default run
def test_a_2_rank_fit_resumed_on_3_ranks_ends_within_rounding(runner: Runner, tmp_path: Path) -> None:
    """Stopped by a max_steps budget mid-epoch 1, resumed on 3 ranks (global batch 32 as 11+11+10)."""
    assert resume_on_3_ranks(runner, tmp_path, "--trainer.max_steps=12") == 16


@pytest.fixture(scope="module")
def damaged_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The resume tests' image folder with one PNG cut short after its header: found only when decoded."""
    root = make_image_folder(tmp_path_factory.mktemp("damaged"), {"train": 64, "val": 8}, size=32)
    damaged = root / "train" / "fish" / "013.png"
    damaged.write_bytes(damaged.read_bytes()[:60])
    return root, damaged


@pytest.mark.fault
@pytest.mark.distributed
def test_a_file_that_fails_to_decode_in_a_worker_ends_the_2_rank_fit_with_one_line(
    damaged_folder: tuple[Path, Path], tmp_path: Path
) -> None:
    root, damaged = damaged_folder
    started = time.monotonic()
    result = ddp_app(
        "fit", "--config", "tests/helpers/imagefolder.yaml", f"--data.init_args.data_dir={root}",
        f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false", timeout=120,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode != 0 and time.monotonic() - started < 100, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("ddp-app: error:")]
    assert errors == [
        f"ddp-app: error: {damaged} cannot be decoded (Out of bound read in decode_png. Probably, the input image "
        "is corrupted). Fix: remove or replace it, or set data.init_args.skip_bad_files=true to skip unreadable "
        "images and count them."
    ], output[-3000:]
    assert "Traceback" not in output, output[-3000:]


@pytest.mark.fault
@pytest.mark.distributed
@pytest.mark.slow  # 31 s on the 2-core VM: three 2-rank fits
def test_with_skip_bad_files_a_2_rank_fit_killed_mid_epoch_resumes_to_the_same_weights(
    damaged_folder: tuple[Path, Path], tmp_path: Path
) -> None:
    """The damaged file's sample is replaced by the next file on whichever rank, worker or resumed
    process meets it: every epoch keeps its 8 steps, and the resumed run ends bit for bit."""
    root, damaged = damaged_folder
    config = ["--config", "tests/helpers/imagefolder.yaml", f"--data.init_args.data_dir={root}"]
    runner = fit_runner([*config, "--data.init_args.skip_bad_files=true"], tmp_path, epochs=2)
    outcome = runner.run(Case("kill-rank1", "mid-epoch", epoch=1))
    assert outcome.exact, outcome.detail or outcome
    assert outcome.weights_diff == 0 and outcome.steps == 16
    log = (tmp_path / "uninterrupted-default.log").read_text()
    summary = f"split (data.init_args.skip_bad_files=true): {damaged}. Fix: remove or replace them."
    assert "unreadable image files were replaced by the next image of their " + summary in log, log[-3000:]


@pytest.mark.fault
@pytest.mark.distributed
def test_check_files_on_2_ranks_scans_on_rank_0_and_stops_every_rank_with_one_line(
    tmp_path: Path,
) -> None:
    """Rank 0 reads the files and sends what it found; every rank raises the same line (none waits)."""
    root = make_image_folder(tmp_path / "images", {"train": 8, "val": 2}, size=32)
    bad = root / "val" / "owl" / "page.jpg"
    bad.write_bytes(b"<html>404 Not Found</html>")
    result = ddp_app(
        "fit", "--config", "tests/helpers/imagefolder.yaml", f"--data.init_args.data_dir={root}",
        "--data.init_args.check_files=true", f"--trainer.default_root_dir={tmp_path / 'run'}", timeout=120,
    )  # fmt: skip
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if line.startswith("ddp-app: error:")]
    assert result.returncode == 2 and errors == [
        f"ddp-app: error: {bad} is not a JPEG, PNG, GIF or WebP image (it starts with b'<htm'). Fix: remove or "
        "replace it, or set data.init_args.skip_bad_files=true to skip unreadable images and count them."
    ], output[-3000:]


def test_the_reference_trainer_builds_the_same_imagefolder_splits(tmp_path: Path) -> None:
    """The plain-PyTorch reference reads an ImageFolder config's data with the DataModule's own function."""
    root = make_image_folder(tmp_path / "images", {"train": 6}, size=32)
    spec = load_config("tests/helpers/imagefolder.yaml")
    spec["data"]["init_args"].update(data_dir=str(root), val_fraction=0.25)
    job = build_job(spec)
    datamodule = ImageFolderDataModule(**spec["data"]["init_args"])
    datamodule.setup("fit")
    assert job.train_dataset.indices == datamodule.train_dataset.indices
    assert job.train_dataset.dataset.samples == datamodule.train_dataset.dataset.samples
    assert all(torch.equal(job.val_dataset[i][0], datamodule.val_dataset[i][0]) for i in range(len(job.val_dataset)))
    own = dict(inspect.signature(ImageFolderDataModule.__init__).parameters)
    function = dict(inspect.signature(imagefolder_splits).parameters)
    assert [(k, p.default) for k, p in own.items() if k not in ("self", "loader_options")] == [
        (k, p.default) for k, p in function.items()
    ]


@pytest.mark.slow  # about 50 s: its splits are the DataModule's (the test above); the loop is the reference's own
@pytest.mark.distributed
def test_the_reference_trainer_trains_an_imagefolder_config_on_2_ranks(tmp_path: Path) -> None:
    root = make_image_folder(tmp_path / "images", {"train": 8, "val": 2}, size=32)
    spec = load_config("tests/helpers/imagefolder.yaml")
    spec["data"]["init_args"]["data_dir"] = str(root)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(spec))
    result = run(
        [sys.executable, "-m", "app.reference", "--config", str(config), "--world-size", "2", "--epochs", "1",
         "--out", str(tmp_path / "out")], timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[rank 0] epoch 0 | steps 1 |" in result.stdout + result.stderr
    assert (tmp_path / "out" / "final.pt").is_file()


def test_resnet_stem_imagenet_downsamples_224_pixel_images_as_torchvision_does() -> None:
    cifar, imagenet = ResNetClassifier(num_classes=4), ResNetClassifier(num_classes=4, stem="imagenet")
    assert cifar.net.conv1.kernel_size == (3, 3) and isinstance(cifar.net.maxpool, torch.nn.Identity)
    reference = torchvision.models.resnet18(num_classes=4)
    assert [(name, p.shape) for name, p in imagenet.net.named_parameters()] == [
        (name, p.shape) for name, p in reference.named_parameters()
    ]
    images = torch.randn(2, 3, 224, 224)
    stem = torch.nn.Sequential(imagenet.net.conv1, imagenet.net.bn1, imagenet.net.relu, imagenet.net.maxpool)
    assert stem(images).shape == (2, 64, 56, 56)  # the CIFAR stem would keep 224x224 for the blocks
    assert imagenet.net(images).shape == (2, 4)
    assert resnet_classifier_parts(4, stem="imagenet").net.conv1.stride == (2, 2)
