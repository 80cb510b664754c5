"""ImageFolderDataModule on generated image files in the real layout: splits, classes, one-line errors,
augmentation that is a function of (seed, epoch, index), and a 2-rank fit killed and resumed exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, Subset

from app.checkpoints.io import safe_load
from app.data.image_files import ImageFiles, UnreadableImageError, imagefolder_splits
from app.data.imagefolder import ImageFolderDataModule
from app.data.seeding import PerSampleSeeded, SampleKey
from app.errors import UserFacingError
from app.resume_check import Case, Runner
from tests.helpers.run import clean_env, ddp_app

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
def test_an_unreadable_image_is_named_or_skipped_and_counted(
    tmp_path: Path, content: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_image_folder(tmp_path, {"train": 4, "val": 1})
    bad = root / "train" / "dog" / "broken.jpg"
    bad.write_bytes(content)
    with pytest.raises(UnreadableImageError) as error:
        imagefolder_splits(str(root), **SMALL)
    message = one_line(error)
    assert message.startswith(f"{bad} ") and "skip_bad_files=true" in message
    datamodule = ImageFolderDataModule(str(root), skip_bad_files=True, **SMALL)
    datamodule.setup("fit")
    assert len(datamodule.train_dataset) == 16 and datamodule.skipped_files == 1
    lines = [line for line in capsys.readouterr().out.splitlines() if "skipped" in line]
    assert lines == [f"ddp-app: skipped 1 unreadable image files in {root} (data.init_args.skip_bad_files=true)"]


def test_an_image_that_fails_to_decode_is_named_or_replaced_by_the_next(tmp_path: Path) -> None:
    """A damaged body behind a valid JPEG header passes the setup check and fails when decoded."""
    root = make_image_folder(tmp_path, {"train": 2})
    damaged = root / "train" / "cat" / "000.jpg"
    damaged.write_bytes(damaged.read_bytes()[:20])
    train, _, _ = imagefolder_splits(str(root), val_fraction=0.25, **SMALL)
    files = train.dataset
    with pytest.raises(UnreadableImageError) as error:
        files[0]
    assert one_line(error).startswith(f"{damaged} cannot be decoded")
    skipping = ImageFiles(files.samples, files.transform, skip_bad_files=True)
    torch.manual_seed(0)
    substitute = skipping[0]
    torch.manual_seed(0)
    assert torch.equal(substitute[0], skipping[1][0]) and substitute[1] == skipping[1][1]


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
    """One uninterrupted 2-rank run (2 epochs of 8 steps), shared by the resume tests below. Without
    dropout and in float64, so that the 3-rank resume's other summation order stays at rounding level
    (tests/fault/test_elastic_resume.py says why); the exact resume does not depend on either."""
    root = make_image_folder(tmp_path_factory.mktemp("images"), {"train": 64, "val": 8}, size=32)
    config = [
        "--config",
        "tests/helpers/imagefolder.yaml",
        f"--data.init_args.data_dir={root}",
        "--model.init_args.dropout=false",
        "--trainer.precision=64-true",
    ]
    return Runner(config, tmp_path_factory.mktemp("runs"), epochs=2)


@pytest.mark.fault
@pytest.mark.distributed
def test_a_2_rank_fit_killed_mid_epoch_resumes_to_the_same_weights(runner: Runner) -> None:
    """SIGKILL of rank 1 mid-epoch, `--ckpt_path last`: the uninterrupted run's weights bit for bit, with
    num_workers 2 and random crop and flip (tests/helpers/imagefolder.yaml)."""
    outcome = runner.run(Case("kill-rank1", "mid-epoch", epoch=1))
    assert outcome.exact, outcome.detail or outcome
    assert outcome.weights_diff == 0 and outcome.optimizer_diff == 0 and outcome.steps == 16


@pytest.mark.fault
@pytest.mark.distributed
def test_a_2_rank_fit_resumed_on_3_ranks_ends_within_rounding(runner: Runner, tmp_path: Path) -> None:
    """Stopped by a max_steps budget mid-epoch 1, resumed on 3 ranks (global batch 32 as 11+11+10)."""
    expected = safe_load(runner.baseline("default") / "checkpoints" / "last.ckpt")
    env = clean_env(DDP_APP_ALLOW_OVERSUBSCRIBE="1")  # 3 ranks with 2 workers each on a 2-core machine
    common = ["fit", *runner.base_args, f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false"]
    for extra in (["--trainer.max_steps=12"], ["--trainer.devices=3", "--ckpt_path=last"]):
        result = ddp_app(*common, *extra, timeout=300, env=env)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert (
        "ddp-app: resuming a 2-rank run on 3 ranks: global batch 32 kept (11+11+10 per micro-step)" in result.stderr
    ), result.stderr[-3000:]
    actual = safe_load(tmp_path / "checkpoints" / "last.ckpt")
    assert actual["global_step"] == expected["global_step"] == 16
    weights = expected["state_dict"]
    for name, value in weights.items():
        scale = float(value.abs().max()) or 1.0
        assert float((actual["state_dict"][name] - value).abs().max()) / scale <= 1e-5, name
