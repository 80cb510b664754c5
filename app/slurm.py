"""`python -m app.slurm`: sbatch scripts that agree with a config, and a check for those that may not.

    python -m app.slurm render --config configs/digits.yaml [--nodes 2] [--gpus-per-node 4] [ddp-app overrides]
    python -m app.slurm check slurm/multinode.sbatch --config configs/digits.yaml [--trainer.num_nodes 2 ...]
    python -m app.slurm endpoint          # inside a job: "first-node:port", the rendezvous for torchrun

`render` takes nodes, tasks per node and GPUs from the config's trainer.num_nodes and trainer.devices
(options override both sides at once) and pins them on the ddp-app command line as well, so the
script and the Trainer cannot disagree. `check` lists every disagreement between a script's
#SBATCH lines and a config, one per line, and exits 1 if there is any.

Stdlib and PyYAML only: it runs on a login node in well under a second.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from app.cluster.preflight import resolve_devices
from app.cluster.slurm_env import master_address_and_port
from app.errors import InvalidConfigError

# sbatch's short options, as their long names.
SHORT_OPTIONS = {
    "-N": "nodes",
    "-n": "ntasks",
    "-c": "cpus-per-task",
    "-G": "gpus",
    "-J": "job-name",
    "-t": "time",
    "-o": "output",
    "-p": "partition",
    "-A": "account",
}

DEFAULTS = {"cpus_per_task": 4, "time": "01:00:00"}


@dataclass(frozen=True)
class TrainerShape:
    """What the config (plus overrides) asks of the Trainer: processes per node and nodes."""

    devices: int | str  # an int, or "auto" when the config leaves it to the machine
    num_nodes: int
    accelerator: str


def read_trainer_shape(config_path: str | Path, overrides: list[str] | None = None) -> TrainerShape:
    """trainer.devices / num_nodes / accelerator as `ddp-app fit --config CONFIG OVERRIDES` resolves
    them: the CLI's own parser (files, `--trainer.X` overrides, precedence), not a second one."""
    from app.cli import parse_config  # imports Lightning: only when a config is read

    trainer = parse_config(["fit", "--config", str(config_path), *(overrides or [])])["trainer"]
    devices = trainer.get("devices", "auto")
    count = resolve_devices(devices, "cpu") if str(devices).strip() not in ("auto", "-1") else None
    accelerator = trainer.get("accelerator") or "auto"
    return TrainerShape(
        count if count is not None else str(devices),
        int(trainer.get("num_nodes") or 1),
        accelerator if isinstance(accelerator, str) else type(accelerator).__name__,
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

    gpus_per_node=0 renders a CPU-only job (no GPU request); otherwise one task per GPU.
    """
    shape = read_trainer_shape(config, overrides)
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
        '"${resume[@]}" "$@"',
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
            "# A requeued job (preemption, or SIGUSR1 before the time limit) resumes from its last checkpoint.",
            "resume=()",
            'if [[ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]]; then',
            "    resume=(--ckpt_path last)",
            "fi",
            " \\\n    ".join(command),
            "",
        ]
    )


def parse_directives(script_text: str) -> dict[str, str]:
    """The script's #SBATCH options by long name ("nodes": "2"); flags map to ""."""
    options: dict[str, str] = {}
    for line in script_text.splitlines():
        if not line.startswith("#SBATCH"):
            # sbatch stops reading directives at the first command.
            if line.strip() and not line.lstrip().startswith("#"):
                break
            continue
        words = shlex.split(line[len("#SBATCH") :], comments=True)
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


def check(script: str | Path, config: str | Path, overrides: list[str] | None = None) -> list[str]:
    """Every disagreement between an sbatch script and a config, one sentence each."""
    text = Path(script).read_text()
    options = parse_directives(text)
    body = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    # A script may pin trainer.devices/num_nodes on its command line (rendered ones do).
    pinned = [
        f"--trainer.{key}={value}"
        for key, value in re.findall(r"--trainer\.(devices|num_nodes|accelerator)[=\s]+([\w.-]+)", "\n".join(body))
    ]
    shape = read_trainer_shape(config, [*pinned, *(overrides or [])])
    uses_torchrun = any(re.search(r"\btorchrun\b", line) for line in body)
    uses_srun = any(re.match(r"\s*(exec\s+)?srun\b", line) for line in body)
    problems: list[str] = []

    nodes = int(options.get("nodes", "1").split("-")[0])
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

    commands.add_parser("endpoint", help="inside a job: the rendezvous host:port (first node, per-job port)")

    # Anything else is a ddp-app override (`--trainer.num_nodes 2`), for the script or for the check.
    args, overrides = parser.parse_known_args(argv)
    overrides = [arg for arg in overrides if arg != "--"]
    if args.command == "endpoint" and overrides:
        parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    prog = f"python -m app.slurm {args.command}"
    try:
        if args.command == "render":
            sys.stdout.write(
                render(
                    args.config,
                    nodes=args.nodes,
                    gpus_per_node=args.gpus_per_node,
                    devices=args.devices,
                    cpus_per_task=args.cpus_per_task,
                    time=args.time,
                    job_name=args.job_name,
                    partition=args.partition,
                    account=args.account,
                    overrides=overrides,
                )
            )
            return 0
        if args.command == "check":
            problems = check(args.script, args.config, overrides)
            for problem in problems:
                print(f"{args.script}: {problem}")
            if not problems:
                print(f"{args.script} agrees with {args.config}")
            return 1 if problems else 0
        address, port = master_address_and_port()
        print(f"{address}:{port}")
        return 0
    except (OSError, ValueError, KeyError) as error:
        detail = f"not inside a Slurm job ({error} is not set)" if isinstance(error, KeyError) else error
        print(f"{prog}: error: {detail}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
