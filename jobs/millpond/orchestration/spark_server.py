"""The stack's warm Spark: a Spark Connect server from pyspark's own jars, on loopback.

Why a server: a JVM per Airflow task costs 10-16 s here; a Connect client answers in under a second. Tasks
are clients (``sc://127.0.0.1:<port>``): no JVM starts in a task process. The server's master is
``spark.master`` (``local[*]`` by default, or a ``spark://``/``k8s://`` cluster); a deployment that runs
its own Connect endpoint names it in ``spark.connect`` and the stack starts nothing.

Only the deployment runs code on it: a Connect client can run any Python on the executors, so the server
requires a shared token (Spark's ``PreSharedKeyAuthenticationInterceptor``, read from
``SPARK_CONNECT_AUTHENTICATE_TOKEN``): ``spark.connect_token`` if the deployment sets one, else one generated
once into ``<home>/spark/connect.token`` (mode 0600), where the stack's clients read it
(``runtime.engines.spark_client``). Its gRPC port has no TLS of its own (docs/deploy.md).

The standalone cluster helpers (a master and workers from pyspark's launcher) serve scale-out tests and
laptops that want to see a cluster; each process is its own group with a PID file, like every service.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

from millpond.config import Settings
from millpond.errors import MillpondError, PrerequisiteMissing
from millpond.orchestration import executor_env
from millpond.orchestration.processes import free_port, port_free, read_pid, run_dir, stop_group
from millpond.prerequisites import require_java
from millpond.runtime.engines.spark_client import token_file

#: the server's driver program (not Spark's ``SparkConnectServer`` class: see ``connect_driver``)
DRIVER = Path(__file__).resolve().parent / "connect_driver.py"


def spark_home() -> Path:
    """The installed pyspark package: it ships Spark's jars, launch scripts and the Connect server."""
    import pyspark

    return Path(pyspark.__file__).resolve().parent


#: a Spark Connect client's variables: a process that opened a Connect session (or a shell set up for a remote
#: Spark) has them, and a driver started with them takes itself for a client and exits at start
CLIENT_VARIABLES = ("SPARK_CONNECT_MODE_ENABLED", "SPARK_REMOTE", "SPARK_LOCAL_REMOTE")


def spark_env(settings: Settings) -> dict[str, str]:
    """Environment of every Spark JVM we start: the project's interpreter for Python workers, loopback; no
    Connect client's variables."""
    env = {k: v for k, v in os.environ.items() if k not in CLIENT_VARIABLES}
    env.update({
        "SPARK_HOME": str(spark_home()),
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_LOG_DIR": str(settings.home / "log"),
        "SPARK_WORKER_DIR": str(settings.home / "spark" / "work"),
        # scratch of every JVM (a standalone worker's executors too): under the home, not /tmp, where the
        # directories of an executor that did not exit cleanly would stay
        "SPARK_LOCAL_DIRS": str(settings.home / "spark" / "local"),
        # executors import millpond from this checkout, installed or not
        "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                    os.environ.get("PYTHONPATH")])),
    })
    return env


def java_tmp(settings: Settings) -> Path:
    """``java.io.tmpdir`` of the JVMs we start: Spark copies archives it ships and native libraries there and
    removes the copies only when the JVM exits cleanly, so they stay under the home, not in /tmp."""
    return settings.home / "spark" / "tmp"


def stack_token(settings: Settings) -> str:
    """The token the stack's Connect server requires: ``spark.connect_token`` when set, else the one in
    ``<home>/spark/connect.token``, generated on the first start (random, owner-only) and kept after."""
    if settings.spark_connect_token:
        return settings.spark_connect_token
    path = token_file(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        draft = path.with_name(f".{path.name}.{os.getpid()}")
        draft.unlink(missing_ok=True)
        fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(32) + "\n")
        try:
            os.link(draft, path)  # whole or not at all; a concurrent first start keeps the first one
        except FileExistsError:
            pass
        finally:
            draft.unlink()
    if path.stat().st_mode & 0o077:
        path.chmod(0o600)
    token = path.read_text().strip()
    if not token:
        raise MillpondError(f"{path} is empty: delete it and start the server again (its clients read the new one)")
    return token


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


