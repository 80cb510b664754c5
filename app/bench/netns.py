"""Two "nodes" on one machine: two network namespaces joined by one veth pair, rate-limited with tc.

`python -m app.bench.network` runs one rank in each namespace, so every byte DDP exchanges crosses the veth link, capped
with `tc qdisc ... tbf` (netem is not available here). Unlike tests/slurm/:

- No bridge and no address in the root namespace: nothing is visible to or routable from the machine's interfaces.
- Fixed names (`nbn-rank0`, `nbn-rank1`; `nbv-rank0`, `nbv-rank1`) and a lock file: one bench per machine; a crashed
  run's leftovers are removed by name at the next start.
- Everything is removed by exact name: processes in our namespaces are killed by PID (via /proc/PID/ns/net), then the
  namespaces are deleted, which destroys the veth pair.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

NAMESPACES = ("nbn-rank0", "nbn-rank1")
INTERFACES = ("nbv-rank0", "nbv-rank1")  # interface r lives in namespace r; they are each other's peer
# Addresses exist only inside the two namespaces (a /30 on the pair), so they cannot clash with a route of the
# machine's.
ADDRESSES = ("10.79.0.1", "10.79.0.2")
PREFIX_LEN = 30
LOCK_FILE = Path("/run/ddp-app-bench-network.lock")
# A queue of 50 ms at the configured rate, as a switch port's buffer; with a much shorter one TCP loses packets at every
# burst and retransmits, which the byte counters would count as traffic.
TBF_LATENCY = "50ms"


class NetworkSetupError(RuntimeError):
    """A namespace, link or qdisc command failed; the message carries the command's own error."""


@dataclass(frozen=True)
class Link:
    """One link speed to measure: a tbf rate in Mbit/s, or None for the unlimited veth."""

    name: str  # as given on the command line: "100mbit", "1gbit", "unlimited"
    rate_mbit: float | None

    @property
    def label(self) -> str:
        if self.rate_mbit is None:
            return "unlimited"
        if self.rate_mbit >= 1000:
            return f"{self.rate_mbit / 1000:g} Gbit/s"
        return f"{self.rate_mbit:g} Mbit/s"


def parse_link(text: str) -> Link:
    """'100mbit', '1gbit', '2.5gbit' or 'unlimited' (tc's own spelling of rates)."""
    name = text.strip().lower()
    if name == "unlimited":
        return Link(name, None)
    for unit, factor in (("gbit", 1000.0), ("mbit", 1.0)):
        if name.endswith(unit):
            try:
                rate = float(name[: -len(unit)]) * factor
            except ValueError:
                break
            if rate > 0:
                return Link(name, rate)
    raise ValueError(f"invalid link {text!r}: expected a rate such as 100mbit or 1gbit, or unlimited")


def run_tool(args: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ip/tc; a failure raises NetworkSetupError with the tool's stderr."""
    process = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check and process.returncode != 0:
        raise NetworkSetupError(f"`{' '.join(args)}` failed: {(process.stderr or process.stdout).strip()}")
    return process


def acquire_lock() -> int:
    """One bench per machine (fixed names); returns the descriptor that holds the lock until closed."""
    descriptor = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise NetworkSetupError(
            f"another `python -m app.bench.network` is running on this machine (lock {LOCK_FILE} is held). "
            "Fix: wait for it to finish."
        ) from None
    return descriptor


@contextlib.contextmanager
def namespace_pair() -> Iterator[None]:
    """Holds the lock while the pair exists: a crashed run's leftovers are removed first (we hold the lock, so nothing
    uses them), and the pair is removed on the way out, whatever happened."""
    lock = acquire_lock()
    try:
        remove_pair()
        create_pair()
        yield
    finally:
        try:
            remove_pair()
        finally:
            os.close(lock)


def refuse(prog: str, message: str) -> None:
    """Bad input or an unusable machine: one line, exit code 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def refuse_unless_able(prog: str) -> None:
    """Namespaces and qdiscs need root and iproute2: say so in one line before anything starts."""
    if os.geteuid() != 0:
        refuse(
            prog, "needs root (it creates network namespaces and sets tc qdiscs). Fix: run it as root, e.g. with sudo."
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            refuse(prog, f"`{tool}` not found. Fix: install iproute2.")


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def stopped_cleanly(prog: str) -> Iterator[None]:
    """SIGTERM stops a bench as Ctrl-C does, so that `namespace_pair`'s `finally` removes the namespaces; a setup
    failure is one line (exit 2), an interruption exit 130."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    except NetworkSetupError as error:
        refuse(prog, str(error))
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; the ranks are stopped and the namespaces removed.", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        signal.signal(signal.SIGTERM, previous)


def init_gloo(plan: dict[str, Any], rank: int, world_size: int) -> None:
    """A rank joins the bench's gloo group at the address and timeout its plan names."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{plan['master_addr']}:{plan['master_port']}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=plan["collective_timeout_s"]),
    )


def namespace_inode(name: str) -> int | None:
    try:
        return os.stat(f"/run/netns/{name}").st_ino
    except OSError:
        return None


def pids_in_namespace(name: str) -> list[int]:
    """Processes whose network namespace is ours (a rank, or anything it started)."""
    inode = namespace_inode(name)
    if inode is None:
        return []
    target, pids = f"net:[{inode}]", []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry}/ns/net") == target:
                    pids.append(int(entry))
    return pids


def kill_and_wait(pids: Sequence[int], timeout_s: float = 10.0) -> list[int]:
    """SIGKILL each PID and wait until /proc says it is gone or a zombie; returns survivors."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline, alive = time.monotonic() + timeout_s, list(pids)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if _running(pid)]
        if alive:
            time.sleep(0.05)
    return alive


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].split()[0] not in ("Z", "X")


