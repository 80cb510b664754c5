"""`python -m app` is the same command as `ddp-app`."""

from __future__ import annotations


def main() -> None:
    import os
    import sys

    from app.console import quiet_native_logs

    quiet_native_logs(os.environ)  # before anything below imports torch, which reads it once

    if sys.argv[1:2] == ["resume-check"]:  # not a LightningCLI subcommand: it runs ddp-app fit itself
        from app.resume_check import main as resume_check

        raise SystemExit(resume_check(sys.argv[2:]))
    from app.entry import main as entry_main

    entry_main()


if __name__ == "__main__":
    main()
