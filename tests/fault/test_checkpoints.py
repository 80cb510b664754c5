"""Checkpoints are atomic, and loading never runs code: local files and http(s) URLs alike."""

from __future__ import annotations

import errno
import functools
import http.server
import io
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from app.checkpoints import state as checkpoint_state
from app.checkpoints.io import (
    CheckpointError,
    CheckpointSummary,
    atomic_torch_save,
    atomic_write,
    check_model_class,
    check_overrides,
    check_state_fits,
    safe_load,
    shapes,
    summarize_checkpoint,
)
from app.export import main as export_main
from app.run.config_checks import command_line_model_keys
from tests.fault.test_bad_input import malicious_checkpoint
from tests.helpers.run import BIN, REPO, clean_env, copy_of, ddp_app, kill_job, start, train

pytestmark = pytest.mark.fault

WRITER = """
import sys, torch
from app.checkpoints.io import atomic_torch_save
payload = {"weights": torch.randn(4_000_000)}  # 16 MB: each save takes long enough to be interrupted
open(sys.argv[2], "w").close()  # ready: imports done, saving starts now
i = 0
while True:
    payload["step"] = i
    atomic_torch_save(payload, sys.argv[1])
    i += 1
"""


def test_killing_a_writer_mid_save_never_leaves_a_truncated_file(tmp_path: Path) -> None:
    target = tmp_path / "last.ckpt"
    atomic_torch_save({"weights": torch.zeros(1), "step": -1}, target)
    rng = random.Random(0)
    for attempt in range(5):
        ready = tmp_path / f"ready-{attempt}"
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(target), str(ready)], cwd=REPO, env=clean_env())
        try:
            deadline = time.monotonic() + 60
            while not ready.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(rng.random() * 1.5)
        finally:
            writer.send_signal(signal.SIGKILL)
            writer.wait()
        assert isinstance(safe_load(target)["step"], int)  # loads, whole
    assert safe_load(target)["step"] >= 0, "the writer never completed a save; the test proved nothing"


def test_lightning_run_killed_during_saves_keeps_a_loadable_last_ckpt(tmp_path: Path) -> None:
    """A checkpoint every step, the whole job killed at random moments, resumed each time."""
    overlay = tmp_path / "every-step.yaml"
    overlay.write_text(
        "trainer:\n  max_epochs: 50\n  enable_progress_bar: false\n  logger: false\n  callbacks:\n"
        "    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
        "      init_args: {every_n_train_steps: 1, save_top_k: 0, save_last: true}\n"
    )
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    rng = random.Random(1)
    for attempt in range(4):
        command = [
            str(BIN / "ddp-app"),
            "fit",
            "--config",
            "configs/digits.yaml",
            "--config",
            str(overlay),
            f"--trainer.default_root_dir={tmp_path / 'run'}",
        ]
        if attempt:
            command.append("--ckpt_path=last")
        job = start(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while not last.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(rng.random())
        finally:
            kill_job(job.pid)  # the launcher and the ranks, the writer among them
            job.wait()
        checkpoint = safe_load(last)
        assert checkpoint["global_step"] > 0
    leftovers = [path.name for path in last.parent.iterdir() if path.name.endswith(".tmp")]
    assert len(leftovers) <= 1, leftovers  # at most the one being written at the last kill


class _FullDisk(io.RawIOBase):
    """A file that takes `room` bytes and then fails as a full disk does (OSError ENOSPC)."""

    def __init__(self, file: Any, room: int) -> None:
        self.file, self.room = file, room

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        size = len(memoryview(data))
        if size > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= size
        return self.file.write(data)


def test_a_full_disk_inside_torch_save_is_reported_as_a_full_disk_with_the_path(tmp_path: Path) -> None:
    """torch.save's zip writer turns ENOSPC into "unexpected pos" on close; the path and cause survive."""
    target = tmp_path / "last.ckpt"
    target.write_bytes(b"previous")
    big = {"w": torch.randn(100_000)}
    with pytest.raises(OSError) as error:
        atomic_write(target, lambda file: torch.save(big, _FullDisk(file, 50_000)))
    assert error.value.errno == errno.ENOSPC and error.value.filename == str(target)
    assert target.read_bytes() == b"previous"
    assert not [path for path in tmp_path.iterdir() if path.name.endswith(".tmp")]


def test_truncated_checkpoint_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "model.ckpt"
    torch.save({"w": torch.randn(1000)}, path)
    path.write_bytes(path.read_bytes()[:500])
    with pytest.raises(CheckpointError, match="truncated or corrupt") as error:
        safe_load(path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_malicious_local_checkpoint_is_refused_without_running(tmp_path: Path) -> None:
    malicious_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="refused to load"):
        safe_load(tmp_path / "evil.ckpt")
    assert not (tmp_path / "PWNED").exists()


@pytest.fixture
def http_server(tmp_path: Path) -> Iterator[str]:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.distributed
def test_malicious_checkpoint_over_http_is_refused_without_running(tmp_path: Path, http_server: str) -> None:
    """Lightning loads http(s) checkpoints with weights_only=False; we never do."""
    malicious_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="refused to load"):
        safe_load(f"{http_server}/evil.ckpt")
    result = ddp_app(
        "fit",
        "--config",
        "configs/digits.yaml",
        f"--trainer.default_root_dir={tmp_path / 'run'}",
        f"--ckpt_path={http_server}/evil.ckpt",
        timeout=120,
    )
    assert result.returncode != 0
    assert "refused to load" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.distributed
