"""`python -m app.slurm`: sbatch scripts that agree with a config, and a check for those that may not.

    python -m app.slurm render --config configs/digits.yaml [--nodes 2] [--gpus-per-node 4] [ddp-app overrides]
    python -m app.slurm check slurm/multinode.sbatch --config configs/digits.yaml [--trainer.num_nodes 2 ...]
    python -m app.slurm submit [--sbatch-option=value ...] slurm/train.sbatch configs/digits.yaml [overrides]
    python -m app.slurm endpoint          # inside a job: "first-node:port", the rendezvous for torchrun
    python -m app.slurm requeue-on-failure EXIT_CODE   # in a batch script, after its srun step

`render` pins the config's sizes on the #SBATCH lines and the command line alike; `check` lists every disagreement (exit
1); `submit` checks, creates the log directory and submits from any directory (docs/slurm.md). Light imports only, for
login nodes. A tool beside app/cluster/ (whose Slurm logic it uses) because it reads configs through app.cli, which
imports app.cluster (tests/test_import_graph.py forbids the cycle).
"""

from __future__ import annotations

import argparse
import getpass
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from app.cluster.preflight import NODE_LAUNCHER_VARIABLE, resolve_devices
from app.cluster.requeue import requeue_after_failed_step
from app.cluster.slurm_env import master_address_and_port
from app.errors import InvalidConfigError, UserFacingError

# sbatch's short options, as their long names.
SHORT_OPTIONS = {
    "-N": "nodes",
    "-n": "ntasks",
    "-c": "cpus-per-task",
    "-G": "gpus",
    "-J": "job-name",
    "-t": "time",
    "-o": "output",
    "-e": "error",
    "-D": "chdir",
    "-p": "partition",
    "-A": "account",
}

DEFAULTS = {"cpus_per_task": 4, "time": "01:00:00"}

# The lines above the srun of train.sbatch, multinode.sbatch and rendered scripts (app/cluster/requeue.py).
REQUEUE_ON_FAILURE_COMMENT = (
    "# A step that fails for a reason other than bad input (a rank killed, a node lost) requeues the",
    "# job, at most DDP_APP_MAX_REQUEUES times (default 3); bad input (exit 2) never does (docs/slurm.md).",
)

# Slurm's filename patterns (man sbatch, "filename pattern"), with an optional zero-padding width (%4j).
FILENAME_PATTERN = re.compile(r"%(\d*)([%AabJjNnstux])")


@dataclass(frozen=True)
class TrainerShape:
    """What the config (plus overrides) asks of the Trainer: processes per node and nodes."""

    devices: int | str  # an int, or "auto" when the config leaves it to the machine
    num_nodes: int
    accelerator: str
    fault_tolerant: bool = False  # fault_tolerance.enabled: one ddp-app per node starts its replica groups


def read_trainer_shape(config_path: str | Path, overrides: list[str] | None = None) -> TrainerShape:
    """trainer.devices / num_nodes / accelerator as `ddp-app fit --config CONFIG OVERRIDES` resolves them: the CLI's own
    parser (files, `--trainer.X` overrides, precedence), not a second one."""
    from app.cli import parse_config  # imports Lightning: only when a config is read

    seed_log = logging.getLogger("lightning.fabric.utilities.seed")
    seed_log_level = seed_log.level
    seed_log.setLevel(logging.WARNING)  # parsing seeds, and "Seed set to 42" is noise in a one-line report
    try:
        with warnings.catch_warnings():
            # Lightning warns when sys.argv holds arguments too: here they are this tool's own.
            warnings.filterwarnings("ignore", "LightningCLI's args parameter", UserWarning)
            parsed = parse_config(["fit", "--config", str(config_path), *(overrides or [])])
            trainer = parsed["trainer"]
    finally:
        seed_log.setLevel(seed_log_level)
    devices = trainer.get("devices", "auto")
    count = resolve_devices(devices, "cpu") if str(devices).strip() not in ("auto", "-1") else None
    accelerator = trainer.get("accelerator") or "auto"
    return TrainerShape(
        count if count is not None else str(devices),
        int(trainer.get("num_nodes") or 1),
        accelerator if isinstance(accelerator, str) else type(accelerator).__name__,
        bool((parsed.get("fault_tolerance") or {}).get("enabled")),
    )


