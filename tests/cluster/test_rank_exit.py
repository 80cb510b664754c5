"""A rank's process ends with its own exit code, not with an abort after its work is done (issue 56).

Every process whose trainer had the hang report on (HangReport in every multi-rank run) holds a Python
handler in PyTorch's debug-endpoint registry, a C++ static that libc's `exit` destroys after the
interpreter has finalized. When finalization had dropped every other reference to the handler, that
destructor freed a Python function without the GIL: "Fatal Python error: PyThreadState_Get ... Python
runtime state: finalizing", SIGABRT, exit 134. ddp-app's own ranks end with `os._exit` (end_rank) and
never ran it; the ranks Lightning starts itself for a `DDPAppCLI` used as a library, such as
`python -m app.parity eval-worker`, end through the interpreter and did, every time.

These run in a new interpreter each (never forked from the tests' zygote, which ends its commands
with `os._exit` and so would hide what the interpreter's own exit does).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from app.parity import python_env
from tests.helpers.run import REPO, check_marked_distributed

FATAL = "Fatal Python error"

# The hang report's registration, then the state interpreter finalization can leave it in: the module's
# namespace cleared, so torch's registry holds the last reference to each handler until libc's exit.
HANDLERS_LEFT_TO_TORCH = """
import sys
from app.cluster import hangs
server, port = hangs.start_debug_endpoint("127.0.0.1")
assert hangs.ask(hangs.RankAddress(0, "here", 0, "127.0.0.1", port), "ping", 30)[0] == "pong"
server.shutdown()
vars(hangs).clear()
del sys.modules["app.cluster.hangs"], sys.modules["app.cluster"].hangs, hangs
print("registered", flush=True)
"""


def run_interpreter(args: list[str], timeout: float, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """`args` in a new interpreter and a session of its own; on timeout, its whole process group is killed."""
    process = subprocess.Popen(
        args, cwd=cwd, env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise AssertionError(f"{args} did not finish in {timeout} s:\n{output[-3000:]}") from None
    finally:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return subprocess.CompletedProcess(args, process.returncode, output, "")


def assert_ended_cleanly(result: subprocess.CompletedProcess[str], what: str) -> None:
    assert result.returncode == 0 and FATAL not in result.stdout, (
        f"{what} exited with {result.returncode}:\n{result.stdout[-4000:]}"
    )


def test_a_process_that_registered_the_hang_reports_handler_exits_0() -> None:
    result = run_interpreter([sys.executable, "-X", "dev", "-c", HANDLERS_LEFT_TO_TORCH], timeout=120)
    assert "registered" in result.stdout, result.stdout[-3000:]
    assert_ended_cleanly(result, "a process that left the hang report's handler to torch's registry")


@pytest.mark.distributed
@pytest.mark.parity
def test_two_ranks_that_lightning_starts_exit_0_every_time(tmp_path: Path) -> None:
    """`python -m app.parity eval-worker --devices 2` (DDPAppCLI as a library: Lightning starts rank 1,
    both end through the interpreter), three times, after a 2-rank fit forked by ddp-app's launcher."""
    root = tmp_path / "fit"
    fit = run_interpreter(
        [sys.executable, "-m", "app", "fit", "--config", "configs/digits.yaml", "--trainer.max_epochs=1",
         "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={root}"],
        timeout=300,
    )  # fmt: skip
    check_marked_distributed(fit.stdout)
    assert_ended_cleanly(fit, "a 2-rank fit forked by ddp-app's launcher")
    for attempt in range(3):
        out = tmp_path / f"eval{attempt}" / "metrics.json"
        evaluation = run_interpreter(
            [sys.executable, "-m", "app.parity", "eval-worker", "--config", "configs/digits.yaml",
             "--ckpt", str(root / "checkpoints" / "last.ckpt"), "--devices", "2", "--json", str(out)],
            timeout=300,
        )  # fmt: skip
        check_marked_distributed(evaluation.stdout)
        assert_ended_cleanly(evaluation, f"the 2-rank eval-worker, attempt {attempt + 1} of 3")
        assert evaluation.stdout.count("Initializing distributed: GLOBAL_RANK:") == 2, evaluation.stdout[-3000:]
        metrics = json.loads(out.read_text())
        assert 0.0 < metrics["test_acc"] <= 1.0 and 0.0 < metrics["val_acc"] <= 1.0, metrics
