"""Experiment tracking: metrics.csv always, and TensorBoard, MLflow and W&B when configured, with one run identity
across every restart (docs/tracking.md).

- `layout.py`: where a run's files are; `history.py`: the journal of logged values and which are final;
- `sinks.py`: metrics.csv and the trackers; `worker.py`: the thread that makes every tracker call;
- `attempt.py`: how an attempt opens; `run.py`: the `tracking:` section, the tracked run, Lightning's logger."""
