"""Operations commands: the local Airflow deployment, backfills through it, and the Data Docs site.

The commands live here, in the user surface; what they drive lives in ``orchestration`` and ``quality``."""

from __future__ import annotations

import argparse

from millpond.config import load_settings
from millpond.errors import MillpondError
from millpond.lake.catalog import drop_pipeline, lake_tables
from millpond.orchestration.airflow_stack import ADMIN_USER, AirflowStack
from millpond.orchestration.backfill import Backfill, parse_time
from millpond.quality.context import site_dir
from millpond.quality.datadocs import PUBLISH_PREFIX, build_data_docs, publish_data_docs, serve
from millpond.surface.cli import command, engine_option


@command("airflow", "the local Airflow deployment: start | stop | status | password",
         lambda p: p.add_argument("action", choices=["start", "stop", "status", "password"]))
def _airflow(args: argparse.Namespace) -> int:
    stack = AirflowStack(load_settings())
    if args.action == "start":
        started = stack.start()
        print(f"airflow {'started' if started else 'already running'}: {stack.url} "
              f"(user {ADMIN_USER}, password: {stack.admin_password()})")
    elif args.action == "stop":
        print("airflow stopped" if stack.stop() else "airflow was not running")
    elif args.action == "status":
        for line in stack.status():
            print(line)
    else:
        print(stack.admin_password())
    return 0


def _configure_backfill(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pipeline", required=True, help="pipeline name (conf/pipelines/<name>.yaml)")
    p.add_argument("--from", dest="start", required=True, help="first processing-time bound (ISO-8601)")
    p.add_argument("--to", dest="end", required=True, help="last processing-time bound, exclusive (ISO-8601)")
    p.add_argument("--reprocess", choices=["none", "failed", "completed"], default="none", nargs="?",
                   const="completed",
                   help="intervals that already have a run: skip (none), redo failed, or recompute the range "
                   "(--reprocess alone, or 'completed': the tables are rewound to FROM as new Delta commits and the "
                   "batches from FROM on run again, to the last committed one; docs/operations.md, 'Reprocess')")
    p.add_argument("--demo", action="store_true", help="land the pipeline's demo events for each interval first")
    p.add_argument("--no-wait", action="store_true", help="return once the backfill is created")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the runs (default 3600)")
    engine_option(p, "the runs' batches (passed in their conf)")


@command("backfill", "re-run a pipeline's micro-batches for past intervals through Airflow", _configure_backfill)
def _backfill(args: argparse.Namespace) -> int:
    if not args.pipeline or not args.start or not args.end:
        raise MillpondError("usage: make backfill PIPELINE=<name> FROM=<ISO time> TO=<ISO time>")
    settings = load_settings()
    # the runs' tasks choose their engine (``runtime.engines.choose``): the deployment's, or the one forced here
    conf = ({"demo": True} if args.demo else {}) | ({"engine": args.engine} if args.engine else {}) or None
    Backfill(settings, args.pipeline, parse_time(args.start), parse_time(args.end), args.reprocess, conf=conf).run(
        wait=not args.no_wait, timeout=args.timeout)
    return 0


def _configure_docs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=8765, help="port on 127.0.0.1 (default 8765)")
    p.add_argument("--no-build", action="store_true", help="serve what was built last")
    p.add_argument("--no-serve", action="store_true", help="build only")
    p.add_argument("--publish", action="store_true", help="also upload the site to the reports bucket")


@command("docs", "build the Data Docs (offline assets) and serve them on 127.0.0.1", _configure_docs)
def _docs(args: argparse.Namespace) -> int:
    settings = load_settings()
    index = site_dir(settings) / "index.html" if args.no_build else build_data_docs(settings)
    if not index.exists():
        raise MillpondError(f"no Data Docs under {index.parent}: run `millpond docs` without --no-build")
    print(f"Data Docs built: {index}")
    if args.publish:
        n = publish_data_docs(settings, rebuild=False)
        print(f"published {n} files to s3://{settings.bucket_reports}/{PUBLISH_PREFIX}/")
    if not args.no_serve:
        serve(index.parent, args.port)
    return 0


def _configure_reset(p: argparse.ArgumentParser) -> None:
    p.add_argument("pipeline", help="the pipeline whose tables and lease to drop")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation (scripts)")


@command("reset", "drop a pipeline's tables and lease (asks first; refused while a batch runs)", _configure_reset)
def _reset(args: argparse.Namespace) -> int:
    settings = load_settings()
    have = lake_tables(settings, args.pipeline)
    if not have:
        print(f"{args.pipeline}: no tables in the lake, nothing to reset")
        return 0
    if not args.yes:
        answer = input(f"drop {args.pipeline}'s {len(have)} tables ({', '.join(have)}) for good? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing dropped")
            return 1
    n = drop_pipeline(settings, args.pipeline)
    print(f"{args.pipeline}: dropped {len(have)} tables ({n} objects); its next batch starts from scratch")
    print(f"{args.pipeline}: readers of its panes' change feed start over from version 0 (its history is gone)")
    return 0
