"""A real two-node Slurm cluster on one Linux machine, for tests marked ``slurm``.

Why this shape:

* Two "nodes" need two network identities, so each slurmd runs in its own
  network namespace, joined to a bridge in the root namespace where slurmctld
  and the test's client commands (sinfo, srun, sbatch) live.  An ``unreachable``
  route for the subnet (with a worse metric than the bridge's connected route)
  makes sure no cluster traffic leaks to the real network if the bridge is gone.
* slurmd is started with ``nsenter --net`` plus ``unshare --mount --uts``
  instead of ``ip netns exec``: the latter remounts /sys, /sys/fs/cgroup then
  disappears and slurmd 22.05 exits with "Unable to initialize cgroup plugin".
  The private mount namespace lets us bind-mount a hosts file over /etc/hosts
  so that job processes resolve node1/node2/the controller to bridge addresses
  (torch.distributed needs that), and the UTS namespace gives each node its
  own hostname.
* Authentication is ``auth/none`` + ``cred/none``: no munged to manage.
* The daemons run in the foreground (``-D``) as our children, so we always know
  their PIDs; ``stop()`` ends them by PID, then kills whatever is left in the
  node namespaces (slurmstepd, job processes) by PID, then removes the network
  plumbing.  Nothing is ever killed by name.
* Only one cluster can exist per machine (fixed interface names): a lock file
  under /run enforces that, and because the lock is free only when no live
  cluster holds it, ``start()`` may safely delete stale state (namespaces,
  links, daemons recorded by a crashed run) that carries our names.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

# Fixed names so that a crashed run's leftovers can be found and removed.
BRIDGE = "sltbr0"
NETNS_PREFIX = "slt-"
VETH_PREFIX = "sltv-"  # host side; the namespace side is renamed to eth0
SUBNET_PREFIX = "10.77.0"
PREFIX_LEN = 24
UNREACHABLE_METRIC = 4242
SLURMD_PORT = 26818

RUN_DIR = Path("/run/slurm-localcluster")
LOCK_FILE = RUN_DIR / "lock"
STATE_FILE = RUN_DIR / "state.json"

SLURM_DAEMONS = frozenset({"slurmctld", "slurmd", "slurmstepd"})


class SlurmClusterError(RuntimeError):
    """The cluster could not be started/stopped or a Slurm command failed."""


class SlurmJobError(SlurmClusterError):
    """A batch job failed; the message carries the tail of its output."""


@dataclass(frozen=True)
class Node:
    """One emulated compute node: a network namespace with one veth link."""

    name: str
    addr: str

    @property
    def netns(self) -> str:
        return f"{NETNS_PREFIX}{self.name}"

    @property
    def netns_path(self) -> Path:
        return Path("/run/netns") / self.netns

    @property
    def veth(self) -> str:
        return f"{VETH_PREFIX}{self.name}"


def _tail(path: Path, lines: int = 40) -> str:
    """Last lines of a log file, for error messages."""
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"
    return "\n".join(text.splitlines()[-lines:])


def _run(cmd: Sequence[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run a setup command; failures carry the command's stderr."""
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise SlurmClusterError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    return proc


