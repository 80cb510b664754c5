"""What a run prints: the user's run, said once; everything else only with `DDP_APP_VERBOSE=1`.

A `ddp-app` run prints its launch line, the model summary, one line per epoch, warnings about the
user's own code and config, and errors (tests/test_console.py pins the shapes). Lightning and
PyTorch print more, some of it once per rank. Each item is turned off at its source with a public
switch scoped to it, so that anything new still shows:

- Lightning's product tip ("Tip: ... litlogger") and "TPU available": a filter on the logger that
  also says "`Trainer.fit` stopped", which stays;
- "Seed set to 42" and "Initializing distributed: GLOBAL_RANK: r, MEMBER: r+1/N" from every rank
  (and "LOCAL_RANK: r - CUDA_VISIBLE_DEVICES" on GPUs): those loggers at WARNING. The seed is in the
  config.yaml saved beside the logs; rank 0's "All distributed processes registered. Starting with
  N processes" says the second once;
- Lightning's hint that `srun` exists but was not used: app/cluster/preflight.py decides the launch
  and refuses, in one line, a Slurm job started without srun;
- the deprecation warning Lightning's own `_pytree.py` triggers in PyTorch, once per rank;
- PyTorch's C++ log lines below ERROR, such as the `[c10d]` lines of every rank's debug endpoint
  (app/cluster/hangs.py) at start and exit: TORCH_CPP_LOG_LEVEL=ERROR, which PyTorch reads once,
  when it loads, so `app.__main__` sets it for the `ddp-app` process (and the ranks it forks)
  before anything imports torch. A TORCH_CPP_LOG_LEVEL the user set wins.

This module imports neither torch nor Lightning: `quiet_native_logs` runs before they load.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, MutableMapping

VERBOSE_VARIABLE = "DDP_APP_VERBOSE"

# Lightning's rank-zero logger says these and the lines that matter ("`Trainer.fit` stopped: ...").
LIGHTNING_NOTICES = ("💡 Tip:", "TPU available:")
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
        return not record.getMessage().startswith(LIGHTNING_NOTICES)


_DROP_NOTICES = _DropNotices()


def quiet_console(env: Mapping[str, str]) -> None:
    """Turn off, in this process and the ranks it forks, what the module docstring lists (unless verbose)."""
    if is_verbose(env):
        return
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_DROP_NOTICES)  # once: same object
    for name in PER_RANK_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings(
        "ignore",
        message="The `srun` command is available on your system but is not used",
        module=r"lightning\.fabric\.plugins\.environments\.slurm",
    )
    for category in (DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category, module=r"lightning\.pytorch\.utilities\._pytree")
