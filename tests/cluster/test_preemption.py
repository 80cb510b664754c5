"""The preemption check's schedule: how often the ranks agree on a signal, and Lightning's own check;
the flag that records stop signals, and the line a stop prints."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

from app.cluster.exit_codes import PREEMPTED_EXIT_CODE
from app.cluster.preemption import (
    LIGHTNING_PER_STEP_SIGTERM_BROADCAST,
    MAX_STEPS_BETWEEN_CHECKS,
    PREEMPTION_SIGNALS,
    STOP_SIGNALS,
    StopSignalFlag,
    steps_between_checks,
    stop_message,
)


def test_checks_come_about_once_per_interval_at_the_recent_pace() -> None:
    assert steps_between_checks(seconds_since_check=0.5, steps_since_check=500, check_interval_s=1.0) == 1000
    assert steps_between_checks(seconds_since_check=0.25, steps_since_check=1, check_interval_s=1.0) == 4


def test_steps_longer_than_the_interval_are_checked_every_step() -> None:
    assert steps_between_checks(seconds_since_check=30.0, steps_since_check=3, check_interval_s=1.0) == 1


def test_the_interval_is_bounded_and_starts_at_one_step() -> None:
    assert steps_between_checks(1e-6, 1_000_000, 1.0) == MAX_STEPS_BETWEEN_CHECKS
    assert steps_between_checks(0.0, 0, 1.0) == 1  # nothing measured yet


def test_lightning_still_has_the_per_step_broadcast_that_preemption_switches_off() -> None:
    # If a Lightning upgrade renames it, the switch-off silently stops working: fail here instead.
    assert callable(getattr(_TrainingEpochLoop, LIGHTNING_PER_STEP_SIGTERM_BROADCAST, None))


@pytest.fixture
def recorded_sigusr1() -> Iterator[list[int]]:
    """SIGUSR1 handled by a recorder (standing for whatever handled it before the flag), put back after."""
    received: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
    yield received
    signal.signal(signal.SIGUSR1, previous)


def test_the_flag_keeps_a_signal_from_setup_when_training_adds_ctrl_c(recorded_sigusr1: list[int]) -> None:
    flag = StopSignalFlag()
    previous_sigint = signal.getsignal(signal.SIGINT)
    assert flag.install(PREEMPTION_SIGNALS) == PREEMPTION_SIGNALS  # as app.cli.entry.run does when a rank starts
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.received == signal.SIGUSR1 and recorded_sigusr1 == []
        assert flag.install(STOP_SIGNALS) == (signal.SIGINT,)  # LastCheckpoint.on_train_start
        assert flag.received == signal.SIGUSR1  # the signal from setup is not forgotten
        flag.restore((signal.SIGINT,))  # on_train_end gives back only what it took
        assert signal.getsignal(signal.SIGINT) is previous_sigint
        assert signal.getsignal(signal.SIGUSR1) == flag._on_signal
    finally:
        flag.restore()
    assert recorded_sigusr1 == []


def test_a_run_that_never_acts_on_the_flag_gets_the_recorded_signal_as_if_there_were_no_flag(
    recorded_sigusr1: list[int],
) -> None:
    """`ddp-app validate` (or a fit without checkpoints): a SIGUSR1 during its setup is delivered to
    the handler from before (in a rank: the default, which ends it) once the run knows."""
    flag = StopSignalFlag()
    previous_sigterm = signal.getsignal(signal.SIGTERM)
    flag.install(PREEMPTION_SIGNALS)
    os.kill(os.getpid(), signal.SIGUSR1)
    flag.release()
    assert recorded_sigusr1 == [signal.SIGUSR1]
    assert flag.received is None and signal.getsignal(signal.SIGTERM) is previous_sigterm


def test_a_stop_before_training_says_nothing_new_was_saved_and_how_to_resume() -> None:
    message, code = stop_message(signal.SIGTERM, 0, 0, None, is_global_zero=False)
    assert code == PREEMPTED_EXIT_CODE
    assert message.startswith("preempted before training started (SIGTERM): nothing new to save. Resume with")
    assert message.endswith("--ckpt_path last")
    message, _ = stop_message(signal.SIGUSR1, 60, 2, "runs/x/checkpoints/last.ckpt", is_global_zero=False)
    assert message.startswith("preempted at global step 60 (epoch 2, SIGUSR1): saved runs/x/checkpoints/last.ckpt.")
