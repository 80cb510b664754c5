"""`python -m app` is the same command as `ddp-app`."""

from __future__ import annotations

import sys


def main() -> None:
    # Before torch and Lightning are imported (about 5 s): start every local rank at once when
    # that applies; the launcher then exits with the ranks' status. See app/cluster/launch.py.
    from app.cluster.launch import launch_local_ranks

    launch_local_ranks(sys.argv[1:])
    from app.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
