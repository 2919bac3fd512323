"""One configuration object for the whole product.

Read from ``conf/millpond.yaml`` and overridden by environment variables, so the same code runs on
the embedded stack (local-dev defaults) and on a cluster (secrets from the environment or an
Airflow connection, never from the repository).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONF_DIR = PROJECT_ROOT / "conf"


@dataclass(frozen=True)
class Settings:
    """Everything a job needs to reach the lakehouse."""

    s3_endpoint: str
    s3_region: str
    s3_access_key: str
    s3_secret_key: str
    bucket_landing: str
    bucket_lake: str
    bucket_reports: str
    table_root: str
    spark_master: str
    spark_shuffle_partitions: int
    home: Path
    conf_dir: Path
    weed_ports: dict[str, int] = field(default_factory=dict)

    @property
    def buckets(self) -> list[str]:
        return [self.bucket_landing, self.bucket_lake, self.bucket_reports]

    def table_uri(self, pipeline: str, name: str) -> str:
        """Delta tables live at s3://<lake>/<root>/<pipeline>/<name>."""
        return f"s3://{self.bucket_lake}/{self.table_root}/{pipeline}/{name}"

    def with_overrides(self, **changes: Any) -> Settings:
        return replace(self, **changes)


# (environment variable, yaml path, caster)
_ENV: dict[str, tuple[str, tuple[str, ...], type]] = {
    "s3_endpoint": ("MILLPOND_S3_ENDPOINT", ("object_store", "endpoint"), str),
    "s3_region": ("MILLPOND_S3_REGION", ("object_store", "region"), str),
    "s3_access_key": ("MILLPOND_S3_ACCESS_KEY", ("object_store", "access_key"), str),
    "s3_secret_key": ("MILLPOND_S3_SECRET_KEY", ("object_store", "secret_key"), str),
    "bucket_landing": ("MILLPOND_BUCKET_LANDING", ("buckets", "landing"), str),
    "bucket_lake": ("MILLPOND_BUCKET_LAKE", ("buckets", "lake"), str),
    "bucket_reports": ("MILLPOND_BUCKET_REPORTS", ("buckets", "reports"), str),
    "table_root": ("MILLPOND_TABLE_ROOT", ("table_root",), str),
    "spark_master": ("MILLPOND_SPARK_MASTER", ("spark", "master"), str),
    "spark_shuffle_partitions": (
        "MILLPOND_SPARK_SHUFFLE_PARTITIONS",
        ("spark", "shuffle_partitions"),
        int,
    ),
}
_PORTS = {
    "s3": ("MILLPOND_S3_PORT", "s3_port"),
    "master": ("MILLPOND_WEED_MASTER_PORT", "master_port"),
    "volume": ("MILLPOND_WEED_VOLUME_PORT", "volume_port"),
    "filer": ("MILLPOND_WEED_FILER_PORT", "filer_port"),
    "webdav": ("MILLPOND_WEED_WEBDAV_PORT", "webdav_port"),
}


def _dig(doc: dict[str, Any], path: tuple[str, ...]) -> Any:
    node: Any = doc
    for part in path:
        node = node[part]
    return node


def load_settings(conf_dir: Path | None = None, env: dict[str, str] | None = None) -> Settings:
    """Settings from ``conf/millpond.yaml`` with environment overrides applied."""
    env = dict(os.environ) if env is None else env
    conf_dir = Path(env.get("MILLPOND_CONF_DIR", conf_dir or DEFAULT_CONF_DIR))
    doc = yaml.safe_load((conf_dir / "millpond.yaml").read_text())
    values: dict[str, Any] = {}
    for name, (var, path, cast) in _ENV.items():
        values[name] = cast(env[var]) if var in env else cast(_dig(doc, path))
    # Standard AWS variables are honoured too, after the Millpond-specific ones.
    if "MILLPOND_S3_ACCESS_KEY" not in env and "AWS_ACCESS_KEY_ID" in env:
        values["s3_access_key"] = env["AWS_ACCESS_KEY_ID"]
    if "MILLPOND_S3_SECRET_KEY" not in env and "AWS_SECRET_ACCESS_KEY" in env:
        values["s3_secret_key"] = env["AWS_SECRET_ACCESS_KEY"]
    store = doc.get("embedded_store", {})
    ports = {k: int(env.get(var, store.get(key, 0))) for k, (var, key) in _PORTS.items()}
    if "MILLPOND_S3_ENDPOINT" not in env and "MILLPOND_S3_PORT" in env:
        values["s3_endpoint"] = f"http://127.0.0.1:{ports['s3']}"
    home = Path(env.get("MILLPOND_HOME", PROJECT_ROOT / "var"))
    return Settings(**values, home=home, conf_dir=conf_dir, weed_ports=ports)