def _proc_name(pid: int) -> str | None:
    """Executable name of a live, non-zombie process (None if gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) S ..." where comm may contain spaces/parentheses.
    comm = stat[stat.index("(") + 1 : stat.rindex(")")]
    state = stat[stat.rindex(")") + 2 :].split()[0]
    return None if state in ("Z", "X") else comm


def _pids_in_netns(ns_path: Path) -> list[int]:
    """PIDs of all processes living in the network namespace bound at ns_path."""
    try:
        target = f"net:[{os.stat(ns_path).st_ino}]"
    except OSError:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry}/ns/net") == target:
                pids.append(int(entry))
        except OSError:
            continue
    return pids


def _descendants(pid: int) -> list[int]:
    """All live descendants of pid (e.g. slurmctld's slurmscriptd helper)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(children.get(child, []))
    return found


def _kill_and_wait(pids: Iterable[int], timeout: float = 10, sig: signal.Signals = signal.SIGKILL) -> list[int]:
    """Send sig (SIGKILL) to the given PIDs and wait until they are gone; returns survivors."""
    pids = [p for p in pids if p != os.getpid()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    deadline = time.monotonic() + timeout
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _proc_name(p) is not None]
        if alive:
            time.sleep(0.05)
    return alive


class LocalSlurmCluster:
    """A slurmctld in the root namespace plus one slurmd per network namespace.

    Use as a context manager, or call ``start()`` and (always, in a finally)
    ``stop()``.  ``env`` is the environment for client commands: it carries
    ``SLURM_CONF`` and a PATH whose first entry is the test interpreter's bin
    dir, and since sbatch/srun export the submitter's environment, job
    processes find the same venv.
    """

    def __init__(
        self,
        workdir: Path,
        node_names: Sequence[str] = ("node1", "node2"),
        cpus_per_node: int = 2,
        real_memory_mb: int = 2000,
        cred_expire_s: int = 5,
        start_timeout: float = 60.0,
    ) -> None:
        if cred_expire_s < 5:
            # slurmctld logs "AuthInfo=cred_expire=2 invalid" and silently
            # falls back to 120 s, which makes requeue tests take minutes.
            raise ValueError(f"cred_expire_s must be >= 5 (Slurm minimum), got {cred_expire_s}")
        self.workdir = Path(workdir).resolve()
        self.nodes = [Node(name, f"{SUBNET_PREFIX}.{11 + i}") for i, name in enumerate(node_names)]
        self.controller_addr = f"{SUBNET_PREFIX}.1"
        self.controller_host = socket.gethostname().split(".")[0]
        self.cpus_per_node = cpus_per_node
        self.real_memory_mb = real_memory_mb
        self.cred_expire_s = cred_expire_s
        self.start_timeout = start_timeout

        self.conf_path = self.workdir / "etc" / "slurm.conf"
        self.hosts_path = self.workdir / "etc" / "hosts"
        self.log_dir = self.workdir / "log"
        self.jobs_dir = self.workdir / "jobs"
        self.ctld_port = 0
        self.startup_seconds: float | None = None

        self._ctld: subprocess.Popen[bytes] | None = None
        self._slurmds: dict[str, subprocess.Popen[bytes]] = {}
        self._lock_fd: int | None = None
        self._network_up = False
        self._job_counter = 0

    # ------------------------------------------------------------------ env

    @property
    def env(self) -> dict[str, str]:
        """Environment for Slurm clients (and, via export, for the jobs)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
        venv_bin = str(Path(sys.executable).parent)
        system = ["/usr/local/bin", "/usr/bin", "/bin", "/usr/sbin", "/sbin"]
        path = [venv_bin, *env.get("PATH", "").split(os.pathsep), *system]
        env["PATH"] = os.pathsep.join(dict.fromkeys(p for p in path if p))
        env["SLURM_CONF"] = str(self.conf_path)
        return env

    # -------------------------------------------------------------- lifecycle

    def __enter__(self) -> LocalSlurmCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Set up network, config and daemons; returns once all nodes are idle."""
        if os.geteuid() != 0:
            raise SlurmClusterError("LocalSlurmCluster needs root (network namespaces, mounts)")
        t0 = time.monotonic()
        self._acquire_lock()
        atexit.register(self.stop)
        try:
            self._cleanup_stale()
            for sub in ("etc", "state", "log", "jobs", *(f"spool/{n.name}" for n in self.nodes)):
                (self.workdir / sub).mkdir(parents=True, exist_ok=True)
            self._setup_network()
            self.ctld_port = self._free_port()
            self._write_config()
            self._start_slurmctld()
            self._start_slurmds()
            self._wait_nodes_idle()
        except BaseException as exc:
            try:
                self.stop()
            except Exception as stop_exc:
                raise SlurmClusterError(f"startup failed ({exc!r}), and so did cleanup: {stop_exc}") from exc
            raise
        self.startup_seconds = time.monotonic() - t0

    def stop(self) -> None:
        """Stop everything we started, by PID, and remove the network plumbing.

        Idempotent and best-effort: every step runs even if an earlier one
        failed; the first error is re-raised at the end.
        """
        if self._lock_fd is None:
            return
        errors: list[BaseException] = []

        def attempt(fn: Callable[..., object], *args: object) -> None:
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - keep tearing down
                errors.append(exc)

        if self._ctld is not None and self._ctld.poll() is None and self._slurmds:
            # A courtesy (slurmstepd ends its jobs cleanly); what follows kills every daemon and
            # job process by PID whatever it did. So a controller that does not answer here is
            # reported, not raised: once (CI, 2026-11-26) every test had passed and the nodes had
            # been set DOWN ten minutes after the last job ("slurm_receive_msgs ... Insane message
            # length" on every ping), and squeue timed out here.
            try:
                self._cancel_all_jobs()
            except (subprocess.TimeoutExpired, SlurmClusterError) as exc:
                warnings.warn(
                    f"Slurm test cluster: cancelling the jobs left at teardown failed ({exc}); every daemon and "
                    f"job process is killed by PID next. slurmctld.log:\n{_tail(self.log_dir / 'slurmctld.log', 8)}",
                    stacklevel=1,
                )
        for name, proc in list(self._slurmds.items()):
            attempt(self._terminate, proc, f"slurmd {name}")
        for node in self.nodes:
            attempt(self._kill_netns_processes, node)
        if self._ctld is not None:
            attempt(self._terminate, self._ctld, "slurmctld")
        attempt(self._teardown_network)
        self._slurmds.clear()
        self._ctld = None
        if not errors:  # otherwise keep the PIDs for the next run's stale cleanup
            with contextlib.suppress(OSError):
                STATE_FILE.unlink()
        self._release_lock()
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        if errors:
            raise SlurmClusterError(f"errors while stopping the cluster: {errors!r}") from errors[0]

    # ---------------------------------------------------------------- clients

    def run(
        self,
        args: Sequence[str],
        timeout: float = 60,
        check: bool = True,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command (sinfo, srun, scontrol, ...) in the workdir."""
        full_env = {**self.env, **(env or {})}
        proc = subprocess.run(
            list(args), capture_output=True, text=True, env=full_env, cwd=self.jobs_dir, timeout=timeout
        )
        if check and proc.returncode != 0:
            raise SlurmClusterError(
                f"{' '.join(args)} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
            )
        return proc

    def sbatch(
        self,
        script: str | Path,
        *args: str,
        env: Mapping[str, str] | None = None,
        wait: bool = True,
        timeout: float = 120,
    ) -> int:
        """Submit a batch job and return its id.

        ``script`` is a path to a script file, or the script text itself (a
        ``str``).  ``args`` are sbatch options.  Unless given, ``--time=5`` is
        added (every job needs a limit so a broken test cannot hang the queue)
        and output goes to ``jobs_dir/slurm-<id>.out``.  With ``wait`` the call
        uses ``sbatch --wait`` and raises SlurmJobError if the job fails; on
        ``timeout`` the job is cancelled.
        """
        if isinstance(script, Path):
            script_path = script
            text = script.read_text()
        else:
            self._job_counter += 1
            script_path = self.jobs_dir / f"job-{self._job_counter}.sh"
            script_path.write_text(script)
            text = script
        options = list(args)
        directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
        given = "\n".join([" ".join(options), *directives])
        if not re.search(r"(^|\s)(--time(=|\s)|-t\s?\S)", given):
            options.insert(0, "--time=5")
        if not re.search(r"(^|\s)(--output(=|\s)|-o\s?\S)", given):
            options.insert(0, f"--output={self.jobs_dir}/slurm-%j.out")
        cmd = ["sbatch", "--parsable", *(["--wait"] if wait else []), *options, str(script_path)]
        full_env = {**self.env, **(env or {})}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env, cwd=self.jobs_dir, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            job_id = self._parse_job_id(out)
            if job_id is not None:
                self.run(["scancel", str(job_id)], check=False)
            raise SlurmJobError(f"job {job_id} did not finish within {timeout}s\n{self._job_debug(job_id)}") from exc
        job_id = self._parse_job_id(proc.stdout)
        if job_id is None:
            raise SlurmClusterError(f"sbatch failed ({proc.returncode}): {proc.stdout}{proc.stderr}")
        if proc.returncode != 0:
            raise SlurmJobError(
                f"job {job_id} failed (sbatch exit {proc.returncode}): {proc.stderr}\n{self._job_debug(job_id)}"
            )
        return job_id

    def output_path(self, job_id: int) -> Path:
        """Default output file of a job submitted through ``sbatch()``."""
        return self.jobs_dir / f"slurm-{job_id}.out"

    def job_info(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (accounting is off, so no sacct)."""
        proc = self.run(["scontrol", "show", "job", "-o", str(job_id)], check=False)
        if proc.returncode != 0:
            raise SlurmClusterError(f"no such job {job_id}: {proc.stderr.strip()}")
        info: dict[str, str] = {}
        for match in re.finditer(r"(\S+?)=(\S*)", proc.stdout):
            info.setdefault(match.group(1), match.group(2))
        return info

    def job_state(self, job_id: int) -> str:
        """Current state of a job, e.g. PENDING, RUNNING, COMPLETED, REQUEUED."""
        return self.job_info(job_id)["JobState"]

    def wait_for_state(self, job_id: int, states: str | Iterable[str], timeout: float = 60) -> str:
        """Poll until the job reaches one of ``states``; returns that state."""
        wanted = {states} if isinstance(states, str) else set(states)
        deadline = time.monotonic() + timeout
        state = "?"
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in wanted:
                return state
            time.sleep(0.2)
        raise TimeoutError(
            f"job {job_id} did not reach {sorted(wanted)} within {timeout}s (last state {state})\n"
            f"{self._job_debug(job_id)}"
        )

    # --------------------------------------------------------------- internals

    @staticmethod
    def _parse_job_id(stdout: str) -> int | None:
        match = re.search(r"^(\d+)", stdout.strip())
        return int(match.group(1)) if match else None

    def _job_debug(self, job_id: int | None) -> str:
        """Job record, output tail and slurmctld log tail for failure messages."""
        if job_id is None:
            return _tail(self.log_dir / "slurmctld.log", 20)
        parts = []
        try:
            info = self.job_info(job_id)
            keys = ("JobState", "Reason", "ExitCode", "NodeList")
            parts.append(" ".join(f"{k}={info[k]}" for k in keys if k in info))
            out = Path(info.get("StdOut", str(self.output_path(job_id))))
        except SlurmClusterError as exc:
            parts.append(str(exc))
            out = self.output_path(job_id)
        parts.append(f"--- {out}:\n{_tail(out, 30)}")
        parts.append(f"--- slurmctld.log:\n{_tail(self.log_dir / 'slurmctld.log', 15)}")
        return "\n".join(parts)

    def _acquire_lock(self) -> None:
        """One cluster per machine: the interface and namespace names are fixed."""
        if self._lock_fd is not None:
            raise SlurmClusterError("cluster already started")
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SlurmClusterError(
                f"another LocalSlurmCluster is running on this machine (lock {LOCK_FILE} is held)"
            ) from None
        self._lock_fd = fd

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing releases the flock
            self._lock_fd = None

    def _record_state(self) -> None:
        """Persist daemon PIDs so a later run can clean up after a crash."""
        pids = [p.pid for p in [self._ctld, *self._slurmds.values()] if p is not None]
        STATE_FILE.write_text(json.dumps({"workdir": str(self.workdir), "pids": pids}))

    def _cleanup_stale(self) -> None:
        """Remove what a crashed run left behind (we hold the lock, so it is dead)."""
        try:
            stale = json.loads(STATE_FILE.read_text())
        except (OSError, ValueError):
            stale = {}
        # Only kill recorded PIDs that are still Slurm daemons (PIDs get reused),
        # plus their helpers (slurmscriptd); SIGTERM first so they shut down
        # cleanly, SIGKILL for whatever ignores it.
        daemons = [p for p in stale.get("pids", []) if _proc_name(p) in SLURM_DAEMONS]
        family = [q for p in daemons for q in (p, *_descendants(p))]
        _kill_and_wait(_kill_and_wait(family, timeout=10, sig=signal.SIGTERM))
        with contextlib.suppress(OSError):
            STATE_FILE.unlink()
        netns_dir = Path("/run/netns")
        stale_ns = sorted(netns_dir.glob(f"{NETNS_PREFIX}*")) if netns_dir.is_dir() else []
        for ns_path in stale_ns:
            _kill_and_wait(_pids_in_netns(ns_path))
            _run(["ip", "netns", "delete", ns_path.name], check=False)
        self._teardown_network(all_stale=True)

    def _setup_network(self) -> None:
        """Bridge in the root namespace, one veth per node namespace."""
        cidr = f"{self.controller_addr}/{PREFIX_LEN}"
        subnet = f"{SUBNET_PREFIX}.0/{PREFIX_LEN}"
        self._network_up = True  # from here on, teardown has something to do
        _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "addr", "add", cidr, "dev", BRIDGE])
        _run(["ip", "link", "set", BRIDGE, "up"])
        # Fallback if the bridge (and its connected route) vanish: never send
        # this subnet to the default gateway.  The worse metric keeps the
        # bridge's own connected route (metric 0) in charge while it exists.
        _run(["ip", "route", "add", "unreachable", subnet, "metric", str(UNREACHABLE_METRIC)])
        for node in self.nodes:
            _run(["ip", "netns", "add", node.netns])
            _run(["ip", "link", "add", node.veth, "type", "veth", "peer", "name", "eth0", "netns", node.netns])
            _run(["ip", "link", "set", node.veth, "master", BRIDGE, "up"])
            _run(["ip", "-n", node.netns, "link", "set", "lo", "up"])
            _run(["ip", "-n", node.netns, "addr", "add", f"{node.addr}/{PREFIX_LEN}", "dev", "eth0"])
            _run(["ip", "-n", node.netns, "link", "set", "eth0", "up"])

    def _teardown_network(self, all_stale: bool = False) -> None:
        """Delete namespaces, veths, bridge and route that carry our names."""
        if not (self._network_up or all_stale):
            return
        for node in self.nodes:
            if node.netns_path.exists():
                _run(["ip", "netns", "delete", node.netns], check=False)
        links = _run(["ip", "-o", "link", "show"], check=False).stdout
        for name in re.findall(r"^\d+:\s+([^:@\s]+)", links, flags=re.M):
            if name.startswith(VETH_PREFIX):
                _run(["ip", "link", "delete", name], check=False)
        if re.search(rf"^\d+:\s+{BRIDGE}[:@]", links, flags=re.M):
            _run(["ip", "link", "delete", BRIDGE], check=False)
        subnet = f"{SUBNET_PREFIX}.0/{PREFIX_LEN}"
        for _ in range(10):  # more than one if earlier runs stacked them up
            if _run(
                ["ip", "route", "del", "unreachable", subnet, "metric", str(UNREACHABLE_METRIC)], check=False
            ).returncode:
                break
        leftovers = [n for n in self.nodes if n.netns_path.exists()]
        self._network_up = False
        if leftovers:
            raise SlurmClusterError(f"could not delete network namespaces: {[n.netns for n in leftovers]}")

    @staticmethod
    def _free_port() -> int:
        """A currently free TCP port for slurmctld (ports clash across runs/CI jobs)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            return int(sock.getsockname()[1])

    def _write_config(self) -> None:
        w = self.workdir
        node_lines = "\n".join(
            f"NodeName={n.name} NodeAddr={n.addr} NodeHostname={n.name} "
            f"CPUs={self.cpus_per_node} RealMemory={self.real_memory_mb} State=UNKNOWN"
            for n in self.nodes
        )
        names = ",".join(n.name for n in self.nodes)
        self.conf_path.write_text(
            f"""# Generated by tests/slurm/localcluster.py