def test_our_own_checkpoints_load_with_weights_only(tmp_path: Path, http_server: str) -> None:
    checkpoint = torch.load(train("configs/toy.yaml", tmp_path, epochs=1), weights_only=True)
    assert {"state_dict", "loops", "optimizer_states", "hyper_parameters", "ddp_app"} <= checkpoint.keys()
    assert len(checkpoint_state.get(checkpoint, "exact_resume")["per_rank"]) == 2
    remote = safe_load(f"{http_server}/checkpoints/last.ckpt")
    assert remote["global_step"] == checkpoint["global_step"]


# Checkpoints that do not fit the config: one line naming the file and what does not fit, exit 2,
# and nothing written, from every subcommand that takes --ckpt_path.


class UserRegressor(L.LightningModule):
    """A user's module: no `net` attribute, no save_hyperparameters()."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.layer = nn.Linear(3, width)


def summary(
    state: dict[str, torch.Tensor], class_path: str | None = None, **hyper_parameters: Any
) -> CheckpointSummary:
    return CheckpointSummary("run/last.ckpt", class_path, hyper_parameters, shapes(state))


def test_a_user_module_without_net_is_checked_on_its_own_state_dict() -> None:
    check_state_fits(summary(UserRegressor().state_dict()), UserRegressor())
    with pytest.raises(CheckpointError, match=r"'layer.weight' has shape \(8, 3\) in the checkpoint but \(4, 3\)"):
        check_state_fits(summary(UserRegressor(width=8).state_dict()), UserRegressor())
    with pytest.raises(CheckpointError, match="unexpected key 'extra'"):
        check_state_fits(summary({**UserRegressor().state_dict(), "extra": torch.zeros(1)}), UserRegressor())
    lenient = UserRegressor()
    lenient.strict_loading = False  # Lightning then loads without the extra key, and so do we
    check_state_fits(summary({**UserRegressor().state_dict(), "extra": torch.zeros(1)}), lenient)


def test_the_model_class_is_compared_as_a_class_not_as_a_spelling() -> None:
    state = UserRegressor().state_dict()
    check_model_class(summary(state, "app.models.MLPClassifier"), "app.models.lightning.MLPClassifier")
    check_model_class(summary(state), "app.models.ToyRegressor")  # no class saved: the shapes decide
    with pytest.raises(CheckpointError, match="made with model app.models.MLPClassifier, but the config builds app."):
        check_model_class(summary(state, "app.models.MLPClassifier"), "app.models.ToyRegressor")


def test_a_command_line_model_argument_that_contradicts_the_checkpoint_is_refused() -> None:
    stored = summary(UserRegressor().state_dict(), "app.models.MLPClassifier", hidden=256, in_features=64)
    check_overrides(stored, {"hidden": 256, "num_classes": 10})  # equal, or not stored: fine
    with pytest.raises(CheckpointError, match=r"--model.init_args.hidden=128 contradicts .* hidden=256\. Fix: drop"):
        check_overrides(stored, {"hidden": 128})


def test_model_keys_set_on_the_command_line() -> None:
    args = [
        "fit",
        "--config",
        "c.yaml",
        "--model.init_args.hidden",
        "128",
        "--model.in_features=3",
        "--model.class_path=X",
    ]
    assert command_line_model_keys([*args, "--trainer.max_epochs=1", "--ckpt_path=last"]) == ["hidden", "in_features"]


def test_an_exported_weights_file_is_named_as_such(tmp_path: Path) -> None:
    torch.save(UserRegressor().state_dict(), tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match="model.pt is an exported weights file"):
        summarize_checkpoint(tmp_path / "model.pt")
    torch.save({"weights": [1, 2]}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="other.pt is not a Lightning checkpoint"):
        summarize_checkpoint(tmp_path / "other.pt")


@pytest.fixture(scope="module")
def digits_run(digits_trained: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished digits run (MLPClassifier, hidden=256; the session's, copied), shared by the cases below."""
    return copy_of(digits_trained, tmp_path_factory.mktemp("digits_run") / "run")


