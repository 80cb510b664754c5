"""`python -m app.sweep`: a hyperparameter sweep of ddp-app runs, locally or as a Slurm job array.

    python -m app.sweep run --config configs/digits.yaml --out sweeps/lr \\
        --grid model.init_args.lr=0.01,0.1,1.0 [--metric val_acc --direction maximize] [ddp-app overrides]
    python -m app.sweep run --config configs/digits.yaml --out sweeps/search \\
        --search model.init_args.lr=loguniform:1e-4:1e-1 --trials 20
    python -m app.sweep run ... --slurm slurm/sweep.sbatch --array-parallel 4 [--sbatch=--partition=gpu ...]
    python -m app.sweep status sweeps/lr
    python -m app.sweep resume sweeps/lr          # what is unfinished: locally, or a new job array

Each point (grid) or trial (search) is an ordinary `ddp-app fit` run in DIR/points/NNN, with every
guarantee of one (exact resume, one tracker run). Results: DIR/results.csv, results.md, results.png.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from app.console import quiet_console
from app.errors import UserFacingError
from app.sweep.results import markdown_table, write_results
from app.sweep.spec import SweepError, SweepSpec, build_spec, check_keys
from app.sweep.store import FAILED, FINISHED, PENDING, SweepStore, claim_alive, shown_state
from app.sweep.worker import main_worker, work

PROG = "python -m app.sweep"


def submit(store: SweepStore, spec: SweepSpec, tasks: int) -> str:
    """`sbatch --array=0-(tasks-1)%parallel SCRIPT DIR`; the job id."""
    slurm = spec.submit or {}
    command = [
        "sbatch",
        "--parsable",
        f"--array=0-{tasks - 1}%{slurm['array_parallel']}",
        *slurm.get("sbatch_args", []),
        slurm["script"],
        str(store.directory.resolve()),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SweepError(f"sbatch refused the array job: {result.stderr.strip() or result.stdout.strip()}")
    job_id = result.stdout.strip().split(";")[0]
    print(
        f"app.sweep: submitted job array {job_id}: {tasks} task(s), at most {slurm['array_parallel']} at a time. "
        f"Follow it with: {PROG} status {store.directory}",
        flush=True,
    )
    return job_id


def tasks_needed(store: SweepStore, spec: SweepSpec) -> int:
    points = store.points()
    pending = sum(point.state == PENDING for point in points)
    return pending + (max(spec.trials - len(points), 0) if spec.is_search else 0)


def command_run(args: argparse.Namespace, fit_args: list[str]) -> None:
    directory: Path = args.out
    if (directory / "sweep.json").is_file():
        raise SweepError(f"{directory} already holds a sweep. Fix: {PROG} resume {directory}, or another --out.")
    spec = build_spec(
        fit_args, args.grid, args.search, args.trials, args.metric, args.direction, args.pruner, args.seed
    )
    if args.slurm:
        if not Path(args.slurm).is_file():
            raise SweepError(f"--slurm {args.slurm}: no such sbatch script. Fix: slurm/sweep.sbatch.")
        spec.submit = {"script": str(Path(args.slurm).resolve()), "array_parallel": args.array_parallel,
                       "sbatch_args": args.sbatch}  # fmt: skip
    check_keys(spec)  # before anything is written or submitted
    store = SweepStore(directory)
    directory.mkdir(parents=True, exist_ok=True)
    spec.save(directory / "sweep.json")
    for params in spec.grid_points() if not spec.is_search else []:
        store.add(params)
    if spec.submit:
        submit(store, spec, spec.size())
        return
    failed = work(directory, one_point=False)
    finish_locally(store, spec, failed)


def finish_locally(store: SweepStore, spec: SweepSpec, failed: int) -> None:
    rows = write_results(store, spec)
    print(markdown_table(rows, list(dict.fromkeys(key for row in rows for key in row))), end="")
    print(f"app.sweep: wrote {store.directory / 'results.csv'}, results.md and results.png", flush=True)
    if failed:
        raise SystemExit(1)


def command_status(directory: Path) -> None:
    store, spec = SweepStore(directory), SweepSpec.load(directory)
    rows = write_results(store, spec)
    print(markdown_table(rows, list(dict.fromkeys(key for row in rows for key in row))), end="")
    counts: dict[str, int] = {}
    for point in store.points():
        counts[shown_state(point)] = counts.get(shown_state(point), 0) + 1
    if spec.is_search and len(store.points()) < spec.trials:
        counts["not started"] = spec.trials - len(store.points())
    summary = ", ".join(f"{count} {state}" for state, count in counts.items())
    print(f"{spec.size()} point(s): {summary}")


def command_resume(directory: Path) -> None:
    """Whatever is unfinished and not running: back to pending (its run continues from its last.ckpt)."""
    store, spec = SweepStore(directory), SweepSpec.load(directory)
    with store.lock():
        for point in store.points():
            search_failure = point.trial is not None and point.state == FAILED  # Optuna told it: asked anew
            if point.state in FINISHED or search_failure or claim_alive(point.claim):
                continue
            point.state, point.claim = PENDING, None
            store.save(point)
    tasks = tasks_needed(store, spec)
    if tasks == 0:
        print(f"app.sweep: nothing to resume in {directory}.", flush=True)
        command_status(directory)
        return
    if spec.submit:
        submit(store, spec, tasks)
        return
    finish_locally(store, spec, work(directory, one_point=False))


def parser() -> argparse.ArgumentParser:
    main = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    commands = main.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="start a sweep; unknown arguments go to every point's ddp-app fit")
    run.add_argument("--out", type=Path, required=True, help="the sweep's directory (shared storage on a cluster)")
    run.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2", help="a grid axis (repeatable)")
    run.add_argument("--search", action="append", default=[], metavar="KEY=DIST", help="a searched key (repeatable)")
    run.add_argument("--trials", type=int, help="how many trials a search runs")
    run.add_argument("--metric", help="the logged metric that ranks points (default val_acc)")
    run.add_argument("--direction", choices=("maximize", "minimize"), help="default maximize")
    run.add_argument("--pruner", choices=("median", "none"), default="median", help="a search's pruner at epoch ends")
    run.add_argument("--seed", type=int, default=0, help="the search sampler's seed")
    run.add_argument(
        "--slurm", help="an sbatch script (slurm/sweep.sbatch): submit a job array instead of running here"
    )
    run.add_argument("--array-parallel", type=int, default=2, help="with --slurm: at most this many tasks at once")
    run.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                     help="with --slurm: an sbatch option, e.g. --sbatch=--partition=gpu (repeatable)")  # fmt: skip
    for name, text in (("status", "show each point's state and results"), ("resume", "run what is unfinished")):
        commands.add_parser(name, help=text).add_argument("directory", type=Path)
    commands.add_parser("worker", help="run points (what each Slurm array task runs)").add_argument(
        "directory", type=Path
    )
    return main


def main(argv: list[str] | None = None) -> None:
    quiet_console(os.environ)  # `check_keys` parses the config once per swept value: no "Seed set to 42" each time
    args, rest = parser().parse_known_args(argv)
    try:
        if args.command != "run" and rest:
            raise SweepError(f"unexpected arguments {' '.join(rest)}. Fix: {PROG} {args.command} DIR.")
        if args.command == "run":
            command_run(args, rest)
        elif args.command == "status":
            command_status(args.directory)
        elif args.command == "resume":
            command_resume(args.directory)
        else:
            main_worker(args.directory)
    except UserFacingError as error:
        print(f"app.sweep: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
