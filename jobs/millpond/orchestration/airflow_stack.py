"""A local Airflow 3 deployment as four explicit processes: api-server, scheduler, dag-processor, triggerer.

Why not ``airflow standalone``: it starts ~40 processes and ignores SIGINT when backgrounded. Four
process groups, each with a PID file under ``<home>/run`` and a log under ``<home>/log``, are stopped
exactly like the object store: only what this module started is ever signalled.

Everything Airflow needs is passed through the environment (no ``airflow.cfg`` edits), so the same
code runs against SQLite (default: a file under ``<home>/airflow``) or PostgreSQL (``airflow.db_url``,
``MILLPOND_AIRFLOW_DB_URL``: ``postgresql+psycopg2://...``). What only SQLite needs (its file, restarting a
scheduler that exited on one of its lock races) is done for SQLite only.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from millpond.config import PROJECT_ROOT, Settings
from millpond.errors import ApiRefused, MillpondError, PrerequisiteMissing
from millpond.orchestration.bytecode import compile_sources
from millpond.orchestration.processes import port_free, read_pid, run_dir, stop_group

# Start order; stop goes the other way (the api-server last: running tasks report to it).
COMPONENTS = ("api-server", "dag-processor", "scheduler", "triggerer")
ADMIN_USER = "admin"
DAGS_FOLDER = PROJECT_ROOT / "dags"


@dataclass(frozen=True)
class AirflowConfig:
    """The ``airflow:`` section of ``conf/millpond.yaml`` after environment overrides."""

    enabled: bool
    port: int
    parallelism: int
    refresh_interval: int
    db_url: str | None
    start_timeout: float
    scheduled_runs: bool
    paused_at_creation: bool = True


def airflow_config(settings: Settings) -> AirflowConfig:
    """The deployment's Airflow settings (``airflow:`` in ``conf/millpond.yaml``, environment overrides)."""
    return AirflowConfig(
        enabled=settings.airflow_enabled,
        port=settings.airflow_port,
        parallelism=settings.airflow_parallelism,
        refresh_interval=settings.airflow_refresh_interval,
        db_url=settings.airflow_db_url or os.environ.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN") or None,
        start_timeout=settings.airflow_start_timeout,
        scheduled_runs=settings.airflow_scheduled_runs,
        paused_at_creation=settings.airflow_paused_at_creation,
    )


#: the form of ``airflow.db_url`` for PostgreSQL (Airflow derives its async engine's ``postgresql+asyncpg`` from it)
DB_URL_FORM = "postgresql+psycopg2://USER:PASSWORD@HOST:5432/DATABASE"
DB_URL_SETTING = "airflow.db_url (MILLPOND_AIRFLOW_DB_URL)"


def is_sqlite(db_url: str | None) -> bool:
    """Whether Airflow's metadata database is SQLite: no URL (the embedded default) or a ``sqlite:`` one."""
    return not db_url or db_url.split(":", 1)[0].split("+", 1)[0].strip().lower() == "sqlite"


