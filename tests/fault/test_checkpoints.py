"""Checkpoints are atomic, and loading never runs code: local files and http(s) URLs alike."""

from __future__ import annotations

import contextlib
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


class _ShortWrites(io.RawIOBase):
    """A file with `room` bytes left, as the OS has it: the write that crosses it is short (takes what
    fits and says so), the next raises `OSError(code)` (full, over quota, failing)."""

    def __init__(self, file: Any, room: int, code: int) -> None:
        self.file, self.room, self.code = file, room, code

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if self.room <= 0:
            raise OSError(self.code, os.strerror(self.code))
        taken = memoryview(data)[: self.room]
        self.room -= len(taken)
        return self.file.write(taken)


def test_a_full_disk_inside_torch_save_is_reported_as_a_full_disk_with_the_path(tmp_path: Path) -> None:
    """torch.save's zip writer turns ENOSPC into "unexpected pos" on close; the path and cause survive."""
    target = tmp_path / "last.ckpt"
    target.write_bytes(b"previous")
    big = {"w": torch.randn(100_000)}
    with pytest.raises(OSError) as error:
        atomic_write(target, lambda file: torch.save(big, io.BufferedWriter(_ShortWrites(file, 50_000, errno.ENOSPC))))
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


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        (errno.EDQUOT, "disk quota exceeded"),
        (errno.ENOSPC, "no space left on device"),
        (errno.EIO, "input/output error"),
    ],
    ids=["edquot", "enospc", "eio"],
)
def test_a_refused_write_inside_torch_save_is_one_line_naming_the_path_and_the_reason(
    tmp_path: Path, code: int, reason: str
) -> None:
    """A short write, then the disk's error, under Python's buffered file (which retries the rest of a
    short write, as for every file ddp-app writes): torch.save's zip writer turns each into its own
    "unexpected pos" error; the line names the disk's reason, and the previous file stays."""
    from app.checkpoints.plugin import CheckpointWriteError, SafeCheckpointIO

    target = tmp_path / "last.ckpt"
    target.write_bytes(b"previous")
    real_save = torch.save
    with pytest.MonkeyPatch.context() as patch:  # the file torch.save writes into refuses past 50 kB
        patch.setattr(
            torch, "save", lambda obj, file: real_save(obj, io.BufferedWriter(_ShortWrites(file, 50_001, code)))
        )
        with pytest.raises(CheckpointWriteError) as error:
            SafeCheckpointIO().save_checkpoint({"w": torch.randn(100_000)}, target)
    assert str(error.value).startswith(f"could not write the checkpoint {target}: {reason}; the previous checkpoint")
    assert target.read_bytes() == b"previous"
    assert not [path for path in tmp_path.iterdir() if path.name.endswith(".tmp")]


def test_dcps_failure_of_another_rank_that_lost_its_cause_is_still_the_disks_one_line(tmp_path: Path) -> None:
    """DCP hands each rank's failure to every rank pickled, without its context: a rank's "unexpected
    pos" arrives bare. On a full filesystem it is the full disk's line, naming that rank; elsewhere EIO."""
    from torch.distributed.checkpoint.api import CheckpointException

    from app.checkpoints.sharded_io import sharded_write_error

    bare = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    failure = CheckpointException("write", {1: (bare, None), 0: (ValueError("not a disk"), None)})
    line = str(sharded_write_error(tmp_path / "last.ckpt", failure))
    assert line.startswith(f"could not write the checkpoint {tmp_path}/last.ckpt (rank 1's shards): input/output error")
    full = tmp_path / "full"
    full.mkdir()
    with _tmpfs(full, "1m"):
        (full / "filler").write_bytes(b"\0" * (1 << 20) if False else b"")
        subprocess.run(["dd", "if=/dev/zero", f"of={full}/filler", "bs=64k"], capture_output=True)
        line = str(sharded_write_error(full / "last.ckpt", failure))
    assert "(rank 1's shards): no space left on device; the previous checkpoint there, if any, is unchanged" in line
    assert (
        sharded_write_error(tmp_path / "last.ckpt", CheckpointException("write", {0: (bare.__class__("a bug"), None)}))
        is None
    )


@contextlib.contextmanager
def _tmpfs(directory: Path, size: str) -> Iterator[None]:
    """A tmpfs of `size` mounted on `directory` (root only; the test is skipped otherwise)."""
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)]).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


