"""Commands and code as the docs name them (README.md, docs/*.md).

- the installed ``millpond`` console script runs (``--help``);
- every ``millpond.…`` path imports and resolves (module, ``module.attribute``, ``module:attribute``,
  ``from millpond.x import a, b``), and every backticked path into the repository or the package
  (``runtime/engines/spark_keys.py``, ``lake/landing.py::list_landing``, ``tests/test_layers.py``,
  ``conf/pipelines/zeitgeist.yaml``) exists;
- every ``millpond <subcommand>`` the docs show is one the console script lists, its ``--help`` works, and the
  arguments the docs give it (placeholders such as ``<pipeline>``, ``P``, ``…`` standing for values) are ones
  its parser accepts: options, choices (``millpond airflow password``), positionals;
- every ``make <target>`` is a target of the Makefile, and each ``VAR=`` it is given is used there.

Nothing here changes state. The console script runs once, with ``--help`` (a process imports the whole CLI:
about a second of CPU: seventeen took 13 s on two cores). Each subcommand's ``--help``, and the
parse of each documented command line, runs in this process through the same entry point, with argparse
stopped as soon as the outermost parse returns: no command's code runs. Make targets are read from the Makefile.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import io
import os
import re
import shlex
import subprocess
import sys
import tomllib
from contextlib import redirect_stderr, redirect_stdout
from functools import cache
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jobs" / "millpond"
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
#: the console script ``pip install`` put beside this interpreter (not ``python -m millpond``)
CONSOLE_SCRIPT = Path(sys.executable).with_name("millpond")

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
SPAN = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"(?<![\w/.$-])millpond(?:\.[A-Za-z_]\w*)+(?::[A-Za-z_]\w*)?")
FROM_IMPORT = re.compile(r"\bfrom\s+(millpond(?:\.\w+)*)\s+import\s+([\w, ]+)")
#: ``millpond.yaml`` and the like are files, not modules
FILE_SUFFIXES = {"yaml", "yml", "json", "md", "py", "txt"}
#: a command and its arguments, to the end of the line or span, a comment, or a shell separator
SUBCOMMAND = re.compile(r"(?<![\w/.$-])millpond[ \t]+([a-z][a-z-]*)([^\n`#;&]*)")
MAKE = re.compile(r"(?<![\w/.$-])make[ \t]+([a-z][\w-]*)([^\n`#;&()]*)")
#: what stands for a value in a documented command line: ``<pipeline>``, ``…``, ``...``
PLACEHOLDER = re.compile(r"<[^>]*>|…|\.\.\.")
#: a backticked path: ``bench/README.md``, ``runtime/engines/``, ``lake/landing.py::list_landing``, ``tables.py``
REPO_PATH = re.compile(r"[\w.-]+(?:/[\w.-]*)+(?:::\w+)?|[\w.-]+\.py(?:::\w+)?")
#: where a relative path in the docs may start: the repository, or the package (``lake/tables.py``)
BASES = (ROOT, PACKAGE)
#: what a path may start with: the repository's entries (not ``var/``, made at run time) and the package's
ROOTS = {p.name for base in BASES for p in base.iterdir() if p.name != "var" and not p.name.startswith((".", "_"))}
#: documented paths that stand for a family of files, not one
PATTERNS = {"expectations/millpond_stream_S.json": "the suite of a computation's output stream S"}


def _doc_texts() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in DOCS}


def _code(text: str) -> list[str]:
    """The fenced blocks and inline code spans of a Markdown text: where commands and paths are named."""
    blocks = FENCE.findall(text)
    prose = FENCE.sub("", text)
    return blocks + SPAN.findall(prose)


def _dotted_paths() -> dict[str, set[str]]:
    """``millpond.…`` path -> the doc files naming it (anywhere in the text, code or prose)."""
    found: dict[str, set[str]] = {}
    for doc, text in _doc_texts().items():
        for path in DOTTED.findall(text):
            if path.rpartition(".")[2] not in FILE_SUFFIXES:
                found.setdefault(path, set()).add(doc)
        for module, names in FROM_IMPORT.findall(text):
            for name in filter(None, (n.strip() for n in names.split(","))):
                found.setdefault(f"{module}:{name}", set()).add(doc)
    return found


def _logger_names() -> set[str]:
    """Logger names the package uses: ``logger `millpond.batch``` in the docs names a logger, not a module."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        names.update(re.findall(r"getLogger\(\s*[\"'](millpond[\w.]*)[\"']", path.read_text()))
    return names


