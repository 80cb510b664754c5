"""What a sweep varies: a grid of values or an Optuna search space, over any keys of a ddp-app config.

    --grid model.init_args.lr=0.01,0.1 --grid data.init_args.batch_size=32,64     (every combination)
    --search model.init_args.lr=loguniform:1e-4:1e-1 --trials 20                  (Optuna proposes)

or the same in a `sweep:` section of the config (ddp-app itself ignores it):

    sweep:
      grid: {model.init_args.lr: [0.01, 0.1]}
      search: {model.init_args.lr: "loguniform:1e-4:1e-1"}
      trials: 20
      metric: val_acc
      direction: maximize

A bad spec is one line, and nothing runs or is submitted."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from app.errors import UserFacingError

DISTRIBUTIONS = ("uniform", "loguniform", "int", "intlog", "choice")


class SweepError(UserFacingError):
    """A sweep spec or directory that cannot be used; the line says what to fix."""


@dataclass(frozen=True)
class Dimension:
    """One searched key: `kind:low:high` (uniform, loguniform, int, intlog) or `choice:a,b,c`."""

    key: str
    kind: str
    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] = ()

    @classmethod
    def parse(cls, key: str, text: str) -> Dimension:
        kind, _, rest = str(text).partition(":")
        if kind not in DISTRIBUTIONS:
            raise SweepError(
                f"--search {key}={text}: unknown distribution {kind!r}. Fix: one of {', '.join(DISTRIBUTIONS)} "
                "(e.g. loguniform:1e-4:1e-1, int:16:128, choice:adam,sgd)."
            )
        if kind == "choice":
            choices = tuple(choice for choice in rest.split(",") if choice)
            if not choices:
                raise SweepError(f"--search {key}={text}: no choices. Fix: choice:a,b,c.")
            return cls(key, kind, choices=choices)
        bounds = rest.split(":")
        try:
            low, high = (float(bound) for bound in bounds)
        except ValueError:
            raise SweepError(f"--search {key}={text}: expected {kind}:LOW:HIGH with two numbers.") from None
        if not low < high:
            raise SweepError(f"--search {key}={text}: empty range (low {low:g} >= high {high:g}). Fix: low < high.")
        if kind in ("loguniform", "intlog") and low <= 0:
            raise SweepError(f"--search {key}={text}: a log scale needs low > 0. Fix: a positive low, or {kind[:-3]}.")
        if kind in ("int", "intlog") and (low != int(low) or high != int(high)):
            raise SweepError(f"--search {key}={text}: int bounds must be whole numbers.")
        return cls(key, kind, low, high)

    def sample_value(self) -> str:
        """A value inside the range, to check the key and its type against the config."""
        if self.kind == "choice":
            return self.choices[0]
        return str(int(self.low)) if self.kind.startswith("int") else repr(self.low)

    def describe(self) -> str:
        return (
            f"choice:{','.join(self.choices)}" if self.kind == "choice" else f"{self.kind}:{self.low:g}:{self.high:g}"
        )


@dataclass
class SweepSpec:
    """Everything `python -m app.sweep` needs again later (status, resume, the Slurm workers): sweep.json."""

    fit_args: list[str]  # `ddp-app fit` arguments every point shares: --config files and overrides
    grid: dict[str, list[str]] = field(default_factory=dict)
    search: list[Dimension] = field(default_factory=list)
    trials: int = 0
    metric: str = "val_acc"
    direction: str = "maximize"
    pruner: str = "median"
    seed: int = 0
    submit: dict[str, Any] | None = None  # --slurm: {"script", "array_parallel", "sbatch_args"}

    def grid_points(self) -> list[dict[str, str]]:
        keys = list(self.grid)
        return [dict(zip(keys, values, strict=True)) for values in itertools.product(*self.grid.values())]

    @property
    def is_search(self) -> bool:
        return bool(self.search)

    def size(self) -> int:
        return self.trials if self.is_search else len(self.grid_points())

    def save(self, path: Path) -> None:
        data = asdict(self)
        path.write_text(json.dumps(data, indent=1))

    @classmethod
    def load(cls, directory: Path) -> SweepSpec:
        path = directory / "sweep.json"
        if not path.is_file():
            raise SweepError(f"{directory} is not a sweep directory (no sweep.json). Fix: the --out of a sweep run.")
        data = json.loads(path.read_text())
        data["search"] = [Dimension(**{**item, "choices": tuple(item["choices"])}) for item in data["search"]]
        return cls(**data)


def point_args(params: dict[str, str]) -> list[str]:
    return [f"--{key}={value}" for key, value in params.items()]


def _scalar(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, dict, bool)) or value is None else str(value)


def sweep_section(fit_args: list[str]) -> dict[str, Any]:
    """The `sweep:` section of the config files among `fit_args` (later files win, as in ddp-app)."""
    section: dict[str, Any] = {}
    for flag, value in zip(fit_args, fit_args[1:], strict=False):
        if flag == "--config" and Path(value).is_file():
            loaded = yaml.safe_load(Path(value).read_text()) or {}
            section.update(loaded.get("sweep") or {})
    return section


def build_spec(
    fit_args: list[str],
    grid: list[str],
    search: list[str],
    trials: int | None,
    metric: str | None,
    direction: str | None,
    pruner: str,
    seed: int,
) -> SweepSpec:
    """The spec from the command line, filling in from the config's `sweep:` section; checked."""
    section = sweep_section(fit_args)
    grid_axes: dict[str, list[str]] = {
        key: [_scalar(v) for v in values] for key, values in (section.get("grid") or {}).items()
    }
    for item in grid:
        key, sep, values = item.partition("=")
        if not sep or not key:
            raise SweepError(f"--grid {item}: expected KEY=V1,V2,... (e.g. model.init_args.lr=0.01,0.1).")
        grid_axes[key.removeprefix("--")] = [value for value in values.split(",") if value != ""]
    dimensions = {key: Dimension.parse(key, text) for key, text in (section.get("search") or {}).items()}
    for item in search:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise SweepError(
                f"--search {item}: expected KEY=DISTRIBUTION (e.g. model.init_args.lr=loguniform:1e-4:1e-1)."
            )
        dimensions[key.removeprefix("--")] = Dimension.parse(key.removeprefix("--"), text)
    for key, values in grid_axes.items():
        if not values:
            raise SweepError(f"--grid {key}: no values. Fix: {key}=V1,V2,...")
    if grid_axes and dimensions:
        raise SweepError("a sweep is a grid or a search, not both. Fix: keep --grid or --search (and its sweep: keys).")
    if not grid_axes and not dimensions:
        raise SweepError("nothing to sweep. Fix: --grid KEY=V1,V2 or --search KEY=DISTRIBUTION --trials N.")
    trials = trials if trials is not None else section.get("trials")
    if dimensions and (not isinstance(trials, int) or trials < 1):
        raise SweepError(f"--search needs --trials >= 1 (got {trials}). Fix: --trials 20.")
    direction = direction or section.get("direction") or "maximize"
    if direction not in ("maximize", "minimize"):
        raise SweepError(f"--direction {direction}: expected maximize or minimize.")
    return SweepSpec(
        fit_args=fit_args,
        grid=grid_axes,
        search=list(dimensions.values()),
        trials=int(trials or 0),
        metric=metric or section.get("metric") or "val_acc",
        direction=direction,
        pruner=pruner,
        seed=seed,
    )


def check_keys(spec: SweepSpec) -> None:
    """Parse the ddp-app config with every swept value (the first of a search's range): an unknown key or a value of the
    wrong type is ddp-app's own one-line parser error, before anything runs."""
    from app.cli import parse_config

    trial_values = [{key: value} for key, values in spec.grid.items() for value in values]
    trial_values += [{dimension.key: dimension.sample_value()} for dimension in spec.search]
    for params in trial_values or [{}]:
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):
                parse_config(["fit", *spec.fit_args, *point_args(params)])
        except SystemExit:
            line = stderr.getvalue().strip().splitlines()
            reason = line[-1].split("error: ", 1)[-1] if line else "ddp-app refused the arguments"
            reason = reason.split(" (see: ")[0]  # ddp-app's pointer to its --help
            raise SweepError(f"{' '.join(point_args(params))}: {reason}") from None
        except UserFacingError as error:
            raise SweepError(f"{' '.join(point_args(params))}: {error}") from None