def shown_url(db_url: str) -> str:
    """A database URL for messages: its password hidden."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(db_url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a URL at all: name its scheme only
        return db_url.split("://", 1)[0] + "://..."


def check_database(db_url: str, timeout: float = 10.0) -> None:
    """Connect once to a server database before ``airflow db migrate`` would fail on it into a log: a URL that is
    not one, a driver that is not installed, or a server that does not answer ends in one line saying what to do.
    SQLite needs no check (Airflow creates the file)."""
    if is_sqlite(db_url):
        return
    import importlib.util

    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError
    from sqlalchemy.pool import NullPool

    try:
        url = make_url(db_url)
    except ArgumentError:
        raise MillpondError(f"{DB_URL_SETTING} is not a database URL: write it as {DB_URL_FORM}") from None
    shown = url.render_as_string(hide_password=True)
    backend = url.get_backend_name()
    connect_args = {"connect_timeout": max(1, int(timeout))} if backend in ("postgresql", "mysql") else {}
    try:
        engine = create_engine(url, poolclass=NullPool, connect_args=connect_args)
    except NoSuchModuleError:
        raise MillpondError(f"{DB_URL_SETTING} = {shown}: SQLAlchemy knows no database {url.drivername!r}: "
                            f"write it as {DB_URL_FORM}") from None
    except ImportError as exc:
        driver = exc.name or url.drivername
        raise PrerequisiteMissing(f"{DB_URL_SETTING} = {shown} needs the Python driver {driver}, which is not "
                                  f"installed: install it into .venv, or use PostgreSQL through {DB_URL_FORM} "
                                  "(`make venv` installs its driver)") from None
    if backend == "postgresql" and importlib.util.find_spec("asyncpg") is None:
        raise PrerequisiteMissing("Airflow's async engine for PostgreSQL needs asyncpg, which is not installed: "
                                  "run `make venv`")
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except SQLAlchemyError as exc:
        reason = " ".join(str(getattr(exc, "orig", None) or exc).strip().splitlines()[0].split()) or type(exc).__name__
        raise MillpondError(f"Airflow's database at {shown} did not answer ({reason}): start it, create the database "
                            f"and its user there, or point {DB_URL_SETTING} at one that runs") from None
    finally:
        engine.dispose()


def _flag(value: object) -> bool:
    return str(value).strip().lower() not in ("0", "false", "no", "off")


def airflow_home(settings: Settings) -> Path:
    return settings.home / "airflow"


def sqlite_url(settings: Settings) -> str:
    """The embedded stack's metadata database: a SQLite file in its Airflow home."""
    return f"sqlite:///{airflow_home(settings) / 'airflow.db'}"


def airflow_binary() -> list[str]:
    candidate = Path(sys.executable).parent / "airflow"
    if candidate.exists():
        return [str(candidate)]
    found = shutil.which("airflow")
    if not found:
        raise PrerequisiteMissing("`airflow` not found: run `make venv` (installs apache-airflow)")
    return [found]


def scheduler_command() -> list[str]:
    """The scheduler through ``airflow_preload`` when this interpreter is Airflow's; else plain ``airflow``."""
    if (Path(sys.executable).parent / "airflow").exists():
        return [sys.executable, "-m", "millpond.orchestration.airflow_preload"]
    return airflow_binary()


def _secrets(settings: Settings) -> dict[str, str]:
    """Secrets generated once per home and shared by all four processes (JWTs must verify across them)."""
    home = airflow_home(settings)
    home.mkdir(parents=True, exist_ok=True)
    path = home / "millpond-secrets.json"
    if path.exists():
        return json.loads(path.read_text())
    from cryptography.fernet import Fernet

    values = {
        "jwt_secret": secrets.token_urlsafe(32),
        "secret_key": secrets.token_urlsafe(32),
        "fernet_key": Fernet.generate_key().decode(),
    }
    _write_private(path, json.dumps(values))
    return values


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def passwords_file(settings: Settings) -> Path:
    return airflow_home(settings) / "simple_auth_manager_passwords.json"


def admin_password(settings: Settings) -> str:
    """The admin password, generated on first use and kept under ``<home>/airflow`` (mode 0600)."""
    path = passwords_file(settings)
    if path.exists():
        try:
            return json.loads(path.read_text())[ADMIN_USER]
        except (ValueError, KeyError):
            pass
    path.parent.mkdir(parents=True, exist_ok=True)
    password = secrets.token_urlsafe(12)
    _write_private(path, json.dumps({ADMIN_USER: password}))
    return password