def remove_pair() -> None:
    """Remove our namespaces (and so the veth pair) by exact name, after killing what runs inside."""
    errors = []
    for name in NAMESPACES:
        if namespace_inode(name) is None:
            continue
        survivors = kill_and_wait(pids_in_namespace(name))
        if survivors:
            errors.append(f"processes {survivors} in {name} survived SIGKILL")
        if (deleted := run_tool(["ip", "netns", "delete", name], check=False)).returncode != 0:
            errors.append(deleted.stderr.strip())
    # The pair is created inside the namespaces; an interface of ours in the root namespace can only be a leftover of an
    # interrupted `ip link add`.
    for name in INTERFACES:
        if Path(f"/sys/class/net/{name}").exists():
            run_tool(["ip", "link", "delete", name], check=False)
    if errors:
        raise NetworkSetupError("could not remove the bench's namespaces: " + "; ".join(errors))


def create_pair() -> None:
    """nbn-rank0 <-> nbn-rank1 over nbv-rank0/nbv-rank1, addresses 10.79.0.1 and .2, links up."""
    for name in NAMESPACES:
        run_tool(["ip", "netns", "add", name])
    (namespace0, namespace1), (interface0, interface1) = NAMESPACES, INTERFACES
    veth_peer = ["type", "veth", "peer", "name", interface1, "netns", namespace1]
    run_tool(["ip", "link", "add", interface0, "netns", namespace0, *veth_peer])
    for namespace, interface, address in zip(NAMESPACES, INTERFACES, ADDRESSES, strict=True):
        run_tool(["ip", "-n", namespace, "addr", "add", f"{address}/{PREFIX_LEN}", "dev", interface])
        run_tool(["ip", "-n", namespace, "link", "set", interface, "up"])
        run_tool(["ip", "-n", namespace, "link", "set", "lo", "up"])


def tbf_burst_bytes(rate_mbit: float) -> int:
    """The bucket: 1 ms at the rate, and at least one 64 KiB GSO packet (tbf would split larger ones)."""
    return max(64 * 1024, int(rate_mbit * 1e6 / 8 / 1000))


def set_rate(interface: str, link: Link, limited: bool) -> bool:
    """Cap `interface`'s egress at the link's rate (inside its namespace; each rank caps its own side); returns whether
    a tbf is on."""
    if link.rate_mbit is None:
        if limited:
            run_tool(["tc", "qdisc", "del", "dev", interface, "root"])
        return False
    burst = tbf_burst_bytes(link.rate_mbit)
    rate = f"{link.rate_mbit * 1000:.0f}kbit"
    tbf = ["tbf", "rate", rate, "burst", str(burst), "latency", TBF_LATENCY]
    run_tool(["tc", "qdisc", "replace", "dev", interface, "root", *tbf])
    return True


def limit_pair(link: Link) -> None:
    """Cap both sides of the pair at the link's rate, from outside (for runs that do not cap it themselves:
    tests/test_diagnose.py's two "nodes")."""
    burst = tbf_burst_bytes(link.rate_mbit or 0.0)
    tbf = ["tbf", "rate", f"{(link.rate_mbit or 0.0) * 1000:.0f}kbit", "burst", str(burst), "latency", TBF_LATENCY]
    for namespace, interface in zip(NAMESPACES, INTERFACES, strict=True):
        run_tool(["ip", "netns", "exec", namespace, "tc", "qdisc", "replace", "dev", interface, "root", *tbf])


def tx_bytes(interface: str) -> int:
    """Bytes `interface` has sent, from /proc/self/net/dev, which lists the caller's namespace."""
    for line in Path("/proc/self/net/dev").read_text().splitlines()[2:]:
        name, _, counters = line.partition(":")
        if name.strip() == interface:
            return int(counters.split()[8])  # receive: 8 fields, then transmit bytes
    raise NetworkSetupError(f"interface {interface} not found in /proc/self/net/dev (wrong network namespace?)")


def run_ranks(
    prog: str,
    ranks: Sequence[tuple[int, list[str]]],
    env: Mapping[str, str],
    out: Path,
    timeout_s: float,
    rank_envs: Sequence[Mapping[str, str]] = (),
) -> None:
    """Run each rank `(node, python -m arguments)` in namespace `node`, gloo bound to its link, and wait for all.

    Rank 0 prints to our stdout, every rank's errors go to out/rank<N>.log; a failed rank takes the others down (by
    PID)."""
    processes: list[subprocess.Popen[bytes]] = []
    logs = [out / f"rank{rank}.log" for rank in range(len(ranks))]
    try:
        for rank, (node, arguments) in enumerate(ranks):
            command = ["ip", "netns", "exec", NAMESPACES[node], sys.executable, "-m", *arguments]
            with logs[rank].open("wb") as log:
                processes.append(
                    subprocess.Popen(
                        command,
                        env={
                            **env,
                            **(rank_envs[rank] if rank_envs else {}),
                            "PYTHONUNBUFFERED": "1",
                            "GLOO_SOCKET_IFNAME": INTERFACES[node],
                        },
                        stdout=None if rank == 0 else log,
                        stderr=log,
                        start_new_session=True,  # Ctrl-C reaches the bench; it stops the ranks
                    )
                )
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [process.poll() for process in processes]
            failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                rank = failed[0]
                tail = "\n".join(logs[rank].read_text(errors="replace").splitlines()[-30:])
                raise RuntimeError(f"{prog}: rank {rank} exited with code {codes[rank]}\n--- {logs[rank]}:\n{tail}")
            if all(code == 0 for code in codes):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{prog}: the ranks did not finish within --timeout {timeout_s:g} s")
            time.sleep(0.2)
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
