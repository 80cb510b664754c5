"""Put on PYTHONPATH by tests/test_per_step_cost.py: counts Python-level collectives per process.

Wraps `torch.distributed.broadcast` and `all_reduce` once torch.distributed is imported, and
writes {name: count} to $COUNT_COLLECTIVES_DIR/<pid>.json at exit.
"""

import atexit
import builtins
import json
import os
import sys
from collections import Counter

counts: Counter = Counter()
_import = builtins.__import__


def _wrap() -> None:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for name in ("broadcast", "all_reduce"):
        original = getattr(c10d, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
        setattr(c10d, name, counted)


def _import_hook(name, *args, **kwargs):
    module = _import(name, *args, **kwargs)
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    # Imports nest: every enclosing call of this hook returns after the first one wrapped.
    if builtins.__import__ is _import_hook and c10d is not None and hasattr(c10d, "all_reduce"):
        builtins.__import__ = _import
        _wrap()
    return module


builtins.__import__ = _import_hook


def _write() -> None:
    if counts:
        path = os.path.join(os.environ["COUNT_COLLECTIVES_DIR"], f"{os.getpid()}.json")
        with open(path, "w") as out:
            json.dump(dict(counts), out)


atexit.register(_write)