def airflow_env(
    settings: Settings, cfg: AirflowConfig | None = None, base: dict[str, str] | None = None
) -> dict[str, str]:
    """The environment of every Airflow process and CLI call of this deployment."""
    cfg = cfg or airflow_config(settings)
    env = dict(os.environ if base is None else base)
    home = airflow_home(settings)
    sec = _secrets(settings)
    admin_password(settings)
    db_url = cfg.db_url or sqlite_url(settings)
    url = f"http://127.0.0.1:{cfg.port}"
    env.update({
        "AIRFLOW_HOME": str(home),
        # Tasks must reach the same store, home and pipeline configuration as the CLI that started them.
        "MILLPOND_HOME": str(settings.home),
        "MILLPOND_CONF_DIR": str(settings.conf_dir),
        "MILLPOND_AIRFLOW_SCHEDULED_RUNS": "true" if cfg.scheduled_runs else "false",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": db_url,
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__CORE__PARALLELISM": str(cfg.parallelism),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS_FOLDER),
        # New DAGs wait paused until `make run` has backfilled their recent history in order, then unpauses.
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": str(cfg.paused_at_creation),
        "MILLPOND_AIRFLOW_PAUSED_AT_CREATION": "true" if cfg.paused_at_creation else "false",
        "AIRFLOW__CORE__FERNET_KEY": sec["fernet_key"],
        "AIRFLOW__CORE__AUTH_MANAGER": "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{ADMIN_USER}:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords_file(settings)),
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{url}/execution/",
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": str(cfg.port),
        "AIRFLOW__API__BASE_URL": url,
        "AIRFLOW__API__WORKERS": "1",
        "AIRFLOW__API__SECRET_KEY": sec["secret_key"],
        "AIRFLOW__API__EXPOSE_CONFIG": "False",
        "AIRFLOW__API_AUTH__JWT_SECRET": sec["jwt_secret"],
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": str(cfg.refresh_interval),
        "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": str(max(cfg.refresh_interval, 5)),
        # a new pipeline's table Assets become active (able to take events that trigger its stages) at the
        # scheduler's next asset clean-up pass: every few seconds, not the default minute
        "AIRFLOW__SCHEDULER__PARSING_CLEANUP_INTERVAL": str(max(cfg.refresh_interval, 5)),
        "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "False",
        "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(home / "logs"),
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    })
    # Airflow runs pipelines' tasks: they import millpond from the repository even without `pip install -e`.
    jobs = str(PROJECT_ROOT / "jobs")
    env["PYTHONPATH"] = jobs + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # lineage.url: the OpenLineage provider's transport (none: the provider stays off, or uses its own config)
    from millpond.orchestration.lineage import airflow_env as lineage_env

    env.update(lineage_env(settings))
    return env


