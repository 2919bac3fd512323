"""OpenLineage for every DAG run: which datasets its batch read and wrote, with the batch's facts.

The mechanism is the OpenLineage provider's (``apache-airflow-providers-openlineage``): its listener runs in
every task's process and emits START when the task starts, COMPLETE when it succeeds and FAIL when it fails,
asking the task's operator for ``get_openlineage_facets_on_start/on_complete/on_failure``. The ``microbatch``
task is a TaskFlow task whose operator (:class:`MicrobatchOperator`, made by :func:`microbatch_task`) answers:

- inputs: the pipeline's landing prefix (``s3://<landing bucket>/<source prefix>``), or, for a stage, its
  upstream pipelines' ``panes`` tables;
- outputs: the pipeline's published Delta tables (``panes``, ``current``, ``batches``: its Assets);
- run facets ``millpond_batch`` (pipeline, batch, processing time, watermark, counts, skipped) and
  ``millpond_quality`` (validated, ok, summary, warnings) on COMPLETE; on FAIL ``millpond_batch`` holds the
  error and ``millpond_quality`` says whether critical data-quality checks stopped the batch.

The provider adds the parent-run facet (the DAG run) and its own Airflow facets to every event. The batch's
Spark session gets the provider's parent properties (``spark.openlineage.parentJobNamespace``,
``parentJobName``, ``parentRunId`` and the root ones) as session confs, so a Spark with the OpenLineage
listener jar links its job's events to this task's run. A batch the Spark engine ran also gets its own Spark
job's START and COMPLETE (or FAIL) from this process (:func:`emit_spark_job`): the job
``<task's job>.spark_batch``, integration SPARK, its parent this task's run and its root the DAG run, with the
batch's datasets, the engine's strategy and Spark's version. The listener jar comes from Maven, which a
deployment without it (this project's own stack) cannot load; its per-query events, where a cluster has it,
come in addition under the same parent.

Off unless configured: ``lineage.url`` (``MILLPOND_OPENLINEAGE_URL``) turns it on for the stack's Airflow
(:func:`airflow_env`); a deployment may instead give the provider its own configuration
(``AIRFLOW__OPENLINEAGE__TRANSPORT``, ``OPENLINEAGE_URL``). Without either, the provider is disabled: no
event, nothing to pay. This module imports neither Airflow nor OpenLineage at import time (DAG parsing).
"""

from __future__ import annotations

import functools
import json
import logging
from datetime import UTC, datetime
from typing import Any

import yaml

log = logging.getLogger(__name__)

#: the tables a batch publishes (the DAG's Assets): its lineage outputs
OUTPUT_TABLES = ("panes", "current", "batches")
QUALITY_STOP = "failed critical data-quality checks"


def transport(url: str) -> dict[str, Any] | None:
    """The provider's transport for ``lineage.url``: http(s):// posts events to an OpenLineage endpoint
    (e.g. Marquez: ``http://marquez:5000``, events go to ``/api/v1/lineage``); ``file://<path>`` (or a plain
    path) appends them to a file, one JSON event a line; empty: none (lineage off)."""
    url = (url or "").strip()
    if not url:
        return None
    if url.startswith(("http://", "https://")):
        return {"type": "http", "url": url}
    path = url.removeprefix("file://")
    return {"type": "file", "log_file_path": path, "append": True}


