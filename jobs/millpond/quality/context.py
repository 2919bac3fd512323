"""The Great Expectations context Millpond validates with: get-or-create, stored under ``settings.home/gx``,
its suites read from the committed JSON under ``expectations/``; results pruned to the newest few per suite."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from millpond.config import Settings
from millpond.errors import MillpondError
from millpond.quality import suites as qs

log = logging.getLogger(__name__)

SITE = "millpond"
DATASOURCE = "millpond_pandas"
SPARK_DATASOURCE = "millpond_spark"
PANDAS, SPARK = "pandas", "spark"
BATCH_DEFINITION = "whole_dataframe"
DEFAULT_KEEP = 100

_LOCK = threading.RLock()  # GX is not thread-safe: one validation at a time per process
_CONTEXTS: dict[Path, Any] = {}
_SPARK_READY: set[Path] = set()  # homes whose cached context has the Spark checkpoints


# -- context -----------------------------------------------------------------------------------
def gx_root(settings: Settings) -> Path:
    return Path(settings.home) / "gx"


def site_dir(settings: Settings) -> Path:
    return gx_root(settings) / "data_docs"


def keep_results(settings: Settings) -> int:
    return max(1, settings.dq_keep_results)


@contextlib.contextmanager
def file_lock(settings: Settings) -> Iterator[None]:
    """Serialise GX store writes between processes that share ``settings.home``."""
    root = gx_root(settings)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".millpond.lock", "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _desired_config(settings: Settings) -> dict[str, Any]:
    def fs(base: str, **extra: Any) -> dict[str, Any]:
        return {"class_name": "TupleFilesystemStoreBackend", "base_directory": base, **extra}

    return {
        "config_version": 4,
        "plugins_directory": None,
        "stores": {
            # The reviewed suites, committed in the repository (absolute path: runtime files live elsewhere).
            "expectations_store": {
                "class_name": "ExpectationsStore",
                "store_backend": fs(str(settings.expectations_path), suppress_store_backend_id=True)},
            "validation_results_store": {"class_name": "ValidationResultsStore",
                                         "store_backend": fs("validations/", suppress_store_backend_id=True)},
            "checkpoint_store": {"class_name": "CheckpointStore",
                                 "store_backend": fs("checkpoints/", suppress_store_backend_id=True)},
            "validation_definition_store": {"class_name": "ValidationDefinitionStore",
                                            "store_backend": fs("validation_definitions/",
                                                                suppress_store_backend_id=True)},
        },
        "expectations_store_name": "expectations_store",
        "validation_results_store_name": "validation_results_store",
        "checkpoint_store_name": "checkpoint_store",
        "data_docs_sites": {
            SITE: {
                "class_name": "SiteBuilder",
                "show_how_to_buttons": False,
                "store_backend": fs("data_docs/"),
                "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
            }
        },
        "analytics_enabled": False,
        "progress_bars": {"globally": False, "metric_calculations": False},
    }


def _write_config(root: Path, settings: Settings) -> None:
    """Write ``great_expectations.yml`` only when our part of it differs (keeps datasources GX added)."""
    path = root / "great_expectations.yml"
    current: dict[str, Any] = yaml.safe_load(path.read_text()) if path.exists() else {}
    desired = {**(current or {}), **_desired_config(settings)}
    if current != desired:
        path.write_text(yaml.safe_dump(desired, sort_keys=False))


def _ensure_suite(context: Any, name: str) -> Any:
    """The committed suite; created from :mod:`quality_suites` only if it is missing."""
    import great_expectations as gx
    from great_expectations.expectations.expectation_configuration import ExpectationConfiguration

    try:
        return context.suites.get(name)
    except Exception:  # noqa: BLE001 - GX raises DataContextError subclasses for "not found"
        pass
    suite = gx.ExpectationSuite(name=name, meta={"owner": "millpond", "notes": qs.__doc__.splitlines()[0]})
    for spec in qs.suite_definitions()[name]:
        config = ExpectationConfiguration(type=spec["type"], kwargs=spec["kwargs"], meta=spec["meta"],
                                          severity=spec["meta"]["severity"])
        suite.add_expectation_configuration(config)
    return context.suites.add(suite)


def checkpoint_name(suite_name: str, engine: str = PANDAS) -> str:
    """The checkpoint validating ``suite_name`` on pandas frames or (``SPARK``) on Spark DataFrames."""
    return f"{suite_name}_checkpoint" if engine == PANDAS else f"{suite_name}_{engine}_checkpoint"


def _ensure_checkpoint(context: Any, suite_name: str, engine: str = PANDAS) -> Any:
    """Get-or-create the checkpoint, its validation definition and its datasource's dataframe asset.

    The Spark datasource does not persist batches (GX's default persists each one and never unpersists)
    and is given no ``spark_config`` (GX could restart the session): it uses the process's session, a
    classic one or a Spark Connect client's. GX opens that session when the datasource is added, so it
    is added on the first Spark validation, not with the context."""
    import great_expectations as gx

    name = checkpoint_name(suite_name, engine)
    try:
        return context.checkpoints.get(name)
    except Exception:  # noqa: BLE001
        pass
    source_name = DATASOURCE if engine == PANDAS else SPARK_DATASOURCE
    try:
        source = context.data_sources.get(source_name)
    except Exception:  # noqa: BLE001
        source = (context.data_sources.add_pandas(source_name) if engine == PANDAS
                  else context.data_sources.add_spark(source_name, persist=False))
    try:
        asset = source.get_asset(suite_name)
    except LookupError:
        asset = source.add_dataframe_asset(suite_name)
    try:
        batch_definition = asset.get_batch_definition(BATCH_DEFINITION)
    except (KeyError, LookupError):
        batch_definition = asset.add_batch_definition_whole_dataframe(BATCH_DEFINITION)
    vd_name = f"{suite_name}_validation" if engine == PANDAS else f"{suite_name}_{engine}_validation"
    try:
        definition = context.validation_definitions.get(vd_name)
    except Exception:  # noqa: BLE001
        definition = context.validation_definitions.add(
            gx.ValidationDefinition(name=vd_name, data=batch_definition, suite=context.suites.get(suite_name)))
    return context.checkpoints.add(gx.Checkpoint(
        name=name, validation_definitions=[definition], actions=[],
        result_format={"result_format": "SUMMARY", "partial_unexpected_count": 5}))


def get_context(settings: Settings, engine: str = PANDAS) -> Any:
    """The project's file GX context (cached per home): config, suites, datasources, checkpoints.

    ``engine=SPARK`` also makes sure of the Spark checkpoints; the first time in a process the context is
    read again under the file lock, so a datasource another process added meanwhile is seen, not re-added."""
    root = gx_root(settings)
    with _LOCK:
        context = _CONTEXTS.get(root)
        if context is not None and (engine == PANDAS or root in _SPARK_READY):
            return context
        if not settings.expectations_path.is_dir():
            raise MillpondError(f"expectation suites folder missing: {settings.expectations_path}")
        for name in ("great_expectations", "great_expectations.core.usage_statistics"):
            logging.getLogger(name).setLevel(logging.WARNING)
        with file_lock(settings):
            context = _load(root, settings)
            if engine == SPARK:
                for suite in qs.SUITES:
                    _ensure_checkpoint(context, suite, SPARK)
                _SPARK_READY.add(root)
        _CONTEXTS[root] = context
        return context


def warm_context(settings: Settings, engine: str = SPARK) -> None:
    """Load the context (``engine``'s checkpoints ready) in a background thread, so a batch's validation finds
    it loaded.

    Why: the load is 0.1-0.5 s of Python (YAML, stores, checkpoints) that a task's process pays once, and the
    batch's own thread spends the time before validation waiting on Spark jobs (a first Spark load also adds the
    Spark datasource, which finds the process's default session from any thread; the one-task form validates on
    pandas, after its one Spark job). A failed load is only logged: the validation loads the context again and
    reports what went wrong."""
    root = gx_root(settings)
    if root in _SPARK_READY or (engine == PANDAS and root in _CONTEXTS):
        return

    def load() -> None:
        try:
            get_context(settings, engine)
        except Exception as exc:  # noqa: BLE001 - the validation's own load reports it
            log.debug("Great Expectations context not loaded ahead: %s", exc)

    threading.Thread(target=load, name="gx-context", daemon=True).start()


def _load(root: Path, settings: Settings) -> Any:
    import great_expectations as gx

    _write_config(root, settings)
    context = gx.get_context(mode="file", project_root_dir=str(root.parent))
    for suite in qs.SUITES:
        _ensure_suite(context, suite)
        _ensure_checkpoint(context, suite)
    return context


def validation_result_path(settings: Settings, vrid: Any) -> Path:
    return gx_root(settings) / "validations" / Path(*vrid.to_tuple()).with_suffix(".json")


def validation_page_path(settings: Settings, vrid: Any) -> Path:
    return site_dir(settings) / "validations" / Path(*vrid.to_tuple()).with_suffix(".html")


def prune_results(context: Any, settings: Settings, keep: int) -> int:
    """Delete all but the newest ``keep`` validation results (and their pages) of each suite."""
    store = context.validation_results_store
    by_suite: dict[str, list[Any]] = {}
    for key in store.list_keys():
        by_suite.setdefault(key.expectation_suite_identifier.name, []).append(key)
    removed = 0
    for keys in by_suite.values():
        keys.sort(key=lambda k: k.run_id.run_time)
        for key in keys[: max(0, len(keys) - keep)]:
            store.remove_key(key)
            page = validation_page_path(settings, key)
            page.unlink(missing_ok=True)
            for path in (validation_result_path(settings, key), page):
                _remove_empty_parents(path.parent, stop=gx_root(settings))
            removed += 1
    return removed


def _remove_empty_parents(folder: Path, stop: Path) -> None:
    while folder != stop and stop in folder.parents:
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent
