"""A newcomer's mistakes with images and shards, refused by the launcher before any rank starts (issue 42).

The class folders of an ImageFolder (one directory listing) and the class names the shard writer
recorded are checked against the model's `num_classes` in the launcher's parse-only pass
(app/run/config_checks.py, `check_data_against_model`): fewer outputs than classes is one line and exit 2,
more is one warning line, a missing `data_dir` is one line and exit 2. The commands run as a user types
them, on small data written in the real on-disk formats (image files in class folders; LitData shards
written by `python -m app.data.shard`).
"""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

from app.bench.data import write_image_folder
from app.cli.entry import check_before_launch
from app.cluster.exit_codes import BAD_INPUT_EXIT_CODE
from app.cluster.launch import env_without_launcher
from app.data.shard import MANIFEST
from app.run import config_checks
from tests.helpers.datasets_on_disk import image_folder_shards
from tests.helpers.run import REPO, clean_env, ddp_app

CPU = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.precision", "32-true"]
# What a rank prints once the launcher has forked the ranks (app/cluster/launch.py): absent, no rank started.
RANKS_STARTED = "ddp-app: launched"


@pytest.fixture(scope="module")
def ten_classes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """30 small JPEGs in 10 class folders under train/, one per class under val/."""
    return write_image_folder(tmp_path_factory.mktemp("images"), images=30, classes=10, pixels=16)


@pytest.fixture(scope="module")
def ten_class_shards(tmp_path_factory: pytest.TempPathFactory, ten_classes: Path) -> Path:
    return image_folder_shards(tmp_path_factory, ten_classes, "configs/imagefolder_resnet18.yaml", 16)


