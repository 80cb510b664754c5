"""A tracker never holds training: every tracker call runs on the run's tracker thread, the training
thread only hands it work. A tracker that hangs, fails or is gone at the end costs a warning, and
what it did not confirm reaches it later, in step order, once (now or in the next attempt).
In-process, with trackers that hang or fail on demand; tests/tracking/test_unreachable.py does the
same with a real MLflow server that stops."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from app.cli.entry import check_before_launch, report_user_error
from app.errors import UserFacingError
from app.tracking import run as tracking_run
from app.tracking.history import Call, sent_seqs
from app.tracking.run import MLflowSettings, TrackedRun, Tracking
from app.tracking.sinks import RunFacts
from tests.helpers.ports import unused_port
from tests.helpers.run import REPO

# Any call of the training thread that hands work to the tracker thread returns within this.
AT_ONCE_S = 0.5


class ControlledSink:
    """A tracker whose calls block while `hold` is clear, or fail while `down` is set; it records
    what it took, in the order it took it."""

    name = "controlled"
    durable_on_send = True
    takes_earlier_steps = True

    def __init__(self) -> None:
        self.hold = threading.Event()
        self.hold.set()
        self.down = False
        self.values: list[tuple[str, int, float]] = []
        self.status: str | None = None

    def _call(self) -> None:
        self.hold.wait()
        if self.down:
            raise ConnectionError("[Errno 111] Connection refused")

    def start(self, run: RunFacts) -> None:
        self._call()

    def send(self, calls: list[Call]) -> None:
        self._call()
        self.values.extend((name, call.step, value) for call in calls for name, value in call.values.items())

    def note(self, tags: dict[str, str]) -> None:
        self._call()

    def close(self, status: str) -> None:
        self._call()
        self.status = status

    def steps(self) -> list[int]:
        return [step for _, step, _ in self.values]


def begin(log_dir: Path, sink: ControlledSink, attempt: int = 1, resumed: tuple[int, int] = (0, -1)) -> TrackedRun:
    run = TrackedRun(log_dir, {"run_id": "0123456789abcdef", "log_version": log_dir.name}, [sink])
    run.begin(*resumed, {"attempt": attempt}, RunFacts(attempt, max(resumed[1], 0), {}, {}, ""))
    return run


def epoch(run: TrackedRun, last_step: int) -> tuple[int, int]:
    """A step row and the epoch-end save, as Lightning logs them; returns the save's (seq, step)."""
    run.log(last_step - 10, {"train_loss": 1.0 / last_step})
    run.log(last_step, {"train_loss": 0.5 / last_step, "val_acc": 0.5})
    checkpoint = (run.history.last_seq, last_step)
    run.saved(*checkpoint, {"checkpoint.last": "last.ckpt"})
    return checkpoint


def timed(action, *args) -> float:
    started = time.monotonic()
    action(*args)
    return time.monotonic() - started


def test_a_tracker_that_hangs_never_holds_the_training_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(tracking_run, "CLOSE_WAIT_S", 1.0)
    monkeypatch.setattr(tracking_run, "STALL_WARNING_S", 0.2)
    sink = ControlledSink()
    sink.hold.clear()  # every call blocks until the test ends
    log_dir = tmp_path / "version_0"
    try:
        run = begin(log_dir, sink)
        for last_step in (19, 39, 59):
            assert timed(epoch, run, last_step) < AT_ONCE_S
            time.sleep(0.1)
        assert timed(run.finish) < AT_ONCE_S
        assert timed(run.close, "success", {}) < tracking_run.CLOSE_WAIT_S + AT_ONCE_S
        assert sink.values == [] and sent_seqs(log_dir / "sent-controlled.txt") == set()
        warnings = [line for line in capsys.readouterr().err.splitlines() if "controlled" in line]
        assert len(warnings) == 2, warnings  # once while training, once when the run leaves it behind
        assert "has not answered for" in warnings[0] and "training goes on" in warnings[0]
        assert "did not answer within 1 s" in warnings[1] and "next attempt" in warnings[1]
    finally:
        sink.hold.set()
    # The abandoned thread goes on once the tracker answers: everything, once, in step order.
    assert run.worker.drain(10)
    assert sink.steps() == [9, 19, 19, 29, 39, 39, 49, 59, 59] and sink.status == "success"
    assert sent_seqs(log_dir / "sent-controlled.txt") == set(run.history.calls)
    # Issue 56: the file says what its numbers are to whoever opens it.
    assert (log_dir / "sent-controlled.txt").read_text().startswith("# ddp-app: the seq of each call of journal.jsonl")


