"""Session fixture that starts a real two-node Slurm cluster for `slurm` tests."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from localcluster import LocalSlurmCluster  # noqa: E402

INSTALL_SCRIPT = Path(__file__).resolve().parent / "install_slurm.sh"


def _netns_unavailable() -> str | None:
    """Why network namespaces cannot be used here, or None if they can."""
    probe = f"sltprobe{os.getpid()}"
    add = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True, timeout=30)
    if add.returncode != 0:
        return f"network namespaces unavailable: {add.stderr.strip()}"
    return None


def _raise_keyboard_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurmCluster]:
    """A started LocalSlurmCluster (node1, node2); stopped at session end."""
    if sys.platform != "linux":
        pytest.skip("the local Slurm cluster needs Linux network namespaces")
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root (network namespaces, mounts)")
    search_path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin:/usr/bin:/bin"
    if any(shutil.which(tool, path=search_path) is None for tool in ("slurmctld", "slurmd", "sinfo", "ip", "nsenter")):
        proc = subprocess.run(["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            pytest.fail(f"{INSTALL_SCRIPT} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)

    cluster = LocalSlurmCluster(tmp_path_factory.mktemp("slurm"))
    # CI cancels with SIGTERM, which by default ends Python without running
    # finally blocks; as KeyboardInterrupt pytest aborts and tears down.
    handle_sigterm = signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    if handle_sigterm:
        signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        cluster.start()
        yield cluster
    finally:
        if handle_sigterm:  # a second SIGTERM must not cut the (bounded) teardown short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            cluster.stop()
        finally:
            if handle_sigterm:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