def _resolve(path: str) -> str | None:
    """None when ``path`` imports and resolves; otherwise why not."""
    if ":" in path:
        module, _, attrs = path.partition(":")
        candidates = [(module, attrs.split("."))]
    else:
        parts = path.split(".")
        candidates = [(".".join(parts[:i]), parts[i:]) for i in range(len(parts), 0, -1)]
    for module, attrs in candidates:
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
                continue  # not a module: try a shorter prefix with attributes
            return f"importing {module} fails: {exc!r}"
        except Exception as exc:  # a module that exists but breaks on import is a failure too
            return f"importing {module} fails: {exc!r}"
        for i, attr in enumerate(attrs):
            if not hasattr(obj, attr):
                return f"no such module or attribute ({module} has no {'.'.join(attrs[:i + 1])!r})"
            obj = getattr(obj, attr)
        return None
    return f"no module {candidates[-1][0]}"


def _repo_paths() -> dict[str, set[str]]:
    """Backticked paths into the repository or the package -> the docs naming them."""
    found: dict[str, set[str]] = {}
    for doc, text in _doc_texts().items():
        for span in map(str.strip, SPAN.findall(FENCE.sub("", text))):
            if REPO_PATH.fullmatch(span) and span not in PATTERNS and ("/" not in span or span.split("/")[0] in ROOTS):
                found.setdefault(span, set()).add(doc)
    return found


def _check_repo_path(ref: str) -> str | None:
    """None when the file or directory exists (and defines ``name`` for ``file.py::name``); otherwise why not."""
    path, _, name = ref.partition("::")
    if "/" in path:
        files = [base / path for base in BASES if (base / path).exists()]
    else:  # a bare file name (``watermark.py``): some module of the package has it
        files = sorted(PACKAGE.rglob(path))
    if not files:
        return "no such file or directory (looked under the repository and jobs/millpond)"
    if not name:
        return None
    file = files[0]
    if file.is_relative_to(PACKAGE):
        module = ".".join(file.relative_to(PACKAGE.parent).with_suffix("").parts)
        return _resolve(f"{module}:{name}")
    if re.search(rf"^(?:def|class)\s+{re.escape(name)}\b|^{re.escape(name)}\s*[:=]", file.read_text(), re.M):
        return None
    return f"{file.relative_to(ROOT)} defines no {name!r}"


def _commands(pattern: re.Pattern[str]) -> dict[str, dict[str, set[str]]]:
    """name -> its argument strings as the docs show them -> the docs showing them."""
    found: dict[str, dict[str, set[str]]] = {}
    for doc, text in _doc_texts().items():
        for code in _code(text):
            for name, rest in pattern.findall(code):
                found.setdefault(name, {}).setdefault(rest.strip(), set()).add(doc)
    return found