def exported_weights(run: Path, scratch: Path) -> list[str]:
    export_main(["--ckpt", str(run / "checkpoints" / "last.ckpt"), "--out", str(scratch / "model.pt")])
    return ["fit", "--config", "configs/digits.yaml", "--ckpt_path", str(scratch / "model.pt")]


def without_hyperparameters(run: Path, scratch: Path) -> list[str]:
    """As a module without save_hyperparameters() writes it: only the shapes can tell. Saved among the
    run's own checkpoints, so the fit continues that run (a fit from a file elsewhere may not write
    into the run's directory: app/run/directory.py) and reaches the ranks, where the shapes are compared."""
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    del checkpoint["hyper_parameters"]
    torch.save(checkpoint, run / "checkpoints" / "no-hparams.ckpt")
    return [
        "fit",
        "--config",
        "configs/digits.yaml",
        "--model.hidden=128",
        "--ckpt_path",
        str(run / "checkpoints" / "no-hparams.ckpt"),
    ]


def last_ckpt(run: Path) -> str:
    return str(run / "checkpoints" / "last.ckpt")


CLASSES = ["last.ckpt", "app.models.MLPClassifier", "app.models.ToyRegressor"]
MISFITS: dict[str, tuple[Callable[[Path, Path], list[str]], list[str]]] = {
    # The digits checkpoint under the toy config: LightningCLI would swap in MLPClassifier silently.
    "another_model_class": (
        lambda run, _: ["fit", "--config=configs/toy.yaml", f"--ckpt_path={last_ckpt(run)}"], CLASSES
    ),
    "another_model_class_validate": (
        lambda run, _: ["validate", "--config=configs/toy.yaml", f"--ckpt_path={last_ckpt(run)}"], CLASSES
    ),
    # `last` is resolved from the checkpoint callback's directory, after the classes are built.
    "another_model_class_last": (lambda run, _: ["fit", "--config=configs/toy.yaml", "--ckpt_path=last"], CLASSES),
    "another_architecture": (
        without_hyperparameters, ["no-hparams.ckpt", "'net.fc1.weight'", "(256, 64)", "(128, 64)"]
    ),
    "exported_weights": (exported_weights, ["model.pt", "exported weights file", "load_state_dict"]),
    # The checkpoint's hidden=256 would win over the command line without a word.
    "contradicting_override": (
        lambda run, _: [
            "fit", "--config=configs/digits.yaml", "--model.init_args.hidden", "128", f"--ckpt_path={last_ckpt(run)}"
        ],
        ["last.ckpt", "--model.init_args.hidden=128", "hidden=256"],
    ),
}  # fmt: skip


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(MISFITS))
def test_a_checkpoint_that_does_not_fit_stops_in_one_line_writing_nothing(
    name: str, digits_run: Path, tmp_path: Path
) -> None:
    make_args, facts = MISFITS[name]
    args = make_args(digits_run, tmp_path)
    before = {path: path.read_bytes() for path in digits_run.rglob("*") if path.is_file()}
    result = ddp_app(
        *args, f"--trainer.default_root_dir={digits_run}", "--trainer.enable_progress_bar=false", timeout=120
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, result.stderr[-3000:]  # once, not once per rank
    assert all(fact in errors[0] for fact in facts), errors[0]
    # No checkpoint touched, and no new log version directory or any other file.
    assert {path: path.read_bytes() for path in digits_run.rglob("*") if path.is_file()} == before


def test_a_checkpoint_with_a_byte_changed_on_disk_is_refused_naming_the_record(tmp_path: Path) -> None:
    """torch.load never checks the CRC32 torch.save writes beside each record: a byte flipped after the
    save would load silently as a wrong weight. safe_load checks it (a file written without checksums
    still loads)."""
    path = tmp_path / "last.ckpt"
    weights = torch.arange(1000, dtype=torch.float32)
    torch.save({"state_dict": {"w": weights}}, path)
    data = bytearray(path.read_bytes())
    data[data.find(weights.numpy().tobytes()[400:432]) + 3] ^= 0x10  # one bit of one weight
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="is corrupt: its record .*data/0 does not match") as error:
        safe_load(path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)
    unchecked = tmp_path / "unchecked.ckpt"
    torch.serialization.set_crc32_options(False)
    try:
        torch.save({"state_dict": {"w": weights}}, unchecked)
    finally:
        torch.serialization.set_crc32_options(True)
    assert torch.equal(safe_load(unchecked)["state_dict"]["w"], weights)