def test_a_tracker_that_fails_gets_its_backlog_in_step_order_when_it_answers_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sink = ControlledSink()
    log_dir = tmp_path / "version_0"
    run = begin(log_dir, sink)
    epoch(run, 19)
    assert run.worker.drain(10) and sink.steps() == [9, 19, 19]
    sink.down = True
    epoch(run, 39)
    epoch(run, 59)
    assert run.worker.drain(10) and sink.steps() == [9, 19, 19]
    sent = sent_seqs(log_dir / "sent-controlled.txt")
    assert sent == {1, 2}, "only what the tracker confirmed counts as sent"
    sink.down = False
    epoch(run, 79)
    run.finish()
    run.close("success", {})
    assert sink.steps() == [9, 19, 19, 29, 39, 39, 49, 59, 59, 69, 79, 79] and sink.status == "success"
    assert sent_seqs(log_dir / "sent-controlled.txt") == set(run.history.calls)
    lines = [line for line in capsys.readouterr().err.splitlines() if "controlled" in line]
    assert len(lines) == 2, lines  # one warning for the outage, one line when it is over
    assert "sending to controlled failed (Connection refused)" in lines[0]
    assert "answers again" in lines[1]


def test_what_a_tracker_missed_when_an_attempt_ended_goes_to_the_next_attempt(tmp_path: Path) -> None:
    down = ControlledSink()
    log_dir = tmp_path / "version_0"
    first = begin(log_dir, down)
    epoch(first, 19)
    assert first.worker.drain(10)
    down.down = True
    checkpoint = epoch(first, 39)
    first.close("stopped", {})
    assert sent_seqs(log_dir / "sent-controlled.txt") == {1, 2} and down.status is None

    back = ControlledSink()
    second = begin(log_dir, back, attempt=2, resumed=checkpoint)
    epoch(second, 59)
    second.finish()
    second.close("success", {})
    assert back.steps() == [29, 39, 39, 49, 59, 59], "the first attempt's unsent values, then the second's"
    assert sent_seqs(log_dir / "sent-controlled.txt") == set(second.history.calls)


def test_an_unreachable_mlflow_server_stops_the_open_in_seconds_and_writes_nothing(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    uri = f"http://127.0.0.1:{unused_port()}"  # nothing listens there
    trainer = SimpleNamespace(default_root_dir=str(tmp_path / "run"), is_global_zero=True, world_size=2, num_nodes=1)
    tracking = Tracking(mlflow=MLflowSettings(tracking_uri=uri), tensorboard=True)
    started = time.monotonic()
    with pytest.raises(UserFacingError) as raised:
        tracking.open(trainer, None, False, "", None)
    assert time.monotonic() - started < tracking_run.MLFLOW_OPEN_DEADLINE_S
    assert str(raised.value) == (
        f"tracking.mlflow: cannot open the MLflow run at {uri} (Connection refused). Fix: start the server, or "
        "correct tracking.mlflow.tracking_uri, or remove tracking.mlflow."
    )
    assert report_user_error(raised.value) == 2
    assert not (tmp_path / "run").exists()
    assert tracking.viewing_lines() == []


def test_a_local_mlflow_store_keeps_its_artifacts_beside_the_run_not_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow's default artifact location for a SQLite store is ./mlruns, wherever ddp-app runs."""
    pytest.importorskip("mlflow")
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "run"
    trainer = SimpleNamespace(
        default_root_dir=str(root), is_global_zero=True, world_size=1, num_nodes=1, checkpoint_callbacks=[],
        callback_metrics={},
    )  # fmt: skip
    tracking = Tracking(mlflow=MLflowSettings(tracking_uri=f"sqlite:///{tmp_path / 'elsewhere.db'}"), tensorboard=False)
    logger = tracking.open(trainer, None, False, "seed_everything: 1\n", None)
    logger.run.log(0, {"loss": 1.0})
    tracking.on_train_end(trainer, None)
    tracking.teardown(trainer, None, "fit")
    assert not (tmp_path / "mlruns").exists()
    assert (root / "mlartifacts").is_dir()


def test_the_launcher_refuses_an_unreachable_mlflow_server_before_any_rank_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ddp-app fit ... --tracking.mlflow.tracking_uri http://...` with nothing listening: the launcher's
    check says so in one line (exit 2) before it starts a rank, and writes nothing."""
    pytest.importorskip("mlflow")
    monkeypatch.chdir(REPO)
    uri = f"http://127.0.0.1:{unused_port()}/"
    root = tmp_path / "run"
    args = ["fit", "--config", "configs/digits.yaml", f"--trainer.default_root_dir={root}"]
    started = time.monotonic()
    with pytest.raises(SystemExit) as refused:
        check_before_launch([*args, f"--tracking.mlflow.tracking_uri={uri}"])
    assert time.monotonic() - started < tracking_run.MLFLOW_OPEN_DEADLINE_S
    assert refused.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"ddp-app: error: tracking.mlflow: cannot open the MLflow run at {uri} (Connection refused). Fix: start the "
        "server, or correct tracking.mlflow.tracking_uri, or remove tracking.mlflow."
    ]
    assert not root.exists() and not (tmp_path / "mlruns").exists()
