"""`python -m app.sweep`: a hyperparameter sweep of ddp-app runs, locally or as a Slurm job array.

    python -m app.sweep run --config configs/digits.yaml --out runs/sweeps/lr \
        --grid optimizer.init_args.lr=0.01,0.1,1.0 [--metric val_acc --direction maximize] [ddp-app overrides]
    python -m app.sweep run --config configs/digits.yaml \
        --search optimizer.init_args.lr=loguniform:1e-4:1e-1 --trials 20   # in runs/sweeps/digits-lr
    python -m app.sweep run ... --slurm slurm/sweep.sbatch --array-parallel 4 [--sbatch=--partition=gpu ...]
    python -m app.sweep status runs/sweeps/lr     # or: status --out runs/sweeps/lr
    python -m app.sweep resume runs/sweeps/lr     # what is unfinished: locally, or a new job array

Every subcommand takes the sweep's directory as its first argument or `--out DIR`; without one, `run` makes
runs/sweeps/<config>-<swept keys>(-2, -3, ...). Each point or trial is an ordinary `ddp-app fit` run in DIR/points/NNN;
results in DIR/results.csv, results.md, results.png.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from app.errors import UserFacingError
from app.run.console import quiet_console
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


# Where `run` puts a sweep given no directory: under runs/, as every ddp-app tool's output.
SWEEPS_ROOT = Path("runs/sweeps")


def default_directory(spec: SweepSpec, root: Path = SWEEPS_ROOT) -> Path:
    """runs/sweeps/<config>-<swept keys> (`digits-lr`), with -2, -3, ... if that holds a sweep already."""
    configs = [value for flag, value in zip(spec.fit_args, spec.fit_args[1:], strict=False) if flag == "--config"]
    keys = [key.rsplit(".", 1)[-1] for key in [*spec.grid, *(dimension.key for dimension in spec.search)]]
    name = "-".join([Path(configs[-1]).stem if configs else "sweep", *keys])
    candidate, number = root / name, 1
    while (candidate / "sweep.json").is_file():
        number += 1
        candidate = root / f"{name}-{number}"
    return candidate


def command_run(args: argparse.Namespace, fit_args: list[str]) -> None:
    spec = build_spec(
        fit_args, args.grid, args.search, args.trials, args.metric, args.direction, args.pruner, args.seed
    )
    directory: Path = args.out or default_directory(spec)
    if (directory / "sweep.json").is_file():
        raise SweepError(f"{directory} already holds a sweep. Fix: {PROG} resume {directory}, or another --out.")
    if args.out is None:
        print(f"app.sweep: the sweep's directory: {directory} (--out DIR chooses another)", flush=True)
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
    run = commands.add_parser(
        "run",
        usage=f"{PROG} run [DIR | --out DIR] [options] [ddp-app fit arguments]",
        help="start a sweep; unknown arguments go to every point's ddp-app fit",
    )
    run.add_argument(
        "--out",
        type=Path,
        help=f"the sweep's directory (shared storage on a cluster; also the first argument); default: "
        f"{SWEEPS_ROOT}/<config>-<swept keys>",
    )
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
    for name, text in (
        ("status", "show each point's state and results"),
        ("resume", "run what is unfinished"),
        ("worker", "run points (what each Slurm array task runs)"),
    ):
        command = commands.add_parser(name, help=text, usage=f"{PROG} {name} DIR | --out DIR")
        command.add_argument("directory", type=Path, nargs="?", help="the sweep's directory")
        command.add_argument("--out", type=Path, help="the sweep's directory (the same as DIR)")
    return main


def sweep_directory(command: str, positional: Path | None, out: Path | None) -> Path | None:
    """The directory named as the first argument or with --out (either, or both if they agree)."""
    if positional is not None and out is not None and positional.resolve() != out.resolve():
        raise SweepError(
            f"two sweep directories: {positional} (first argument) and --out {out}. Fix: name it once, "
            f"{PROG} {command} DIR or {PROG} {command} --out DIR."
        )
    directory = positional or out
    if directory is None and command != "run":
        raise SweepError(f"{command}: which sweep? Fix: {PROG} {command} DIR (or --out DIR), e.g. {SWEEPS_ROOT}/lr.")
    return directory


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The arguments, and the rest (`run` passes them to every point's ddp-app fit), with the sweep's directory in
    `args.out`. `run` takes DIR only as its first argument: after it, a bare word is an option's value (`--config
    configs/digits.yaml`), for argparse as much as for ddp-app."""
    positional = None
    if argv[:1] == ["run"] and len(argv) > 1 and not argv[1].startswith("-"):
        positional, argv = Path(argv[1]), [argv[0], *argv[2:]]
    args, rest = parser().parse_known_args(argv)
    if args.command != "run":
        positional = args.directory
    args.out = sweep_directory(args.command, positional, args.out)
    return args, rest


def main(argv: list[str] | None = None) -> None:
    quiet_console(os.environ)  # `check_keys` parses the config once per swept value: no "Seed set to 42" each time
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, rest = parse(argv)
        if args.command != "run" and rest:
            raise SweepError(f"unexpected arguments {' '.join(rest)}. Fix: {PROG} {args.command} DIR.")
        if args.command == "run":
            command_run(args, rest)
        elif args.command == "status":
            command_status(args.out)
        elif args.command == "resume":
            command_resume(args.out)
        else:
            main_worker(args.out)
    except UserFacingError as error:
        print(f"app.sweep: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
