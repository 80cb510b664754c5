"""Where a user's own `class_path` (say `mymodels.MyNet`) is imported from, and what to say when it is not.

The same on every rank: the current directory first on `sys.path` (as `python -m` does), then the directory of every
`--config` file in order, then what was there (PYTHONPATH, installed packages). Modules already imported (torch,
lightning, app) cannot be replaced by a local file."""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

# The directories this process put on sys.path for user code, in search order (for error messages).
USER_CODE_DIRECTORIES: list[str] = []


def config_files(args: Sequence[str]) -> list[Path]:
    """The `--config`/`-c` arguments that name existing files (an inline YAML string is not a file)."""
    files = []
    for index, arg in enumerate(args):
        name, equals, value = arg.partition("=")
        if name not in ("--config", "-c"):
            continue
        if not equals:
            value = args[index + 1] if index + 1 < len(args) else ""
        path = Path(value)
        if value and path.is_file():
            files.append(path)
    return files


def add_user_code_directories(args: Sequence[str] | None = None) -> list[str]:
    """Put the current directory, then each `--config` file's directory, first on sys.path; returns them."""
    args = sys.argv[1:] if args is None else args
    directories = [os.getcwd(), *(str(path.resolve().parent) for path in config_files(args))]
    directories = list(dict.fromkeys(directories))
    # `python -m` puts the current directory in as '' or the absolute path; either way, only once.
    sys.path[:] = directories + [entry for entry in sys.path if entry not in ("", *directories)]
    USER_CODE_DIRECTORIES[:] = directories
    return directories


def _classes_in(module_name: str) -> dict[str, type]:
    try:
        module = importlib.import_module(module_name)
    except Exception:
        return {}
    # `__all__` too: app.models and app.data import their Lightning classes on first use.
    names = [*vars(module), *getattr(module, "__all__", [])]
    classes = {name: getattr(module, name, None) for name in names if not name.startswith("_")}
    return {name: value for name, value in classes.items() if inspect.isclass(value)}


def suggest_class(class_path: str) -> str | None:
    """The closest existing `module.Class` to a mistyped class path: in its own module, then in `app.models` and
    `app.data`; None if nothing is close."""
    module_name, _, class_name = class_path.rpartition(".")
    for candidate_module in dict.fromkeys([module_name, "app.models", "app.data"]):
        if not candidate_module:
            continue
        names = _classes_in(candidate_module)
        if names.get(class_name) is not None and candidate_module != module_name:
            return f"{candidate_module}.{class_name}"
        close = difflib.get_close_matches(class_name, list(names), n=1, cutoff=0.75)
        if close:
            return f"{candidate_module}.{close[0]}"
    return None


def _searched() -> str:
    directories = USER_CODE_DIRECTORIES or [os.getcwd()]
    return ", ".join(directories) + ", then PYTHONPATH and the installed packages"


def explain_class_path_error(key: str, class_path: str, reason: str, expected_base: str | None) -> str:
    """One line for a `class_path` that did not resolve, from jsonargparse's reason."""
    suggestion = suggest_class(class_path)
    did_you_mean = f" Did you mean {suggestion}?" if suggestion else ""
    missing = reason.partition("No module named ")[2].strip().strip("'\"")
    if missing:
        module_name = class_path.rpartition(".")[0]
        if module_name == missing or module_name.startswith(f"{missing}."):
            return (
                f"{key}: cannot import {class_path}: no module named '{missing}' (looked in {_searched()})."
                f"{did_you_mean} Fix: run from the directory that holds {missing.split('.')[0]}.py, put it "
                "beside the --config file, or install it."
            )
        return (
            f"{key}: importing {class_path} failed: its module imports '{missing}', which is not installed "
            f"(looked in {_searched()}). Fix: install {missing.split('.')[0]}."
        )
    no_attribute = re.search(r"module '([^']+)' has no attribute '([^']+)'", reason)
    if no_attribute:
        module_name, class_name = no_attribute.groups()
        fix = did_you_mean or " Fix: check the spelling."
        if f"{module_name}.{class_name}" != class_path:  # a package without that submodule
            return f"{key}: cannot import {class_path}: {module_name} has no module {class_name}.{fix}"
        return f"{key}: {module_name} has no class {class_name}.{fix}"
    if "Expected a dot import path" in reason:
        return (
            f"{key}: {class_path} is not a full class path (module.Class).{did_you_mean or ''} "
            "Fix: write the module too, e.g. app.models.MLPClassifier or mymodels.MyNet."
        )
    if expected_base and "does not correspond to a subclass" in reason:
        base = expected_base.rpartition(".")[2]
        example = "app.data.DigitsDataModule" if base == "LightningDataModule" else "app.models.MLPClassifier"
        return (
            f"{key}: {class_path} is not a {base} (a {key} class must subclass {expected_base}). "
            f"Fix: a class_path to a {base} subclass, e.g. {example}."
        )
    return f"{key}: cannot use class_path {class_path}: {' '.join(reason.split())}"
