"""Bad input: every case exits non-zero in bounded time with one clear line, and destroys nothing.

Each case runs `ddp-app fit` against a run directory that already holds a checkpoint and a metrics
log from an earlier run; their bytes must be unchanged afterwards. Input the launcher refuses in its
parse-only pass, before any rank exists (`app.cli.entry.check_before_launch`), is tested there, in this
process, through that same function (`LAUNCHER_CASES`); the rest, and a few of those for the real
exit code and output of the command, run the real `ddp-app` command (`COMMAND_CASES`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import zipfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from app.cli.entry import check_before_launch
from app.cluster.exit_codes import BAD_INPUT_EXIT_CODE
from app.cluster.launch import env_without_launcher
from tests.helpers.run import REPO, clean_env, copy_of, ddp_app

pytestmark = [pytest.mark.fault, pytest.mark.distributed]  # a module fixture trains a 2-rank run

TIMEOUT_S = 120


@dataclass
class Case:
    args: list[str]
    expect: str  # a substring the error line must contain (names the problem)
    env: dict[str, str] = field(default_factory=dict)
    prepare: Callable[[Path], list[str]] | None = None  # returns extra args, given a scratch dir
    needs_root: bool = False


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def yaml_with_unknown_key(scratch: Path) -> list[str]:
    return ["--config", str(write(scratch / "extra.yaml", "trainer:\n  max_epocs: 3\n"))]


def malformed_yaml(scratch: Path) -> list[str]:
    return ["--config", str(write(scratch / "broken.yaml", "trainer:\n  max_epochs: [3\n  devices: 2\n"))]


def truncated_checkpoint(scratch: Path) -> list[str]:
    good = Path(os.environ["BAD_INPUT_LAST_CKPT"]).read_bytes()
    (scratch / "truncated.ckpt").write_bytes(good[: len(good) // 2])
    return ["--ckpt_path", str(scratch / "truncated.ckpt")]


def other_model_checkpoint(scratch: Path) -> list[str]:
    from app.models import ToyRegressor

    checkpoint = {
        "state_dict": ToyRegressor().state_dict(),
        "epoch": 0,
        "global_step": 0,
        "pytorch-lightning_version": "2.6.6",
        "loops": {},
        "callbacks": {},
        "optimizer_states": [],
        "lr_schedulers": [],
    }
    torch.save(checkpoint, scratch / "toy.ckpt")
    return ["--ckpt_path", str(scratch / "toy.ckpt")]


class MarkerOnUnpickle:
    """Unpickling this object would create a file: the proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def malicious_checkpoint(scratch: Path) -> list[str]:
    with open(scratch / "evil.ckpt", "wb") as file:
        torch.save({"state_dict": {}, "payload": MarkerOnUnpickle(scratch / "PWNED")}, file, pickle_protocol=2)
    return ["--ckpt_path", str(scratch / "evil.ckpt")]


def yaml_at_ckpt_path(scratch: Path) -> list[str]:
    return ["--ckpt_path", str(write(scratch / "config.yaml", "trainer:\n  max_epochs: 3\n"))]


def zip_of_text_at_ckpt_path(scratch: Path) -> list[str]:
    with zipfile.ZipFile(scratch / "notes.zip", "w") as archive:
        archive.writestr("notes.txt", "not a checkpoint")
    return ["--ckpt_path", str(scratch / "notes.zip")]


def empty_file_at_ckpt_path(scratch: Path) -> list[str]:
    return ["--ckpt_path", str(write(scratch / "empty.ckpt", ""))]


def directory_at_ckpt_path(scratch: Path) -> list[str]:
    return ["--ckpt_path", str(scratch)]


def tensor_at_ckpt_path(scratch: Path) -> list[str]:
    torch.save(torch.zeros(3), scratch / "tensor.ckpt")
    return ["--ckpt_path", str(scratch / "tensor.ckpt")]


def list_at_ckpt_path(scratch: Path) -> list[str]:
    torch.save([1, 2], scratch / "list.ckpt")
    return ["--ckpt_path", str(scratch / "list.ckpt")]


