"""Create (once) and locate the Apache Beam virtualenv used by the differential tests.

Beam's dependency tree conflicts with the project's, so it lives in its own virtualenv under the
repo's ``var/beam-venv/<hash>/``, keyed by a hash of ``requirements-beam.txt`` (a changed pin
builds a fresh one; an unchanged one is reused). Created with ``python3.11 -m venv`` and pip from
the package registry; about 15-40 s and ~480 MB the first time, instant afterwards.

    python tests/reference/beam_env.py          # create if needed, print the interpreter path

``MILLPOND_BEAM_PYTHON`` overrides the location with an existing interpreter that has
apache-beam installed. ``MILLPOND_PYTHON311`` names the interpreter that creates the venv
(default ``python3.11``).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
REQUIREMENTS = HERE / "requirements-beam.txt"
VENV_ROOT = REPO / "var" / "beam-venv"
RUNNER = HERE / "beam_runner.py"


class BeamEnvError(RuntimeError):
    """The Beam virtualenv could not be created (e.g. no network to the package registry)."""


def requirements_hash() -> str:
    return hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()[:12]


def venv_dir() -> Path:
    return VENV_ROOT / requirements_hash()


def _python_in(venv: Path) -> Path:
    return venv / "bin" / "python"


def _ready(venv: Path) -> bool:
    return (venv / ".complete").exists() and _python_in(venv).exists()


def ensure_beam_python(log=None) -> Path:
    """Path of a Python interpreter with apache-beam; builds the venv on first use.

    Raises :class:`BeamEnvError` with pip's output tail when the venv cannot be built.
    """
    override = os.environ.get("MILLPOND_BEAM_PYTHON")
    if override:
        return Path(override)
    return _python_in(build_venv(REQUIREMENTS, VENV_ROOT, "Beam", BeamEnvError, log))


def build_venv(requirements: Path, root: Path, label: str, error: type[Exception] = RuntimeError, log=None) -> Path:
    """The virtualenv ``root/<hash of requirements>``, built once with ``python3.11 -m venv`` and pip.

    Shared by the reference peers (``flink_env.py`` too): each has its own pins and its own root."""
    venv = root / hashlib.sha256(requirements.read_bytes()).hexdigest()[:12]
    if _ready(venv):
        return venv
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time (parallel test sessions)
        if _ready(venv):
            return venv
        started = time.monotonic()
        build = venv.with_name(venv.name + ".building")
        shutil.rmtree(build, ignore_errors=True)
        base = os.environ.get("MILLPOND_PYTHON311", "python3.11")
        if shutil.which(base) is None and not Path(base).exists():
            raise error(f"{base} not found: the {label} reference venv needs Python 3.11")
        steps = [
            [base, "-m", "venv", str(build)],
            [
                str(_python_in(build)),
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "-r",
                str(requirements),
            ],
        ]
        env = dict(os.environ, PIP_NO_INPUT="1")
        for cmd in steps:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
            if proc.returncode != 0:
                shutil.rmtree(build, ignore_errors=True)
                tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
                raise error(f"`{' '.join(cmd[:4])} ...` failed ({proc.returncode}):\n{tail}")
        (build / ".complete").write_text(f"{time.monotonic() - started:.1f}s\n")
        # venvs hard-code their path in scripts, but `bin/python` works after a rename
        shutil.rmtree(venv, ignore_errors=True)
        build.rename(venv)
        for stale in root.iterdir():  # older pins
            if stale.is_dir() and stale != venv and not stale.name.endswith(".building"):
                shutil.rmtree(stale, ignore_errors=True)
        if log:
            log(f"created {label} venv {venv} in {time.monotonic() - started:.1f}s")
    return venv


def cli(name: str, ensure, error: type[Exception]) -> int:
    """A peer venv's command line: build it when missing, print its interpreter."""
    started = time.monotonic()
    try:
        python = ensure(log=lambda m: print(m, file=sys.stderr))
    except error as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 1
    print(python)
    print(f"{name}: ready in {time.monotonic() - started:.1f}s", file=sys.stderr)
    return 0


def main() -> int:
    return cli("beam_env", ensure_beam_python, BeamEnvError)


if __name__ == "__main__":
    sys.exit(main())
