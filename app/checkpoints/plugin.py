"""The Trainer's checkpoint I/O (`trainer.plugins`): Lightning's own, made atomic and safe to load.

Every ddp-app Trainer gets it (app/run/build.py), a config with its own `plugins:` too; the sharded
path (strategy fsdp) writes through app/parallel/fsdp.py instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from app.checkpoints.io import atomic_torch_save, refuse_url, remove_stale_temporaries, safe_load


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint I/O with atomic, fsynced saves and `weights_only=True` loads."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:  # as Lightning's TorchCheckpointIO: they would be ignored
            raise TypeError(
                "SafeCheckpointIO takes no storage_options: those configure fsspec's remote storage, and "
                "ddp-app writes checkpoints to a filesystem path only (docs/resume.md)."
            )
        refuse_url(path, "checkpoint path")
        remove_stale_temporaries(Path(path))
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = safe_load(path, map_location=map_location if map_location is not None else "cpu")
        # Lightning calls the callbacks' on_load_checkpoint only if the checkpoint has a "callbacks"
        # entry (`call._call_callbacks_on_load_checkpoint`); a converted one (app.parity) may not, and
        # ExactResume must see every checkpoint a run resumes from, or it counts from epoch 0.
        if isinstance(checkpoint, dict):
            checkpoint.setdefault("callbacks", {})
        return checkpoint