@cache
def _console_help() -> subprocess.CompletedProcess[str]:
    """``millpond --help`` through the installed console script."""
    return subprocess.run([str(CONSOLE_SCRIPT), "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "COLUMNS": "200"})


def _entry_point() -> importlib.metadata.EntryPoint:
    (entry,) = importlib.metadata.entry_points(group="console_scripts", name="millpond")
    return entry


def _choices(usage: str) -> set[str]:
    """The ``{a,b,c}`` choices of a help text's usage paragraph (subcommands, ``airflow``'s actions)."""
    return {c for group in re.findall(r"\{([\w,-]+)\}", usage.partition("\n\n")[0]) for c in group.split(",")}


def _help(subcommand: str) -> tuple[int, str]:
    """(exit code, output) of ``millpond <subcommand> --help``, run in this process by the console script's
    entry point."""
    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(out):
        try:
            code = _entry_point().load()([subcommand, "--help"])
        except SystemExit as exc:
            code = exc.code
    return int(code or 0), out.getvalue()


class _Parsed(Exception):
    """The outermost parse returned: raised before the CLI can dispatch to a command."""


class _Refused(Exception):
    """argparse's error message, raised instead of printing usage and exiting."""


def _parse(argv: list[str]) -> str | None:
    """None when the console script's parser accepts ``argv``, otherwise argparse's message. Nothing runs: every
    parse goes through ``parse_known_args``, and the outermost one raises instead of returning to the CLI."""
    original = argparse.ArgumentParser.parse_known_args
    depth = 0

    def parse_known_args(self, args=None, namespace=None):
        nonlocal depth
        depth += 1
        try:
            namespace, extras = original(self, args, namespace)
        finally:
            depth -= 1
        if depth:
            return namespace, extras  # a subcommand's parser, inside the outermost parse
        if extras:
            raise _Refused(f"unrecognized arguments: {' '.join(extras)}")
        raise _Parsed

    def error(self, message):
        raise _Refused(message)

    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", parse_known_args), \
            mock.patch.object(argparse.ArgumentParser, "error", error):
        try:
            _entry_point().load()(argv)
        except _Parsed:
            return None
        except _Refused as exc:
            return str(exc)
    raise AssertionError(f"millpond {' '.join(argv)} was not stopped after parsing")


def _argvs(rest: str) -> list[list[str]]:
    """The argument lists a documented ``millpond <sub> <rest>`` stands for: placeholders become a value,
    ``[optional]`` parts are kept, ``start|stop|status`` is each of them; [] for a bare mention or ``...``."""
    if PLACEHOLDER.fullmatch(rest) or not rest:
        return []
    words = shlex.split(PLACEHOLDER.sub("X", rest.replace("[", " ").replace("]", " ")))
    if words and re.fullmatch(r"[\w-]+(?:\|[\w-]+)+", words[0]):
        return [[alternative, *words[1:]] for alternative in words[0].split("|")]
    return [words]


def _where(docs: set[str]) -> str:
    return ", ".join(sorted(docs))


def test_console_script_runs() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["millpond"]
    assert _entry_point().value == declared, (
        f"installed entry point {_entry_point().value} is not pyproject's {declared}: pip install --no-deps -e .")
    assert CONSOLE_SCRIPT.is_file(), f"{CONSOLE_SCRIPT} missing: pip install --no-deps -e . into this venv"
    done = _console_help()
    assert done.returncode == 0, f"millpond --help exited {done.returncode}:\n{done.stderr}"
    assert done.stdout.startswith("usage: millpond"), done.stdout
    assert {"run", "batch", "query", "replay"} <= _choices(done.stdout), done.stdout


def test_documented_module_paths_resolve() -> None:
    paths = _dotted_paths()
    assert len(paths) > 10, sorted(paths)  # the extraction itself still finds the docs' paths
    loggers = _logger_names()
    failures = [f"{path} ({_where(docs)}): {why}" for path, docs in sorted(paths.items())
                if path not in loggers and (why := _resolve(path))]
    assert not failures, "paths the docs name that do not resolve:\n" + "\n".join(failures)


def test_documented_repository_paths_exist() -> None:
    refs = _repo_paths()
    assert len(refs) > 10, sorted(refs)
    failures = [f"{ref} ({_where(docs)}): {why}" for ref, docs in sorted(refs.items())
                if (why := _check_repo_path(ref))]
    assert not failures, "files the docs name that do not exist:\n" + "\n".join(failures)


def test_documented_millpond_commands_exist() -> None:
    documented = _commands(SUBCOMMAND)
    assert {"query", "batch", "history"} <= documented.keys(), sorted(documented)
    console = _console_help()
    assert console.returncode == 0, console.stderr
    listed = _choices(console.stdout)
    failures = []
    for sub, uses in sorted(documented.items()):
        if sub not in listed:
            failures.append(f"millpond {sub} ({_where(set().union(*uses.values()))}): no such subcommand "
                            f"(the console script has {', '.join(sorted(listed))})")
            continue
        code, text = _help(sub)
        if code != 0:
            failures.append(f"millpond {sub}: `millpond {sub} --help` exited {code}: {text.strip()[-300:]}")
            continue
        for rest, docs in sorted(uses.items()):
            for argv in _argvs(rest):
                why = _parse([sub, *argv])
                if why and why.startswith("the following arguments are required") and \
                        all(w.startswith("-") for w in argv):
                    continue  # a mention of an option (`millpond backfill --reprocess`), not a whole command
                if why:
                    failures.append(f"millpond {sub} {rest} ({_where(docs)}): {why}")
    assert not failures, "commands the docs show that the console script refuses:\n" + "\n".join(failures)


def _make_targets(makefile: str) -> set[str]:
    """Explicit targets of the Makefile (``name: prerequisites``, not ``VAR := value``)."""
    return {t for line in re.findall(r"^([\w. -]+):(?!=)", makefile, re.M) for t in line.split()
            if not t.startswith(".")}


def test_documented_make_targets_exist() -> None:
    makefile = (ROOT / "Makefile").read_text()
    targets = _make_targets(makefile)
    assert {"run", "test"} <= targets, sorted(targets)
    documented = _commands(MAKE)
    assert {"run", "test", "query"} <= documented.keys(), sorted(documented)
    failures = []
    for target, uses in sorted(documented.items()):
        if target not in targets:
            failures.append(f"make {target} ({_where(set().union(*uses.values()))}): no such target")
            continue
        for rest, docs in sorted(uses.items()):
            for var in re.findall(r"\b([A-Z][A-Z0-9_]*)=", rest):
                if not re.search(rf"\$\({var}\)|\b{var}\s*[?:]?=", makefile):
                    failures.append(f"make {target} {rest} ({_where(docs)}): the Makefile does not use {var}")
    assert not failures, "make targets the docs show that the Makefile lacks:\n" + "\n".join(failures)


def test_make_soak_runs_three_random_seeds_unless_told() -> None:
    """``make soak`` says "default: three random": its command line, as make expands it, asks for three seeds."""
    def seeds(*args: str) -> str:
        out = subprocess.run(["make", "-n", "soak", *args], cwd=ROOT, capture_output=True, text=True, check=True)
        return re.search(r"MILLPOND_OPS_SEEDS=(\S+)", out.stdout).group(1)

    assert seeds() == "$RANDOM,$RANDOM,$RANDOM"
    assert seeds("SEEDS=7") == "7"