def nan_data(scratch: Path) -> list[str]:
    inputs = torch.randn(64, 64)
    inputs[17, 3] = float("nan")
    torch.save({"inputs": inputs, "targets": torch.randint(0, 10, (64,))}, scratch / "data.pt")
    return ["--data=app.data.TensorFileDataModule", f"--data.init_args.path={scratch / 'data.pt'}"]


def unwritable_root(scratch: Path) -> list[str]:
    blocker = write(scratch / "a-file", "not a directory")
    return [f"--trainer.default_root_dir={blocker / 'runs'}"]


def port_in_use(scratch: Path) -> list[str]:
    return []


CASES: dict[str, Case] = {
    "unknown_key_cli": Case(["--trainer.max_epocs=3"], "max_epocs"),
    "unknown_key_yaml": Case([], "max_epocs", prepare=yaml_with_unknown_key),
    "wrong_type": Case(["--trainer.max_epochs=oops"], "trainer.max_epochs"),
    "malformed_yaml": Case([], "YAML", prepare=malformed_yaml),
    "missing_config": Case(["--config=configs/nope.yaml"], "does not exist"),
    "unknown_model_class": Case(["--model=NoSuchModel"], "NoSuchModel"),
    "negative_lr": Case(["--optimizer.init_args.lr=-0.1"], "optimizer.init_args.lr"),
    "batch_size_zero": Case(["--data.init_args.batch_size=0"], "batch_size"),
    "max_epochs_zero": Case(["--trainer.max_epochs=0"], "trainer.max_epochs"),
    "max_epochs_negative": Case(["--trainer.max_epochs=-3"], "trainer.max_epochs"),
    # -1 is Lightning's "no epoch limit": with no step limit either (max_steps' default), a run without end.
    "no_epoch_limit_and_no_step_limit": Case(["--trainer.max_epochs=-1"], "Fix: set one of them"),
    "max_steps_zero": Case(["--trainer.max_steps=0"], "trainer.max_steps must be >= 1, or -1 for no step limit, got 0"),
    "devices_zero": Case(["--trainer.devices=0"], "trainer.devices"),
    "num_nodes_without_other_nodes": Case(["--trainer.num_nodes=2"], "num_nodes"),
    "missing_data_dir": Case(
        [
            "--config=configs/mnist.yaml",
            "--data.init_args.data_dir=/nonexistent/data",
            "--data.init_args.download=false",
            "--data.init_args.num_workers=0",
        ],
        "MNIST not found",
    ),
    # The image data modules' data_dir is read by the launcher (the class folders, the shards' record).
    "missing_imagefolder_data_dir": Case(
        [
            "--config=configs/imagefolder_resnet18.yaml",
            "--data.init_args.data_dir=/nonexistent/images",
            "--trainer.accelerator=cpu",
            "--trainer.precision=32-true",
        ],
        "ImageFolder data not found: /nonexistent/images does not exist",
    ),
    "missing_shards_data_dir": Case(
        [
            "--config=configs/streaming_resnet18.yaml",
            "--data.init_args.data_dir=/nonexistent/shards",
            "--trainer.accelerator=cpu",
            "--trainer.precision=32-true",
        ],
        "no LitData shards at /nonexistent/shards",
    ),
    "unwritable_root_dir": Case([], "not writable", prepare=unwritable_root),
    "nonexistent_ckpt_path": Case(["--ckpt_path=/nonexistent/last.ckpt"], "/nonexistent/last.ckpt"),
    "truncated_ckpt": Case([], "truncated or corrupt", prepare=truncated_checkpoint),
    "checkpoint_of_another_model": Case([], "net.", prepare=other_model_checkpoint),
    "malicious_ckpt": Case([], "refused to load", prepare=malicious_checkpoint),
    # Files torch.save did not write, told apart by their first bytes before torch.load reads them.
    "text_file_at_ckpt_path": Case(["--ckpt_path=README.md"], "--ckpt_path README.md is not a checkpoint (a text file"),
    "yaml_file_at_ckpt_path": Case([], "is not a checkpoint (a YAML file", prepare=yaml_at_ckpt_path),
    "zip_of_text_at_ckpt_path": Case(
        [], "is not a checkpoint (a zip archive of other files: notes.txt", prepare=zip_of_text_at_ckpt_path
    ),
    "empty_file_at_ckpt_path": Case([], "is not a checkpoint (an empty file", prepare=empty_file_at_ckpt_path),
    "directory_at_ckpt_path": Case([], "is not a checkpoint (a directory", prepare=directory_at_ckpt_path),
    "tensor_at_ckpt_path": Case([], "torch.save wrote a tensor of shape (3,) there", prepare=tensor_at_ckpt_path),
    "list_at_ckpt_path": Case([], "torch.save wrote a list of 2 items there", prepare=list_at_ckpt_path),
    "nan_in_input_data": Case([], "NaN", prepare=nan_data),
    "nan_loss": Case(["--optimizer=torch.optim.SGD", "--optimizer.init_args.lr=1e30"], "diverged"),
    "torchrun_world_size_mismatch": Case(
        [],
        "trainer.devices",
        env={
            "WORLD_SIZE": "3",
            "RANK": "0",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "3",
            "GROUP_RANK": "0",
            "TORCHELASTIC_RUN_ID": "bad-input",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29531",
        },
    ),
    "master_port_in_use": Case([], "MASTER_PORT", prepare=port_in_use),
    # Rank 1 of a 2-node job whose rank 0 never comes up: nothing listens at the address.
    "unreachable_master_addr": Case(
        ["--collective_timeout_s=8", "--trainer.devices=1", "--trainer.num_nodes=2"],
        "MASTER_ADDR=127.0.0.1",
        env={
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29532",
            "NODE_RANK": "1",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "0",
            "RANK": "1",
        },
    ),
    "unknown_accelerator": Case(["--trainer.accelerator=quantum"], "invalid value 'quantum' for trainer.accelerator"),
    # Refused by Lightning while the launcher builds the Trainer (app/run/trainer_check.py), before any rank starts.
    "devices_not_a_number": Case(["--trainer.devices=two"], "invalid value 'two' for trainer.devices"),
    "devices_a_fraction": Case(["--trainer.devices=0.5"], "invalid value '0.5' for trainer.devices"),
    "unknown_strategy": Case(["--trainer.strategy=nonsense"], "invalid value 'nonsense' for trainer.strategy"),
    "unknown_precision": Case(["--trainer.precision=17"], "invalid value '17' for trainer.precision"),
    "num_nodes_zero": Case(["--trainer.num_nodes=0"], "invalid value 0 for trainer.num_nodes"),
    "limit_train_batches_negative": Case(["--trainer.limit_train_batches=-1"], "invalid value -1"),
    # Taken by Lightning's Trainer, then a ZeroDivisionError in every rank or silently ignored.
    "accumulate_grad_batches_zero": Case(
        ["--trainer.accumulate_grad_batches=0"], "invalid value 0 for trainer.accumulate_grad_batches"
    ),
    "gradient_clip_val_negative": Case(["--trainer.gradient_clip_val=-1"], "invalid value -1"),
    "val_check_interval_zero": Case(
        ["--trainer.val_check_interval=0"], "invalid value 0 for trainer.val_check_interval"
    ),
    "log_every_n_steps_negative": Case(
        ["--trainer.log_every_n_steps=-1"], "invalid value -1 for trainer.log_every_n_steps"
    ),
    "gpu_on_a_machine_without_one": Case(["--trainer.accelerator=gpu"], "no usable GPU"),
    "precision_the_device_cannot_run": Case(["--trainer.precision=16-mixed", "--trainer.accelerator=cpu"], "precision"),
    "validation_set_smaller_than_ranks": Case(
        ["--config=configs/toy.yaml", "--data.init_args.num_samples=4"], "fewer than the 2 ranks"
    ),
    "disk_full_while_saving": Case([], "no space left", needs_root=True),
}


