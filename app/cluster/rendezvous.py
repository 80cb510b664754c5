"""Rendezvous ports held from the moment they are picked until the store that serves them listens.

Picking a free port (bind to port 0, close the socket) and binding it again later, in a rank, is a race: for the
seconds a rank takes to import, the port is free, and another job's rank, or any outgoing connection (the kernel draws
source ports from the same ephemeral range), can take it. CI saw two tests' rank 0s draw the same port: one ended
"MASTER_PORT is already in use", and the other's ranks met the wrong job's. So whoever picks a port keeps the
socket bound and listening, the process that serves the store inherits it (TCPStore's public `master_listen_fd`,
which takes the file descriptor over), and every rank, the serving one too, connects to it as a client. torch's
env:// rendezvous does that when TORCHELASTIC_USE_AGENT_STORE is "True" and MASTER_ADDR:MASTER_PORT is the store's
(torch/distributed/rendezvous.py `_agent_store_serves`, as under torchrun's agent; docs/private_apis.md).

A port the user chose (MASTER_PORT set, a multi-node launch, Slurm's per-job port) is theirs: nothing here applies.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Mapping, MutableMapping
from typing import Any

from app.private_apis import require

# The held sockets a launcher's forked processes inherit, as "PORT_VARIABLE=fd,...": each port variable names the port
# of the socket whose descriptor follows (MASTER_PORT, fault tolerance's group store port).
HELD_PORTS_VARIABLE = "DDP_APP_HELD_PORTS"
# torch's env:// rendezvous connects every rank as a client when this is "True" (see the module docstring).
CLIENTS_ONLY_VARIABLE = "TORCHELASTIC_USE_AGENT_STORE"

# The stores this process serves: alive as long as the process, as a rank 0's own store would be.
_SERVED: list[Any] = []


def hold_free_port() -> socket.socket:
    """A listening socket on a port the kernel picked, inheritable by forked children. Connections that come before
    the store serves it wait in the backlog."""
    if socket.has_dualstack_ipv6():
        sock = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True, backlog=1024)
    else:
        sock = socket.create_server(("", 0), backlog=1024)
    sock.set_inheritable(True)
    return sock


def held_ports_variables(held: Mapping[str, socket.socket]) -> dict[str, str]:
    """The variables that send a launch's processes to the stores to be served on the `held` sockets, by port variable
    (MASTER_ADDR is the caller's). With MASTER_PORT among them, torch's env:// rendezvous makes every rank a client."""
    variables = {name: str(sock.getsockname()[1]) for name, sock in held.items()}
    variables[HELD_PORTS_VARIABLE] = ",".join(f"{name}={sock.fileno()}" for name, sock in held.items())
    if "MASTER_PORT" in held:
        variables[CLIENTS_ONLY_VARIABLE] = "True"
    return variables


def serve_store(listen_fd: int, port: int, timeout_s: float) -> Any:
    """Serve a TCPStore on a socket already bound and listening (the descriptor becomes the store's)."""
    import importlib

    from torch.distributed import TCPStore

    env_rendezvous = importlib.import_module("torch.distributed.rendezvous")  # the attribute is the function

    # Private (docs/private_apis.md): the ranks, rank 0 too, must connect to this store as clients; a torch whose
    # env:// rendezvous no longer does would have rank 0 bind the held port again ("already in use").
    require(env_rendezvous, "_agent_store_serves", "torch", "ranks meeting at a port their launcher held")

    store = TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, master_listen_fd=listen_fd,
        timeout=datetime.timedelta(seconds=timeout_s),
    )  # fmt: skip
    _SERVED.append(store)
    return store


def serve_held(env: MutableMapping[str, str], serves: bool, timeout_s: float = 1800.0) -> None:
    """In a forked process of a launch whose launcher held its ports: the one that `serves` (the group's rank 0)
    serves a store on each; the others close their copies, so a dead server is refused at once rather than waited
    for. Nothing where no port was held (the user's own MASTER_PORT, a torchrun or srun rank)."""
    held = env.pop(HELD_PORTS_VARIABLE, "")
    for entry in filter(None, held.split(",")):
        port_variable, listen_fd = entry.split("=")
        if serves:
            serve_store(int(listen_fd), int(env[port_variable]), timeout_s)
        else:
            os.close(int(listen_fd))


def serve_fresh_store(timeout_s: float) -> int:
    """Serve a new store on a port picked and held here; returns the port (torchrun's rank 0, each round)."""
    sock = hold_free_port()
    port = sock.getsockname()[1]
    serve_store(sock.detach(), port, timeout_s)
    return port
