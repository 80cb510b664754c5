"""`python -m app.bench.recovery [--paths ddp-app,torchrun,slurm] [--repeats 3] [--json docs/recovery.json]`

What a rank killed with kill -9 mid-run costs on each way of restarting without a human:

  ddp-app    `ddp-app fit ... --restarts 1`: the launcher restarts every local rank (forked, no
             re-import) from last.ckpt;
  torchrun   `torchrun --standalone --nproc_per_node=2 --max-restarts=1 -m app fit ... --ckpt_path
             last`: the agent starts every rank again (each imports torch and Lightning anew);
  torchft    `ddp-app fit ... --trainer.devices 2 --fault_tolerance.enabled true`: two replica
             groups of one process (docs/fault_tolerance.md); the killed group is started again and
             heals from the other, which keeps training (its longest pause: `others_stall_s`);
  slurm      `sbatch slurm/multinode.sbatch` on two nodes, one rank each, the rank on the second
             node killed: the batch script requeues the job (app/cluster/requeue.py), Slurm starts
             it again and it resumes with --ckpt_path last;
  slurm-torchrun  `sbatch slurm/torchrun.sbatch`, the same two nodes: the agents restart the ranks
             inside the job (--max-restarts).
             The Slurm paths need `sbatch` on PATH and a two-node cluster on this machine (the kill
             is an os.kill by PID); for the tests' cluster: `python tests/slurm/localcluster.py --
             python -m app.bench.recovery --paths slurm,slurm-torchrun`.

For each: the recovery time (kill to the end of the restarted ranks' first step) and the lost work (steps trained again:
the kill's step minus last.ckpt's), against the checkpoint interval (one epoch). Times come from `StepClock`, a callback
added with `--trainer.callbacks+=` that appends every step's wall-clock time on rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning as L

from app.cluster.launch import env_without_launcher

REPO = Path(__file__).resolve().parents[2]
CONFIG = "configs/digits.yaml"
# Digits at 2 ranks: 20 steps per epoch. The kill comes mid-epoch, half an interval after last.ckpt.
KILL_AT_STEP = 110
RUN = ("--trainer.max_epochs=8", "--trainer.enable_progress_bar=false")
CPU_ONLY_SBATCH = ("--ntasks-per-node=1", "--gpus-per-node=0", "--cpus-per-task=1", "--time=10")
SLURM_FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")
GOAL_S = 30
# Slurm paths: (script, environment, requeues expected). torchrun.sbatch's agents restart the ranks inside the job
# (--max-restarts); multinode.sbatch requeues the job.
SLURM_PATHS = {
    "slurm": ("multinode.sbatch", {}, 1),
    "slurm-torchrun": ("torchrun.sbatch", {"NPROC_PER_NODE": "1"}, 0),
}


class StepClock(L.Callback):
    """Rank 0 appends `<unix time> <global step>` to `path` after every training step, and `start <unix time> <global
    step> <steps per epoch>` when training starts (again); every rank writes `<path>.rank<global rank>` = `<pid>
    <host>`, so that a benchmark can kill it."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._file: Any = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        rank_file = self.path.with_name(f"{self.path.name}.rank{trainer.global_rank}")
        rank_file.write_text(f"{os.getpid()} {socket.gethostname()}\n")
        if trainer.is_global_zero:
            self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 (open for the whole of training)
            self._file.write(f"start {time.time():.3f} {trainer.global_step} {trainer.num_training_batches}\n")

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self._file is not None:
            self._file.write(f"{time.time():.3f} {trainer.global_step}\n")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def clock_arguments(clock: Path) -> list[str]:
    """ddp-app arguments that add a StepClock writing to `clock` to the config's callbacks."""
    # By name: run as `python -m app.bench.recovery`, this module is __main__.
    return ["--trainer.callbacks+=app.bench.recovery.StepClock", f"--trainer.callbacks.init_args.path={clock}"]


@dataclass(frozen=True)
class Recovery:
    """One kill and what it cost."""

    recovery_s: float  # from the kill to the end of the restarted ranks' first training step
    steps_redone: int  # trained before the kill and again after it
    killed_after_step: int  # the last step rank 0 finished before the kill
    resumed_from_step: int  # the step of the last.ckpt the restarted ranks loaded
    checkpoint_interval_steps: int  # last.ckpt is written at every epoch end: the steps of an epoch
    others_stall_s: float | None = None  # torchft: the surviving group's longest pause between two steps


def read_clock(clock: Path, killed_at: float) -> Recovery:
    """The Recovery a StepClock file shows for a kill at `killed_at` (unix time)."""
    steps: list[tuple[float, int]] = []
    starts: list[tuple[float, int, int]] = []
    for line in clock.read_text().splitlines():
        words = line.split()
        if words[0] == "start":
            starts.append((float(words[1]), int(words[2]), int(words[3])))
        else:
            steps.append((float(words[0]), int(words[1])))
    restart = next((start for start in starts if start[0] > killed_at), None)
    if restart is None:
        raise RuntimeError(f"{clock}: training never started again after the kill")
    first_step = next((when for when, _ in steps if when > restart[0]), None)
    if first_step is None:
        raise RuntimeError(f"{clock}: no training step after the restart")
    done = max(step for when, step in steps if when <= killed_at)
    return Recovery(round(first_step - killed_at, 2), done - restart[1], done, restart[1], restart[2])


