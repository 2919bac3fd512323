"""Local service processes: free loopback ports, PID files, and stopping a whole process group.

Each service is one process group recorded in a PID file under ``var/run``; stop only ever signals
a group whose PID file this project wrote, so a user's own processes are never touched.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
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


def free_port(avoid: set[int] | None = None) -> int:
    """A free loopback port whose gRPC twin (+10000) is free as well (SeaweedFS uses both)."""
    avoid = avoid or set()
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 55000 and port not in avoid and port + 10000 not in avoid and port_free(port + 10000):
            return port
    raise MillpondError("no free loopback port found")


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


def stop_group(pidfile: Path, timeout: float = 15.0) -> bool:
    """Stop the process group recorded in ``pidfile``; True if something was running."""
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
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    return True
            except ChildProcessError:
                pass
            if not _pid_alive(pid):
                return True
            time.sleep(0.1)
    return True
