"""Create (once) and locate the Apache Flink virtualenv of the bench's Flink peer.

The ``apache-flink`` wheel brings Flink's jars (no Maven here) and pins a tree that conflicts with the
project's (an older Beam, pyarrow 16), so it lives in its own virtualenv under ``var/flink-venv/<hash>/``,
keyed by a hash of ``requirements-flink.txt`` and built like the Beam one (``beam_env.build_venv``):
about 2-5 minutes and ~850 MB the first time, instant afterwards.

    python tests/reference/flink_env.py          # create if needed, print the interpreter path

``MILLPOND_FLINK_PYTHON`` overrides the location with an existing interpreter that has apache-flink.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REQUIREMENTS = HERE / "requirements-flink.txt"
VENV_ROOT = HERE.parents[1] / "var" / "flink-venv"


def _beam_env():
    spec = importlib.util.spec_from_file_location("millpond_beam_env", HERE / "beam_env.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FlinkEnvError(RuntimeError):
    """The Flink virtualenv could not be created (e.g. no network to the package registry)."""


def ensure_flink_python(log=None) -> Path:
    """Path of a Python interpreter with apache-flink; builds the venv on first use."""
    override = os.environ.get("MILLPOND_FLINK_PYTHON")
    if override:
        return Path(override)
    venv = _beam_env().build_venv(REQUIREMENTS, VENV_ROOT, "Flink", FlinkEnvError, log)
    return venv / "bin" / "python"


def main() -> int:
    return _beam_env().cli("flink_env", ensure_flink_python, FlinkEnvError)


if __name__ == "__main__":
    sys.exit(main())