ClusterName=localtest
SlurmctldHost={self.controller_host}({self.controller_addr})
SlurmctldPort={self.ctld_port}
SlurmdPort={SLURMD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
# cred_expire also delays the restart of a requeued job (default 120 s).
AuthInfo=cred_expire={self.cred_expire_s}
StateSaveLocation={w}/state
SlurmdSpoolDir={w}/spool/%n
SlurmctldPidFile={w}/slurmctld.pid
SlurmdPidFile={w}/slurmd-%n.pid
SlurmctldLogFile={self.log_dir}/slurmctld.log
SlurmdLogFile={self.log_dir}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
# Trust the configured CPUs/memory even if this machine differs.
SlurmdParameters=config_overrides
JobRequeue=0
KillWait=5
InactiveLimit=0
MinJobAge=300
SlurmdTimeout=30
SlurmctldTimeout=30
MessageTimeout=10
{node_lines}
PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""
        )
        # Looked up next to slurm.conf; relevant only on cgroup v2 hosts
        # without systemd, where slurmd would otherwise try to talk to dbus.
        (self.conf_path.parent / "cgroup.conf").write_text("CgroupPlugin=autodetect\nIgnoreSystemdOnFailure=yes\n")
        hosts = [
            "127.0.0.1\tlocalhost",
            "::1\tlocalhost ip6-localhost ip6-loopback",
            f"{self.controller_addr}\t{self.controller_host}",
            *(f"{n.addr}\t{n.name}" for n in self.nodes),
        ]
        self.hosts_path.write_text("\n".join(hosts) + "\n")

    def _daemon_env(self) -> dict[str, str]:
        env = self.env
        sbin_first = ["/usr/sbin", "/usr/bin", "/sbin", "/bin", *env["PATH"].split(os.pathsep)]
        env["PATH"] = os.pathsep.join(dict.fromkeys(sbin_first))
        return env

    def _spawn(self, cmd: list[str], name: str) -> subprocess.Popen[bytes]:
        """Start a foreground daemon in its own session (Ctrl-C won't hit it)."""
        with open(self.log_dir / f"{name}.stdout", "wb") as out:
            return subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self._daemon_env(),
                cwd=self.workdir,
                start_new_session=True,
            )

    def _daemon_failure(self, name: str, what: str) -> SlurmClusterError:
        """Error for a daemon that failed to come up, with its log tails."""
        parts = [f"{name} {what}"]
        for path in (self.log_dir / f"{name}.log", self.log_dir / f"{name}.stdout"):
            if path.exists():
                parts.append(f"--- {path}:\n{_tail(path)}")
        return SlurmClusterError("\n".join(parts))

    def _start_slurmctld(self) -> None:
        for binary in ("slurmctld", "slurmd", "nsenter", "unshare"):
            if shutil.which(binary, path=self._daemon_env()["PATH"]) is None:
                raise SlurmClusterError(f"{binary} not found; run tests/slurm/install_slurm.sh")
        self._ctld = self._spawn(["slurmctld", "-D", "-i"], "slurmctld")
        self._record_state()
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self._ctld.poll() is not None:
                raise self._daemon_failure("slurmctld", f"exited with code {self._ctld.returncode} during startup")
            ping = self.run(["scontrol", "ping"], check=False, timeout=15)
            if "is UP" in ping.stdout:
                return
            if time.monotonic() > deadline:
                raise self._daemon_failure("slurmctld", f"did not answer 'scontrol ping' within {self.start_timeout}s")
            time.sleep(0.1)

    def _start_slurmds(self) -> None:
        for node in self.nodes:
            inner = (
                f"mount --bind {self.hosts_path} /etc/hosts && hostname {node.name} && exec slurmd -D -N {node.name}"
            )
            cmd = [
                "nsenter", f"--net={node.netns_path}",
                "unshare", "--mount", "--uts", "--propagation", "private",
                "sh", "-c", inner,
            ]  # fmt: skip
            # nsenter, unshare and sh all exec: the PID we get is slurmd's.
            self._slurmds[node.name] = self._spawn(cmd, f"slurmd-{node.name}")
        self._record_state()

    def _wait_nodes_idle(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        states: dict[str, str] = {}
        while True:
            for name, proc in self._slurmds.items():
                if proc.poll() is not None:
                    raise self._daemon_failure(f"slurmd-{name}", f"exited with code {proc.returncode} during startup")
            if self._ctld is not None and self._ctld.poll() is not None:
                raise self._daemon_failure("slurmctld", f"exited with code {self._ctld.returncode} during startup")
            out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False, timeout=15).stdout
            states = dict(line.split(None, 1) for line in out.splitlines() if " " in line)
            if all(states.get(n.name) == "idle" for n in self.nodes):
                return
            if time.monotonic() > deadline:
                name = next(f"slurmd-{n.name}" for n in self.nodes if states.get(n.name) != "idle")
                raise self._daemon_failure(name, f"nodes not idle within {self.start_timeout}s: {states}")
            time.sleep(0.1)

    def _cancel_all_jobs(self) -> None:
        """Let slurmstepd end jobs cleanly before we kill what remains."""
        queue = self.run(["squeue", "-h", "-o", "%i"], check=False, timeout=10).stdout.split()
        if not queue:
            return
        self.run(["scancel", *queue], check=False, timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if not self.run(["squeue", "-h", "-o", "%i"], check=False, timeout=10).stdout.split():
                return
            time.sleep(0.2)

    @staticmethod
    def _terminate(proc: subprocess.Popen[bytes], what: str, timeout: float = 10) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; always reaps the child."""
        if proc.poll() is not None:
            return
        helpers = _descendants(proc.pid)  # slurmscriptd; orphaned if slurmctld is killed
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise SlurmClusterError(f"{what} (pid {proc.pid}) survived SIGKILL") from None
        survivors = _kill_and_wait(p for p in helpers if _proc_name(p) is not None)
        if survivors:
            raise SlurmClusterError(f"helpers of {what} survived SIGKILL: {survivors}")

    @staticmethod
    def _kill_netns_processes(node: Node) -> None:
        """Kill slurmstepd and job processes left in a node namespace, by PID."""
        survivors = _kill_and_wait(_pids_in_netns(node.netns_path))
        if survivors:
            raise SlurmClusterError(f"processes in {node.netns} survived SIGKILL: {survivors}")


def main(argv: list[str]) -> int:
    """`python tests/slurm/localcluster.py -- COMMAND [ARGS...]`: start the cluster (as root), run
    COMMAND with the cluster's environment (SLURM_CONF, this Python's bin first on PATH), stop it.
    For measurements that need a cluster outside the tests (`python -m app.bench.recovery --paths slurm`)."""
    import tempfile

    command = argv[1:] if argv[:1] == ["--"] else argv
    if not command:
        print("usage: python tests/slurm/localcluster.py -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    with (
        tempfile.TemporaryDirectory(prefix="slurm-localcluster-") as workdir,
        LocalSlurmCluster(Path(workdir)) as cluster,
    ):
        return subprocess.run(command, env=cluster.env, check=False).returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
