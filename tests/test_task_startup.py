"""What a DAG task's process inherits or finds ready, so that a small batch's run is its work and not start-up:
Millpond's bytecode cached by the stack's start (even where ``PYTHONDONTWRITEBYTECODE`` is set), boto3's S3
model loaded in the scheduler the task forks from, the validation's context loaded while the Spark task runs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from importlib.util import cache_from_source
from pathlib import Path

from millpond.config import Settings
from millpond.orchestration.bytecode import compile_sources, source_folders

NO_CACHE = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}


def _imported_from(folder: Path, module: str) -> str:
    """Where ``python -v`` says ``module`` came from: its cached bytecode or its source."""
    proc = subprocess.run([sys.executable, "-v", "-c", f"import {module}"], cwd=folder, env=NO_CACHE,
                          capture_output=True, text=True, timeout=120, check=True)
    return next(line for line in proc.stderr.splitlines() if line.startswith("# code object from")
                and module in line)


def test_compiled_sources_are_what_a_task_imports(tmp_path: Path) -> None:
    """Without the caches, a process under ``PYTHONDONTWRITEBYTECODE`` compiles the module from source and
    writes nothing; after ``compile_sources`` it reads the cache; an edit makes the cache stale until the next
    compile (Python checks the source's time and size), never wrong."""
    module = tmp_path / "mp_startup_probe.py"
    module.write_text("VALUE = 1\n")
    assert "mp_startup_probe.py" in _imported_from(tmp_path, "mp_startup_probe")
    assert not Path(cache_from_source(str(module))).exists()

    assert compile_sources([tmp_path])
    assert Path(cache_from_source(str(module))).is_file()
    assert ".pyc" in _imported_from(tmp_path, "mp_startup_probe")

    time.sleep(0.01)
    module.write_text("VALUE = 22\n")  # another size: stale whatever the clock's resolution
    assert "mp_startup_probe.py" in _imported_from(tmp_path, "mp_startup_probe")
    out = subprocess.run([sys.executable, "-c", "import mp_startup_probe as m; print(m.VALUE)"], cwd=tmp_path,
                         env=NO_CACHE, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "22"
    assert compile_sources([tmp_path])
    assert ".pyc" in _imported_from(tmp_path, "mp_startup_probe")


def test_the_stack_compiles_the_package_and_the_dag_files() -> None:
    folders = source_folders()
    assert {f.name for f in folders} == {"millpond", "dags"}
    assert compile_sources()
    for source in (folders[0] / "runtime" / "job.py", folders[1] / "millpond_pipelines.py"):
        assert Path(cache_from_source(str(source))).is_file(), source


def test_forked_tasks_inherit_boto3s_s3_model(settings: Settings) -> None:
    """The scheduler's warm-up leaves a default session whose loader holds the S3 model, and a client made from
    it afterwards (as the lease's is, in a forked task) reaches the real store."""
    script = textwrap.dedent("""
        import os, boto3
        from millpond.lake.s3_model import warm
        assert warm()
        loader = boto3.DEFAULT_SESSION._session.get_component("data_loader")
        assert any("s3" in str(key) for key in loader._cache), "the S3 model is not cached"
        pid = os.fork()
        if pid == 0:
            from millpond.config import load_settings
            from millpond.lake.lease import s3_client
            s = load_settings()
            names = [b["Name"] for b in s3_client(s).list_buckets()["Buckets"]]
            os._exit(0 if s.bucket_landing in names else 3)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
    """)
    proc = subprocess.run([sys.executable, "-c", script], env=dict(os.environ), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "child 0", proc.stdout + proc.stderr[-2000:]


def test_what_the_scheduler_preloads_is_one_function_the_bench_shares() -> None:
    """``preload_task_libraries`` (the scheduler's, and the bench's clients that stand for a DAG task) imports the
    task's libraries and leaves boto3's S3 model loaded: a measured task starts as a forked one does (the bench's
    preload imported the libraries only, and its first lease client parsed the model inside the batch: 0.1-0.3 s of a
    stage batch, measured side by side)."""
    script = textwrap.dedent("""
        import sys, boto3
        from millpond.orchestration.airflow_preload import PRELOAD, preload_task_libraries
        assert preload_task_libraries() == []
        assert all(name in sys.modules for name in PRELOAD)
        loader = boto3.DEFAULT_SESSION._session.get_component("data_loader")
        print(any("s3" in str(key) for key in loader._cache))
    """)
    proc = subprocess.run([sys.executable, "-c", script], env=dict(os.environ), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "True", proc.stdout + proc.stderr[-2000:]


def test_the_pandas_context_loads_in_the_background(tmp_path: Path, settings: Settings) -> None:
    """``warm_context(settings, PANDAS)`` (what the one-task form calls before its Spark job) leaves the context
    cached for the batch's validation, which then loads nothing itself."""
    from millpond.quality import context as qc

    local = settings.with_overrides(home=tmp_path)
    root = qc.gx_root(local)
    assert root not in qc._CONTEXTS
    qc.warm_context(local, qc.PANDAS)
    deadline = time.monotonic() + 60
    while root not in qc._CONTEXTS and time.monotonic() < deadline:
        time.sleep(0.05)
    assert root in qc._CONTEXTS, "the background load did not finish"
    loaded = qc._CONTEXTS[root]
    assert qc.get_context(local) is loaded
    assert root not in qc._SPARK_READY  # the pandas warm-up adds no Spark datasource
