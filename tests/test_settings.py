"""Settings are strict and listed once: unknown keys suggest the nearest one, wrong types name the key and the
expected form, the environment wins over the file, and docs/settings.md lists every setting with its default."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
from millpond.config import load_settings
from millpond.config.settings import OPTIONS, ConfigError, Settings

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def _conf(tmp_path: Path, text: str) -> Path:
    (tmp_path / "millpond.yaml").write_text(text)
    return tmp_path


def test_shipped_configuration_loads_with_its_defaults() -> None:
    s = load_settings(env={})
    assert s.bucket_lake == "lake" and s.engine in ("local", "spark") and s.lease_ttl_s > 0
    assert s.weed_ports["s3"] == s.s3_port


def test_unknown_key_suggests_the_nearest(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'engine\.nmae': did you mean 'engine\.name'\?"):
        load_settings(_conf(tmp_path, "engine:\n  nmae: spark\n"), env={})
    with pytest.raises(ConfigError, match="unknown key 'colour'.*known keys"):
        load_settings(_conf(tmp_path, "colour: blue\n"), env={})


def test_wrong_type_names_the_key_and_the_form(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"spark\.shuffle_partitions = 'four': expected an integer"):
        load_settings(_conf(tmp_path, "spark:\n  shuffle_partitions: four\n"), env={})
    with pytest.raises(ConfigError, match=r"MILLPOND_LEASE_TTL: lease\.ttl = 'soon': expected a duration"):
        load_settings(_conf(tmp_path, "lease:\n  ttl: 1m\n"), env={"MILLPOND_LEASE_TTL": "soon"})
    with pytest.raises(ConfigError, match="engine.name = 'flink': use local or spark"):
        load_settings(_conf(tmp_path, "engine:\n  name: flink\n"), env={})


def test_environment_wins_and_durations_parse(tmp_path: Path) -> None:
    conf = _conf(tmp_path, "lease:\n  ttl: 1m\nengine:\n  name: local\n  columnar_windows: false\n")
    s = load_settings(conf, env={})
    assert s.lease_ttl_s == 60.0 and s.columnar_windows is False and s.engine == "local"
    s = load_settings(conf, env={"MILLPOND_LEASE_TTL": "90", "MILLPOND_ENGINE": "spark",
                                 "AWS_ACCESS_KEY_ID": "from-aws"})
    assert s.lease_ttl_s == 90.0 and s.engine == "spark" and s.s3_access_key == "from-aws"
    assert s.with_overrides(driver_workers=0).workers == 0
    with pytest.raises(ConfigError, match="unknown setting"):
        s.with_overrides(no_such_setting=1)


def test_every_setting_is_declared_once_and_documented() -> None:
    declared = [o.name for o in OPTIONS]
    assert len(declared) == len(set(declared)) and len({o.env for o in OPTIONS}) == len(OPTIONS)
    assert set(declared) == {f.name for f in fields(Settings)} - {"home", "conf_dir", "extra"}
    docs = (ROOT / "docs" / "settings.md").read_text()
    missing = [o.path for o in OPTIONS if f"`{o.path}`" not in docs or f"`{o.env}`" not in docs]
    assert not missing, f"docs/settings.md lacks {missing}"


def test_the_documented_engine_default_is_the_shipped_one() -> None:
    """docs/settings.md gives the engine a deployment gets: the shipped file's, then the code's when a file has none."""
    docs = (ROOT / "docs" / "settings.md").read_text()
    default = next(line for line in docs.splitlines() if line.startswith("| `engine.name` |")).split(" | ")[2]
    shipped, bare = load_settings(env={}).engine, next(o.default for o in OPTIONS if o.name == "engine")
    assert default.startswith(f"`{shipped}` (the shipped `conf/millpond.yaml`") and f"`{bare}` in a file" in default


def test_nothing_reads_millpond_variables_at_import_time() -> None:
    """Module-level reads of MILLPOND_* would freeze a setting before the settings object exists."""
    import ast

    offenders = []
    for path in (ROOT / "jobs" / "millpond").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign | ast.AnnAssign) and "MILLPOND_" in ast.unparse(node) and \
                    "environ" in ast.unparse(node):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders


@pytest.mark.parametrize("timeout", ["5s", "2m"])
def test_object_store_timeout_bounds_every_client_with_its_retries(tmp_path: Path, timeout: str) -> None:
    """One setting bounds a store call of each client, attempts x per-attempt wait (backoff fits in the rest)."""
    from millpond.lake.delta_options import storage_options
    from millpond.lake.lease import s3_client
    from millpond.lake.objectstore import client
    from millpond.lake.waits import ATTEMPTS, StoreWait

    s = load_settings(env={"MILLPOND_S3_TIMEOUT": timeout})
    total = s.store_timeout_s
    wait = StoreWait.of(s)
    assert ATTEMPTS * (wait.connect + wait.read) <= 0.9 * total + 1e-9 and wait.connect <= 3
    http = client(s)._http
    assert http.connection_pool_kw["timeout"].read_timeout == pytest.approx(wait.read)
    assert http.connection_pool_kw["retries"].total + 1 == ATTEMPTS
    opts = storage_options(s)
    assert float(opts["timeout"].rstrip("s")) * (int(opts["max_retries"]) + 1) <= 0.9 * total + 1e-3
    config = s3_client(s).meta.config
    assert config.read_timeout + config.connect_timeout == pytest.approx(wait.attempt)
    assert config.retries["total_max_attempts"] == ATTEMPTS
