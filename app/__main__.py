"""`python -m app` is the same command as `ddp-app`."""

from __future__ import annotations


def main() -> None:
    import os
    import sys
    import time

    from app.run.console import STARTED_VARIABLE, quiet_native_logs

    # The run's wall time, which its summary reports (app/run/summary.py), counts from here: the imports below take
    # seconds.
    os.environ.setdefault(STARTED_VARIABLE, str(time.time()))
    quiet_native_logs(os.environ)  # before anything below imports torch, which reads it once

    if sys.argv[1:2] == ["resume-check"]:  # not a LightningCLI subcommand: it runs ddp-app fit itself
        from app.cli.resume_check import main as resume_check

        raise SystemExit(resume_check(sys.argv[2:]))
    if sys.argv[1:2] == ["diagnose"]:  # the same: it runs ddp-app fit once per variant
        from app.cli.diagnose import main as diagnose

        raise SystemExit(diagnose(sys.argv[2:]))
    from app.cli.entry import main as entry_main

    entry_main()


if __name__ == "__main__":
    main()
