"""One settings object for the whole product, built once and passed down.

Read from ``conf/millpond.yaml``, then overridden by environment variables, so the same code runs on
the embedded stack (local-dev defaults, marked as such in the file) and on a cluster (secrets from the
environment or an Airflow connection, never from the repository). Every setting is declared once, in
``OPTIONS``: its place in the file, its variable, its type and its default; ``docs/settings.md`` lists
the same table. Strict: an unknown key or a value of the wrong type is an error that says what was meant.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from millpond.errors import MillpondError
from millpond.model.timeutil import parse_duration

PROJECT_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_CONF_DIR = PROJECT_ROOT / "conf"


class ConfigError(MillpondError):
    """A settings or pipeline file that cannot be used as written."""


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


def _int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("expected an integer")
    if isinstance(value, int):
        return value
    try:
        return int(str(value).strip())
    except ValueError:
        raise ValueError("expected an integer") from None


def _seconds(value: Any) -> float:
    """A duration: a number of seconds or text such as ``90s``, ``10m``, ``1h``."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 30s, 10m or a number of seconds")
    if isinstance(value, int | float):
        return float(value)
    try:
        return parse_duration(str(value).strip()) / 1_000_000
    except (ValueError, TypeError):
        raise ValueError("expected a duration such as 30s, 10m or a number of seconds") from None


def _str(value: Any) -> str:
    if isinstance(value, dict | list):
        raise ValueError("expected text")
    return "" if value is None else str(value)


def _optional_int(value: Any) -> int | None:
    return None if value in (None, "", "auto") else _int(value)


def _positive_seconds(value: Any) -> float:
    seconds = _seconds(value)
    if seconds <= 0:
        raise ValueError("expected a duration longer than zero, such as 7d")
    return seconds


@dataclass(frozen=True)
class Option:
    """One setting: its field, its place in ``millpond.yaml``, its environment variable, type and default."""

    name: str
    path: str
    env: str
    cast: Callable[[Any], Any]
    default: Any
    doc: str
    #: a value only the embedded stack should use; deployments set their own
    local_dev: bool = False