def render(
    config: str,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    devices: int | None = None,
    cpus_per_task: int = DEFAULTS["cpus_per_task"],
    time: str = DEFAULTS["time"],
    job_name: str | None = None,
    partition: str | None = None,
    account: str | None = None,
    overrides: list[str] | None = None,
) -> str:
    """An sbatch script for `ddp-app fit --config CONFIG` whose shape comes from the config.

    gpus_per_node=0 renders a CPU-only job (no GPU request); otherwise one task per GPU."""
    shape = read_trainer_shape(config, overrides)
    if shape.fault_tolerant:
        raise InvalidConfigError(
            f"fault_tolerance.enabled is true in {config}: render writes one srun task per rank, and a fault-tolerant"
            " job runs one ddp-app per node that starts (and restarts) its replica groups, with a lighthouse."
            " Fix: sbatch --nodes=N slurm/fault_tolerant.sbatch CONFIG (python -m app.slurm check agrees with it)."
        )
    num_nodes = nodes if nodes is not None else shape.num_nodes
    if devices is None and gpus_per_node:
        devices = gpus_per_node
    if devices is None:
        if not isinstance(shape.devices, int):
            raise InvalidConfigError(
                f"trainer.devices is {shape.devices!r} in {config}: the script needs a number."
                " HINT: --gpus-per-node N (or --devices N for a CPU-only job)."
            )
        devices = shape.devices
    if gpus_per_node is None:
        gpus_per_node = 0 if shape.accelerator == "cpu" else devices
    if gpus_per_node and gpus_per_node != devices:
        raise InvalidConfigError(
            f"--gpus-per-node={gpus_per_node} but {devices} processes per node: DDP runs one process per GPU."
            f" HINT: --gpus-per-node {devices}, or --devices {gpus_per_node}."
        )
    name = job_name or Path(config).stem
    directives = [
        f"--job-name={name}",
        *([f"--partition={partition}"] if partition else []),
        *([f"--account={account}"] if account else []),
        f"--nodes={num_nodes}",
        f"--ntasks-per-node={devices}",
        *([f"--gpus-per-node={gpus_per_node}"] if gpus_per_node else []),
        f"--cpus-per-task={cpus_per_task}",
        f"--time={time}",
        "--signal=SIGUSR1@90",
        "--requeue",
        "--open-mode=append",
        "--output=logs/%x-%j.out",
    ]
    command = [
        "srun --kill-on-bad-exit=1 ddp-app fit",
        f"--config {shlex.quote(config)}",
        f"--trainer.devices={devices} --trainer.num_nodes={num_nodes}",
        *([shlex.join(overrides)] if overrides else []),
        '"${resume[@]}" "$@" || status=$?',
    ]
    where = "CPU-only, " if not gpus_per_node else ""
    return "\n".join(
        [
            "#!/bin/bash",
            f"# Rendered by `python -m app.slurm render` from {config}: {where}{num_nodes} node(s) x {devices}"
            " task(s) per node,",
            "# pinned on the ddp-app command line too. Render again rather than edit the sizes by hand.",
            "#   mkdir -p logs && sbatch THIS_FILE [more ddp-app overrides]",
            *(f"#SBATCH {directive}" for directive in directives),
            "set -euo pipefail",
            "",
            "# Since Slurm 22.05 srun no longer inherits --cpus-per-task from sbatch.",
            'export SRUN_CPUS_PER_TASK="${SLURM_CPUS_PER_TASK:-1}"',
            "",
            "# A requeued job (preempted, or its step failed: see below) resumes from its last checkpoint.",
            "resume=()",
            'if [[ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]]; then',
            "    resume=(--ckpt_path last)",
            "fi",
            "",
            *REQUEUE_ON_FAILURE_COMMENT,
            "status=0",
            " \\\n    ".join(command),
            'python -m app.slurm requeue-on-failure "$status"',
            'exit "$status"',
            "",
        ]
    )


