"""Requeueing a Slurm batch job: after a preemption or a failure worth retrying, never after bad input. Stdlib only
(`python -m app.slurm`).

- A preempted job is requeued by its rank 0 once every rank saved `last.ckpt` (exit code 3).
- A failed job step is requeued by the batch script (`python -m app.slurm requeue-on-failure "$status"`), at most
  `DDP_APP_MAX_REQUEUES` times (default 3, counted by `SLURM_RESTART_COUNT`, preemptions included), and resumes with
  `--ckpt_path last`.
- A deterministic failure (exit 2) is never requeued: the failing rank turns the job's requeue flag off (`scontrol
  update JobId=N Requeue=0`), since srun's exit code cannot tell it apart (Slurm 22.05)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Mapping

from app.cluster.exit_codes import BAD_INPUT_EXIT_CODE
from app.cluster.launch import worth_a_restart
from app.cluster.preflight import INTERACTIVE_JOB_NAMES

MAX_REQUEUES_VARIABLE = "DDP_APP_MAX_REQUEUES"
DEFAULT_MAX_REQUEUES = 3
SCONTROL_TIMEOUT_S = 60


def slurm_batch_job_id(env: Mapping[str, str]) -> str | None:
    """The id `scontrol requeue` takes for this batch job (array task included); None outside a Slurm job or in an
    interactive allocation, which has nothing to requeue."""
    job_id = env.get("SLURM_ARRAY_JOB_ID") or env.get("SLURM_JOB_ID")
    if not job_id or env.get("SLURM_JOB_NAME") in INTERACTIVE_JOB_NAMES:
        return None
    if env.get("SLURM_ARRAY_TASK_ID"):
        return f"{job_id}_{env['SLURM_ARRAY_TASK_ID']}"
    return job_id


def _scontrol(*args: str) -> tuple[bool, str]:
    """(succeeded, stdout or the reason it failed)."""
    try:
        result = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        return False, str(error)
    if result.returncode != 0:
        return False, " ".join(result.stderr.split()) or f"exit code {result.returncode}"
    return True, result.stdout


def requeue_slurm_job(env: Mapping[str, str] | None = None) -> str:
    """Ask Slurm to requeue this batch job; returns a note for the message ('' outside Slurm)."""
    job_id = slurm_batch_job_id(os.environ if env is None else env)
    if job_id is None:
        return ""
    done, detail = _scontrol("requeue", job_id)
    return f"; requeued SLURM job {job_id}" if done else f"; requeue of job {job_id} failed ({detail})"


def forbid_requeue(env: Mapping[str, str] | None = None) -> None:
    """Bad input: running the job again would fail the same way, so no one may requeue it.

    Called by every rank that exits 2; errors are ignored (a missing scontrol leaves the batch script's budget as the
    only bound)."""
    job_id = slurm_batch_job_id(os.environ if env is None else env)
    if job_id is not None:
        _scontrol("update", f"JobId={job_id}", "Requeue=0")


def describe_step_exit(code: int) -> str:
    """'exit code 143 (128 + SIGTERM)' for srun's exit code. srun ends the other tasks with SIGTERM when one fails, so
    its code rarely names the first failure: its `srun: error:` lines do."""
    if code > 128:
        try:
            return f"exit code {code} (128 + {signal.Signals(code - 128).name})"
        except ValueError:
            pass
    return f"exit code {code}"


def requeue_decision(exit_code: int, restart_count: int, max_requeues: int, requeue_allowed: bool) -> tuple[bool, str]:
    """Whether a batch job whose step ended with `exit_code` should requeue itself, and why (or why not)."""
    if exit_code == BAD_INPUT_EXIT_CODE:
        return False, (
            "not requeued: exit code 2 is bad input (a config error, a non-finite loss, a checkpoint that does not "
            "load: the error line above says which), which running again would repeat"
        )
    if not requeue_allowed:
        return False, (
            "not requeued: the job may not be requeued (Requeue=0): a rank stopped on bad input (the error line "
            "above says which), or the job was submitted with --no-requeue"
        )
    if not worth_a_restart(exit_code):  # a stop on purpose (3, 130): rank 0 requeued a preempted job itself
        return False, "not requeued here: the ranks stopped on a signal after saving last.ckpt (see above)"
    if restart_count >= max_requeues:
        return False, (
            f"not requeued: the job has been requeued {restart_count} time(s), the budget is "
            f"{MAX_REQUEUES_VARIABLE}={max_requeues}. To go on, submit it again with --ckpt_path last"
        )
    return True, f"requeue {restart_count + 1} of {max_requeues}: it starts again from last.ckpt"


def max_requeues(env: Mapping[str, str]) -> int:
    value = env.get(MAX_REQUEUES_VARIABLE, "").strip()
    if not value:
        return DEFAULT_MAX_REQUEUES
    if not value.isdigit():
        raise ValueError(f"{MAX_REQUEUES_VARIABLE}={value!r} is not a count. Fix: a number >= 0, e.g. 3")
    return int(value)


def requeue_after_failed_step(exit_code: int, env: Mapping[str, str] | None = None) -> str:
    """In a batch script, after its srun step ended with `exit_code`: requeue the job if the failure is worth running
    again and the budget allows; returns the one line for the job's log."""
    env = os.environ if env is None else env
    if exit_code == 0:
        return ""
    job_id = slurm_batch_job_id(env)
    if job_id is None:
        return f"ddp-app: the step ended with {describe_step_exit(exit_code)}; not in a Slurm batch job, not requeued"
    restart_count = int(env.get("SLURM_RESTART_COUNT") or 0)
    found, record = _scontrol("show", "job", "-o", job_id)
    # Requeue=0: a rank reported bad input (forbid_requeue), or sbatch --no-requeue.
    requeue_allowed = not (found and re.search(r"\bRequeue=0\b", record))
    requeue, reason = requeue_decision(exit_code, restart_count, max_requeues(env), requeue_allowed)
    if requeue:
        done, detail = _scontrol("requeue", job_id)
        reason = f"requeued job {job_id}, {reason}" if done else f"requeue of job {job_id} failed ({detail})"
    return (
        f"ddp-app: the step ended with {describe_step_exit(exit_code)} at SLURM_RESTART_COUNT={restart_count}; "
        f"{reason}."
    )
