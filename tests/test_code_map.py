"""The README's code map ("Where things are") matches the tree: every path it names exists, every
package and top-level module of app/ is named in it, and app/ keeps its loose modules few (issue 41:
at most 8 beside the packages, `__init__.py` and `__main__.py`)."""

from __future__ import annotations

import re

from tests.helpers.run import REPO

APP = REPO / "app"
MAX_LOOSE_MODULES = 8


def code_map() -> str:
    readme = (REPO / "README.md").read_text()
    return readme[readme.index("## Where things are") : readme.index("## What it guarantees")]


def named_paths() -> set[str]:
    return {
        path.rstrip("/") for path in re.findall(r"`((?:app|configs|slurm|examples|tests|docs)/[\w./]*)`", code_map())
    }


def test_every_path_the_code_map_names_exists() -> None:
    missing = sorted(path for path in named_paths() if not (REPO / path).exists())
    assert not missing, f"README's code map names paths that do not exist: {missing}"


def test_every_package_and_top_level_module_of_app_is_named() -> None:
    packages = {f"app/{path.parent.name}" for path in APP.glob("*/__init__.py")}
    modules = {f"app/{path.name}" for path in APP.glob("*.py")} - {"app/__init__.py", "app/__main__.py"}
    unnamed = sorted((packages | modules) - named_paths())
    assert not unnamed, f"README's code map does not name {unnamed}: add each to the table with what it holds"


def test_app_keeps_its_loose_modules_few() -> None:
    modules = sorted(path.name for path in APP.glob("*.py") if path.name not in ("__init__.py", "__main__.py"))
    assert len(modules) <= MAX_LOOSE_MODULES, (
        f"app/ has {len(modules)} loose modules ({', '.join(modules)}); at most {MAX_LOOSE_MODULES}: put a new "
        "module in the package of its concern"
    )
