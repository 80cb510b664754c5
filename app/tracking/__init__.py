"""Experiment tracking: metrics.csv always, and TensorBoard, MLflow and W&B when configured, with one
run identity across every restart of a training run.

- `app/tracking/layout.py`: where a run's files are;
- `app/tracking/history.py`: the journal of logged values and which of them are final;
- `app/tracking/sinks.py`: metrics.csv and the trackers;
- `app/tracking/worker.py`: the thread that makes every tracker call after the open, and what it keeps per tracker;
- `app/tracking/attempt.py`: how an attempt opens: the run identity, what it records, its trackers;
- `app/tracking/run.py`: the `tracking:` config section, the tracked run and Lightning's logger.

docs/tracking.md says what a user sees and why.
"""