def parse_options(words: list[str]) -> dict[str, str]:
    """sbatch options (["--nodes=2", "-J", "x", "--requeue"]) by long name; flags map to ""."""
    options: dict[str, str] = {}
    index = 0
    while index < len(words):
        word = words[index]
        if word.startswith("--"):
            name, equals, value = word[2:].partition("=")
            if not equals and index + 1 < len(words) and not words[index + 1].startswith("-"):
                value, index = words[index + 1], index + 1
            options[name] = value
        elif word[:2] in SHORT_OPTIONS:
            value = word[2:]
            if not value and index + 1 < len(words):
                value, index = words[index + 1], index + 1
            options[SHORT_OPTIONS[word[:2]]] = value
        index += 1
    return options


def parse_directives(script_text: str) -> dict[str, str]:
    """The script's #SBATCH options by long name ("nodes": "2"); flags map to ""."""
    options: dict[str, str] = {}
    for line in script_text.splitlines():
        if not line.startswith("#SBATCH"):
            # sbatch stops reading directives at the first command.
            if line.strip() and not line.lstrip().startswith("#"):
                break
            continue
        options.update(parse_options(shlex.split(line[len("#SBATCH") :], comments=True)))
    return options


def _count(value: str) -> int:
    """The number in "2", "a100:2" or "gpu:a100:2"."""
    return int(value.rsplit(":", 1)[-1])


def gpus_per_node_of(options: dict[str, str], nodes: int, tasks_per_node: int | None) -> int | None:
    """GPUs per node that the directives request, or None when they request none."""
    if "gpus-per-node" in options:
        return _count(options["gpus-per-node"])
    gres = re.search(r"(?:^|,)gpu(?::[^,:]+)?:(\d+)", options.get("gres", ""))
    if gres:
        return int(gres.group(1))
    if "gpus" in options:
        return _count(options["gpus"]) // max(nodes, 1)
    if "gpus-per-task" in options and tasks_per_node:
        return _count(options["gpus-per-task"]) * tasks_per_node
    return None


