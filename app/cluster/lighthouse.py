"""`python -m app.cluster.lighthouse`: a torchft lighthouse for ddp-app's launcher (app/cluster/ft_launch.py),
or for slurm/fault_tolerant.sbatch, which starts it on the job's first node (`--bind [::]:0`, any port).

It prints its address on the first line of stdout and serves until its stdin closes (the launcher
closes it at the end, and the kernel does when the launcher dies), so it never outlives the run.
Its own process, not a thread of the launcher: the launcher forks the groups' processes, and a fork
beside the lighthouse's threads could copy a lock one of them holds.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m app.cluster.lighthouse")
    parser.add_argument("--bind", default="[::]:0", help="address to listen on; port 0: any free port")
    # The defaults are those of the `fault_tolerance:` section (app/parallel/fault_tolerance.py).
    parser.add_argument("--min_replicas", type=int, default=1)
    parser.add_argument("--join_timeout_ms", type=int, default=2000)
    parser.add_argument("--heartbeat_timeout_ms", type=int, default=2000)
    parser.add_argument("--quorum_tick_ms", type=int, default=50)
    args = parser.parse_args(argv)
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(
        bind=args.bind,
        min_replicas=args.min_replicas,
        join_timeout_ms=args.join_timeout_ms,
        quorum_tick_ms=args.quorum_tick_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )
    print(server.address(), flush=True)
    sys.stdin.read()
    server.shutdown()


if __name__ == "__main__":
    main()