class SparkConnectServer:
    """``spark-submit connect_driver.py`` as one process group, data and logs under ``var/``."""

    def __init__(self, settings: Settings, master: str | None = None, executor_cache: Path | None = None) -> None:
        self.settings = settings
        self.master = master or settings.spark_master
        #: where the executors' environment archive is built and kept on a cluster (``orchestration.executor_env``)
        self.executor_cache = executor_cache
        self.pidfile = run_dir(settings) / "spark-connect.pid"
        self.logfile = settings.home / "log" / "spark-connect.log"

    @property
    def url(self) -> str:
        return f"sc://127.0.0.1:{self.settings.spark_connect_port}"

    @property
    def ui_url(self) -> str:
        return f"http://127.0.0.1:{self.settings.spark_ui_port}"

    @property
    def token_file(self) -> Path:
        """The generated token's file (unused when ``spark.connect_token`` is set)."""
        return token_file(self.settings)

    @property
    def token_source(self) -> str:
        """Where its clients find the token, for messages (never the token itself)."""
        if self.settings.spark_connect_token:
            return "spark.connect_token (MILLPOND_SPARK_CONNECT_TOKEN)"
        return str(self.token_file)

    def running(self) -> bool:
        return read_pid(self.pidfile) is not None

    def command(self) -> list[str]:
        home, s = self.settings.home, self.settings
        conf = {
            "spark.connect.grpc.binding.port": s.spark_connect_port,
            "spark.connect.grpc.binding.address": "127.0.0.1",
            "spark.driver.host": "127.0.0.1",
            "spark.driver.bindAddress": "127.0.0.1",
            "spark.ui.port": s.spark_ui_port,
            "spark.driver.memory": s.spark_driver_memory,
            "spark.sql.shuffle.partitions": s.spark_shuffle_partitions,
            "spark.default.parallelism": s.spark_shuffle_partitions,
            "spark.sql.session.timeZone": "UTC",
            "spark.sql.execution.arrow.pyspark.enabled": "true",
            # Python UDFs (Great Expectations' JSON check) exchange rows with their worker as Arrow batches
            "spark.sql.execution.pythonUDF.arrow.enabled": "true",
            "spark.sql.adaptive.enabled": "false",
            # the code Spark generates for a batch's plans, kept for the next batch's same plans
            # (``runtime.engines.spark_values``): a sessions batch has about seventy classes, validation as many,
            # and each pipeline its own; past the default 100 a batch evicts the last one's and the JIT compiles
            # them again
            "spark.sql.codegen.cache.maxEntries": 2000,
            "spark.python.worker.reuse": "true",
            "spark.python.daemon.module": "millpond.runtime.engines.spark_daemon",
            "spark.sql.artifact.isolation.enabled": "false",
            "spark.jars.ivy": home / "spark" / "ivy",
            "spark.local.dir": home / "spark" / "local",
            "spark.sql.warehouse.dir": home / "spark" / "warehouse",
            "spark.driver.extraJavaOptions": f"-Djava.io.tmpdir={java_tmp(s)}",
            **self.executor_conf(),
        }
        args = [str(spark_home() / "bin" / "spark-submit"), "--master", self.master, "--name", "millpond-connect"]
        for key, value in conf.items():
            args += ["--conf", f"{key}={value}"]
        return [*args, str(DRIVER)]

    @property
    def on_cluster(self) -> bool:
        """Executors on other hosts (``spark://``, ``k8s://``): they get Python from ``executor_env``."""
        return not self.master.startswith("local")

    def executor_conf(self) -> dict[str, object]:
        """How executors run Millpond's Python: on ``local[*]`` this interpreter and checkout; on a cluster the
        environment archive shipped to them (``spark.archives``), built first if missing."""
        if self.on_cluster:
            return dict(executor_env.spark_conf(self.settings, self.executor_cache))
        return {"spark.executorEnv.PYTHONPATH": spark_env(self.settings)["PYTHONPATH"],
                "spark.executorEnv.PYSPARK_PYTHON": sys.executable}

    def start(self, timeout: float = 120.0) -> bool:
        """Start if not running (idempotent); wait until a client can connect. True if started."""
        if self.running():
            return False
        require_java()
        ports = (("Spark Connect", self.settings.spark_connect_port), ("Spark UI", self.settings.spark_ui_port))
        for name, port in ports:
            if not port_free(port):
                var = "MILLPOND_SPARK_CONNECT_PORT" if name == "Spark Connect" else "MILLPOND_SPARK_UI_PORT"
                raise PrerequisiteMissing(f"port {port} ({name}) is in use by another program: stop it or set {var}")
        for sub in ("spark/ivy", "spark/local", "spark/warehouse", "spark/tmp", "log"):
            (self.settings.home / sub).mkdir(parents=True, exist_ok=True)
        # the token through the environment (owner-only in /proc), not a --conf: every local user sees argv
        env = spark_env(self.settings) | {"SPARK_CONNECT_AUTHENTICATE_TOKEN": stack_token(self.settings)}
        if self.on_cluster:  # Connect's planner names the executors' Python from this variable, not the conf
            env["PYSPARK_PYTHON"] = executor_env.PYTHON
        with open(self.logfile, "ab") as log:
            proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True, cwd=self.settings.home)
        self.pidfile.write_text(str(proc.pid))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                self.pidfile.unlink(missing_ok=True)
                raise MillpondError(
                    f"Spark Connect server exited at start (code {proc.returncode}): see {self.logfile}")
            if _listening(self.settings.spark_connect_port):
                return True
            time.sleep(0.5)
        self.stop()
        raise MillpondError(f"Spark Connect server did not listen within {timeout:.0f}s: see {self.logfile}")

    def stop(self) -> bool:
        return stop_group(self.pidfile)

    def status(self) -> str:
        pid = read_pid(self.pidfile)
        if self.settings.spark_connect:
            return f"spark: external Connect endpoint {self.settings.spark_connect}"
        if pid is None:
            return "spark: stopped"
        return f"spark: running (pid {pid}) at {self.url}, master {self.master}; UI {self.ui_url}"


