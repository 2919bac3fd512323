"""The Python environment a cluster's executors run Millpond's functions in, shipped to them by Spark.

Why: a ``spark://`` or ``k8s://`` worker is another machine, with neither this checkout nor its ``.venv``.
The stack's Connect server on such a master passes this archive as ``spark.archives``
(``<archive>#environment``): every executor unpacks it into its own work directory and starts its Python
workers with ``./environment/bin/python`` (``spark.pyspark.python``, and ``PYSPARK_PYTHON`` in the server's
environment: Spark Connect's planner reads only that).

What is in it, copied from this installation (no registry, so it builds offline):

- this interpreter: its binary, ``libpython`` and the standard library, less tests, Tk, IDLE and the static
  library. ``bin/python`` is a three-line shell script that puts the archive's ``lib/`` on ``LD_LIBRARY_PATH``
  (the binary's own search path is absolute) and runs ``bin/python3.11``, which finds its standard library
  beside it;
- the distributions executors import (``ROOTS`` and what they require), as installed in ``.venv``: the
  versions ``requirements.lock`` pins; their ``tests`` folders and C headers are left out;
- the ``millpond`` package (installed editable, so copied from its source), compiled.

Not pyspark (500 MB of jars): an executor's Python workers import it from the worker's own Spark
(``$SPARK_HOME/python/lib/pyspark.zip``, which Spark puts first on their ``PYTHONPATH``); it has to match that
JVM anyway. Built once per key (a hash of ``requirements.lock``, the package's source, the interpreter and
the copied distributions' versions) under ``<home>/spark/executor-env/``; a build checks that the archive's
interpreter imports the executors' modules before it publishes it.
"""

from __future__ import annotations

import compileall
import fcntl
import hashlib
import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

from packaging.requirements import Requirement

from millpond.config import Settings
from millpond.config.settings import PROJECT_ROOT
from millpond.errors import MillpondError

#: the folder each executor unpacks the archive into (the fragment of ``spark.archives``)
ALIAS = "environment"
#: the executors' interpreter, relative to their work directory
PYTHON = f"./{ALIAS}/bin/python"
#: what the executors' code imports: the daemon's preload (``runtime.engines.spark_daemon``) and a whole batch
#: run as one task (``runtime.engines.spark_task``: the lake's tables, lease and object store)
ROOTS = ("pyarrow", "deltalake", "pandas", "minio", "boto3", "PyYAML")
#: the layers of the package an executor may import (``CHECK`` imports every module in them)
EXECUTOR_LAYERS = ("model", "config", "lake", "runtime")
#: run by a staged interpreter as an executor runs it: the daemon's preload, then every executor-side module
CHECK = f"""
import importlib, pkgutil, sys
from millpond.runtime.engines.spark_daemon import preload
preload()
for layer in {EXECUTOR_LAYERS!r}:
    package = importlib.import_module("millpond." + layer)
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(module.name)
print(sys.prefix)
"""
#: bumped when what a build puts in the archive changes (part of the key)
FORMAT = 2
#: archives of other keys kept beside the newest (a server started before a rebuild still serves its own to
#: executors that join later)
KEEP = 1
PACKAGE = Path(__file__).resolve().parents[1]
VERSION = f"python{sys.version_info.major}.{sys.version_info.minor}"
#: standard-library folders no executor imports
STDLIB_SKIP = {"site-packages", "test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data"}
#: parts of installed distributions no executor loads
DIST_SKIP_SUFFIXES = (".pyx", ".pxd", ".pxi", ".h", ".hpp", ".cc", ".pyi")
DIST_SKIP_DIRS = {"tests", "include", "src"}


def default_cache(settings: Settings) -> Path:
    return settings.home / "spark" / "executor-env"


def spark_conf(settings: Settings, cache: Path | None = None) -> dict[str, str]:
    """What a Connect server on a cluster sets so that its executors run the shipped environment (built or
    found in ``cache``); the driver keeps this interpreter."""
    archive = ensure_archive(cache or default_cache(settings))
    return {"spark.archives": f"{archive}#{ALIAS}", "spark.pyspark.python": PYTHON,
            "spark.pyspark.driver.python": sys.executable, "spark.executorEnv.PYSPARK_PYTHON": PYTHON}


def distributions(roots: tuple[str, ...] = ROOTS) -> list[md.Distribution]:
    """The installed distributions ``roots`` need: each one and, transitively, its unconditional requirements."""
    seen: dict[str, md.Distribution] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        dist = md.distribution(name)
        canon = dist.metadata["Name"].lower().replace("_", "-")
        if canon in seen:
            continue
        seen[canon] = dist
        for text in dist.requires or ():
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return sorted(seen.values(), key=lambda d: d.metadata["Name"].lower())