class AirflowStack:
    """Start, stop and inspect the four Airflow processes of one Millpond home."""

    def __init__(self, settings: Settings, cfg: AirflowConfig | None = None) -> None:
        self.settings = settings
        self.cfg = cfg or airflow_config(settings)
        self.home = airflow_home(settings)
        self.log_dir = settings.home / "log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.cfg.port}"

    def pidfile(self, component: str) -> Path:
        return run_dir(self.settings) / f"airflow-{component}.pid"

    def logfile(self, component: str) -> Path:
        return self.log_dir / f"airflow-{component}.log"

    def pids(self) -> dict[str, int | None]:
        return {c: read_pid(self.pidfile(c)) for c in COMPONENTS}

    def running(self) -> bool:
        return all(self.pids().values())

    def admin_password(self) -> str:
        return admin_password(self.settings)

    @property
    def db_url(self) -> str:
        """The metadata database the components use: a running stack's (kept with its environment), else this
        configuration's."""
        kept = self.home / "stack-env.json"
        if kept.exists() and any(self.pids().values()):
            try:
                return json.loads(kept.read_text())["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
            except (ValueError, KeyError):
                pass
        return self.cfg.db_url or sqlite_url(self.settings)

    @property
    def database(self) -> str:
        """The metadata database, for messages: SQLite's file, or the server's URL without its password."""
        url = self.db_url
        return f"SQLite {url.split(':///', 1)[-1]}" if is_sqlite(url) else shown_url(url)

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, timeout: float | None = None) -> bool:
        """Start the components that are not running (idempotent); wait until healthy. True if any started."""
        timeout = self.cfg.start_timeout if timeout is None else timeout
        missing = [c for c, pid in self.pids().items() if pid is None]
        if not missing:
            self.wait_healthy(timeout)
            return False
        if "api-server" in missing and not port_free(self.cfg.port):
            raise PrerequisiteMissing(
                f"port {self.cfg.port} (Airflow api-server) is in use by another program: stop it or set "
                "MILLPOND_AIRFLOW_PORT to a free port"
            )
        self.home.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        compile_sources()  # every task imports Millpond and the DAG file: compiled once here, not in each task
        env = self._environment(fresh=len(missing) == len(COMPONENTS))
        check_database(env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"])  # a server database: reachable, or one line
        migrate = subprocess.run(airflow_binary() + ["db", "migrate"], env=env, capture_output=True, text=True,
                                 stdin=subprocess.DEVNULL, timeout=300)
        if migrate.returncode != 0:
            self.logfile("db-migrate").write_text(migrate.stdout + migrate.stderr)
            raise MillpondError(
                f"`airflow db migrate` failed (code {migrate.returncode}): see {self.logfile('db-migrate')}"
            )
        procs: dict[str, subprocess.Popen] = {}
        for component in COMPONENTS:
            if component not in missing:
                continue
            args = [component]
            if component == "api-server":
                args += ["--host", "127.0.0.1", "--port", str(self.cfg.port)]
            elif component in ("scheduler", "triggerer"):
                args += ["--skip-serve-logs"]  # logs are read from local files: no extra ports
            # The scheduler forks the task processes (LocalExecutor): started with the tasks' heavy libraries
            # loaded, so each task has them at no cost (airflow_preload.py)
            command = scheduler_command() if component == "scheduler" else airflow_binary()
            with open(self.logfile(component), "ab") as log:
                proc = subprocess.Popen(
                    command + args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env=env, start_new_session=True, cwd=self.home,
                )
            self.pidfile(component).write_text(str(proc.pid))
            procs[component] = proc
        whole = len(missing) == len(COMPONENTS)
        try:  # a revive waits for what it restarted, and on failure stops only that
            self.wait_healthy(timeout, procs, only=None if whole else missing)
        except BaseException:
            if whole:
                self.stop()
            else:
                for component in procs:
                    stop_group(self.pidfile(component), timeout=20.0)
            raise
        return True

    def _environment(self, fresh: bool) -> dict[str, str]:
        """The components' environment: made when the stack starts whole, then kept (owner-only: it holds the
        stack's secrets), so a component revived later by another process — a CLI with other overrides, a
        test's patched environment — runs with exactly its siblings' settings."""
        kept = self.home / "stack-env.json"
        if not fresh and kept.exists():
            return json.loads(kept.read_text())
        env = airflow_env(self.settings, self.cfg)
        kept.touch(mode=0o600)
        kept.write_text(json.dumps(env))
        return env

    def revive(self) -> list[str]:
        """Restart the components that died while the others still run; the restarted ones (none when
        the whole stack is down: that is `make up`'s job). Airflow expects a supervisor to do this: on SQLite its
        scheduler exits on some database races (e.g. a run deleted under it by `dag.test` on the same
        database) and adopts the orphaned tasks when it comes back. On PostgreSQL there are no such races:
        a dead component is a fault to read about, not to paper over, so it is reported, not restarted. It waits
        for the health of what it restarted (a live sibling's lagging heartbeat is not its to fix), and if that
        fails it stops only what it started."""
        pids = self.pids()
        dead = [c for c, pid in pids.items() if pid is None]
        if not dead or len(dead) == len(pids):
            return []
        if not is_sqlite(self.db_url):
            raise MillpondError(f"Airflow {' and '.join(dead)} stopped while the others run (on {self.database}, "
                                f"no SQLite race): see {self.logfile(dead[0])}, then run `make up` to start it again")
        self.start()
        return dead

    def wait_healthy(self, timeout: float, procs: dict[str, subprocess.Popen] | None = None,
                     only: list[str] | None = None) -> dict[str, Any]:
        """Block until the api-server answers and every component reports a heartbeat (``only``: these
        components, as ``COMPONENTS`` names them; a revive's: a live component's lagging heartbeat is not the
        revive's to wait for)."""
        wanted = None if only is None else {"metadatabase", *(c.replace("-", "_") for c in only)}
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while time.monotonic() < deadline:
            for component, proc in (procs or {}).items():
                if proc.poll() is not None:
                    raise MillpondError(
                        f"Airflow {component} exited at start (code {proc.returncode}): see {self.logfile(component)}"
                    )
            try:
                health = self.health()
            except MillpondError as exc:
                last = str(exc)
            else:
                unhealthy = [k for k, v in health.items() if isinstance(v, dict) and v.get("status") != "healthy"
                             and (wanted is None or k in wanted)]
                if not unhealthy:
                    return health
                last = f"not yet healthy: {', '.join(unhealthy)}"
            time.sleep(1.0)
        raise MillpondError(
            f"Airflow did not become healthy in {timeout:.0f}s ({last}): see {self.log_dir}/airflow-*.log"
        )

    def stop(self) -> bool:
        """Stop the process groups this module started; True if any was running."""
        stopped = False
        for component in reversed(COMPONENTS):
            stopped = stop_group(self.pidfile(component), timeout=20.0) or stopped
        return stopped

    def status(self) -> list[str]:
        pids = self.pids()
        if not any(pids.values()):
            return ["airflow: stopped"]
        parts = ", ".join(f"{c} {'pid ' + str(p) if p else 'STOPPED'}" for c, p in pids.items())
        state = "running" if all(pids.values()) else "partly running (run `make up` to restart the rest)"
        where = passwords_file(self.settings)
        return [f"airflow: {state} at {self.url} ({parts}); user {ADMIN_USER}, password in {where}; "
                f"metadata database {self.database}"]

    # -- REST ------------------------------------------------------------------------------------
    def _http(self, method: str, path: str, body: Any = None, token: str | None = None,
              timeout: float = 30.0) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(req, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            raise ApiRefused(f"Airflow API {method} {path} answered {exc.code}: {detail}", exc.code) from exc
        except (urllib.error.URLError, OSError) as exc:
            if isinstance(exc, TimeoutError) or isinstance(getattr(exc, "reason", None), TimeoutError):
                raise MillpondError(f"Airflow API at {self.url} did not answer {method} {path} within {timeout:.0f}s: "
                                    "check it (`make status`), then retry") from exc
            raise MillpondError(f"Airflow API unreachable at {self.url}: start it with `make up` ({exc})") from exc
        return json.loads(raw) if raw else None

    def health(self) -> dict[str, Any]:
        return self._http("GET", "/api/v2/monitor/health", timeout=5.0)

    def token(self) -> str:
        answer = self._http("POST", "/auth/token", {"username": ADMIN_USER, "password": self.admin_password()})
        return answer["access_token"]

    def api(self, method: str, path: str, body: Any = None, token: str | None = None) -> Any:
        """An authenticated call to the public REST API (``/api/v2/...``)."""
        return self._http(method, "/api/v2" + path, body, token or self.token())


def start_isolated_stack(overrides: dict[str, str], timeout: float = 240.0) -> tuple[AirflowStack, Settings]:
    """A stack for tests and benchmarks: this process's environment plus ``overrides``, without the caller's
    own ``AIRFLOW*`` variables (an in-process test Airflow's DB and home must not leak into it); the process
    environment is restored after. Returns the stack and the settings its tasks see."""
    from millpond.config import load_settings
    from millpond.lake.objectstore import ObjectStore

    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")} | overrides
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        settings = load_settings()
        ObjectStore(settings).ensure_buckets()
        stack = AirflowStack(settings, airflow_config(settings))
        stack.start(timeout=timeout)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return stack, settings