class StandaloneCluster:
    """A Spark standalone master and ``workers`` worker JVMs on loopback (pyspark's launcher)."""

    def __init__(self, settings: Settings, workers: int = 2, cores: int = 1, memory: str = "1g",
                 master_port: int = 0, name: str = "spark-standalone") -> None:
        self.settings, self.workers, self.cores, self.memory, self.name = settings, workers, cores, memory, name
        self.master_port = master_port or free_port()
        self.master_url = f"spark://127.0.0.1:{self.master_port}"

    def pidfile(self, role: str) -> Path:
        return run_dir(self.settings) / f"{self.name}-{role}.pid"

    def _launch(self, role: str, cls: str, *args: str) -> None:
        log = self.settings.home / "log" / f"{self.name}-{role}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        # as on another host: no path to this checkout or its interpreter (executors get the shipped environment)
        env = {k: v for k, v in spark_env(self.settings).items()
               if k not in ("PYTHONPATH", "PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "VIRTUAL_ENV")}
        # the daemons and the executors they launch (which inherit it): archives fetched, native libraries
        env["JAVA_TOOL_OPTIONS"] = " ".join(filter(None, [env.get("JAVA_TOOL_OPTIONS"),
                                                          f"-Djava.io.tmpdir={java_tmp(self.settings)}"]))
        with open(log, "ab") as out:
            proc = subprocess.Popen([str(spark_home() / "bin" / "spark-class"), cls, *args], stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                    env=env, cwd=self.settings.home)
        self.pidfile(role).write_text(str(proc.pid))

    def start(self, timeout: float = 90.0) -> str:
        """Start the master and the workers; wait until every worker has registered. Returns the master URL."""
        require_java()
        for sub in ("work", "local", "tmp"):
            (self.settings.home / "spark" / sub).mkdir(parents=True, exist_ok=True)
        ports: set[int] = {self.master_port}  # the web UIs' ports, each its own (a JVM binds its own seconds later)
        for _ in range(1 + self.workers):
            ports.add(free_port(avoid=ports))
        ui, *worker_uis = sorted(ports - {self.master_port})
        try:
            self._launch("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                         "--port", str(self.master_port), "--webui-port", str(ui))
            for i, worker_ui in enumerate(worker_uis):
                self._launch(f"worker{i}", "org.apache.spark.deploy.worker.Worker", self.master_url, "--host",
                             "127.0.0.1", "--cores", str(self.cores), "--memory", self.memory,
                             "--webui-port", str(worker_ui))
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.alive_workers(ui) >= self.workers:
                    return self.master_url
                time.sleep(1)
            raise MillpondError(f"Spark standalone cluster did not come up within {timeout:.0f}s")
        except BaseException:  # any way the start ends without a cluster: no JVM it launched outlives it
            self.stop()
            raise

    def alive_workers(self, ui_port: int) -> int:
        """The workers registered with the master, by its web UI's ``/json/``; 0 while it does not answer that
        (not listening yet, or an HTML page while its UI starts)."""
        import json
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}/json/", timeout=2) as resp:
                return int(json.loads(resp.read()).get("aliveworkers", 0))
        except (OSError, ValueError, AttributeError):  # ValueError: not JSON; AttributeError: JSON, not an object
            return 0

    def kill_worker(self, index: int) -> bool:
        """SIGKILL one worker's process group (a lost machine), for failure tests."""
        import signal

        pid = read_pid(self.pidfile(f"worker{index}"))
        if pid is None:
            return False
        os.killpg(pid, signal.SIGKILL)
        return True

    def stop(self) -> None:
        for i in range(self.workers):
            stop_group(self.pidfile(f"worker{i}"))
        stop_group(self.pidfile("master"))