def wait_for_step(clock: Path, step: int, alive: Any, timeout: float = 300) -> None:
    """Until rank 0 has finished `step`; `alive()` is false once the run ended (an error)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if clock.exists():
            lines = clock.read_text().splitlines()
            if lines and not lines[-1].startswith("start") and int(lines[-1].split()[1]) >= step:
                return
        if not alive():
            raise RuntimeError(f"the run ended before step {step}")
        time.sleep(0.02)
    raise RuntimeError(f"no step {step} within {timeout} s")


def kill_rank(clock: Path, rank: int) -> float:
    """kill -9 the given global rank (by the PID its StepClock wrote); returns the kill's unix time."""
    pid = int(clock.with_name(f"{clock.name}.rank{rank}").read_text().split()[0])
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    return killed_at


def run_and_kill(command: list[str], log: Path, kill: Callable[[subprocess.Popen], float]) -> float:
    """Run `command` (its output to `log`), `kill` one of its processes when due (returning the kill's unix
    time), wait for the run to end; it must end with exit 0. Returns the kill's time."""
    env = env_without_launcher(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    with open(log, "w") as output:
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        killed_at = kill(process)
        code = process.wait(timeout=600)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    if code != 0:
        raise RuntimeError(f"{command[0]} exited with {code}:\n{log.read_text()[-3000:]}")
    return killed_at


def _local_run(command: list[str], workdir: Path, clock: Path, log_name: str) -> Recovery:
    """Run `command`, kill rank 1 at KILL_AT_STEP, wait for the run to end; it must end with exit 0."""

    def kill(process: subprocess.Popen) -> float:
        wait_for_step(clock, KILL_AT_STEP, lambda: process.poll() is None)
        return kill_rank(clock, 1)

    return read_clock(clock, run_and_kill(command, workdir / log_name, kill))


def measure_ddp_app(workdir: Path) -> Recovery:
    clock = workdir / "clock.txt"
    command = [
        str(Path(sys.executable).parent / "ddp-app"), "fit", "--config", CONFIG, *RUN, "--restarts=1",
        f"--trainer.default_root_dir={workdir / 'run'}", *clock_arguments(clock),
    ]  # fmt: skip
    return _local_run(command, workdir, clock, "ddp-app.log")


def measure_torchrun(workdir: Path) -> Recovery:
    clock = workdir / "clock.txt"
    command = [
        str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node=2", "--max-restarts=1",
        "-m", "app", "fit", "--config", CONFIG, *RUN, "--ckpt_path", "last",
        f"--trainer.default_root_dir={workdir / 'run'}", *clock_arguments(clock),
    ]  # fmt: skip
    return _local_run(command, workdir, clock, "torchrun.log")


def measure_torchft(workdir: Path) -> Recovery:
    """Two replica groups; group 1 killed at KILL_AT_STEP. Read from the groups' per-step records
    (app/parallel/ft_manager.py): the kill to the restarted group's first step, the steps the surviving
    group trained again (none, unless it went back), and its longest pause."""
    root = workdir / "run"
    command = [
        str(Path(sys.executable).parent / "ddp-app"), "fit", "--config", CONFIG, *RUN, "--trainer.devices=2",
        "--fault_tolerance.enabled=true", f"--trainer.default_root_dir={root}",
    ]  # fmt: skip

    def record(group: int) -> list[dict[str, Any]]:
        path = root / "fault_tolerance" / f"group_{group}.jsonl"
        lines = path.read_text().split("\n") if path.exists() else [""]
        return [json.loads(line) for line in lines[:-1]]  # the last piece: empty, or a line being written

    log = workdir / "torchft.log"

    def kill(process: subprocess.Popen) -> float:
        deadline = time.monotonic() + 300
        while not any(entry.get("step", 0) >= KILL_AT_STEP and "time" in entry for entry in record(1)):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"torchft: no step {KILL_AT_STEP}:\n{log.read_text()[-3000:]}")
            time.sleep(0.01)
        pid = next(entry["pid"] for entry in record(1) if entry.get("start"))
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        return killed_at

    killed_at = run_and_kill(command, log, kill)
    restarted = next(entry for entry in record(1) if entry.get("start") and entry["time"] > killed_at)
    back = next(entry for entry in record(1) if entry["time"] > restarted["time"] and not entry.get("start"))
    done = max(entry["step"] for entry in record(1) if entry["time"] <= killed_at and "sent" not in entry)
    others = [(entry["time"], entry["step"]) for entry in record(0) if "sent" not in entry and not entry.get("start")]
    redone = sum(1 for (_, earlier), (_, later) in zip(others, others[1:], strict=False) if later <= earlier)
    stall = max(later - earlier for (earlier, _), (later, _) in zip(others, others[1:], strict=False))
    per_epoch = 20  # digits at 2 ranks (2 groups of 1)
    return Recovery(round(back["time"] - killed_at, 2), redone, done, restarted["step"], per_epoch, round(stall, 2))