@pytest.fixture
def launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's own pass, in this process, as `ddp-app` runs it: from the repository, no launcher
    variables, and no line said yet (each is said once per process)."""
    monkeypatch.setattr(config_checks, "SAID_ONCE", set())
    monkeypatch.chdir(REPO)
    for variable in set(os.environ) - set(env_without_launcher(os.environ)):
        monkeypatch.delenv(variable)


def the_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The command's single error line; nothing else went wrong (no traceback) and no rank started."""
    assert result.returncode == BAD_INPUT_EXIT_CODE, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert RANKS_STARTED not in result.stdout + result.stderr, result.stdout[-2000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, result.stderr[-3000:]
    return errors[0]


def fit(config: str, data_dir: Path | str, root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    args = ["fit", "--config", config, "--data.init_args.data_dir", str(data_dir), *extra, *CPU]
    return ddp_app(*args, "--trainer.default_root_dir", str(root), timeout=120, env=clean_env())


def test_the_issue_command_with_num_classes_5_on_10_class_folders_is_one_line_before_any_rank(
    ten_classes: Path, tmp_path: Path
) -> None:
    started = time.monotonic()
    config = "configs/imagefolder_resnet18.yaml"
    result = fit(config, ten_classes, tmp_path / "run", "--model.init_args.num_classes", "5")
    seconds = time.monotonic() - started
    line = the_error_line(result)
    assert f"model.init_args.num_classes is 5 but data.init_args.data_dir {ten_classes} holds 10 classes" in line
    assert line.endswith("Fix: --model.init_args.num_classes 10."), line
    assert not (tmp_path / "run").exists(), "the refused run wrote into its directory"
    print(f"refused in {seconds:.1f} s")  # the issue's run failed after 13 s, in every rank


def test_the_streaming_config_on_shards_of_10_classes_with_num_classes_5_is_one_line_before_any_rank(
    ten_class_shards: Path, tmp_path: Path
) -> None:
    manifest = json.loads((ten_class_shards / MANIFEST).read_text())
    assert manifest["num_classes"] == 10 and len(manifest["classes"]) == 10  # the writer's record
    result = fit(
        "configs/streaming_resnet18.yaml", ten_class_shards, tmp_path / "run", "--model.init_args.num_classes", "5"
    )
    line = the_error_line(result)
    assert "model.init_args.num_classes is 5 but data.init_args.data_dir" in line and "holds 10 classes" in line
    assert "Fix: --model.init_args.num_classes 10" in line
    assert not (tmp_path / "run").exists()


def test_a_missing_data_dir_is_one_line_before_any_rank(tmp_path: Path) -> None:
    """As the command exits (the shards' case, and this one, are also launcher cases of
    tests/fault/test_bad_input.py, refused in that process by the launcher's own pass)."""
    result = fit("configs/imagefolder_resnet18.yaml", tmp_path / "nowhere", tmp_path / "run")
    line = the_error_line(result)
    assert f"{tmp_path / 'nowhere'} does not exist" in line and "Fix:" in line, line
    assert not (tmp_path / "run").exists()


def test_more_outputs_than_classes_is_one_warning_line_and_the_run_goes_on(
    ten_classes: Path, ten_class_shards: Path, tmp_path: Path, launcher: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """The documented shard command gives no num_classes: the config's 1000-class head trains, after a word."""
    for config, data_dir in (
        ("configs/imagefolder_resnet18.yaml", ten_classes),
        ("configs/streaming_resnet18.yaml", ten_class_shards),
    ):
        args = ["fit", "--config", config, f"--data.init_args.data_dir={data_dir}", *CPU]
        checked = check_before_launch([*args, f"--trainer.default_root_dir={tmp_path / 'run'}"])
        assert checked.config["model"]["init_args"]["num_classes"] == 1000
        warnings = [line for line in capsys.readouterr().err.splitlines() if "num_classes" in line]
        assert warnings == [
            f"ddp-app: warning: model.init_args.num_classes is 1000 but data.init_args.data_dir {data_dir} holds "
            "10 classes (class_0, class_1, class_2, ... class_9): 990 outputs are never a target. For a head that "
            "fits: --model.init_args.num_classes 10."
        ], config


def test_shards_without_a_class_record_and_a_model_without_num_classes_are_not_checked(
    ten_class_shards: Path, ten_classes: Path, tmp_path: Path, launcher: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """Shards written before the writer recorded the classes (no record, or no manifest at all) train as
    before; so does a user's own model without a `num_classes` argument."""
    for drop_manifest in (False, True):
        old = shutil.copytree(ten_class_shards, tmp_path / f"old-{drop_manifest}")
        if drop_manifest:
            (old / MANIFEST).unlink()
        else:
            manifest = json.loads((old / MANIFEST).read_text())
            (old / MANIFEST).write_text(json.dumps({k: v for k, v in manifest.items() if "classes" not in k}))
        args = ["fit", "--config", "configs/streaming_resnet18.yaml", f"--data.init_args.data_dir={old}", *CPU]
        check_before_launch([*args, "--model.init_args.num_classes=5", f"--trainer.default_root_dir={tmp_path}"])
        assert "num_classes" not in capsys.readouterr().err
    args = ["fit", "--config", "configs/imagefolder_resnet18.yaml", f"--data.init_args.data_dir={ten_classes}", *CPU]
    user_model = ["--model=tests.helpers.user_module.TwoLayerRegressor", f"--trainer.default_root_dir={tmp_path}"]
    assert "num_classes" not in check_before_launch([*args, *user_model]).config["model"]["init_args"]
    assert "num_classes" not in capsys.readouterr().err


def test_on_a_cpu_the_gpu_settings_get_one_line_naming_what_to_change(
    ten_classes: Path, tmp_path: Path, launcher: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """The config as written (bf16 autocast, devices auto: one process of one thread) on a CPU-only machine."""
    if torch.cuda.is_available():
        pytest.skip("the line is for machines without a GPU")
    args = ["fit", "--config", "configs/imagefolder_resnet18.yaml", f"--data.init_args.data_dir={ten_classes}"]
    check_before_launch([*args, "--model.init_args.num_classes=10", f"--trainer.default_root_dir={tmp_path}"])
    advice = [line for line in capsys.readouterr().err.splitlines() if "no GPU here" in line]
    assert len(advice) == 1, advice
    assert "--trainer.precision 32-true" in advice[0] and "--trainer.devices" in advice[0]
    assert "docs/usage.md" in advice[0]
    check_before_launch([*args, "--model.init_args.num_classes=10", *CPU, f"--trainer.default_root_dir={tmp_path}"])
    assert "no GPU here" not in capsys.readouterr().err  # the CPU command changes both


def write_digit_images(root: Path, pixels: int = 32) -> Path:
    """scikit-learn's 1,797 real 8x8 handwritten digits as `pixels`-pixel grey PNGs in 10 class folders:
    a small ImageFolder a model can learn (train/ 80 %, val/ 20 %, every class in both)."""
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    for index, (image, label) in enumerate(zip(images, labels, strict=True)):
        folder = root / ("val" if index % 5 == 0 else "train") / f"digit_{label}"
        folder.mkdir(parents=True, exist_ok=True)
        grey = Image.fromarray((image.reshape(8, 8) * 255 / 16).astype("uint8"))
        grey.resize((pixels, pixels), Image.Resampling.BILINEAR).convert("RGB").save(folder / f"{index:04d}.png")
    return root


def documented_cpu_command() -> list[str]:
    """The command under docs/usage.md's "A first run on a CPU", as a user would paste it."""
    text = (REPO / "docs" / "usage.md").read_text()
    section = text.split("### A first run on a CPU", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "docs/usage.md has no command under 'A first run on a CPU'"
    return shlex.split(block.group(1).replace("\\\n", " "))


@pytest.mark.slow  # a real 2-rank fit of resnet18 on the CPU
@pytest.mark.distributed
def test_the_documented_cpu_command_learns_a_small_folder(tmp_path: Path) -> None:
    """docs/usage.md's CPU command on 10 classes of real digits: a sensible accuracy, measured for the doc."""
    command = documented_cpu_command()
    assert command[:2] == ["ddp-app", "fit"], command
    data_dir = write_digit_images(tmp_path / "digits")
    command = [str(data_dir) if part == "data/my_images" else part for part in command]
    root = tmp_path / "run"
    started = time.monotonic()
    result = ddp_app(*command[1:], f"--trainer.default_root_dir={root}", timeout=900, env=clean_env())
    seconds = time.monotonic() - started
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "no GPU here" not in result.stderr and "num_classes" not in result.stderr
    with next(root.rglob("metrics.csv")).open() as file:
        accuracies = [float(row["val_acc"]) for row in csv.DictReader(file) if row.get("val_acc")]
    print(f"documented CPU command: val_acc {accuracies[-1]:.3f} after {seconds:.0f} s (every epoch: {accuracies})")
    assert accuracies[-1] >= 0.8, accuracies