def check(
    script: str | Path,
    config: str | Path,
    overrides: list[str] | None = None,
    sbatch_options: list[str] | None = None,
) -> list[str]:
    """Every disagreement between an sbatch script (with the sbatch command line's options, which win over its #SBATCH
    lines) and a config, one sentence each."""
    text = Path(script).read_text()
    options = {**parse_directives(text), **parse_options(sbatch_options or [])}
    body = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not any(re.search(r"\bddp-app\b|-m app\s", line) for line in body):
        # The overrides are for the script's program: reference.sbatch takes `--epochs 2`, not ddp-app's.
        overrides = []
    nodes = int(options.get("nodes", "1").split("-")[0])
    # A script may pin trainer.devices/num_nodes on its command line (rendered ones do), to a number or to the job's
    # node count (fault_tolerant.sbatch: --trainer.num_nodes "$SLURM_JOB_NUM_NODES").
    job_nodes = re.compile(r'"?\$\{?(SLURM_JOB_NUM_NODES|SLURM_NNODES)\}?"?')
    pinned = [
        f"--trainer.{key}={nodes if job_nodes.fullmatch(value) else value}"
        for key, value in re.findall(
            r"--trainer\.(devices|num_nodes|accelerator)[=\s]+([\w.-]+|\"?\$\{?\w+\}?\"?)", "\n".join(body)
        )
        if "$" not in value or job_nodes.fullmatch(value)  # another variable: unknown here, as if not pinned
    ]
    # fault_tolerant.sbatch makes each node's one task the launcher of its replica groups, and turns them on itself.
    node_launcher = f"{NODE_LAUNCHER_VARIABLE}=1" in "\n".join(body)
    if node_launcher:
        pinned.append("--fault_tolerance.enabled=true")
    shape = read_trainer_shape(config, [*pinned, *(overrides or [])])
    uses_torchrun = any(re.search(r"\btorchrun\b", line) for line in body)
    uses_srun = any(re.match(r"\s*(exec\s+)?srun\b", line) for line in body)
    problems: list[str] = []

    if shape.fault_tolerant and not node_launcher:
        problems.append(
            "fault_tolerance.enabled is true but the script starts one ddp-app per rank: a fault-tolerant job runs"
            " one ddp-app per node, which starts its replica groups (each task here would refuse at its start)."
            " Fix: slurm/fault_tolerant.sbatch, or --fault_tolerance.enabled false."
        )
    if node_launcher and not shape.fault_tolerant:  # an override after the script's own turned it off
        problems.append(
            f"the script starts each node's replica groups ({NODE_LAUNCHER_VARIABLE}=1) but fault_tolerance.enabled is"
            " false. Fix: drop --fault_tolerance.enabled false, or slurm/multinode.sbatch for a run without it."
        )
    if nodes != shape.num_nodes:
        problems.append(
            f"--nodes={nodes} but trainer.num_nodes={shape.num_nodes}."
            f" Fix: --nodes={shape.num_nodes}, or --trainer.num_nodes {nodes}."
        )
    tasks_per_node = int(options["ntasks-per-node"]) if "ntasks-per-node" in options else None
    if "ntasks" in options and tasks_per_node is None:
        problems.append(
            f"--ntasks={options['ntasks']} without --ntasks-per-node: Lightning refuses it (it cannot tell the"
            f" ranks per node). Fix: --ntasks-per-node={shape.devices} instead of --ntasks."
        )
    if uses_torchrun:
        if tasks_per_node not in (None, 1):
            problems.append(
                f"--ntasks-per-node={tasks_per_node} under torchrun: each task is a torchrun agent that starts"
                " trainer.devices ranks itself. Fix: --ntasks-per-node=1."
            )
    elif node_launcher:
        pass  # its srun starts one task per node, which forks the node's trainer.devices processes (its groups)
    elif tasks_per_node is not None and isinstance(shape.devices, int) and tasks_per_node != shape.devices:
        problems.append(
            f"--ntasks-per-node={tasks_per_node} but trainer.devices={shape.devices}: under srun there is one task"
            f" per process. Fix: --ntasks-per-node={shape.devices}, or --trainer.devices {tasks_per_node}."
        )
    gpus = gpus_per_node_of(options, nodes, tasks_per_node)
    if gpus and isinstance(shape.devices, int) and gpus != shape.devices:
        problems.append(
            f"{gpus} GPUs per node requested but trainer.devices={shape.devices}: DDP runs one process per GPU."
            f" Fix: --gpus-per-node={shape.devices}, or --trainer.devices {gpus}."
        )
    if gpus and shape.accelerator == "cpu":
        problems.append(f"{gpus} GPUs per node requested but trainer.accelerator=cpu. Fix: drop the GPU request.")
    wanted_tasks = (tasks_per_node or 1) * nodes if "ntasks" not in options else int(options["ntasks"])
    if not uses_srun and not uses_torchrun and wanted_tasks > 1:
        problems.append(
            f"the job has {wanted_tasks} tasks but the script never calls srun: one process would wait for the"
            " others until the time limit. Fix: srun ddp-app fit ... (see slurm/train.sbatch)."
        )
    return problems


def expand_filename_pattern(pattern: str, values: dict[str, str]) -> str:
    """`pattern` with the %-codes that `values` knows replaced ("x": job name, "j": job id, ...) and zero-padded as %4j
    asks; any other code is left as it is."""

    def replace(match: re.Match[str]) -> str:
        width, code = match.groups()
        if code == "%":
            return "%"
        if code not in values:
            return match.group(0)
        return values[code].zfill(int(width or 0))

    return FILENAME_PATTERN.sub(replace, pattern)


