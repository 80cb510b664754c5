"""Checkpoints are atomic, and loading never runs code: local files and http(s) URLs alike."""

from __future__ import annotations

import functools
import http.server
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from app.checkpoints import CheckpointError, atomic_torch_save, safe_load
from tests.fault.test_bad_input import malicious_checkpoint
from tests.helpers.run import BIN, REPO, clean_env, ddp_app, kill_job, train

pytestmark = pytest.mark.fault

WRITER = """
import sys, torch
from app.checkpoints import atomic_torch_save
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
        job = subprocess.Popen(
            command,
            cwd=REPO,
            env=clean_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
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


def test_our_own_checkpoints_load_with_weights_only(tmp_path: Path, http_server: str) -> None:
    checkpoint = torch.load(train("configs/toy.yaml", tmp_path, epochs=1), weights_only=True)
    assert {"state_dict", "loops", "optimizer_states", "hyper_parameters", "rng_states_per_rank"} <= checkpoint.keys()
    assert len(checkpoint["rng_states_per_rank"]) == 2
    remote = safe_load(f"{http_server}/checkpoints/last.ckpt")
    assert remote["global_step"] == checkpoint["global_step"]
