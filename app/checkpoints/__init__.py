"""Checkpoints: what a run saves and how it finds it again.

- `io.py`: saving and loading: atomic, fsynced writes; `weights_only` loads; one-line errors for a
  checkpoint that does not fit (no Lightning: the reference trainer's datasets load with it too).
- `last.py`: `last.ckpt` is always fresh, and every stop saves it first (`LastCheckpoint` writes it,
  `app.run.coordinator.RunCoordinator` decides when); rank 0 finds it for `--ckpt_path last`.
- `sharded.py`: strategy fsdp's checkpoints: a directory of every rank's DCP shards, published by
  an atomic link swap, read without running code, joined whole for tools; `sharded_io.py` writes
  and loads them (`ShardedCheckpointIO`, the strategy's checkpoint I/O).
- `plugin.py`: the checkpoint I/O of a file (`SafeCheckpointIO`) and the one `BackgroundWriter`
  behind both I/Os (`BackgroundCheckpointIO`); `save_mode.py`: how a run saves (`SaveMode`,
  `SavePlan`), and the one place that chooses the Trainer's checkpoint I/O.

Exporting a trained model (`python -m app.export`) is a tool beside this package, not in it: it
rebuilds the model and its DataModule (app.models, app.data), which themselves load through `io`.
"""