def unchanged(before: dict[str, str], after: dict[str, str]) -> bool:
    """Every file that existed before still exists with the same bytes (new files are fine)."""
    return all(after.get(name) == value for name, value in before.items())


def digest(directory: Path) -> dict[str, str]:
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


@pytest.fixture(scope="module")
def previous_run(digits_trained: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A finished run (the session's digits run, copied) whose checkpoint and logs every case must leave untouched."""
    root = copy_of(digits_trained, tmp_path_factory.mktemp("previous_run") / "run")
    os.environ["BAD_INPUT_LAST_CKPT"] = str(root / "checkpoints" / "last.ckpt")
    yield root
    os.environ.pop("BAD_INPUT_LAST_CKPT", None)


def run_case(case: Case, scratch: Path) -> subprocess.CompletedProcess[str]:
    """The case as a new run in a directory of its own (`scratch/run`): a fit that does not continue a
    run may not write into its directory (app/run/directory.py), so bad input cannot reach another run's
    files; the launcher's refusals run against a previous run (`test_refused_before_any_rank`), and a
    failed continuation of one is `test_disk_full_while_saving_keeps_the_old_checkpoint`."""
    root = scratch / "run"
    extra = case.prepare(scratch) if case.prepare else []
    # Last, unless the case sets its own: a case's `--config` (mnist.yaml, toy.yaml) would otherwise
    # bring its own default_root_dir, the repository's runs/<config>.
    own_root = any(arg.startswith("--trainer.default_root_dir") for arg in [*extra, *case.args])
    args = [
        "fit",
        "--config",
        "configs/digits.yaml",
        "--trainer.enable_progress_bar=false",
        *extra,
        *case.args,
        *([] if own_root else [f"--trainer.default_root_dir={root}"]),
    ]
    return ddp_app(*args, timeout=TIMEOUT_S, env=clean_env(**case.env))


def assert_one_clear_line(result: subprocess.CompletedProcess[str], expect: str) -> None:
    assert result.returncode != 0, result.stdout[-1500:] + result.stderr[-1500:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert errors, result.stderr[-3000:]
    assert len(set(errors)) == 1, errors  # every rank that reports says the same single line
    assert expect in errors[0], errors[0]


# Refused by the launcher's parse-only pass: tested in this process (`test_refused_before_any_rank`).
LAUNCHER_CASES = [
    "unknown_key_cli", "unknown_key_yaml", "wrong_type", "malformed_yaml", "missing_config", "unknown_model_class",
    "negative_lr", "max_epochs_zero", "max_epochs_negative", "no_epoch_limit_and_no_step_limit", "max_steps_zero",
    "devices_zero",
    "num_nodes_without_other_nodes", "unwritable_root_dir", "truncated_ckpt", "malicious_ckpt",
    "text_file_at_ckpt_path", "yaml_file_at_ckpt_path", "zip_of_text_at_ckpt_path", "empty_file_at_ckpt_path",
    "directory_at_ckpt_path", "tensor_at_ckpt_path", "list_at_ckpt_path",
    "unknown_accelerator", "devices_not_a_number", "devices_a_fraction", "unknown_strategy", "unknown_precision",
    "num_nodes_zero", "limit_train_batches_negative", "accumulate_grad_batches_zero", "gradient_clip_val_negative",
    "val_check_interval_zero", "log_every_n_steps_negative", "gpu_on_a_machine_without_one",
    "precision_the_device_cannot_run", "missing_imagefolder_data_dir", "missing_shards_data_dir",
]  # fmt: skip
# Run as the real command (`test_bad_input`): what only ranks can find, and one launcher refusal of each
# kind (the parser, a checkpoint, Lightning's own check of the Trainer) for the command's exit code and
# output. The other two cases need a live socket or a mount of their own.
OWN_TESTS = ("master_port_in_use", "disk_full_while_saving")
COMMAND_CASES = [name for name in CASES if name not in LAUNCHER_CASES and name not in OWN_TESTS]
COMMAND_CASES += ["unknown_key_cli", "truncated_ckpt", "unknown_accelerator"]


@pytest.fixture(scope="module")
def case_results(
    previous_run: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[subprocess.CompletedProcess[str], Path]]:
    """Every plain case's run, two at a time: each is a whole `ddp-app` start, mostly single-threaded
    imports, so two of them keep both cores busy. Per case its result and scratch directory. (Cases
    that name a finished checkpoint take the previous run's, through BAD_INPUT_LAST_CKPT.)"""

    scratches = {name: tmp_path_factory.mktemp(name) for name in COMMAND_CASES}  # not thread-safe: here, in order

    def run_one(name: str) -> tuple[str, tuple[subprocess.CompletedProcess[str], Path]]:
        return name, (run_case(CASES[name], scratches[name]), scratches[name])

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(run_one, COMMAND_CASES))


@pytest.mark.parametrize("name", COMMAND_CASES)
def test_bad_input(name: str, case_results) -> None:
    result, scratch = case_results[name]
    assert_one_clear_line(result, CASES[name].expect)
    assert not (scratch / "PWNED").exists(), "unpickling the checkpoint ran code"


@pytest.mark.parametrize("name", LAUNCHER_CASES)
def test_refused_before_any_rank(
    name: str, previous_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The launcher's own pass over the command line, in this process: exit code 2, one line that names
    the problem, the previous run untouched, nothing unpickled."""
    case = CASES[name]
    monkeypatch.chdir(REPO)
    for variable in set(os.environ) - set(env_without_launcher(os.environ)):
        monkeypatch.delenv(variable)
    before = digest(previous_run)
    extra = case.prepare(tmp_path) if case.prepare else []
    own_root = any(arg.startswith("--trainer.default_root_dir") for arg in [*extra, *case.args])
    args = [
        "fit", "--config", "configs/digits.yaml", "--trainer.enable_progress_bar=false", *extra, *case.args,
        *([] if own_root else [f"--trainer.default_root_dir={previous_run}"]),  # after a case's own --config
    ]  # fmt: skip
    with pytest.raises(SystemExit) as refused:
        check_before_launch(args)
    assert refused.value.code == BAD_INPUT_EXIT_CODE
    captured = capsys.readouterr()
    assert_one_clear_line(subprocess.CompletedProcess(args, 2, captured.out, captured.err), case.expect)
    assert unchanged(before, digest(previous_run)), "an existing checkpoint or log was changed"
    assert not (tmp_path / "PWNED").exists(), "unpickling the checkpoint ran code"


def test_more_cpu_ranks_than_cores_run_after_one_warning_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Slow, not wrong (a resume on more ranks than a small machine has cores): the launcher's pass accepts
    it and says so once; DDP_APP_ALLOW_OVERSUBSCRIBE=1 silences the line."""
    monkeypatch.chdir(REPO)
    for variable in set(os.environ) - set(env_without_launcher(os.environ)):
        monkeypatch.delenv(variable)
    monkeypatch.delenv("DDP_APP_ALLOW_OVERSUBSCRIBE", raising=False)
    devices = (os.cpu_count() or 1) + 1
    args = [
        "fit",
        "--config",
        "configs/digits.yaml",
        f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.devices={devices}",
    ]
    assert check_before_launch(args).plan is not None
    warnings = [line for line in capsys.readouterr().err.splitlines() if "oversubscribe" in line]
    assert warnings == [
        f"ddp-app: warning: trainer.devices={devices} CPU processes on a machine with {devices - 1} cores "
        f"oversubscribe it: every step waits for the slowest rank. For speed: trainer.devices <= {devices - 1} "
        "(DDP_APP_ALLOW_OVERSUBSCRIBE=1 silences this line)."
    ]
    monkeypatch.setenv("DDP_APP_ALLOW_OVERSUBSCRIBE", "1")
    check_before_launch(args)
    assert "oversubscribe" not in capsys.readouterr().err


def test_a_lightning_checkpoint_still_loads(
    previous_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The format check lets a real checkpoint through, in either of torch.save's formats."""
    monkeypatch.chdir(REPO)
    last = previous_run / "checkpoints" / "last.ckpt"
    args = ["fit", "--config", "configs/digits.yaml", f"--trainer.default_root_dir={tmp_path / 'run'}"]
    assert check_before_launch([*args, f"--ckpt_path={last}"]).config["ckpt_path"] == str(last)
    legacy = tmp_path / "legacy.ckpt"
    torch.save(torch.load(last, weights_only=True), legacy, _use_new_zipfile_serialization=False)
    assert check_before_launch([*args, f"--ckpt_path={legacy}"]).config["ckpt_path"] == str(legacy)


@pytest.mark.parametrize(
    "length",
    [
        ["--trainer.max_epochs=-1", "--trainer.max_steps=20"],
        ["--trainer.max_epochs=-1", "--trainer.max_time=00:00:01:00"],
    ],
)
def test_no_epoch_limit_is_taken_with_a_step_or_time_limit(
    length: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """max_epochs -1 is Lightning's "no epoch limit", legal when max_steps or max_time ends the run."""
    monkeypatch.chdir(REPO)
    args = ["fit", "--config", "configs/digits.yaml", f"--trainer.default_root_dir={tmp_path}", *length]
    assert check_before_launch(args).config["trainer"]["max_epochs"] == -1


def test_files_torch_save_did_not_write_are_told_apart(tmp_path: Path) -> None:
    """What `describe_other_format` says, from the first bytes, of files a user might pass by mistake."""
    import pickle

    from app.checkpoints.io import describe_other_format

    def described(name: str, content: bytes) -> str | None:
        (tmp_path / name).write_bytes(content)
        with open(tmp_path / name, "rb") as file:
            return describe_other_format(file, Path(name).suffix)

    assert (
        described("a.pkl", pickle.dumps({"a": 1}, protocol=4))
        == "a Python pickle written by pickle.dump, not by torch.save"
    )
    assert described("a.gz", b"\x1f\x8b\x08\x00") == "a gzip-compressed file"
    assert described("a.json", b'{"a": 1}') == "a JSON file"
    assert described("a.bin", bytes(range(256))) == "a binary file in another format"
    truncated = (REPO / "README.md").read_bytes()[:0]
    assert described("b.ckpt", truncated) == "an empty file"
    script = torch.jit.script(torch.nn.Linear(2, 2))
    torch.jit.save(script, tmp_path / "model.pt")
    with open(tmp_path / "model.pt", "rb") as file:
        assert "TorchScript" in (describe_other_format(file) or "")


def test_master_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        case = Case([], "MASTER_PORT", env={"MASTER_PORT": str(port), "MASTER_ADDR": "127.0.0.1"})
        result = run_case(case, tmp_path)
    assert_one_clear_line(result, "MASTER_PORT")


def test_disk_full_while_saving_keeps_the_old_checkpoint(previous_run: Path, tmp_path: Path) -> None:
    """A real full file system: a 1 MiB tmpfs holding the previous run; the next save cannot fit."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True)
    try:
        shutil.copytree(previous_run / "checkpoints", small / "checkpoints")
        filler = small / "filler"
        with open(filler, "wb") as file:  # leave less room than one more checkpoint needs
            free = shutil.disk_usage(small).free
            file.write(b"\0" * max(0, free - 100_000))
        before = digest(small / "checkpoints")
        result = ddp_app(
            "fit",
            "--config",
            "configs/digits.yaml",
            f"--trainer.default_root_dir={small}",
            "--ckpt_path=last",  # continuing the run: a new one may not write into its directory
            "--trainer.enable_progress_bar=false",
            "--trainer.logger=false",
            timeout=TIMEOUT_S,
        )
        assert_one_clear_line(result, "no space left")
        assert unchanged(before, digest(small / "checkpoints"))
        assert not [path for path in (small / "checkpoints").iterdir() if path.name.endswith(".tmp")]
    finally:
        subprocess.run(["umount", str(small)], check=False)


def test_there_are_at_least_25_cases_and_each_is_tested() -> None:
    assert len(CASES) >= 25
    assert set(LAUNCHER_CASES) | set(COMMAND_CASES) | set(OWN_TESTS) == set(CASES)


def test_malicious_checkpoint_is_really_malicious(tmp_path: Path) -> None:
    """The test's payload does run code when loaded without weights_only (so refusing it matters)."""
    malicious_checkpoint(tmp_path)
    with open(tmp_path / "evil.ckpt", "rb") as file:
        torch.load(file, weights_only=False)
    assert (tmp_path / "PWNED").exists()
