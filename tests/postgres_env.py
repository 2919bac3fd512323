"""A real PostgreSQL for the tests' Airflow: Debian's binaries, ``initdb`` into a temporary folder, trust on
127.0.0.1 only, run as a non-root user. The session's Airflow keeps its metadata in it, as a deployment's does
(docs/deploy.md); a machine without the binaries runs that Airflow on SQLite instead, unless it is root (then
``make test`` installs them, and their absence is a failure that says so)."""

from __future__ import annotations

import dataclasses
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

PG_USER = "millpond"  # the server's superuser (trust on 127.0.0.1 only)
HINT = "install PostgreSQL (Debian: apt-get install -y postgresql; .ci/run and `make test` do as root)"


def postgres_bin() -> Path | None:
    """The newest PostgreSQL's server binaries: Debian's ``/usr/lib/postgresql/<major>/bin``, else ``PATH``."""
    def major(pg_ctl: Path) -> int:
        name = pg_ctl.parent.parent.name
        return int(name) if name.isdigit() else -1

    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=major)
    if found:
        return found[-1].parent
    which = shutil.which("pg_ctl")
    return Path(which).parent if which and shutil.which("initdb") else None


def server_account() -> dict:
    """How ``initdb`` and ``postgres`` run: as this user, or as root (which they refuse) as Debian's
    ``postgres`` account, made as a system user when missing; without root's groups."""
    if os.geteuid() != 0:
        return {}
    try:
        entry = pwd.getpwnam("postgres")
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "postgres"],
                       check=True, capture_output=True)
        entry = pwd.getpwnam("postgres")
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


@dataclasses.dataclass
class Postgres:
    """One PostgreSQL server in a folder of its own: data, unix socket and log."""

    bin: Path
    base: Path
    port: int
    account: dict

    @property
    def data(self) -> Path:
        return self.base / "data"

    def url(self, database: str = "airflow") -> str:
        return f"postgresql+psycopg2://{PG_USER}@127.0.0.1:{self.port}/{database}"

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        done = subprocess.run(args, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout,
                              cwd=self.base, **self.account)
        if done.returncode != 0:
            log = self.base / "server.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise RuntimeError(f"{' '.join(args[:2])} failed ({done.returncode}): {done.stdout}{done.stderr}{tail}")
        return done

    @classmethod
    def start(cls, bin_dir: Path) -> Postgres:
        from millpond.orchestration.processes import free_port

        account = server_account()
        base = Path(tempfile.mkdtemp(prefix="millpond-pg-"))
        if account:
            os.chown(base, account["user"], account["group"])
        server = cls(bin_dir, base, free_port(), account)
        server.run(str(bin_dir / "initdb"), "-D", str(server.data), "-U", PG_USER, "-E", "UTF8", "--locale=C",
                   "--auth=trust", "--no-sync")
        sockets = base / "sockets"
        server.run("mkdir", "-m", "0700", str(sockets))
        with open(server.data / "postgresql.conf", "a") as conf:  # appended: the file keeps its owner
            conf.write(f"\nlisten_addresses = '127.0.0.1'\nport = {server.port}\n"
                       f"unix_socket_directories = '{sockets}'\nmax_connections = 200\n"
                       # a test's throw-away data: no flushes to wait for
                       "fsync = off\nsynchronous_commit = off\nfull_page_writes = off\n")
        # trust on loopback TCP only; the socket (in a folder only the server's user can enter) for that user
        (server.data / "pg_hba.conf").write_text("local all all peer\nhost all all 127.0.0.1/32 trust\n")
        server.run(str(bin_dir / "pg_ctl"), "-D", str(server.data), "-l", str(base / "server.log"), "-w", "-t", "60",
                   "start")
        import psycopg2

        conn = psycopg2.connect(host="127.0.0.1", port=server.port, user=PG_USER, dbname="postgres")
        try:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute("CREATE DATABASE airflow")
        finally:
            conn.close()
        return server

    def query(self, sql: str, database: str = "airflow") -> list[tuple]:
        import psycopg2

        conn = psycopg2.connect(host="127.0.0.1", port=self.port, user=PG_USER, dbname=database)
        try:
            with conn.cursor() as cur:
                cur.execute(sql)
                return cur.fetchall()
        finally:
            conn.close()

    def stop(self) -> None:
        try:
            if (self.data / "postmaster.pid").exists():
                self.run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop")
        finally:
            pid_file = self.data / "postmaster.pid"
            if pid_file.exists():  # it did not stop in time: the server this fixture started, by its own pid
                try:
                    os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            shutil.rmtree(self.base, ignore_errors=True)




def start_if_possible() -> Postgres | None:
    """A started server; None (run on SQLite) when the binaries are missing and this is not root, who can
    install them: then their absence fails the test that asked."""
    bin_dir = postgres_bin()
    if bin_dir is None:
        if os.geteuid() == 0:
            pytest.fail(f"PostgreSQL's binaries (initdb, pg_ctl) are missing: {HINT}")
        return None
    return Postgres.start(bin_dir)
