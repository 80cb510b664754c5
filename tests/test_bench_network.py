"""`python -m app.bench.network`: its arguments, schedule and report, the refusals, and one short real
run over a rate-limited link between two network namespaces (root only)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from app.bench import netns
from app.bench.netns import INTERFACES, LOCK_FILE, NAMESPACES, Link, parse_link, tx_bytes
from app.bench.network import build_schedule, main
from app.bench.network_report import build_report, setting_key
from tests.helpers.run import REPO, clean_env, run, start

CONFIG = "configs/bench_cnn.yaml"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)")
# Every test here may create or remove nbn-rank0/1: they run on the worker of every other test that does
# (tests/conftest.py), never beside one.
pytestmark = pytest.mark.network_namespaces


def leftovers() -> list[str]:
    """Our namespaces or interfaces that still exist, anywhere on the machine."""
    found = [name for name in NAMESPACES if Path(f"/run/netns/{name}").exists()]
    return found + [name for name in INTERFACES if Path(f"/sys/class/net/{name}").exists()]


def test_links_parse_as_tc_spells_them() -> None:
    assert parse_link("100mbit") == Link("100mbit", 100.0)
    assert parse_link("1gbit").rate_mbit == 1000.0 and parse_link("1gbit").label == "1 Gbit/s"
    assert parse_link("2.5gbit").label == "2.5 Gbit/s" and parse_link("100mbit").label == "100 Mbit/s"
    assert parse_link("unlimited").rate_mbit is None
    for bad in ("100", "fast", "0mbit", "-1gbit"):
        with pytest.raises(ValueError, match="expected a rate such as 100mbit"):
            parse_link(bad)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--config", "nope.yaml"], "config nope.yaml does not exist"),
        (["--config", CONFIG, "--links", "100mbit,fast"], "invalid link 'fast'"),
        (["--config", CONFIG, "--links", "1gbit,1000mbit"], "a link speed is listed twice"),
        (["--config", CONFIG, "--methods", "none,zip"], "unknown method 'zip'"),
        (["--config", CONFIG, "--buckets", "1,0"], "bucket sizes must be > 0 MB"),
        (["--config", CONFIG, "--steps", "0"], "--steps must be >= 1"),
        (["--config", CONFIG, "--powersgd-start-iter", "1"], "--powersgd-start-iter must be >= 2"),
        (["--config", CONFIG, "--warmup-steps", "2"], "PowerSGD's uncompressed first steps would be timed"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("python -m app.bench.network: error: ") and message in error, error


def test_schedule_alternates_settings_and_flips_the_order_every_repeat() -> None:
    links = [parse_link("100mbit"), parse_link("1gbit")]
    schedule = build_schedule(links, ["none", "powersgd"], [1.0, 100.0], parse_link("1gbit"), 25.0, repeats=2)
    assert [item["index"] for item in schedule] == list(range(len(schedule)))
    first = [item for item in schedule if item["repeat"] == 0]
    second = [item for item in schedule if item["repeat"] == 1]
    key = [(i["link"]["name"], i["method"], i["bucket_cap_mb"], i["world_size"]) for i in first]
    assert [(i["link"]["name"], i["method"], i["bucket_cap_mb"], i["world_size"]) for i in second] == key[::-1]
    # Per repeat and link: the 1-rank baseline, then every setting; buckets swept at 1 Gbit/s only.
    assert key[:3] == [("100mbit", "none", 25.0, 1), ("100mbit", "none", 25.0, 2), ("100mbit", "powersgd", 25.0, 2)]
    swept = [(method, bucket) for name, method, bucket, size in key if name == "1gbit" and size == 2]
    assert swept == [(m, b) for b in (1.0, 25.0, 100.0) for m in ("none", "powersgd")]


def record(repeat: int, method: str, step_ms: float, sent: float, world_size: int = 2, **extra: Any) -> dict[str, Any]:
    return {
        "repeat": repeat,
        "link": {"name": "100mbit", "rate_mbit": 100.0},
        "method": method,
        "bucket_cap_mb": 25.0,
        "world_size": world_size,
        "step_ms": step_ms,
        "samples_per_s": world_size * 64 / (step_ms / 1e3),
        "bytes_per_step": sent,
        "chosen": extra.get("chosen", method),
        "decision": extra.get("decision", ""),
        "probe_steps": extra.get("probe_steps", 0),
    }


def test_report_pairs_each_repeat_and_checks_the_targets() -> None:
    records = [
        record(0, "none", 50.0, 0.0, world_size=1),
        record(1, "none", 60.0, 0.0, world_size=1),
        record(0, "none", 400.0, 5e6),
        record(1, "none", 480.0, 5e6),
        record(0, "powersgd", 80.0, 2e5),
        record(1, "powersgd", 100.0, 2e5),
        record(0, "auto", 82.0, 2e5, chosen="powersgd", decision="chose powersgd", probe_steps=30),
        record(1, "auto", 120.0, 2e5, chosen="powersgd", decision="chose powersgd", probe_steps=31),
    ]
    context = {"default_bucket_cap_mb": 25.0}
    report = build_report(records, [parse_link("100mbit")], context)
    link = report["links"]["100mbit"]
    powersgd = link["settings"][setting_key("powersgd", 25.0)]
    assert powersgd["step_ms"] == {"median": 90.0, "min": 80.0, "max": 100.0, "n": 2}
    # Each repeat against its own baseline and its own no-hook run: 50/80, 60/100; 400/80, 480/100.
    assert powersgd["scaling_efficiency"] == {"median": 0.6125, "min": 0.6, "max": 0.625, "n": 2}
    assert powersgd["speedup_over_none"] == {"median": 4.9, "min": 4.8, "max": 5.0, "n": 2}
    assert powersgd["bytes_reduction_over_none"]["median"] == 25.0
    assert link["best"] == "powersgd@25MB"
    assert link["auto_over_best"] == {"median": pytest.approx(1.1125), "min": 1.025, "max": 1.2, "n": 2}
    assert link["settings"]["auto@25MB"]["chosen"] == {"powersgd": 2}
    targets = report["targets"]
    assert targets["powersgd_speedup_over_none_at_100mbit"]["met"]
    assert targets["powersgd_bytes_reduction_over_none_at_100mbit"]["met"]
    assert not targets["powersgd_scaling_efficiency_at_100mbit"]["met"]  # 0.61 < 0.7
    assert not targets["auto_over_best_at_100mbit"]["met"]  # 1.11 > 1.05


def test_bytes_sent_are_read_from_this_namespace() -> None:
    assert tx_bytes("lo") >= 0
    with pytest.raises(netns.NetworkSetupError, match="not found"):
        tx_bytes("nbv-none")


@pytest.mark.more_cases
def test_refuses_in_one_line_when_not_root() -> None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root (to drop to another user) and setpriv")
    # A HOME the other user can write: matplotlib (imported through Lightning) complains otherwise.
    with tempfile.TemporaryDirectory() as home:
        os.chmod(home, 0o777)
        env = clean_env(HOME=home, MPLCONFIGDIR=home)
        nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        result = run([*nobody, sys.executable, "-m", "app.bench.network", "--config", CONFIG], timeout=120, env=env)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "python -m app.bench.network: error: needs root (it creates network namespaces and sets tc qdiscs). "
        "Fix: run it as root, e.g. with sudo."
    ]


@needs_root
def test_refuses_while_another_bench_holds_the_lock(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)
    descriptor = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pytest.skip("a bench is running on this machine right now")
        with pytest.raises(SystemExit) as exit_info:
            main(["--config", CONFIG, "--links", "unlimited", "--methods", "none", "--out", str(tmp_path / "out")])
    finally:
        os.close(descriptor)
    assert exit_info.value.code == 2
    assert "another `python -m app.bench.network` is running on this machine" in capsys.readouterr().err


@needs_root
@pytest.mark.distributed
def test_short_run_at_100mbit_writes_json_and_plot_and_removes_its_namespaces(tmp_path: Path) -> None:
    """The user's command on a small budget. Bytes per step are exact properties of the hook (the
    no-hook step sends every gradient once); step times on a shared machine are only compared
    where the link, not the CPU, decides: at 100 Mbit/s no hook needs >= 5 MB / 12.5 MB/s."""
    # A crashed run's leftover: a namespace of ours with a process in it, removed by the next run. A real
    # leftover (a run killed on this machine before) serves as well.
    if not Path(f"/run/netns/{NAMESPACES[0]}").exists():
        subprocess.run(["ip", "netns", "add", NAMESPACES[0]], check=True, timeout=30)
    stray = subprocess.Popen(["ip", "netns", "exec", NAMESPACES[0], "sleep", "600"], start_new_session=True)
    report_path, plot_path = tmp_path / "net.json", tmp_path / "net.png"
    try:
        result = run(
            [sys.executable, "-m", "app.bench.network", "--config", CONFIG, "--links", "100mbit"]
            + ["--methods", "none,powersgd", "--repeats", "1", "--steps", "3", "--warmup-steps", "3"]
            + ["--out", str(tmp_path / "out"), "--json", str(report_path), "--plot", str(plot_path)],
            timeout=240,
        )
        assert stray.wait(timeout=10) == -signal.SIGKILL
    finally:
        if stray.poll() is None:
            stray.kill()
            stray.wait()
        subprocess.run(["ip", "netns", "delete", NAMESPACES[0]], capture_output=True, timeout=30)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert leftovers() == []
    progress = [line for line in result.stdout.splitlines() if line.startswith("[")]
    assert len(progress) == 3 and "1 rank (no communication)" in progress[0], progress
    report = json.loads(report_path.read_text())
    link = report["links"]["100mbit"]
    none, powersgd = link["settings"]["none@25MB"], link["settings"]["powersgd@25MB"]
    gradient_bytes = 1_199_882 * 4  # the CNN's parameters in float32
    assert gradient_bytes <= none["bytes_per_step"]["median"] < 1.1 * gradient_bytes
    assert powersgd["bytes_reduction_over_none"]["median"] >= 20
    assert none["step_ms"]["median"] >= 400
    assert powersgd["speedup_over_none"]["median"] > 1
    for figures in (none, powersgd):
        assert figures["samples_per_s"]["median"] > 0 and figures["scaling_efficiency"]["median"] > 0
    assert set(report["targets"]) >= {"powersgd_bytes_reduction_over_none_at_100mbit"}
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_root
@pytest.mark.distributed
def test_diloco_sends_one_exchange_per_sync_every_steps(tmp_path: Path) -> None:
    """`--methods diloco,diloco_overlap`: no DDP, one outer all-reduce of every parameter per 5 steps, so
    about a fifth of DDP's bytes per step (the no-hook step sends every gradient once), in line or started
    2 steps early (overlap_steps: half of 5) and sent beside them; timed over a whole period."""
    report_path = tmp_path / "net.json"
    result = run(
        [sys.executable, "-m", "app.bench.network", "--config", CONFIG, "--links", "100mbit", "--methods"]
        + ["diloco,diloco_overlap"]
        + ["--diloco-sync-every", "5", "--repeats", "1", "--steps", "3", "--warmup-steps", "1"]
        + ["--out", str(tmp_path / "out"), "--json", str(report_path)],
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert leftovers() == []
    report = json.loads(report_path.read_text())
    gradient_bytes = 1_199_882 * 4  # the CNN's parameters in float32
    for method in ("diloco", "diloco_overlap"):
        diloco = report["links"]["100mbit"]["settings"][f"{method}@25MB"]
        assert gradient_bytes / 5 <= diloco["bytes_per_step"]["median"] < 1.1 * gradient_bytes / 5, method
    assert report["diloco"] == {"sync_every": 5, "outer_dtype": "float32", "overlap_steps": 2}


@needs_root
@pytest.mark.distributed
@pytest.mark.fault
@pytest.mark.parametrize(
    ("stop", "exit_code", "message"),
    [
        pytest.param(  # about 30 s; the dead rank below ends the bench the same way
            "sigterm-to-bench",
            130,
            "python -m app.bench.network: interrupted; the ranks are stopped and the namespaces",
            marks=pytest.mark.slow,
        ),
        ("kill-9-rank-1", 1, "python -m app.bench.network: rank 1 exited with code -9"),
    ],
)
def test_a_stopped_bench_or_a_dead_rank_ends_every_rank_and_removes_the_namespaces(
    stop: str, exit_code: int, message: str, tmp_path: Path
) -> None:
    """SIGTERM to the bench (CI's cancel), or a rank killed, while a long bench runs at 100 Mbit/s."""
    process = start(
        [sys.executable, "-m", "app.bench.network", "--config", CONFIG, "--links", "100mbit", "--methods", "none"]
        + ["--repeats", "5", "--out", str(tmp_path / "out")]
    )
    try:
        assert process.stdout is not None
        deadline = time.monotonic() + 180
        for line in process.stdout:  # once a measurement is reported, the ranks are up
            if line.startswith("[") or time.monotonic() > deadline:
                break
        ranks = [pid for name in NAMESPACES for pid in netns.pids_in_namespace(name)]
        assert len(ranks) == 2, ranks
        stopped = time.monotonic()
        if stop == "sigterm-to-bench":
            process.send_signal(signal.SIGTERM)
        else:
            os.kill(ranks[1], signal.SIGKILL)
        _, stderr = process.communicate(timeout=60)
        seconds = time.monotonic() - stopped
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == exit_code, stderr[-3000:]
    assert message in stderr, stderr[-3000:]
    assert seconds < 30  # the bench polls its ranks every 0.2 s; removing the namespaces is quick
    assert leftovers() == []
    assert not [pid for pid in ranks if Path(f"/proc/{pid}").exists()]