@dataclass(frozen=True)
class SlurmRun:
    job_id: int
    state: str
    restarts: int
    log: Path
    recovery: Recovery


def scontrol_job(job_id: int, env: Mapping[str, str]) -> dict[str, str]:
    """`scontrol show job -o JOB` as a dict (no accounting needed)."""
    output = subprocess.run(
        ["scontrol", "show", "job", "-o", str(job_id)], env=env, capture_output=True, text=True, timeout=60, check=True
    ).stdout
    return dict(word.split("=", 1) for word in output.split() if "=" in word)


def measure_slurm(
    workdir: Path,
    env: Mapping[str, str],
    overrides: tuple[str, ...] = RUN,
    sbatch_options: tuple[str, ...] = CPU_ONLY_SBATCH,
    timeout: float = 400,
    script: str = "multinode.sbatch",
) -> SlurmRun:
    """`script` (multinode.sbatch) on two nodes x one rank, the rank on the second node killed with kill -9 at
    KILL_AT_STEP; waits for the job's final state (and cancels the job if anything goes wrong)."""
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    clock = workdir / "clock.txt"
    arguments = [
        str(REPO / CONFIG), *overrides, "--trainer.devices=1", "--trainer.num_nodes=2",
        f"--trainer.default_root_dir={workdir / 'run'}", *clock_arguments(clock),
    ]  # fmt: skip
    submitted = subprocess.run(
        ["sbatch", "--parsable", f"--chdir={workdir}", *sbatch_options, str(REPO / "slurm" / script),
         *arguments],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    job_id = int(submitted.stdout.strip().split(";")[0])
    deadline = time.monotonic() + timeout

    def running() -> bool:
        return scontrol_job(job_id, env)["JobState"] not in SLURM_FINAL_STATES

    try:
        wait_for_step(clock, KILL_AT_STEP, running, timeout)
        killed_at = kill_rank(clock, 1)
        while (record := scontrol_job(job_id, env))["JobState"] not in SLURM_FINAL_STATES:
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job_id} did not end within {timeout} s: {record['JobState']}")
            time.sleep(0.2)
    finally:
        subprocess.run(["scancel", str(job_id)], env=env, capture_output=True, timeout=60, check=False)
    recovery = read_clock(clock, killed_at) if record["JobState"] == "COMPLETED" else Recovery(-1, -1, -1, -1, -1)
    return SlurmRun(job_id, record["JobState"], int(record["Restarts"]), Path(record["StdOut"]), recovery)


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument(
        "--paths",
        default="ddp-app,torchrun",
        help="comma-separated: ddp-app, torchrun, torchft, slurm, slurm-torchrun",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path("runs/recovery"))
    parser.add_argument("--json", type=Path, default=None, help="write the figures here (merged by path)")
    options = parser.parse_args()
    figures: dict[str, Any] = json.loads(options.json.read_text()) if options.json and options.json.exists() else {}
    for path in options.paths.split(","):
        load_before = os.getloadavg()[0]
        runs: list[Recovery] = []
        for repeat in range(options.repeats):
            workdir = (options.workdir / f"{path}-{repeat}").resolve()
            workdir.mkdir(parents=True, exist_ok=False)
            if path in SLURM_PATHS:
                script, extra_env, requeues = SLURM_PATHS[path]
                job = measure_slurm(workdir, {**os.environ, **extra_env}, script=script)
                if job.state != "COMPLETED" or job.restarts != requeues:
                    raise SystemExit(f"{path}: job {job.job_id} {job.state}, {job.restarts} restart(s); see {job.log}")
                runs.append(job.recovery)
            else:
                measure = {"ddp-app": measure_ddp_app, "torchft": measure_torchft}.get(path, measure_torchrun)
                runs.append(measure(workdir))
            print(f"{path} #{repeat + 1}: {runs[-1]}", flush=True)
        figures[path] = {
            "cpus": os.cpu_count(),
            "loadavg_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "recovery_s": summary([run.recovery_s for run in runs]),
            "steps_redone": summary([run.steps_redone for run in runs]),
            "checkpoint_interval_steps": runs[0].checkpoint_interval_steps,
            "runs": [asdict(run) for run in runs],
            **({"others_stall_s": summary([run.others_stall_s for run in runs])} if path == "torchft" else {}),
        }
        recovery, redone = figures[path]["recovery_s"], figures[path]["steps_redone"]
        print(
            f"{path}: recovery {recovery['median']:.1f} s [{recovery['min']:.1f}, {recovery['max']:.1f}] "
            f"(goal <= {GOAL_S} s), steps redone {redone['median']:g} [{redone['min']:g}, {redone['max']:g}] "
            f"of a {runs[0].checkpoint_interval_steps}-step checkpoint interval",
            flush=True,
        )
        if options.json:  # after every path: a later failure keeps the figures measured so far
            options.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
