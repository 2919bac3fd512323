"""Airflow's scheduler with the libraries a pipeline's task imports already loaded: ``python -m
millpond.orchestration.airflow_preload scheduler ...`` (how ``AirflowStack`` starts it).

Why: on Linux the LocalExecutor forks its workers from the scheduler, and each task's process from a worker,
so what the scheduler imported before its executor started is in every task's process at no cost. A task
otherwise spends seconds importing Great Expectations, pandas, pyarrow, delta-rs and minio before its batch
validates (Great Expectations alone: 3-9 s on two busy cores), many times what a 1k-event batch takes.
Only third-party libraries are loaded (and boto3's S3 model, :mod:`millpond.lake.s3_model`), and none of them
starts a thread: Millpond's own modules are still imported by each task, so an edited pipeline or engine
takes effect at the next run, as before (a library upgrade needs an Airflow restart, as any install does); the
stack caches their bytecode when it starts (:mod:`millpond.orchestration.bytecode`).
"""

from __future__ import annotations

import importlib
import sys

#: what a batch's task imports that costs the most (measured with ``python -X importtime``)
PRELOAD = ("pyarrow", "pyarrow.compute", "pyarrow.json", "pandas", "deltalake", "minio", "great_expectations", "boto3")


def preload(modules: tuple[str, ...] = PRELOAD) -> list[str]:
    """Import ``modules``; return those that failed (a missing library is the task's error to report)."""
    failed = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the scheduler must start whatever a library does on import
            failed.append(name)
    return failed


def preload_task_libraries() -> list[str]:
    """What the scheduler holds before its executor forks a task's process: :data:`PRELOAD` imported and boto3's S3
    model loaded. The bench's clients that stand for a DAG task (``bench.connect_client``'s ``preload``) call this
    too, so a measured task starts as the product's does. Returns the modules that failed to import."""
    failed = preload()
    from millpond.lake import s3_model  # imports nothing of Millpond's: see its docstring

    s3_model.warm()
    return failed


def main() -> None:
    from airflow.__main__ import main as airflow_main

    failed = preload_task_libraries()
    if failed:
        print(f"millpond: not preloaded (tasks import them): {', '.join(failed)}", file=sys.stderr, flush=True)
    sys.argv = ["airflow", *sys.argv[1:]]
    airflow_main()


if __name__ == "__main__":
    main()