def airflow_env(settings) -> dict[str, str]:
    """What the stack's Airflow processes need for lineage: the provider's transport (none when off)."""
    config = transport(getattr(settings, "lineage_url", ""))
    return {} if config is None else {"AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps(config)}


def enabled() -> bool:
    """Whether the provider emits events in this process (its own check: a transport is configured)."""
    try:
        from airflow.providers.openlineage import conf
    except ImportError:
        return False
    return not conf.is_disabled()


# ------------------------------------------------------------------------------------------------
# Datasets
# ------------------------------------------------------------------------------------------------
def _s3(uri: str) -> tuple[str, str]:
    """OpenLineage's S3 naming: namespace ``s3://<bucket>``, name the key (no trailing slash)."""
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return f"s3://{bucket}", key.rstrip("/")


def datasets(info, settings) -> dict[str, list[tuple[str, str]]]:
    """The run's inputs and outputs as (namespace, name): from the pipeline file, without loading the spec."""
    if info.upstreams:
        inputs = [_s3(settings.table_uri(u, "panes")) for u in info.upstreams]
    else:
        doc = yaml.safe_load(info.path.read_text()) or {}
        source = doc.get("source") if isinstance(doc.get("source"), dict) else {}
        prefix = str(source.get("prefix") or f"{info.name}/")
        inputs = [(f"s3://{settings.bucket_landing}", prefix.rstrip("/"))]
    outputs = [_s3(settings.table_uri(info.name, t)) for t in OUTPUT_TABLES]
    return {"inputs": inputs, "outputs": outputs, "pipeline": info.name}


# ------------------------------------------------------------------------------------------------
# Facets
# ------------------------------------------------------------------------------------------------
@functools.cache
def _facets():
    import attr
    from openlineage.client.facet_v2 import RunFacet

    schema = "https://github.com/millpond/millpond/blob/main/docs/deploy.md#lineage"

    @attr.define
    class MillpondBatchRunFacet(RunFacet):
        """The batch: pipeline, number, processing time, watermark, counts (or the error that stopped it)."""

        pipeline: str
        batch: int | None = None
        processingTime: str | None = None  # noqa: N815 - OpenLineage facets are camelCase
        watermark: str | None = None
        counts: dict[str, int] = attr.field(factory=dict)
        skipped: bool = False
        error: str | None = None
        #: the engine and strategy that ran it (``spark/plan``, ``spark/one-task``, ``local/in-process``)
        engine: str | None = None

        @staticmethod
        def _get_schema() -> str:
            return schema + "-batch"

    @attr.define
    class MillpondQualityRunFacet(RunFacet):
        """The batch's data-quality outcome (Great Expectations, run inside the batch)."""

        validated: bool
        ok: bool | None = None
        summary: str | None = None
        warnings: list[str] = attr.field(factory=list)

        @staticmethod
        def _get_schema() -> str:
            return schema + "-quality"

    return MillpondBatchRunFacet, MillpondQualityRunFacet


def run_facets(pipeline: str, summary: dict[str, Any] | None, error: BaseException | None = None) -> dict:
    """``millpond_batch`` and ``millpond_quality`` for a finished batch (its summary) or a failed one."""
    batch_facet, quality_facet = _facets()
    summary = summary or {}
    quality = summary.get("quality") or {}
    counts = {str(k): int(v) for k, v in (summary.get("counts") or {}).items() if isinstance(v, int | float)}
    batch = batch_facet(pipeline=pipeline, batch=summary.get("batch"), processingTime=summary.get("processing_time"),
                        watermark=summary.get("watermark"), counts=counts, skipped=bool(summary.get("skipped")),
                        error=None if error is None else str(error)[:1000], engine=summary.get("engine") or None)
    if error is not None and QUALITY_STOP in str(error):
        checks = quality_facet(validated=True, ok=False, summary=str(error)[:1000])
    elif error is not None or not quality.get("validated"):
        checks = quality_facet(validated=False)
    else:
        checks = quality_facet(validated=True, ok=bool(quality.get("ok")), summary=quality.get("summary"),
                               warnings=[str(w) for w in quality.get("warnings") or []][:20])
    return {"millpond_batch": batch, "millpond_quality": checks}


# ------------------------------------------------------------------------------------------------
# The operator and its decorator
# ------------------------------------------------------------------------------------------------
@functools.cache
def operator_class():
    """The ``microbatch`` task's operator: Airflow's TaskFlow operator that also answers the provider's
    ``get_openlineage_facets_on_*`` (its listener finds them by name; see the module's docstring)."""
    from airflow.providers.standard.decorators.python import _PythonDecoratedOperator

    class MicrobatchOperator(_PythonDecoratedOperator):
        def __init__(self, *, lineage: dict[str, Any] | None = None, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.lineage = lineage or {"inputs": [], "outputs": [], "pipeline": ""}
            self.lineage_summary: dict[str, Any] | None = None
            self.lineage_error: BaseException | None = None

        def execute(self, context: Any) -> Any:
            try:
                result = super().execute(context)
            except BaseException as exc:
                self.lineage_error = exc
                raise
            self.lineage_summary = result if isinstance(result, dict) else None
            return result

        def _operator_lineage(self, facets: dict | None = None):
            from airflow.providers.openlineage.extractors import OperatorLineage
            from openlineage.client.event_v2 import InputDataset, OutputDataset

            return OperatorLineage(inputs=[InputDataset(namespace=n, name=k) for n, k in self.lineage["inputs"]],
                                   outputs=[OutputDataset(namespace=n, name=k) for n, k in self.lineage["outputs"]],
                                   run_facets=facets or {})

        def get_openlineage_facets_on_start(self):
            return self._operator_lineage()

        def get_openlineage_facets_on_complete(self, task_instance):
            return self._operator_lineage(run_facets(self.lineage["pipeline"], self.lineage_summary))

        def get_openlineage_facets_on_failure(self, task_instance):
            error = self.lineage_error or RuntimeError("the task failed")
            return self._operator_lineage(run_facets(self.lineage["pipeline"], self.lineage_summary, error))

    MicrobatchOperator.__module__, MicrobatchOperator.__qualname__ = __name__, "MicrobatchOperator"
    return MicrobatchOperator


def microbatch_task(**kwargs: Any):
    """``@task(...)`` whose operator is :class:`MicrobatchOperator`; ``lineage=`` is :func:`datasets`."""
    from airflow.sdk.bases.decorator import task_decorator_factory

    return task_decorator_factory(decorated_operator_class=operator_class(), **kwargs)


def tag_spark(spark: Any, context: dict[str, Any]) -> dict[str, str]:
    """Give the batch's Spark session the provider's parent-run properties (the task's job and run, and the
    DAG run's as root), so the Spark OpenLineage listener, where the cluster has it, makes this task its
    parent. The provider's helper fills a spark-submit property dict; a Spark Connect session takes them as
    session confs. Nothing when lineage is off or there is no session; never fails the batch."""
    if spark is None or not enabled():
        return {}
    try:
        from airflow.providers.openlineage.utils.spark import inject_parent_job_information_into_spark_properties

        properties = inject_parent_job_information_into_spark_properties({}, context)
    except Exception as exc:  # noqa: BLE001 - lineage must never fail a batch
        log.warning("OpenLineage parent properties not computed (%s): Spark's events will have no parent", exc)
        return {}
    done = {}
    for key, value in properties.items():
        try:
            spark.conf.set(key, str(value))
            done[key] = str(value)
        except Exception as exc:  # noqa: BLE001 - a server that refuses a conf keeps its batch
            log.warning("Spark session refused %s (%s): set it on the server to link Spark's events", key, exc)
    return done


# ------------------------------------------------------------------------------------------------
# The Spark job's own events
# ------------------------------------------------------------------------------------------------
#: the batch's Spark job: the task's job name with this suffix
SPARK_JOB_SUFFIX = ".spark_batch"


def spark_job_events(confs: dict[str, str], io: dict[str, Any], started: datetime, ended: datetime,
                     summary: dict[str, Any] | None = None, error: BaseException | None = None,
                     spark_version: str = "") -> list:
    """START and COMPLETE (FAIL with ``error``) of the batch's Spark job: its parent the task's run and its root
    the DAG run, as ``confs`` (what :func:`tag_spark` set) name them; ``io``: :func:`datasets`."""
    from airflow.providers.openlineage.utils.utils import _PRODUCER
    from openlineage.client.event_v2 import InputDataset, Job, OutputDataset, Run, RunEvent, RunState
    from openlineage.client.facet_v2 import error_message_run, job_type_job, parent_run, processing_engine_run
    from openlineage.client.uuid import generate_new_uuid

    namespace, parent_name = confs["spark.openlineage.parentJobNamespace"], confs["spark.openlineage.parentJobName"]
    root = parent_run.Root(run=parent_run.RootRun(runId=confs["spark.openlineage.rootParentRunId"]),
                           job=parent_run.RootJob(namespace=confs.get("spark.openlineage.rootParentJobNamespace",
                                                                      namespace),
                                                  name=confs["spark.openlineage.rootParentJobName"]))
    parent = parent_run.ParentRunFacet(run=parent_run.Run(runId=confs["spark.openlineage.parentRunId"]),
                                       job=parent_run.Job(namespace=namespace, name=parent_name), root=root)
    job = Job(namespace=namespace, name=parent_name + SPARK_JOB_SUFFIX,
              facets={"jobType": job_type_job.JobTypeJobFacet(processingType="BATCH", integration="SPARK",
                                                              jobType="JOB")})
    run_id = str(generate_new_uuid(started))
    base = {"parent": parent,
            "processing_engine": processing_engine_run.ProcessingEngineRunFacet(version=spark_version or "unknown",
                                                                                name="spark")}
    end = {"millpond_batch": run_facets(io["pipeline"], summary, error)["millpond_batch"]}
    if error is not None:
        end["errorMessage"] = error_message_run.ErrorMessageRunFacet(message=str(error)[:1000],
                                                                    programmingLanguage="PYTHON")
    inputs = [InputDataset(namespace=n, name=k) for n, k in io["inputs"]]
    outputs = [OutputDataset(namespace=n, name=k) for n, k in io["outputs"]]
    return [RunEvent(eventType=state, eventTime=when.isoformat(), job=job, inputs=inputs, outputs=outputs,
                     run=Run(runId=run_id, facets=facets), producer=_PRODUCER)
            for state, when, facets in ((RunState.START, started, base),
                                        (RunState.FAIL if error is not None else RunState.COMPLETE, ended,
                                         {**base, **end}))]


def emit_spark_job(confs: dict[str, str], io: dict[str, Any], started: datetime,
                   summary: dict[str, Any] | None = None, error: BaseException | None = None,
                   spark: Any = None) -> int:
    """Emit the batch's Spark job events through the provider's client (its transport, its redaction), when
    lineage tagged the session (``confs``) and the batch ran on Spark (its summary's engine; a failed batch:
    the session was there). How many went out; never fails the batch."""
    if not confs or (error is None and not str((summary or {}).get("engine", "")).startswith("spark")):
        return 0
    try:
        from airflow.providers.openlineage.plugins.listener import get_openlineage_listener

        adapter = get_openlineage_listener().adapter
        # the server's Spark (a round trip) after a batch that ran; after a failure (perhaps the server's) no call
        # that could wait on it: the client library's version
        version = str(spark.version) if spark is not None and error is None else _client_spark_version()
        events = spark_job_events(confs, io, started, datetime.now(UTC), summary, error, version)
        for event in events:
            adapter.emit(event)
    except Exception as exc:  # noqa: BLE001 - lineage must never fail a batch
        log.warning("the Spark job's OpenLineage events were not sent (%s)", exc)
        return 0
    return len(events)


def _client_spark_version() -> str:
    try:
        from importlib.metadata import version

        return version("pyspark")
    except Exception:  # noqa: BLE001 - a facet's detail
        return ""