def log_paths(options: dict[str, str], script: str | Path, cwd: Path, job_id: str | None = None) -> list[Path]:
    """The job's --output file (and --error, when it has one of its own) as absolute paths, as sbatch resolves them:
    relative to --chdir, itself relative to cwd. %x and %u are known before the job is submitted, %j and %A only with
    job_id; other codes are left for Slurm."""
    workdir = cwd / options.get("chdir", ".")
    values = {"x": options.get("job-name") or Path(script).name, "u": getpass.getuser()}
    if job_id is not None:
        values.update(j=job_id, A=job_id)
    default_output = "slurm-%A_%a.out" if "array" in options else "slurm-%j.out"
    patterns = [options.get("output") or default_output, *([options["error"]] if options.get("error") else [])]
    return [Path(os.path.normpath(workdir / expand_filename_pattern(pattern, values))) for pattern in patterns]


def log_directories(options: dict[str, str], script: str | Path, cwd: Path) -> list[Path]:
    """The directories the job's output and error files go to, which Slurm does not create."""
    directories = []
    for path in log_paths(options, script, cwd):
        unknown = [code for code in FILENAME_PATTERN.findall(str(path.parent)) if code[1] != "%"]
        if unknown:
            codes = ", ".join(f"%{width}{code}" for width, code in unknown)
            raise InvalidConfigError(
                f"the log directory {path.parent} contains {codes}, which Slurm knows only once the job runs,"
                " and Slurm does not create directories. Fix: put those codes in the file name only"
                " (--output=logs/%x-%j.out)."
            )
        directories.append(path.parent)
    return directories


def absolute_config_paths(arguments: list[str], cwd: Path) -> list[str]:
    """`arguments` with every YAML file they name (`--config x.yaml`, `--data=data.yaml`) made absolute, so the job
    finds them whatever its working directory."""

    def absolute(value: str) -> str:
        path = cwd / value
        return os.path.normpath(path) if value.endswith((".yaml", ".yml")) and path.is_file() else value

    resolved = []
    for argument in arguments:
        key, equals, value = argument.partition("=")
        resolved.append(f"{key}={absolute(value)}" if argument.startswith("-") and equals else absolute(argument))
    return resolved


def split_submit_arguments(words: list[str]) -> tuple[list[str], str, str, list[str]]:
    """`[SBATCH OPTIONS] SCRIPT CONFIG [OVERRIDES]` into its four parts: the script is the first word that is not an
    option, so sbatch options must carry their value after `=`."""
    first = next((index for index, word in enumerate(words) if not word.startswith("-")), len(words))
    sbatch_options, rest = words[:first], [word for word in words[first:] if word != "--"]
    if len(rest) < 2:
        raise UserFacingError(
            "expected SCRIPT CONFIG after the sbatch options."
            " Usage: python -m app.slurm submit [--sbatch-option=value ...] SCRIPT CONFIG [ddp-app overrides]"
        )
    script, config, *overrides = rest
    return sbatch_options, script, config, overrides


