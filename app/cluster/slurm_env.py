"""Facts read from a SLURM job's environment: the node list and a per-job rendezvous port."""

from __future__ import annotations

import hashlib
import os
import re

from app.errors import InvalidConfigError


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand Slurm's compressed host list: "gpu[01-03,07],login1" -> gpu01, gpu02, gpu03, gpu07, login1.

    The same result as `scontrol show hostnames`, without needing the Slurm binaries on the node."""
    hosts: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", hostlist):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            start, _, end = part.partition("-")
            for number in range(int(start), int(end or start) + 1):
                hosts.append(f"{prefix}{number:0{len(start)}d}")
    return hosts


def first_host(hostlist: str) -> str:
    """The job's first node: where rank 0 runs and the rendezvous listens."""
    hosts = expand_hostlist(hostlist)
    if not hosts:
        raise InvalidConfigError(f"SLURM_JOB_NODELIST {hostlist!r} names no host.")
    return hosts[0]


def job_master_port(job_id: str, low: int = 10000, high: int = 32767) -> int:
    """A rendezvous port hashed from the whole job id, below Linux's ephemeral range (32768+); MASTER_PORT in the
    environment wins.

    Lightning's 15000 + job_id % 10000 always collides for two jobs on one node whose ids share the last four digits."""
    digest = hashlib.blake2b(job_id.encode(), digest_size=4).digest()
    return low + int.from_bytes(digest, "big") % (high - low + 1)


def master_address_and_port(env: dict[str, str] | None = None) -> tuple[str, int]:
    """(MASTER_ADDR, MASTER_PORT) for a job started by srun: the environment's, else derived."""
    env = dict(os.environ) if env is None else env
    address = env.get("MASTER_ADDR") or first_host(env.get("SLURM_JOB_NODELIST") or env["SLURM_NODELIST"])
    port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else job_master_port(env["SLURM_JOB_ID"])
    return address, port
