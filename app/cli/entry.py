"""`ddp-app`'s entry: parse and check the config once, fork the local ranks, supervise them.

    ddp-app fit --config configs/digits.yaml [--trainer.max_epochs 5 ...]

A rank started by torchrun or srun runs as it is (not slurm/fault_tolerant.sbatch's one task per node: the launcher of
its node's replica groups); otherwise a parse-only `DDPAppCLI` reports bad input once, before any
rank exists, then app/cluster/launch.py forks and supervises the ranks (restarting from last.ckpt up to `restarts`
times)."""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import warnings
from collections.abc import MutableMapping
from typing import Any, NoReturn

from jsonargparse import DefaultHelpFormatter

from app.cli import DDPAppCLI, ParsedRun
from app.cluster.exit_codes import BAD_INPUT_EXIT_CODE, HANG_EXIT_CODE, INTERRUPTED_EXIT_CODE, PEER_LOST_EXIT_CODE
from app.cluster.hangs import keep_hang_records
from app.cluster.launch import (
    check_exit_handlers,
    end_rank,
    exit_code_of,
    refuse_cuda_before_fork,
    run_local_ranks,
    with_ckpt_path_last,
    worth_a_restart,
)
from app.cluster.preemption import PREEMPTION_SIGNALS, STOP_SIGNAL_FLAG, Stopped
from app.cluster.preflight import already_launched, is_node_launcher
from app.cluster.requeue import forbid_requeue
from app.cluster.threads import configure_cpu_threads
from app.errors import UserFacingError, failed_because_a_peer_died, user_message
from app.run.console import STARTED_VARIABLE, quiet_console
from app.run.directory import LOCK_VARIABLE, acquire
from app.run.plan import hand_to_forked_ranks

# `ddp-app --help`'s description: every subcommand, one line each. `resume-check` is not a LightningCLI subcommand
# (app/__main__.py runs it before the CLI exists), so the parser's own list below it, fit to predict with Lightning's
# docstrings, cannot name it (issue 42: a newcomer found it only in docs/resume.md). tests/test_subcommands.py checks
# that this names every subcommand there is.
SUBCOMMANDS_HELP = """\
ddp-app trains and evaluates a LightningModule with DDP, from a YAML config (README.md, docs/usage.md).

subcommands (`ddp-app SUBCOMMAND --help` for each one's options):
  fit           train: ddp-app fit --config configs/digits.yaml (--ckpt_path last continues a run)
  validate      validation metrics of a checkpoint (--ckpt_path), the same at any world size
  test          test metrics of a checkpoint (--ckpt_path), the same at any world size
  predict       a checkpoint's predictions, written to <trainer.default_root_dir>/predictions.pt
  resume-check  prove your config resumes exactly: runs it stopped and resumed where resumes go wrong
  diagnose      why is my run slow: where each rank's step time goes, one verdict and its fix
"""


class HelpFormatter(argparse.RawDescriptionHelpFormatter, DefaultHelpFormatter):
    """jsonargparse's help, with the description's lines kept as they are written."""


# The main parser's keyword arguments (LightningCLI passes those not named after a subcommand to it).
PARSER_KWARGS: dict[str, Any] = {"description": SUBCOMMANDS_HELP, "formatter_class": HelpFormatter}