OPTIONS: tuple[Option, ...] = (
    Option("s3_endpoint", "object_store.endpoint", "MILLPOND_S3_ENDPOINT", _str, "http://127.0.0.1:8333",
           "S3 endpoint of the lake (any S3-compatible store)", local_dev=True),
    Option("s3_region", "object_store.region", "MILLPOND_S3_REGION", _str, "us-east-1", "S3 region"),
    Option("s3_access_key", "object_store.access_key", "MILLPOND_S3_ACCESS_KEY", _str, "millpond-dev",
           "S3 access key (AWS_ACCESS_KEY_ID is honoured too)", local_dev=True),
    Option("s3_secret_key", "object_store.secret_key", "MILLPOND_S3_SECRET_KEY", _str,
           "millpond-dev-secret-change-me", "S3 secret key (AWS_SECRET_ACCESS_KEY is honoured too)", local_dev=True),
    Option("store_timeout_s", "object_store.timeout", "MILLPOND_S3_TIMEOUT", _seconds, 120.0,
           "longest wait for one object-store call, retries included: a store that stops answering fails "
           "the batch in about this long, in one line naming it"),
    Option("bucket_landing", "buckets.landing", "MILLPOND_BUCKET_LANDING", _str, "landing",
           "bucket the injectors land event files in"),
    Option("bucket_lake", "buckets.lake", "MILLPOND_BUCKET_LAKE", _str, "lake", "bucket of the Delta tables"),
    Option("bucket_reports", "buckets.reports", "MILLPOND_BUCKET_REPORTS", _str, "reports",
           "bucket reports and Data Docs are published to"),
    Option("table_root", "table_root", "MILLPOND_TABLE_ROOT", _str, "tables",
           "prefix of the Delta tables inside the lake bucket"),
    Option("retention_s", "retention", "MILLPOND_RETENTION", _positive_seconds, 7 * 86400.0,
           "how long a table's history is kept (the files newer versions replaced, the log): time travel, a "
           "reprocess and a lagging stage reach back this far; a pipeline's `retention:` may lengthen it"),
    Option("engine", "engine.name", "MILLPOND_ENGINE", _str, "local",
           "what runs a batch's per-key step: local (in-process, forked over the cores) or spark"),
    Option("engine_local_below", "engine.local_below", "MILLPOND_ENGINE_LOCAL_BELOW", _int, 0,
           "with engine spark: batches whose landing files hold fewer bytes run in-process (0: none do)"),
    Option("engine_one_task_below", "engine.one_task_below", "MILLPOND_ENGINE_ONE_TASK_BELOW", _int, 100_000,
           "with engine spark: a batch of fewer rows (its files' events, estimated from their size, plus its "
           "stored windows) runs as one Spark task, not a multi-stage plan (0: none does)"),
    Option("columnar_windows", "engine.columnar_windows", "MILLPOND_COLUMNAR_WINDOWS", _bool, True,
           "form and fire the windows of keys without stored state on columns (false: the per-element reference path)"),
    Option("driver_workers", "engine.driver_workers", "MILLPOND_DRIVER_WORKERS", _optional_int, None,
           "processes the local engine forks for a large chunk (auto: one per extra core; 0: none)"),
    Option("driver_min_range", "engine.driver_min_range", "MILLPOND_DRIVER_MIN_RANGE", _int, 20000,
           "smallest share of a chunk (in elements) worth a forked process"),
    Option("spark_master", "spark.master", "MILLPOND_SPARK_MASTER", _str, "local[*]",
           "master of the Spark Connect server (local[*], spark://host:port, k8s://...)"),
    Option("spark_connect", "spark.connect", "MILLPOND_SPARK_CONNECT", _str, "",
           "an existing Spark Connect endpoint (sc://host:port); empty: the stack's own server"),
    Option("spark_connect_token", "spark.connect_token", "MILLPOND_SPARK_CONNECT_TOKEN", _str, "",
           "the token Spark Connect clients pass and the stack's server requires (SPARK_CONNECT_AUTHENTICATE_TOKEN "
           "is honoured too); a secret: set the variable (e.g. from an Airflow connection), never the file; "
           "empty: `make up` generates one into <home>/spark/connect.token (mode 0600) for its own server"),
    Option("spark_connect_port", "spark.connect_port", "MILLPOND_SPARK_CONNECT_PORT", _int, 15002,
           "port of the stack's Spark Connect server on 127.0.0.1"),
    Option("spark_ui_port", "spark.ui_port", "MILLPOND_SPARK_UI_PORT", _int, 4040,
           "port of the Spark UI of the stack's Connect server"),
    Option("spark_timeout_s", "spark.timeout", "MILLPOND_SPARK_TIMEOUT", _seconds, 120.0,
           "longest the Spark Connect server may leave a probe unanswered while a batch runs on it: a frozen "
           "server fails the batch in about this long, in one line naming it"),
    Option("spark_shuffle_partitions", "spark.shuffle_partitions", "MILLPOND_SPARK_SHUFFLE_PARTITIONS", _int, 4,
           "partitions of a batch's shuffles (keys are hashed into them)"),
    Option("spark_driver_memory", "spark.driver_memory", "MILLPOND_SPARK_DRIVER_MEMORY", _str, "4g",
           "memory of the Spark driver"),
    Option("lease_ttl_s", "lease.ttl", "MILLPOND_LEASE_TTL", _seconds, 600.0,
           "how long a pipeline's lease outlives a writer that stopped renewing it"),
    Option("expectations_dir", "quality.expectations_dir", "MILLPOND_EXPECTATIONS_DIR", _str, "",
           "folder of the expectation suites (empty: expectations/ in the project)"),
    Option("dq_keep_results", "quality.keep_results", "MILLPOND_DQ_KEEP_RESULTS", _int, 100,
           "validation results kept per suite (older ones and their pages are pruned)"),
    Option("datadocs_assets", "quality.datadocs_assets", "MILLPOND_DATADOCS_ASSETS", _str, "",
           "installed CSS/JS for offline Data Docs (empty: var/datadocs-assets/node_modules)"),
    Option("freshness_hook", "quality.freshness_hook", "MILLPOND_FRESHNESS_HOOK", _str, "",
           "where freshness alerts go besides the log: module:function (called with pipeline, check, message, "
           "detail) or an http(s):// URL (POSTed as JSON); empty: the log only"),
    Option("s3_port", "embedded_store.s3_port", "MILLPOND_S3_PORT", _int, 8333, "embedded store: S3 port"),
    Option("weed_master_port", "embedded_store.master_port", "MILLPOND_WEED_MASTER_PORT", _int, 9333,
           "embedded store: master port"),
    Option("weed_volume_port", "embedded_store.volume_port", "MILLPOND_WEED_VOLUME_PORT", _int, 8080,
           "embedded store: volume port"),
    Option("weed_filer_port", "embedded_store.filer_port", "MILLPOND_WEED_FILER_PORT", _int, 8888,
           "embedded store: filer port"),
    Option("weed_webdav_port", "embedded_store.webdav_port", "MILLPOND_WEED_WEBDAV_PORT", _int, 7333,
           "embedded store: WebDAV port"),
    Option("weed_admin_port", "embedded_store.admin_port", "MILLPOND_WEED_ADMIN_PORT", _int, 23646,
           "embedded store: admin server port (its gRPC port is this + 10000; the admin UI stays off)"),
    Option("airflow_enabled", "airflow.enabled", "MILLPOND_AIRFLOW_ENABLED", _bool, True,
           "start the local Airflow with `make up`"),
    Option("airflow_port", "airflow.port", "MILLPOND_AIRFLOW_PORT", _int, 8280, "Airflow UI and REST API port"),
    Option("airflow_parallelism", "airflow.parallelism", "MILLPOND_AIRFLOW_PARALLELISM", _int, 2,
           "Airflow task slots (1-8; each pre-forks a worker)"),
    Option("airflow_refresh_interval", "airflow.refresh_interval", "MILLPOND_AIRFLOW_REFRESH_INTERVAL", _int, 5,
           "seconds between scans of the DAG folder"),
    Option("airflow_start_timeout", "airflow.start_timeout", "MILLPOND_AIRFLOW_START_TIMEOUT", _seconds, 180.0,
           "longest wait for the local Airflow to become healthy"),
    Option("airflow_paused_at_creation", "airflow.paused_at_creation", "MILLPOND_AIRFLOW_PAUSED_AT_CREATION", _bool,
           True, "new DAGs start paused (`make run` backfills, then unpauses)"),
    Option("airflow_scheduled_runs", "airflow.scheduled_runs", "MILLPOND_AIRFLOW_SCHEDULED_RUNS", _bool, True,
           "false: scheduled runs do nothing (manual runs and backfills still work)"),
    Option("airflow_task_timeout_s", "airflow.task_timeout", "MILLPOND_AIRFLOW_TASK_TIMEOUT", _seconds, 1800.0,
           "a DAG task running longer than this is stopped and retried"),
    Option("airflow_db_url", "airflow.db_url", "MILLPOND_AIRFLOW_DB_URL", _str, "",
           "Airflow metadata database (empty: SQLite under var/airflow)"),
    Option("demo", "demo", "MILLPOND_DEMO", _bool, False,
           "DAG runs land each pipeline's demo events before their batch"),
    Option("lineage_url", "lineage.url", "MILLPOND_OPENLINEAGE_URL", _str, "",
           "where the DAG runs' OpenLineage events go: an http(s):// endpoint or a file:// path (one event a "
           "line); empty: no events (unless Airflow's own [openlineage] transport is set)"),
)
#: environment-only settings: where the configuration itself lives
HOME_ENV, CONF_ENV = "MILLPOND_HOME", "MILLPOND_CONF_DIR"
_BY_PATH = {o.path: o for o in OPTIONS}


