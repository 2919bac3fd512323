"""Millpond's own modules compiled to bytecode before a stack starts its processes.

Why: every Airflow task is a new process that imports Millpond's modules and the DAG file. pip compiles the
libraries it installs, but Millpond is installed editable, so its modules are compiled when first imported and the
result cached in ``__pycache__`` only if Python may write it. Where ``PYTHONDONTWRITEBYTECODE`` is set (many
container images set it, this project's CI machines among them) nothing is cached, and every task compiled
Millpond from source again: about 0.1 s of each DAG run on two cores. ``py_compile`` writes the caches whatever
that variable says, and an import reads them; a module edited since is compiled again on its next import (Python
checks the source's time and size), and cached by the next stack start.
"""

from __future__ import annotations

import logging
import py_compile
import struct
from importlib.util import MAGIC_NUMBER, cache_from_source
from pathlib import Path

import millpond
from millpond.config import PROJECT_ROOT

log = logging.getLogger(__name__)


def source_folders() -> list[Path]:
    """The folders whose modules a task imports: the package and the DAG files beside it."""
    folders = [Path(millpond.__file__).resolve().parent, PROJECT_ROOT / "dags"]
    return [f for f in folders if f.is_dir()]


def is_fresh(source: Path) -> bool:
    """Whether ``source``'s cache is one an import would use: the header importlib checks (magic number, the
    source's modification time and size). ``compileall`` compares the time only, to the second, so an edit within
    the second of a compile would keep a cache that every import then ignores."""
    stat = source.stat()
    expect = struct.pack("<4sLLL", MAGIC_NUMBER, 0, int(stat.st_mtime) & 0xFFFF_FFFF, stat.st_size & 0xFFFF_FFFF)
    try:
        with open(cache_from_source(str(source)), "rb") as fh:
            return fh.read(16) == expect
    except OSError:
        return False


def compile_sources(folders: list[Path] | None = None) -> bool:
    """Cache the bytecode of every module under ``folders`` (default :func:`source_folders`) whose cache is
    missing or stale. False when one could not be compiled or cached (a syntax error, a read-only checkout):
    imports then compile that module as before, and report its error."""
    ok = True
    for folder in source_folders() if folders is None else folders:
        for source in sorted(folder.rglob("*.py")):
            if "__pycache__" in source.parts or is_fresh(source):
                continue
            try:
                py_compile.compile(str(source), doraise=True)
            except (OSError, py_compile.PyCompileError) as exc:
                log.debug("bytecode of %s not cached: %s", source, exc)
                ok = False
    return ok


if __name__ == "__main__":  # `make venv`: the caches of a fresh checkout (a failure only leaves imports slower)
    compile_sources()
