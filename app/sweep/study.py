"""A search's Optuna study, shared by every worker through a journal file (NFS-safe, unlike SQLite)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.sweep.spec import SweepSpec

STUDY_NAME = "sweep"
JOURNAL_NAME = "study.journal"


def storage(directory: Path) -> Any:
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    return JournalStorage(JournalFileBackend(str(directory / JOURNAL_NAME)))


def pruner(spec: SweepSpec) -> Any:
    import optuna

    if spec.pruner == "none":
        return optuna.pruners.NopPruner()
    # Prune below the median of the finished trials at the same epoch, once 2 trials have finished and from the second
    # epoch on (the first epoch says little about a learning rate).
    return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1)


def open_study(directory: Path, spec: SweepSpec, worker: int = 0, asked: int = 0) -> Any:
    """The study, with a sampler seeded by (seed, worker, trials asked so far): a sampler is made anew for every trial a
    worker asks, and concurrent workers must not propose the same point."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=spec.seed * 1_000_003 + asked * 7_919 + worker)
    return optuna.create_study(
        storage=storage(directory),
        study_name=STUDY_NAME,
        direction=spec.direction,
        sampler=sampler,
        pruner=pruner(spec),
        load_if_exists=True,
    )


def distributions(spec: SweepSpec) -> dict[str, Any]:
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    space: dict[str, Any] = {}
    for dimension in spec.search:
        if dimension.kind == "choice":
            space[dimension.key] = CategoricalDistribution(list(dimension.choices))
        elif dimension.kind in ("int", "intlog"):
            space[dimension.key] = IntDistribution(
                int(dimension.low), int(dimension.high), log=dimension.kind == "intlog"
            )
        else:
            space[dimension.key] = FloatDistribution(dimension.low, dimension.high, log=dimension.kind == "loguniform")
    return space


def trial_of(study: Any, directory: Path, number: int) -> Any:
    """The live `optuna.trial.Trial` of trial `number` (to report to and tell), through public storage calls."""
    import optuna

    journal = storage(directory)
    trial_id = journal.get_trial_id_from_study_id_trial_number(journal.get_study_id_from_name(STUDY_NAME), number)
    return optuna.trial.Trial(study, trial_id)