@dataclass(frozen=True)
class Settings:
    """Everything a job needs: where the lake is, how a batch runs, what the local stack listens on.

    Defaults live in ``OPTIONS`` only: build one with :func:`load_settings`."""

    home: Path
    conf_dir: Path
    s3_endpoint: str
    s3_region: str
    s3_access_key: str
    s3_secret_key: str
    store_timeout_s: float
    bucket_landing: str
    bucket_lake: str
    bucket_reports: str
    table_root: str
    retention_s: float
    engine: str
    engine_local_below: int
    engine_one_task_below: int
    columnar_windows: bool
    driver_workers: int | None
    driver_min_range: int
    spark_master: str
    spark_connect: str
    spark_connect_token: str = field(repr=False)  # a secret: kept out of reprs and logs
    spark_connect_port: int
    spark_ui_port: int
    spark_timeout_s: float
    spark_shuffle_partitions: int
    spark_driver_memory: str
    lease_ttl_s: float
    expectations_dir: str
    dq_keep_results: int
    datadocs_assets: str
    freshness_hook: str
    s3_port: int
    weed_master_port: int
    weed_volume_port: int
    weed_filer_port: int
    weed_webdav_port: int
    weed_admin_port: int
    airflow_enabled: bool
    airflow_port: int
    airflow_parallelism: int
    airflow_refresh_interval: int
    airflow_start_timeout: float
    airflow_paused_at_creation: bool
    airflow_scheduled_runs: bool
    airflow_task_timeout_s: float
    airflow_db_url: str
    demo: bool
    lineage_url: str
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def buckets(self) -> list[str]:
        return [self.bucket_landing, self.bucket_lake, self.bucket_reports]

    @property
    def weed_ports(self) -> dict[str, int]:
        return {"s3": self.s3_port, "master": self.weed_master_port, "volume": self.weed_volume_port,
                "filer": self.weed_filer_port, "webdav": self.weed_webdav_port, "admin": self.weed_admin_port}

    @property
    def workers(self) -> int:
        """Processes the local engine may fork: the setting, else one per extra core."""
        return self.driver_workers if self.driver_workers is not None else max(0, (os.cpu_count() or 1) - 1)

    @property
    def expectations_path(self) -> Path:
        return Path(self.expectations_dir) if self.expectations_dir else PROJECT_ROOT / "expectations"

    @property
    def datadocs_assets_path(self) -> Path:
        default = PROJECT_ROOT / "var" / "datadocs-assets" / "node_modules"
        return Path(self.datadocs_assets) if self.datadocs_assets else default

    @property
    def spark_connect_url(self) -> str:
        """Where a Spark Connect client connects: the configured endpoint, or the stack's own server."""
        return self.spark_connect or f"sc://127.0.0.1:{self.spark_connect_port}"

    def table_uri(self, pipeline: str, name: str) -> str:
        """Delta tables live at s3://<lake>/<root>/<pipeline>/<name>."""
        return f"s3://{self.bucket_lake}/{self.table_root}/{pipeline}/{name}"

    def with_overrides(self, **changes: Any) -> Settings:
        unknown = sorted(set(changes) - {f.name for f in fields(self)})
        if unknown:
            raise ConfigError(f"unknown setting(s) {', '.join(unknown)}")
        return replace(self, **changes)


