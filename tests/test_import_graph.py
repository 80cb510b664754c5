"""Package boundaries: no import cycle between app/ packages, and a reference trainer without Lightning."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
APP = REPO / "app"


def unit_of(module: str) -> str:
    """app.data.base -> app.data; app.cli -> app.cli: a subpackage, or a top-level module of app."""
    return ".".join(module.split(".")[:2])


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every `app.*` module this file imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("app.")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("app."):
            found.add(node.module)
    return found


def unit_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in APP.rglob("*.py"):
        unit = unit_of(module_name(path))
        if unit == "app":
            continue
        edges = {unit_of(imported) for imported in imports_of(path)} - {unit, "app"}
        graph.setdefault(unit, set()).update(edges)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None."""
    state: dict[str, str] = {}

    def visit(node: str, trail: list[str]) -> list[str] | None:
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return [*trail[trail.index(target) :], target] if target in trail else [node, target]
            if target not in state and (cycle := visit(target, [*trail, target])):
                return cycle
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [node])):
            return cycle
    return None


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_between_app_packages() -> None:
    cycle = find_cycle(unit_graph())
    assert cycle is None, f"import cycle between app/ packages: {' -> '.join(cycle or [])}"


def test_reference_imports_only_models_datasets_and_helpers() -> None:
    """Statically: the reference's own files import no Lightning side of app/ and no benchmark."""
    # app.cluster.preflight: "who launched me" and "what devices means" have one answer, Lightning-free.
    # app.resume.elastic and app.data.samplers: the sample order of a run continued on another number of
    # ranks has one definition, which both trainers follow (so that parity can check it).
    # app.data.on_device: how a split held as tensors is batched (by indexing), the same on both sides,
    # so that the benchmark's Lightning / reference compares trainers, not data paths.
    # app.cluster.ddp_buffers: DDP's arguments at one rank, the same on both sides.
    # app.data.image_datasets: the ImageFolder's datasets, bare like app.data.datasets (which it imports,
    # so it cannot be listed there).
    # app.parallel.fragments: which parameters strategy diloco syncs together (its "blocks"), one
    # definition on both sides, Lightning-free; the outer loop itself is written again in app/reference/diloco.py.
    # app.data.worker_fork: loader workers whose hung fork is forked again (CPython < 3.12), Lightning-free: the
    # reference's ranks run gloo too.
    allowed = {
        "app.reference", "app.models.nets", "app.models.transformer", "app.data.datasets", "app.data.image_datasets",
        "app.cluster.preflight", "app.cluster.slurm_env", "app.cluster.threads",
        "app.resume.elastic", "app.data.samplers", "app.data.on_device", "app.cluster.ddp_buffers",
        "app.parallel.fragments", "app.data.worker_fork",
    }  # fmt: skip
    for path in (APP / "reference").glob("*.py"):
        for imported in imports_of(path):
            assert imported in allowed or imported.startswith("app.reference."), (
                f"{path.relative_to(REPO)} imports {imported}: the reference may import the bare models "
                "and datasets (app.models.nets, app.data.datasets), not the Lightning side or app.bench"
            )


FORBIDDEN = ("lightning", "pytorch_lightning", "lightning_fabric", "app.bench", "app.cli")


def test_importing_the_reference_loads_no_lightning() -> None:
    """The acceptance check: `python -c "import app.reference.train"` loads no Lightning, no app.bench."""
    script = (
        "import json, sys\n"
        "import app.reference.train, app.reference.__main__, app.reference.model_parallel, app.reference.fsdp\n"
        "from app.reference.config import build_job, load_config\n"
        "build_job(load_config('configs/digits.yaml'))\n"
        "build_job(load_config('configs/toy.yaml'))\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120, check=True
    )
    loaded = json.loads(result.stdout.splitlines()[-1])
    offending = [name for name in loaded if name in FORBIDDEN or name.startswith(tuple(f"{f}." for f in FORBIDDEN))]
    assert not offending, f"importing and building the reference loaded {offending[:5]}"
