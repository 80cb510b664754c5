"""Only app/checkpoints/ writes a checkpoint's top-level keys (app/checkpoints/state.py): read from the
source of every module of app/, so that a new writer elsewhere fails here, naming its file and line."""

from __future__ import annotations

import ast
from pathlib import Path

from app.checkpoints.state import LIGHTNING_KEYS, TOP_LEVEL_KEYS

APP = Path(__file__).resolve().parents[2] / "app"
OWNER = APP / "checkpoints"
MUTATORS = ("setdefault", "pop", "update", "__setitem__", "__delitem__")


def _key(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _root(node: ast.AST) -> ast.AST:
    while isinstance(node, (ast.Subscript, ast.Attribute, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _is_checkpoint(node: ast.AST, aliases: set[str]) -> bool:
    """A value named as a checkpoint (`checkpoint`, `lightning_checkpoint`, `ckpt`), or an alias of one of
    its entries (`loops = checkpoint.get("loops")`)."""
    root = _root(node)
    name = root.id if isinstance(root, ast.Name) else root.attr if isinstance(root, ast.Attribute) else ""
    return "checkpoint" in name.lower() or "ckpt" in name.lower() or name in aliases


def _entry_of_a_checkpoint(value: ast.AST, aliases: set[str]) -> bool:
    """`checkpoint["loops"]`, `checkpoint.get("loops")` or either `or {}`: a top-level entry."""
    if isinstance(value, ast.BoolOp):
        return any(_entry_of_a_checkpoint(operand, aliases) for operand in value.values)
    if isinstance(value, ast.Subscript):
        return _key(value.slice) in TOP_LEVEL_KEYS and _is_checkpoint(value.value, aliases)
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "get":
        return bool(value.args) and _key(value.args[0]) in TOP_LEVEL_KEYS and _is_checkpoint(value.func.value, aliases)
    return False


def writes_outside_the_owner(source: str) -> list[tuple[int, str]]:
    """(line, what) for each write of a checkpoint's top-level key, or of an entry under one, in `source`."""
    tree = ast.parse(source)
    aliases = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name) and _entry_of_a_checkpoint(node.value, set())
    }
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:  # checkpoint[key] = ..., checkpoint["loops"]["fit_loop"] = ..., del ...
            if isinstance(target, ast.Subscript) and _is_checkpoint(target.value, aliases):
                found.append((node.lineno, ast.unparse(target)))
        call = node.func if isinstance(node, ast.Call) else None
        if isinstance(call, ast.Attribute) and call.attr in MUTATORS and _is_checkpoint(call.value, aliases):
            found.append((node.lineno, ast.unparse(call)))  # checkpoint.pop("state_dict"), .setdefault, .update
        if isinstance(node, ast.Dict):
            keys = {_key(key) for key in node.keys} & set(LIGHTNING_KEYS)
            if len(keys) >= 2:  # a checkpoint built by hand
                found.append((node.lineno, "{" + ", ".join(sorted(keys)) + ", ...}"))
    return found


def test_only_app_checkpoints_writes_a_checkpoints_top_level_keys() -> None:
    found = [
        f"{path.relative_to(APP.parent)}:{line}: {what}"
        for path in sorted(APP.rglob("*.py"))
        if OWNER not in path.parents
        for line, what in writes_outside_the_owner(path.read_text())
    ]
    assert not found, (
        "a checkpoint's top-level keys are written outside app/checkpoints/ (use checkpoint_state.put, "
        "lightning_checkpoint or replace_loop_state, app/checkpoints/state.py):\n" + "\n".join(found)
    )


def test_the_scan_finds_each_way_of_writing_a_top_level_key() -> None:
    """The scan itself, on the writes this round moved into app/checkpoints/ (so the test above can fail)."""
    writes = {
        'checkpoint["sharding"] = {}\ncheckpoint["state_dict"] = {}': 2,  # ddp-app's parts go through `put`
        'tensors = {"state_dict": checkpoint.pop("state_dict")}': 1,
        'loops = checkpoint.get("loops") or {}\nloops["fit_loop"] = 1': 1,
        'checkpoint.setdefault("callbacks", {})': 1,
        'converted = {"state_dict": weights, "optimizer_states": [state]}': 1,
        'del lightning_checkpoint["ddp_app"]': 1,
        'checkpoint["loops"]["fit_loop"] = 1': 1,
    }
    for source, count in writes.items():
        assert len(writes_outside_the_owner(source)) == count, source
    reads = (
        'step = checkpoint["global_step"]\nloops = checkpoint.get("loops") or {}\nfit = loops.get("fit_loop")',
        'config["trainer"]["callbacks"] = []\nrow["epoch"] = 1',  # not a checkpoint
        'checkpoint_state.put(checkpoint, "tracking", {})',
    )
    for source in reads:
        assert writes_outside_the_owner(source) == [], source
