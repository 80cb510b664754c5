"""The private Lightning, PyTorch and CPython APIs ddp-app uses, checked at runtime where they are used.

docs/private_apis.md lists each and why; tests/test_private_apis.py checks them at test time. At runtime each use asks
`require` once, so an unsupported version stops the run with one line (API, installed version, supported range, fix)
instead of an AttributeError deep in a rank. No Lightning or torch here: `app.cluster.launch` uses it before the ranks
start."""

from __future__ import annotations

import importlib.metadata
import platform
import re
import types
from collections.abc import Mapping
from typing import Any

from app.errors import UserFacingError

DOC = "docs/private_apis.md"


class PrivateApiChanged(UserFacingError):
    """A private API ddp-app relies on is missing from the installed Lightning, PyTorch or CPython."""


def installed_version(package: str) -> str:
    if package == "python":
        return platform.python_version()
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def supported_range(package: str) -> str:
    """What ddp-app's pyproject.toml asks of `package` (`lightning>=2.6,<2.7`), from the installed metadata."""
    try:
        if package == "python":
            return f"python{importlib.metadata.metadata('ddp-app')['Requires-Python']}"
        for requirement in importlib.metadata.requires("ddp-app") or []:
            name = re.match(r"[A-Za-z0-9_.\-]+", requirement)
            if name and name.group(0).lower() == package and ";" not in requirement:
                return requirement.replace(" ", "")
    except importlib.metadata.PackageNotFoundError:
        pass
    return f"{package} as pinned in ddp-app's pyproject.toml"


# How the packages are called in a message.
DISPLAY_NAMES = {"python": "Python", "torch": "PyTorch", "lightning": "Lightning", "torchvision": "torchvision"}


def changed(api: str, package: str, needed_for: str) -> PrivateApiChanged:
    """The one-line error for `api` missing from the installed `package`."""
    installed, supported = installed_version(package), supported_range(package)
    if package == "python":
        fix = "run ddp-app under a CPython that has it"
    elif _satisfies(installed, supported):  # the range has no upper bound, and this version dropped it
        fix = f"install a {package} that tests/test_private_apis.py passes on, or adapt ddp-app to {installed}"
    else:
        fix = f"pip install '{supported}'"
    return PrivateApiChanged(
        f"{DISPLAY_NAMES.get(package, package)} {installed} has no {api}, a private API ddp-app needs for "
        f"{needed_for} ({DOC}); ddp-app supports {supported}. Fix: {fix}."
    )


def _satisfies(version: str, requirement: str) -> bool:
    from packaging.requirements import InvalidRequirement, Requirement  # Lightning's own dependency
    from packaging.version import InvalidVersion

    try:
        return Requirement(requirement).specifier.contains(version, prereleases=True)
    except (InvalidRequirement, InvalidVersion):
        return False


def _name_of(owner: object) -> str:
    if isinstance(owner, type):
        return owner.__qualname__
    if isinstance(owner, types.ModuleType):
        return owner.__name__
    return type(owner).__qualname__


def require(owner: object, name: str, package: str, needed_for: str, owner_name: str | None = None) -> Any:
    """`owner.name` (or `owner[name]` for a mapping, such as a state dict Lightning wrote), or `PrivateApiChanged`
    naming it, the installed `package` version and the supported range. `owner_name` names the owner in the message
    where its type's name would not say what it is."""
    if isinstance(owner, Mapping):
        if name in owner:
            return owner[name]
        raise changed(f"{name!r} in {owner_name or _name_of(owner)}", package, needed_for)
    try:
        return getattr(owner, name)
    except AttributeError:
        raise changed(f"{owner_name or _name_of(owner)}.{name}", package, needed_for) from None
