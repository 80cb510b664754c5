"""`python -m app.bench.reference ARGS`: `python -m app.reference ARGS` with the bench's step timer.

The reference trainer imports nothing of the benchmark; the bench passes its recorder in here.
Without `APP_BENCH_DIR` in the environment it records nothing (`StepRecorder.from_env`).
"""

from __future__ import annotations

import functools

from app.bench.recorder import StepRecorder
from app.reference.__main__ import main

# A partial of a classmethod pickles, so mp.spawn can hand it to every rank.
make_recorder = functools.partial(StepRecorder.from_env, "reference")

if __name__ == "__main__":
    main(make_hooks=make_recorder)
