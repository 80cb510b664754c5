"""Run sweep points: take the next one (or continue this Slurm task's own), run `ddp-app fit`, record it.

Locally one point after another; under Slurm one point per array task (`srun ddp-app fit ...`). A preempted point is
requeued (app/cluster/requeue.py) and continued with `--ckpt_path last`, which every attempt passes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from app.cluster.exit_codes import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE
from app.sweep.pruning import PRUNED_FILE
from app.sweep.results import best_value, point_row, write_results
from app.sweep.spec import SweepSpec, point_args
from app.sweep.store import (
    DONE,
    FAILED,
    FINISHED,
    PENDING,
    PREEMPTED,
    PRUNED,
    RUNNING,
    Point,
    SweepStore,
    my_claim,
    now,
    same_worker,
)
from app.sweep.study import distributions, open_study, trial_of


def worker_index() -> int:
    return int(os.environ.get("SLURM_ARRAY_TASK_ID", "0"))


def trial_params(trial: object, spec: SweepSpec) -> dict[str, str]:
    params = trial.params  # type: ignore[attr-defined]
    return {dimension.key: _text(params[dimension.key]) for dimension in spec.search}


def _text(value: object) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def next_point(store: SweepStore, spec: SweepSpec) -> Point | None:
    """This worker's unfinished claim (a requeued Slurm task), else the next pending point, else a new search trial
    while fewer than `trials` were asked; claimed under the sweep's lock."""
    mine = my_claim()
    with store.lock():
        points = store.points()
        for point in points:
            if point.state not in FINISHED and point.state != FAILED and same_worker(point.claim, mine):
                # This Slurm task was requeued (preempted): `scontrol requeue` ended its batch script before the worker
                # could note how the attempt ended.
                if point.attempts and "ended" not in point.attempts[-1]:
                    point.attempts[-1].update(ended=now(), exit_code=None, requeued=True)
                return point
        for point in points:
            if point.state == PENDING and not point.claim:
                point.claim = mine
                point.state = RUNNING
                store.save(point)
                return point
        if spec.is_search:
            asked = len(open_study(store.directory, spec).trials)
            study = open_study(store.directory, spec, worker_index(), asked)
            if asked < spec.trials:
                trial = study.ask(distributions(spec))
                point = store.add(trial_params(trial, spec), trial=trial.number)
                point.claim, point.state = mine, RUNNING
                store.save(point)
                return point
    return None


def fit_command(store: SweepStore, spec: SweepSpec, point: Point) -> list[str]:
    # `python -m app` is ddp-app, with this interpreter: no PATH needed, on every node alike.
    command = [sys.executable, "-m", "app", "fit", *spec.fit_args, *point_args(point.params)]
    command += [f"--trainer.default_root_dir={store.point_dir(point)}", "--ckpt_path=last"]
    if point.trial is not None:
        command += [
            "--trainer.callbacks+=app.sweep.pruning.OptunaPruning",
            f"--trainer.callbacks.init_args.sweep_dir={store.directory}",
            f"--trainer.callbacks.init_args.trial={point.trial}",
        ]
    if os.environ.get("SLURM_JOB_ID"):
        return ["srun", "--kill-on-bad-exit=1", *command]
    return command


def run_point(store: SweepStore, spec: SweepSpec, point: Point) -> Point:
    directory = store.point_dir(point)
    attempt = {"started": now(), **{key: value for key, value in my_claim().items() if key != "since"}}
    point.state, point.claim = RUNNING, my_claim()
    point.attempts.append(attempt)
    store.save(point)
    label = " ".join(f"{key.split('.')[-1]}={value}" for key, value in point.params.items())
    print(f"app.sweep: point {point.name} ({label}) attempt {len(point.attempts)}", flush=True)
    # Ctrl-C reaches the run too (one process group): it saves last.ckpt and exits; the worker waits for that, records
    # the point as preempted and stops (a shell waits for its job the same way). (A handler, not SIG_IGN: an ignored
    # signal stays ignored in the child across exec.)
    previous = signal.signal(signal.SIGINT, lambda signum, frame: None)
    try:
        if os.environ.get("SLURM_JOB_ID"):  # the sbatch log is the place for the run's output
            code = subprocess.call(fit_command(store, spec, point))
        else:
            with open(directory / "fit.log", "a") as log:
                code = subprocess.call(fit_command(store, spec, point), stdout=log, stderr=subprocess.STDOUT)
    finally:
        signal.signal(signal.SIGINT, previous)
    attempt["ended"], attempt["exit_code"] = now(), code
    if code == 0:
        point.state = PRUNED if (directory / PRUNED_FILE).is_file() else DONE
    elif code in (PREEMPTED_EXIT_CODE, INTERRUPTED_EXIT_CODE):
        point.state = PREEMPTED
    else:
        point.state = FAILED
    if point.state != PREEMPTED:  # a preempted point stays claimed: its requeued task continues it
        point.claim = None
    store.save(point)
    row = point_row(store, spec, point)
    print(
        f"app.sweep: point {point.name} {point.state}: best {spec.metric} {row[f'best {spec.metric}'] or '-'} "
        f"(epoch {row['epoch']}), exit code {code}" + ("" if code == 0 else f"; its log: {directory / 'fit.log'}"),
        flush=True,
    )
    if point.trial is not None and point.state in (DONE, PRUNED, FAILED):
        tell(store, spec, point, best_value(row, spec))
    return point


def tell(store: SweepStore, spec: SweepSpec, point: Point, value: float | None) -> None:
    import optuna

    study = open_study(store.directory, spec, worker_index())
    trial = trial_of(study, store.directory, point.trial)
    if point.state == PRUNED:
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    elif point.state == DONE and value is not None:
        study.tell(trial, value)
    else:
        study.tell(trial, state=optuna.trial.TrialState.FAIL)


def work(directory: Path, one_point: bool) -> int:
    """Run points until none is left (or one, for a Slurm array task); the number of failed points."""
    store = SweepStore(directory)
    spec = SweepSpec.load(directory)
    failed = 0
    while (point := next_point(store, spec)) is not None:
        point = run_point(store, spec, point)
        failed += point.state == FAILED
        write_results(store, spec)
        if one_point or point.state == PREEMPTED:
            break
    return failed


def main_worker(directory: Path) -> None:
    """`python -m app.sweep worker DIR`: what each array task of slurm/sweep.sbatch runs."""
    failed = work(directory, one_point=bool(os.environ.get("SLURM_ARRAY_TASK_ID")))
    sys.exit(1 if failed else 0)
