"""The settings of each tracker, as `tracking.mlflow` and `tracking.wandb` take them in a config (app/tracking/run.py
`Tracking`); an attempt (app/tracking/attempt.py) opens its trackers from them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MLflowSettings:
    """`tracking.mlflow`: an MLflow run per training run.

    Args:
        tracking_uri: where MLflow keeps runs (`http://host:5000`, `sqlite:///path/runs.db`, a
            `databricks` profile, ...). None: the `MLFLOW_TRACKING_URI` variable, else
            `sqlite:///<default_root_dir>/mlflow.db`. With a local store (SQLite, a file URI) the artifacts
            go to `<default_root_dir>/mlartifacts`, not to MLflow's default `./mlruns`.
        experiment: the MLflow experiment the run belongs to (created if missing)."""

    tracking_uri: str | None = None
    experiment: str = "ddp-app"


@dataclass
class WandbSettings:
    """`tracking.wandb`: a Weights & Biases run per training run.

    Args:
        project: the W&B project.
        entity: the W&B team or user (None: your default entity).
        mode: offline (files under the log directory, uploaded later with `wandb sync`; compute
            nodes often have no network) or online. None: the `WANDB_MODE` variable, else offline."""

    project: str = "ddp-app"
    entity: str | None = None
    mode: str | None = None
