"""``millpond`` command line: services, the main job, replay, query.

Every user-caused failure ends in one line on stderr and a non-zero exit code.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from millpond.config import load_settings
from millpond.errors import MillpondError

Command = Callable[[argparse.Namespace], int | None]
_COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Command]] = {}


def command(name: str, help_text: str, configure: Callable[[argparse.ArgumentParser], None] | None = None):
    """Register a subcommand; modules add theirs without touching this file's dispatch."""

    def wrap(fn: Command) -> Command:
        _COMMANDS[name] = (help_text, configure or (lambda p: None), fn)
        return fn

    return wrap


@command("preflight", "check prerequisites (Java 17+, weed binary)")
def _preflight(args: argparse.Namespace) -> int:
    from millpond.orchestration.store import weed_binary
    from millpond.prerequisites import require_java

    require_java()
    weed_binary()
    return 0


@command("up", "start the embedded object store and create the buckets (idempotent)")
def _up(args: argparse.Namespace) -> int:
    from millpond.orchestration.stack import up

    up(load_settings())
    return 0


@command("down", "stop the services `up` started (idempotent)")
def _down(args: argparse.Namespace) -> int:
    from millpond.orchestration.stack import down

    down(load_settings())
    return 0


@command("status", "show which services are running")
def _status(args: argparse.Namespace) -> int:
    from millpond.orchestration.stack import status

    for line in status(load_settings()):
        print(line)
    return 0


@command("check", "check the object store: reachable, credentials accepted, buckets present")
def _check(args: argparse.Namespace) -> int:
    from millpond.lake.objectstore import ObjectStore

    settings = load_settings()
    ObjectStore(settings).check()
    print(f"object store at {settings.s3_endpoint}: ok ({', '.join(settings.buckets)})")
    return 0


#: what a command adds when the Connect endpoint of engine spark does not answer (``engines.spark_for``)
LOCAL_HINT = "or run in-process with --engine local"


def engine_option(p: argparse.ArgumentParser, runs: str = "the batches") -> None:
    """``--engine local|spark``: the one way a command overrides the deployment's ``engine.name``
    (``runtime.engines.choose``)."""
    p.add_argument("--engine", choices=["local", "spark"],
                   help=f"run {runs} in-process (local) or on the deployment's Spark Connect server (spark); "
                   "default: the deployment's engine.name")


def _load_plugins() -> None:
    # Subcommands that live beside the concepts they drive.
    for module in ("run", "replay", "query", "report", "operations", "inputs"):
        try:
            __import__(f"millpond.surface.{module}")
        except ModuleNotFoundError as exc:
            if exc.name != f"millpond.surface.{module}":
                raise


def main(argv: list[str] | None = None) -> int:
    _load_plugins()
    parser = argparse.ArgumentParser(prog="millpond", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, configure, _fn) in _COMMANDS.items():
        configure(sub.add_parser(name, help=help_text))
    args = parser.parse_args(argv)
    try:
        return int(_COMMANDS[args.command][2](args) or 0)
    except MillpondError as exc:
        print(f"millpond: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("millpond: interrupted", file=sys.stderr)
        return 130
