"""What a run prints: the user's run, said once; everything else only with `DDP_APP_VERBOSE=1`.

A `ddp-app` run prints its launch line, the model summary, one line per epoch, warnings about the
user's own code and config, and errors (tests/test_console.py pins the shapes). Lightning and
PyTorch print more, some of it once per rank. Each item is turned off at its source with a public
switch scoped to it, so that anything new still shows:

- Lightning's product tip ("Tip: ... litlogger"), "GPU available: ..., used: ..." and "TPU
  available" (the launch line says where the ranks run), and the 100-dash rules and
  "distributed_backend=gloo" of the banner said when the ranks meet: a filter on Lightning's
  rank-zero logger, which also says "`Trainer.fit` stopped", which stays. Of the banner, its one
  line "All distributed processes registered. Starting with N processes" stays: ddp-app's launch
  line ("world size N = nodes x processes") comes before the rendezvous, and this line is the sign
  that every node joined it (docs/slurm.md);
- "Seed set to 42" and "Initializing distributed: GLOBAL_RANK: r, MEMBER: r+1/N" from every rank
  (and "LOCAL_RANK: r - CUDA_VISIBLE_DEVICES" on GPUs), and from every parse of the config
  (`python -m app.sweep` parses it once per swept value): those loggers at WARNING. The seed is in
  the config.yaml saved beside the logs;
- the model summary's FLOPs column and "Total Flops" line when every count is 0, as they are for a
  module without `example_input_array` (Lightning 2.6 counts FLOPs on that input only):
  `app.run.callbacks.PlainModelSummary`, the ModelSummary callback `app.cli` gives every run;
- Lightning's hint that `srun` exists but was not used: app/cluster/preflight.py decides the launch
  and refuses, in one line, a Slurm job started without srun;
- the deprecation warning Lightning's own `_pytree.py` triggers in PyTorch, once per rank;
- Lightning's "Checkpoint directory ... exists and is not empty" at every resume: a fit may write
  into a run's checkpoint directory only to continue that run (app/run/directory.py);
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
# When `ddp-app` started (time.time()), for the ranks it forks too: the wall time in a run's summary.
STARTED_VARIABLE = "DDP_APP_STARTED"

# Lightning's rank-zero logger says these and the lines that matter ("`Trainer.fit` stopped: ...").
LIGHTNING_NOTICES = ("💡 Tip:", "GPU available:", "TPU available:")
# The banner is one message: a rule of 100 dashes, "distributed_backend=...", this line, a rule.
RENDEZVOUS_BANNER = "-" * 100 + "\ndistributed_backend="
RENDEZVOUS_LINE = "All distributed processes registered."
# Lightning's rank-zero logger: lightning_utilities' one `rank_zero_info`, whose logger is the rank_zero
# module imported last (Lightning's, after Fabric's); both get the filter.
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
    # A fit that writes into a checkpoint directory with files in it continues that run: any other is
    # refused before it starts (app/run/directory.py), so Lightning's warning would only greet every resume.
    warnings.filterwarnings(
        "ignore",
        message=r"Checkpoint directory .* exists and is not empty",
        module=r"lightning\.pytorch\.callbacks\.model_checkpoint",
    )
    for category in (DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category, module=r"lightning\.pytorch\.utilities\._pytree")
