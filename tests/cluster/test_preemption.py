"""The preemption check's schedule: how often the ranks agree on a signal, and Lightning's own check."""

from __future__ import annotations

from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

from app.cluster.preemption import (
    LIGHTNING_PER_STEP_SIGTERM_BROADCAST,
    MAX_STEPS_BETWEEN_CHECKS,
    steps_between_checks,
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