FULL_DISK_CONFIG = "configs/gpt_fsdp.yaml"  # a GPT: about 1.4 MB a checkpoint (DDP), 1.8 MB of shards (fsdp)
FULL_DISK_OVERLAY = """
trainer:
  max_epochs: 1
  enable_progress_bar: false
  logger: false
{strategy}
last_checkpoint:
  every_n_steps: 2
  async_save: {async_save}
"""


@pytest.fixture(scope="module")
def uninterrupted_gpt(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, bool], tuple[Path, Path]]:
    """(the overlay, the uninterrupted run's last.ckpt) of each strategy and save mode, made once."""
    made: dict[tuple[str, bool], tuple[Path, Path]] = {}

    def run(strategy: str, async_save: bool) -> tuple[Path, Path]:
        if (strategy, async_save) not in made:
            root = tmp_path_factory.mktemp(f"uninterrupted-{strategy}-{async_save}")
            overlay = root / "overlay.yaml"
            line = "  strategy: ddp" if strategy == "ddp" else ""
            overlay.write_text(FULL_DISK_OVERLAY.format(strategy=line, async_save=str(async_save).lower()))
            result = ddp_app(
                "fit",
                "--config",
                FULL_DISK_CONFIG,
                "--config",
                str(overlay),
                f"--trainer.default_root_dir={root / 'run'}",
            )
            assert result.returncode == 0, result.stderr[-3000:]
            made[strategy, async_save] = overlay, root / "run" / "checkpoints" / "last.ckpt"
        return made[strategy, async_save]

    return run


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("strategy", "async_save"),
    [
        ("ddp", True),
        ("fsdp", True),
        pytest.param("ddp", False, marks=pytest.mark.slow),
        pytest.param("fsdp", False, marks=pytest.mark.slow),
    ],
    ids=["ddp-background", "fsdp-background", "ddp-sync", "fsdp-sync"],
)
def test_a_full_disk_is_one_line_exit_2_keeps_the_previous_checkpoint_and_resumes_bit_for_bit(
    tmp_path: Path, uninterrupted_gpt, strategy: str, async_save: bool
) -> None:
    """The run directory on a 64 MB tmpfs with room for about one and a half checkpoints: the first
    save (step 2) fits, the second cannot. Then space is freed and `--ckpt_path last` ends with the
    uninterrupted run's weights."""
    from app.checkpoints.sharded import load_whole

    overlay, expected = uninterrupted_gpt(strategy, async_save)
    saved = expected.resolve()  # a file (DDP), or the directory of shards its link names (fsdp)
    size = sum(path.stat().st_size for path in saved.rglob("*")) if saved.is_dir() else saved.stat().st_size
    run = tmp_path / "run"
    run.mkdir()
    with _tmpfs(run, "64m"):
        filler = run / "filler"
        left = size * 3 // 2 + 64 * 1024  # the first save and the run's other files fit, a second save not
        room = os.statvfs(run).f_bavail * os.statvfs(run).f_frsize - left
        with open(filler, "wb") as file:
            os.posix_fallocate(file.fileno(), 0, room)
        result = ddp_app(
            "fit", "--config", FULL_DISK_CONFIG, "--config", str(overlay), f"--trainer.default_root_dir={run}"
        )
        log = result.stdout + result.stderr
        errors = sorted({line for line in log.splitlines() if "error:" in line})
        last = run / "checkpoints" / "last.ckpt"
        assert result.returncode == 2 and len(errors) == 1, log[-3000:]
        assert (
            f"could not write the checkpoint {last}" in errors[0]
            and "no space left on device; the previous checkpoint there, if any, is unchanged. Fix: free space on"
            in errors[0]
        ), errors
        assert "Traceback" not in log, log[-3000:]
        assert load_whole(last)["global_step"] == 2  # the first save, whole; the second never published
        leftovers = [path.name for path in last.parent.iterdir() if path.name.endswith((".tmp", ".shards"))]
        assert len(leftovers) == (1 if strategy == "fsdp" else 0), leftovers  # the failed save's space freed
        filler.unlink()
        resumed = ddp_app(
            "fit",
            "--config",
            FULL_DISK_CONFIG,
            "--config",
            str(overlay),
            f"--trainer.default_root_dir={run}",
            "--ckpt_path=last",
        )
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        first, second = load_whole(expected)["state_dict"], load_whole(last)["state_dict"]
        assert first.keys() == second.keys()
        different = [key for key in first if not torch.equal(first[key], second[key])]
        assert not different, f"weights differ after the resume, first: {different[0]}"
