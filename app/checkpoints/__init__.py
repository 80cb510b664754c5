"""Checkpoints: what a run saves and how it finds it again.

- `io.py`: atomic, fsynced writes; `weights_only` loads; one-line errors (no Lightning: the reference's datasets use
  it);
- `last.py`: `last.ckpt` always fresh and saved at every stop (`LastCheckpoint`; `RunCoordinator` decides when);
  `--ckpt_path last`;
- `sharded.py`: strategy fsdp's directory of DCP shards, published by an atomic link swap; `sharded_io.py` writes and
  loads it;
- `plugin.py`: `SafeCheckpointIO` and the one `BackgroundWriter` (`BackgroundCheckpointIO`); `save_mode.py`: `SaveMode`,
  `SavePlan`, the one choice of the Trainer's checkpoint I/O.

Exporting (`python -m app.export`) is a tool beside this package."""
