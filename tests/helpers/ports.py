"""Ports for the servers a test starts itself (a torchrun rendezvous endpoint, slurmctld, a tracker server).

A port picked by binding to 0 comes from the kernel's ephemeral range, the range every outgoing connection's source
port and every rank's rendezvous is drawn from, and it stays free only until the server binds it again: under xdist,
another worker's job can take it in between. These come from below that range, in a band of its own for each xdist
worker, so nothing else in the test session draws them. (ddp-app itself holds the ports it picks:
app/cluster/rendezvous.py.)
"""

from __future__ import annotations

import os
import random
import socket

FIRST, LAST = 20000, 32000  # below Linux's default ephemeral range (32768-60999)
BAND = 1500  # ports per xdist worker: 8 workers fit


def unused_port() -> int:
    """A port in this xdist worker's band that nothing listens on or is bound to now."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    start = FIRST + (int(worker) if worker.isdigit() else 0) * BAND % (LAST - FIRST)
    candidates = list(range(start, start + BAND))
    random.shuffle(candidates)
    for port in candidates:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {start}..{start + BAND - 1}")
