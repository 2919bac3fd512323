"""Local service processes: free loopback ports, PID files, and stopping a whole process group.

Each service is one process group recorded in a PID file under ``var/run``; stop only ever signals
a group whose PID file this project wrote, so a user's own processes are never touched.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import signal
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from millpond.config import Settings
from millpond.errors import MillpondError


def run_dir(settings: Settings) -> Path:
    path = settings.home / "run"
    path.mkdir(parents=True, exist_ok=True)
    return path


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


#: the lowest port ``free_port`` hands out: below it sit many tools' default ports (8080, 9000, 9333, ...)
LOWEST_PORT = 12000


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for connections' own ports (Linux: ``ip_local_port_range``)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return low, high


#: how long a port ``free_port`` handed out stays its taker's, whether bound or not: a store stopped for an outage
#: gets its ports back on restart, not taken meanwhile by another process's free port (a CI run failed so)
LEASE_S = 3600.0


def lease_book() -> Path:
    """The ports handed out on this host by any process of this user, with when: one small file, locked."""
    return Path(tempfile.gettempdir()) / f"millpond-ports-{os.getuid()}"


@contextlib.contextmanager
def _leases() -> Iterator[dict[int, float]]:
    """The unexpired leases, under an exclusive lock held until the block ends; what it adds is written back."""
    path = lease_book()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    with os.fdopen(fd, "r+") as book:
        fcntl.flock(book, fcntl.LOCK_EX)
        now = time.time()
        leases: dict[int, float] = {}
        for line in book.read().split():
            port, _, at = line.partition("@")
            with contextlib.suppress(ValueError):
                if now - float(at) < LEASE_S:
                    leases[int(port)] = float(at)
        yield leases
        book.seek(0)
        book.truncate()
        book.write("".join(f"{port}@{at:.0f}\n" for port, at in sorted(leases.items())))


def free_port(avoid: set[int] | None = None, twin: int | None = None) -> int:
    """A free loopback port for a server, below the kernel's ephemeral range: a server stopped and started
    again on it (a store after an outage) never finds it taken meanwhile by some connection's own port, which
    the kernel picks from that range, nor by another process's free port (each is leased, ``LEASE_S``). With
    ``twin``, port + twin is free and below the range as well (SeaweedFS's gRPC ports are +10000)."""
    avoid = avoid or set()
    top = ephemeral_ports()[0] - 1 - (twin or 0)
    pick = random.SystemRandom()
    with _leases() as leased:
        for _ in range(500):
            port = pick.randint(LOWEST_PORT, top) if top > LOWEST_PORT else _kernel_port()
            ports = {port, port + twin} if twin else {port}
            if (max(ports) < 65536 and not ports & avoid and not ports & leased.keys()
                    and all(port_free(p) for p in ports)):
                leased.update(dict.fromkeys(ports, time.time()))
                return port
    raise MillpondError("no free loopback port found")


def _kernel_port() -> int:
    """A port the kernel says is free (when the ephemeral range leaves no room below it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pid_alive(pid: int) -> bool:
    """Running, not a zombie: a service this process started and that exited stays in the process
    table until reaped, and would otherwise look alive (a dead scheduler would never be restarted)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no procfs: trust the signal probe
    if state != "Z":
        return True
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # reap it if it is ours
    return False


def read_pid(pidfile: Path) -> int | None:
    try:
        pid = int(pidfile.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    return pid if _pid_alive(pid) else None


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of a process group; with no procfs, its leader if alive."""
    proc = Path("/proc")
    if not proc.is_dir():
        return [pgid] if _pid_alive(pgid) else []
    members = []
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # a process that just ended
        if int(fields[2]) == pgid and fields[0] != "Z":  # after the name: state, ppid, pgrp
            members.append(int(stat.parent.name))
    return members


#: how long a group's other processes get to follow their leader out before the next signal
FOLLOW_S = 2.0


def stop_group(pidfile: Path, timeout: float = 15.0) -> bool:
    """Stop the process group recorded in ``pidfile``, every process of it; True if something was running.
    SIGTERM, then SIGKILL for what is left after ``timeout``, or ``FOLLOW_S`` after the leader exited: a child
    that outlives its leader (a Spark driver program whose JVM has gone, stuck in its shutdown) is stopped
    too, not left behind."""
    pid = read_pid(pidfile)
    pidfile.unlink(missing_ok=True)
    if pid is None:
        return False
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)  # reap the leader if it is ours
            members = group_members(pid)
            if not members:
                return True
            if pid not in members:
                deadline = min(deadline, time.monotonic() + FOLLOW_S)
            time.sleep(0.1)
    return True