def _flatten(doc: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in doc.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and not any(o.path == path for o in OPTIONS):
            out |= _flatten(value, path + ".")
        else:
            out[path] = value
    return out


def unknown_key_error(where: str, key: str, known: list[str]) -> ConfigError:
    """An unknown key, with the nearest valid one when there is a close match."""
    near = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f": did you mean {near[0]!r}?" if near else f" (known keys: {', '.join(sorted(known))})"
    return ConfigError(f"{where}: unknown key {key!r}{hint}")


def _parse(option: Option, value: Any, where: str) -> Any:
    try:
        return option.cast(value)
    except ValueError as exc:
        raise ConfigError(f"{where}: {option.path} = {value!r}: {exc}") from None


def load_settings(conf_dir: Path | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Settings from ``conf/millpond.yaml`` with environment overrides applied; strict about keys and types."""
    env = dict(os.environ) if env is None else dict(env)
    conf_dir = Path(env.get(CONF_ENV) or conf_dir or DEFAULT_CONF_DIR)
    path = conf_dir / "millpond.yaml"
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"{path} not found: set {CONF_ENV} to a folder holding millpond.yaml") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a mapping of settings")
    values: dict[str, Any] = {o.name: o.default for o in OPTIONS}
    for key, value in _flatten(doc).items():
        option = _BY_PATH.get(key)
        if option is None:
            raise unknown_key_error(str(path), key, list(_BY_PATH))
        if value is not None:
            values[option.name] = _parse(option, value, str(path))
    for option in OPTIONS:
        if option.env in env:
            values[option.name] = _parse(option, env[option.env], f"environment variable {option.env}")
    # Standard AWS variables are honoured too, after the Millpond-specific ones.
    if "MILLPOND_S3_ACCESS_KEY" not in env and "AWS_ACCESS_KEY_ID" in env:
        values["s3_access_key"] = env["AWS_ACCESS_KEY_ID"]
    if "MILLPOND_S3_SECRET_KEY" not in env and "AWS_SECRET_ACCESS_KEY" in env:
        values["s3_secret_key"] = env["AWS_SECRET_ACCESS_KEY"]
    if "MILLPOND_SPARK_CONNECT_TOKEN" not in env and env.get("SPARK_CONNECT_AUTHENTICATE_TOKEN"):
        values["spark_connect_token"] = env["SPARK_CONNECT_AUTHENTICATE_TOKEN"]  # Spark's own variable
    if "MILLPOND_S3_ENDPOINT" not in env and "MILLPOND_S3_PORT" in env:
        values["s3_endpoint"] = f"http://127.0.0.1:{values['s3_port']}"
    if not 1 <= values["airflow_parallelism"] <= 8:
        raise ConfigError(f"airflow.parallelism must be between 1 and 8 (got {values['airflow_parallelism']}): "
                          "each slot pre-forks a worker")
    if values["engine"] not in ("local", "spark"):
        raise ConfigError(f"engine.name = {values['engine']!r}: use local or spark")
    home = Path(env.get(HOME_ENV) or PROJECT_ROOT / "var")
    return Settings(home=home, conf_dir=conf_dir, **values)
