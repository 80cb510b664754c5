"""Hyperparameter sweeps of ddp-app runs: `python -m app.sweep` (see its __main__ for the commands).

- `spec.py`: the grid or search space, checked against the config before anything runs;
- `store.py`: the sweep directory, its points and the claims of the workers running them;
- `worker.py`: runs points (locally one after another, or one per Slurm array task);
- `study.py`, `pruning.py`: Optuna's study in a journal file and its pruner at epoch ends;
- `results.py`: results.csv, results.md, results.png."""