def submit(
    script: str, config: str, overrides: list[str] | None = None, sbatch_options: list[str] | None = None
) -> tuple[str, Path]:
    """`sbatch --chdir=$PWD [SBATCH OPTIONS] SCRIPT CONFIG [OVERRIDES]` once `check` agrees, with the config paths made
    absolute and the log directory created; returns the job id and its log file."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise UserFacingError("sbatch not found: run this on a Slurm login node (or put Slurm's commands on PATH).")
    sbatch_options = sbatch_options or []
    if not Path(script).is_file():
        hint = " HINT: sbatch options go before the script, as --name=value (--partition=gpu, not -p gpu)."
        raise UserFacingError(f"no sbatch script {script!r}.{hint if sbatch_options else ''}")
    if not Path(config).is_file():
        raise UserFacingError(f"no config file {config!r} (relative paths are relative to {Path.cwd()}).")
    cwd = Path.cwd()
    config, *overrides = absolute_config_paths([config, *(overrides or [])], cwd)
    problems = check(script, config, overrides, sbatch_options)
    if problems:
        raise UserFacingError(f"{script} disagrees with {config}, nothing submitted: {' '.join(problems)}")
    options = {**parse_directives(Path(script).read_text()), **parse_options(sbatch_options)}
    for directory in log_directories(options, script, cwd):
        directory.mkdir(parents=True, exist_ok=True)
    # The scripts run `ddp-app` from PATH: the job (sbatch exports this environment) uses the environment of this
    # command even when it was not activated.
    environment = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    command = [sbatch, "--parsable", f"--chdir={cwd}", *sbatch_options, script, config, *overrides]
    result = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=120)
    if result.returncode != 0:
        raise UserFacingError(f"sbatch refused the job: {' '.join(result.stderr.split())}")
    sys.stderr.write(result.stderr)
    job_id = result.stdout.strip().split(";")[0]
    return job_id, log_paths(options, script, cwd, job_id)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.slurm", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    render_parser = commands.add_parser("render", help="print an sbatch script whose sizes come from the config")
    render_parser.add_argument("--config", required=True)
    render_parser.add_argument("--nodes", type=int, help="default: trainer.num_nodes (sets it too)")
    render_parser.add_argument("--gpus-per-node", type=int, help="0: CPU-only; default: trainer.devices")
    render_parser.add_argument("--devices", type=int, help="processes (tasks) per node; default: trainer.devices")
    render_parser.add_argument("--cpus-per-task", type=int, default=DEFAULTS["cpus_per_task"])
    render_parser.add_argument("--time", default=DEFAULTS["time"])
    render_parser.add_argument("--job-name", help="default: the config's file name")
    render_parser.add_argument("--partition", help="site-specific: omitted unless given")
    render_parser.add_argument("--account", help="site-specific: omitted unless given")

    check_parser = commands.add_parser("check", help="list every disagreement between a script and a config")
    check_parser.add_argument("script")
    check_parser.add_argument("--config", required=True)

    submit_parser = commands.add_parser(
        "submit",
        help="check a script against a config, create its log directory and sbatch it, from any directory",
        usage="python -m app.slurm submit [--sbatch-option=value ...] SCRIPT CONFIG [ddp-app overrides]",
    )
    submit_parser.add_argument("script")
    submit_parser.add_argument("config")

    commands.add_parser("endpoint", help="inside a job: the rendezvous host:port (first node, per-job port)")
    requeue_parser = commands.add_parser(
        "requeue-on-failure",
        help="in a batch script, after its srun step: requeue the job if the step failed for a reason other than"
        " bad input, at most DDP_APP_MAX_REQUEUES times (default 3)",
    )
    requeue_parser.add_argument("exit_code", type=int, help="the srun step's exit code")

    # Anything else is a ddp-app override (`--trainer.num_nodes 2`), for the script or for the check.
    args, overrides = parser.parse_known_args(argv)
    overrides = [arg for arg in overrides if arg != "--"]
    if args.command in ("endpoint", "requeue-on-failure") and overrides:
        parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    prog = f"python -m app.slurm {args.command}"
    try:
        if args.command == "render":
            sizes = {name: value for name, value in vars(args).items() if name not in ("command", "config")}
            sys.stdout.write(render(args.config, overrides=overrides, **sizes))  # --nodes ... --account
            return 0
        if args.command == "check":
            problems = check(args.script, args.config, overrides)
            for problem in problems:
                print(f"{args.script}: {problem}")
            if not problems:
                print(f"{args.script} agrees with {args.config}")
            return 1 if problems else 0
        if args.command == "submit":
            words = sys.argv[1:] if argv is None else argv
            sbatch_options, script, config, overrides = split_submit_arguments(words[words.index("submit") + 1 :])
            job_id, log = submit(script, config, overrides, sbatch_options)
            print(f"submitted job {job_id}; log: {log}")
            return 0
        if args.command == "requeue-on-failure":
            line = requeue_after_failed_step(args.exit_code)
            if line:
                print(line, flush=True)
            return 0
        address, port = master_address_and_port()
        print(f"{address}:{port}")
        return 0
    except (OSError, ValueError, KeyError, UserFacingError) as error:
        detail = f"not inside a Slurm job ({error} is not set)" if isinstance(error, KeyError) else error
        print(f"{prog}: error: {detail}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