def _package_files() -> Iterator[Path]:
    for path in sorted(PACKAGE.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            yield path


def archive_key() -> str:
    """Changes with anything the archive holds: the lock, the package's source, the interpreter, the copies."""
    h = hashlib.sha256(f"{FORMAT}\n{sys.version}\n{sys.platform}\n{ROOTS}\n".encode())
    lock = PROJECT_ROOT / "requirements.lock"
    h.update(lock.read_bytes() if lock.exists() else b"")
    for dist in distributions():
        h.update(f"{dist.metadata['Name']}=={dist.version}\n".encode())
    for path in _package_files():
        h.update(str(path.relative_to(PACKAGE)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def ensure_archive(cache: Path) -> Path:
    """The archive for the current key in ``cache``, built first if missing (one builder at a time)."""
    cache.mkdir(parents=True, exist_ok=True)
    archive = cache / f"millpond-executor-{archive_key()}.tar.gz"
    if archive.exists():
        return archive
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent builder of the same key: wait for its archive
        if not archive.exists():
            build(archive)
            _prune(cache, archive)
    return archive


def build(archive: Path) -> None:
    """Stage the environment in a scratch folder beside ``archive``, check it, pack it, publish it whole."""
    with tempfile.TemporaryDirectory(prefix=".stage-", dir=archive.parent) as tmp:
        root = Path(tmp) / ALIAS
        site = root / "lib" / VERSION / "site-packages"
        _stage_python(root)
        for dist in distributions():
            _stage_distribution(dist, site)
        shutil.copytree(PACKAGE, site / "millpond", ignore=shutil.ignore_patterns("__pycache__"))
        compileall.compile_dir(site / "millpond", quiet=1, workers=1)
        check(root)
        draft = Path(tmp) / archive.name
        with tarfile.open(draft, "w:gz", compresslevel=1) as tar:
            for entry in sorted(root.iterdir()):
                tar.add(entry, arcname=entry.name)
        os.replace(draft, archive)


def _stage_python(root: Path) -> None:
    """This interpreter as a relocatable prefix: binary, shared library, standard library, a launcher."""
    base = Path(sys.base_prefix)
    (root / "bin").mkdir(parents=True)
    shutil.copy2(Path(sys._base_executable).resolve(), root / "bin" / VERSION)
    libdir = Path(sysconfig.get_config_var("LIBDIR") or base / "lib")
    soname = sysconfig.get_config_var("INSTSONAME")
    (root / "lib").mkdir()
    if sysconfig.get_config_var("Py_ENABLE_SHARED") and soname and (libdir / soname).exists():
        shutil.copy2(libdir / soname, root / "lib" / soname)

    def skip(folder: str, names: list[str]) -> set[str]:
        top = Path(folder) == stdlib
        return {n for n in names if (top and (n in STDLIB_SKIP or n.startswith("config-"))) or ".opt-" in n}

    stdlib = Path(sysconfig.get_path("stdlib"))
    shutil.copytree(stdlib, root / "lib" / VERSION, symlinks=True, ignore=skip, dirs_exist_ok=True)
    launcher = root / "bin" / "python"
    launcher.write_text('#!/bin/sh\nd=$(cd "$(dirname "$0")" && pwd)\n'
                        'LD_LIBRARY_PATH="$d/../lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" '
                        f'exec "$d/{VERSION}" "$@"\n')
    launcher.chmod(0o755)


def _stage_distribution(dist: md.Distribution, site: Path) -> None:
    """Copy one installed distribution's files (its RECORD) that live in site-packages, less what no one loads."""
    origin = Path(dist.locate_file("")).resolve()
    for file in dist.files or ():
        rel = Path(file)
        if rel.is_absolute() or ".." in rel.parts or rel.suffix in DIST_SKIP_SUFFIXES:
            continue
        if DIST_SKIP_DIRS & set(rel.parts[1:-1]) or ".opt-" in rel.name:
            continue
        source = origin / rel
        if source.is_file():
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, site / rel)


def check(root: Path) -> None:
    """Run the staged interpreter as an executor would (pyspark from Spark's zip) and import what tasks import."""
    import pyspark

    zips = sorted((Path(pyspark.__file__).resolve().parent / "python" / "lib").glob("*.zip"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PYTHONPATH"] = os.pathsep.join(map(str, zips))
    out = subprocess.run([str(root / "bin" / "python"), "-c", CHECK], capture_output=True, text=True, env=env,
                         cwd=root.parent, timeout=300)
    prefix = (out.stdout.strip().splitlines() or [""])[-1]
    if out.returncode != 0 or Path(prefix).resolve() != root.resolve():
        raise MillpondError(f"the executors' environment in {root} does not work (prefix {prefix!r}): "
                            f"{out.stderr[-2000:]}")


def _prune(cache: Path, keep: Path) -> None:
    """Drop all but the newest few archives of other keys (each is some hundred megabytes)."""
    others = sorted((p for p in cache.glob("millpond-executor-*.tar.gz") if p != keep),
                    key=lambda p: p.stat().st_mtime, reverse=True)
    for old in others[KEEP:]:
        old.unlink(missing_ok=True)


if __name__ == "__main__":
    from millpond.config import load_settings

    print(ensure_archive(default_cache(load_settings())))