def run(args: list[str]) -> int:
    """Run the CLI in this process (a rank, or a run without DDP); returns the exit code.

    Preemption signals are recorded from the start (during setup they stop every rank together at train start) and stay
    handled until exit: a signal after training is ignored, as the work is saved."""
    keep_hang_records(os.environ)
    STOP_SIGNAL_FLAG.install(PREEMPTION_SIGNALS)
    allow_plain_cuda_availability_checks(os.environ)
    try:
        DDPAppCLI(args=args, parser_kwargs=PARSER_KWARGS)
    except Stopped as stopped:
        if stopped.is_global_zero:  # once, not once per rank
            print(f"ddp-app: {stopped}", file=sys.stderr)
        return stopped.exit_code
    except KeyboardInterrupt:  # Ctrl-C before training started: nothing to save yet
        print("ddp-app: interrupted (Ctrl-C) before training started; nothing was saved.", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE
    except Exception as error:
        hang = getattr(error, "ddp_app_hang_report", None)  # set by HangReport; the traceback is in its directory
        if hang is not None:
            print(hang, file=sys.stderr, flush=True)
            return HANG_EXIT_CODE
        code = report_user_error(error)
        if code is None:
            raise
        return code
    return 0


NVML_BASED_CUDA_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def allow_plain_cuda_availability_checks(env: MutableMapping[str, str]) -> None:
    """In a rank, let `torch.cuda.is_available()` ask the CUDA runtime again, as by default.

    Lightning sets PYTORCH_NVML_BASED_CUDA_CHECK=1 (for the launcher's forks). Where CUDA never initialises, every check
    then reloads NVML through ctypes and fails, and `Optimizer.step` checks at every step. A rank forks nothing that
    uses CUDA."""
    env.pop(NVML_BASED_CUDA_CHECK, None)


def report_user_error(error: Exception) -> int | None:
    """Print the one line for an error the user can act on and return the exit code; None for a bug (the caller
    re-raises it, traceback and all)."""
    message = user_message(error)
    if message is None:
        return None
    print(f"ddp-app: error: {message}", file=sys.stderr)
    # Another rank's failure, not this rank's input: running again may work (a restart or requeue).
    return PEER_LOST_EXIT_CODE if failed_because_a_peer_died(error) else BAD_INPUT_EXIT_CODE


def main(args: list[str] | None = None) -> None:
    """`ddp-app`: check the config once here, then fork the local ranks (app/cluster/launch.py)."""
    try:
        launch_and_run(args)
    except SystemExit as exit_request:
        # Every way out of ddp-app (a rank under srun, the launcher, a parser error) passes here.
        if exit_request.code == BAD_INPUT_EXIT_CODE:  # a requeued Slurm job would fail the same way
            forbid_requeue()
        if already_launched(os.environ):  # a rank of torchrun or srun ends as the launcher's ranks do
            end_rank(exit_code_of(exit_request))
        raise


def check_before_launch(args: list[str]) -> ParsedRun:
    """The launcher's parse-only pass: the config parsed, planned and checked once, before any rank exists. Bad input:
    one line on stderr and SystemExit (tests/fault/test_bad_input.py calls this in-process)."""
    try:
        parsed = DDPAppCLI(args=args, parse_only=True, parser_kwargs=PARSER_KWARGS).parsed
    except KeyboardInterrupt:
        print("ddp-app: interrupted (Ctrl-C) before training started; nothing was saved.", file=sys.stderr)
        raise SystemExit(INTERRUPTED_EXIT_CODE) from None
    except Exception as error:
        code = report_user_error(error)
        if code is None:
            raise
        raise SystemExit(code) from None
    assert parsed is not None  # a parse-only DDPAppCLI always plans, or exits
    return parsed


def launch_and_run(args: list[str] | None) -> NoReturn:
    """Run this rank (torchrun, srun), or parse and check the config, fork the ranks and supervise them."""
    os.environ.setdefault(STARTED_VARIABLE, str(time.time()))  # the run's wall time (app/run/summary.py)
    configure_cpu_threads()
    quiet_console(os.environ)  # the forked ranks inherit it; torchrun's and srun's pass here too
    args = list(sys.argv[1:] if args is None else args)
    try:
        check_exit_handlers()  # every way out of a rank runs them (end_rank)
    except UserFacingError as error:
        raise SystemExit(report_user_error(error)) from None
    # The ranks get the command line as a list (with the launcher's additions); that is deliberate.
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
    # torchrun, srun or a launcher started this rank; not slurm/fault_tolerant.sbatch's one task per node,
    # which is the launcher of its node's replica groups (app/cluster/ft_launch.py).
    if already_launched(os.environ) and not is_node_launcher(os.environ):
        raise SystemExit(run(args))
    checked = check_before_launch(args)
    lock = None
    # One run per directory (app/run/directory.py): the launcher holds the lock for every round below.
    if checked.plan.subcommand == "fit" and checked.plan.rank_zero:
        root = checked.plan.run_dir
        try:
            lock = acquire(root, os.environ)
        except UserFacingError as error:
            raise SystemExit(report_user_error(error)) from None
        if lock is not None:
            os.environ[LOCK_VARIABLE] = str(lock.path)
    try:
        launch_checked(args, checked)
    finally:
        if lock is not None:
            lock.release()


def launch_checked(args: list[str], checked: ParsedRun) -> NoReturn:
    """Run the checked config in this process, or fork its ranks and supervise them, restarts included."""
    plan, num_nodes, restarts = checked.plan.ranks, checked.plan.num_nodes, checked.config["restarts"]
    if checked.plan.fault_tolerance is not None:  # replica groups: one dead group does not stop the others
        from app.cluster.ft_launch import run_replica_groups

        hand_to_forked_ranks(checked.plan)
        try:
            refuse_cuda_before_fork()
        except UserFacingError as error:
            raise SystemExit(report_user_error(error)) from None
        settings = checked.config["fault_tolerance"]
        code = run_replica_groups(checked.plan.fault_tolerance, settings, args, run, checked.plan.run_dir)
        raise SystemExit(code)
    if not plan.processes:
        raise SystemExit(run(args))
    hand_to_forked_ranks(checked.plan)  # the checkpoint it read, for the ranks forked below
    try:
        refuse_cuda_before_fork()
    except UserFacingError as error:
        raise SystemExit(report_user_error(error)) from None
    if plan.notice:
        print(plan.notice, flush=True)
    rank_args = args + list(plan.extra_args)
    # One seed for every round: a restart must shuffle the data as the first round did.
    os.environ.setdefault("PL_GLOBAL_SEED", str(random.randint(0, 2**31 - 1)))
    code = run_local_ranks(plan.processes, lambda: run(rank_args), os.environ, num_nodes)
    for restart in range(1, restarts + 1):
        if not worth_a_restart(code):
            break
        print(
            f"ddp-app: restart {restart} of {restarts} after exit code {code}: every rank starts again from last.ckpt",
            file=sys.stderr,
            flush=True,
        )
        resume_args = with_ckpt_path_last(rank_args)
        code = run_local_ranks(plan.processes, lambda: run(resume_args), os.environ, num_nodes)  # noqa: B023
    raise SystemExit(code)


if __name__ == "__main__":
    main()
