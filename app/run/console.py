"""What a run prints: the user's run, said once; everything else only with `DDP_APP_VERBOSE=1`.

A run prints its launch line, the model summary, one line per epoch, warnings about the user's code and config, and
errors (tests/test_console.py pins the shapes). Each extra is turned off at its source with a narrow public switch, so
anything new still shows:

- Lightning's tip, "GPU/TPU available" and the banner's rules and backend line (a filter on Lightning's rank-zero
  logger); "All distributed processes registered" stays: it shows every node joined (docs/slurm.md);
- "Seed set to", "Initializing distributed" and the CUDA_VISIBLE_DEVICES lines of every rank and parse: those loggers at
  WARNING;
- the model summary's all-zero FLOPs: `app.run.callbacks.PlainModelSummary`;
- Lightning's unused-`srun` hint: app/cluster/preflight.py refuses such a job in one line;
- the deprecation warning Lightning's `_pytree.py` triggers, once per rank;
- "Checkpoint directory ... exists and is not empty" at every resume (app/run/directory.py owns that rule);
- PyTorch's C++ log lines below ERROR: TORCH_CPP_LOG_LEVEL=ERROR, read once at load, so `app.__main__` sets it before
  torch is imported (a user's value wins).

This module imports neither torch nor Lightning: `quiet_native_logs` runs before they load."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, MutableMapping

VERBOSE_VARIABLE = "DDP_APP_VERBOSE"
# When `ddp-app` started (time.time()), for the ranks it forks too: the wall time in a run's summary.
STARTED_VARIABLE = "DDP_APP_STARTED"

# Lightning's rank-zero logger says these and the lines that matter ("`Trainer.fit` stopped: ...").
LIGHTNING_NOTICES = ("💡 Tip:", "GPU available:", "TPU available:")
# The banner is one message: a rule of 100 dashes, "distributed_backend=...", this line, a rule.
RENDEZVOUS_BANNER = "-" * 100 + "\ndistributed_backend="
RENDEZVOUS_LINE = "All distributed processes registered."
# Lightning's rank-zero logger: lightning_utilities' one `rank_zero_info`, whose logger is the rank_zero module imported
# last (Lightning's, after Fabric's); both get the filter.
RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")
# Loggers whose INFO lines every rank repeats.
PER_RANK_LOGGERS = (
    "lightning.fabric.utilities.seed",
    "lightning.fabric.utilities.distributed",
    "lightning.pytorch.accelerators.cuda",
)


def is_verbose(env: Mapping[str, str]) -> bool:
    return env.get(VERBOSE_VARIABLE, "") not in ("", "0")


def quiet_native_logs(env: MutableMapping[str, str]) -> None:
    """Before torch loads: PyTorch's C++ log lines at ERROR and above only (unless verbose, or set)."""
    if not is_verbose(env):
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


class _DropNotices(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(RENDEZVOUS_BANNER):  # a filter may rewrite the record it passes
            record.msg = next((line for line in message.splitlines() if line.startswith(RENDEZVOUS_LINE)), "")
            record.args = ()
            return bool(record.msg)
        return not message.startswith(LIGHTNING_NOTICES)


_DROP_NOTICES = _DropNotices()


def quiet_console(env: Mapping[str, str]) -> None:
    """Turn off, in this process and the ranks it forks, what the module docstring lists (unless verbose)."""
    if is_verbose(env):
        return
    for name in RANK_ZERO_LOGGERS:
        logging.getLogger(name).addFilter(_DROP_NOTICES)  # once: same object
    for name in PER_RANK_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings(
        "ignore",
        message="The `srun` command is available on your system but is not used",
        module=r"lightning\.fabric\.plugins\.environments\.slurm",
    )
    # A fit that writes into a checkpoint directory with files in it continues that run: any other is refused before it
    # starts (app/run/directory.py), so Lightning's warning would only greet every resume.
    warnings.filterwarnings(
        "ignore",
        message=r"Checkpoint directory .* exists and is not empty",
        module=r"lightning\.pytorch\.callbacks\.model_checkpoint",
    )
    for category in (DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category, module=r"lightning\.pytorch\.utilities\._pytree")
