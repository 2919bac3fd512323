"""``millpond backfill``: re-run a pipeline's micro-batches for past intervals through Airflow.

Why through Airflow (and not a local loop): the batches then run exactly like live ones (same DAG,
same tasks, same retries), one at a time and in order (``max_active_runs=1``: each batch's
watermark builds on the previous one), and they show up in the UI's grid. Batches already committed
are skipped by the engine, so a backfill over a range that was partly processed is safe.

FROM/TO are the processing-time range: the batches cover arrivals in [FROM, TO), one per
``batch_interval``; FROM is floored and TO ceiled to the interval.

``reprocess="completed"`` recomputes a past range: the pipeline's tables are rewound to the last batch at or
before FROM (``runtime.rewind``: new Delta commits, history keeps the old results), the range reaches on to
the last committed batch, and Airflow redoes the completed runs (live runs meanwhile leave their files to the
first live run after it, ``runtime.catchup``).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote, urlencode

from millpond.config import Settings
from millpond.errors import ApiRefused, MillpondError
from millpond.orchestration.airflow_stack import AirflowStack
from millpond.orchestration.dagfactory import DAG_PREFIX, TASK_ID, pipelines_dir, read_pipeline_info

TERMINAL = {"success", "failed"}
#: a reprocess's run Airflow left as it was (queued before the backfill was made): its batch was not redone
NOT_RERUN = "not re-run"
#: a run that had failed before a backfill which leaves failed runs alone (``--reprocess none``)
FAILED_BEFORE = "failed before"


def parse_time(text: str) -> datetime:
    """ISO-8601 (UTC if no zone) or epoch seconds."""
    text = str(text).strip()
    try:
        return datetime.fromtimestamp(float(text), tz=UTC)
    except ValueError:
        pass
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as exc:
        raise MillpondError(f"not a timestamp: {text!r} (use ISO-8601, e.g. 2026-01-01T12:00:00Z)") from exc
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def align(start: datetime, end: datetime, interval: timedelta) -> tuple[datetime, datetime]:
    """Floor ``start`` and ceil ``end`` to multiples of the interval since the epoch (cron-aligned)."""
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    first = epoch + ((start - epoch) // interval) * interval
    last = epoch + -((epoch - end) // interval) * interval
    return first, last


def _iso(value: datetime) -> str:
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


#: how long a backfill's create waits out Airflow's locked database (SQLite under a busy scheduler)
LOCKED_PATIENCE_S = 120.0


class BackfillGone(MillpondError):
    """Airflow removed the backfill being waited for: on SQLite, a create it refused half-way ("database is
    locked") is cleaned up after its id was already handed out."""


class Backfill:
    """A backfill of one pipeline over [start, end) through the running Airflow's REST API."""

    def __init__(self, settings: Settings, pipeline: str, start: datetime, end: datetime,
                 reprocess: str = "none", stack: AirflowStack | None = None,
                 conf: dict[str, Any] | None = None, unpause: bool = False) -> None:
        """``unpause``: unpause the DAG once the backfill is made (``millpond run``: a new DAG, paused at
        creation, whose schedule carries on after the backfill; the live run of the newest interval, due at
        unpause, finds the backfill made and leaves the range's files to it)."""
        infos = {}
        for path in sorted(pipelines_dir(settings).glob("*.yaml")):
            try:
                info = read_pipeline_info(path)
            except Exception:  # noqa: BLE001 - a broken neighbour must not block this pipeline
                continue
            infos[info.name] = info
        if pipeline not in infos:
            known = ", ".join(infos) or "none"
            raise MillpondError(f"no pipeline {pipeline!r} in {pipelines_dir(settings)} (known: {known})")
        self.info = infos[pipeline]
        if start >= end:
            raise MillpondError(f"FROM ({_iso(start)}) must be before TO ({_iso(end)})")
        self.start, self.end = align(start, end, self.info.batch_interval)
        if self.end > datetime.now(UTC):
            raise MillpondError(f"TO ({_iso(self.end)}) is in the future: a backfill covers past intervals only")
        self.reprocess = reprocess
        #: what Airflow is asked to redo of the range's ended runs (``redo_idle_runs`` can widen it)
        self.behaviour = reprocess
        self.conf = dict(conf or {})  # trigger params for every run, e.g. {"demo": True}
        self.stack = stack or AirflowStack(settings)
        self.dag_id = DAG_PREFIX + self.info.name
        self.unpause = unpause
        self._token: str | None = None

    @property
    def total(self) -> int:
        return int((self.end - self.start) / self.info.batch_interval)

    def api(self, method: str, path: str, body: Any = None) -> Any:
        if self._token is None:
            self._token = self.stack.token()
        return self.stack.api(method, path, body, token=self._token)

    def wait_for_dag(self, timeout: float = 60.0) -> None:
        """A new pipeline file appears after the dag-processor's next pass (a few seconds)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.api("GET", f"/dags/{self.dag_id}")
                return
            except MillpondError as exc:
                if status_of(exc) != 404 or time.monotonic() > deadline:
                    raise MillpondError(f"DAG {self.dag_id} is not known to Airflow ({exc})") from exc
            time.sleep(2.0)

    def body(self) -> dict[str, Any]:
        return {
            "dag_id": self.dag_id,
            "from_date": _iso(self.start),
            # Airflow's bounds are logical dates (= interval starts), both inclusive.
            "to_date": _iso(self.end - self.info.batch_interval),
            "run_backwards": False,
            "reprocess_behavior": self.behaviour,
            "max_active_runs": 1,
            "dag_run_conf": {**self.conf, "backfill_from": _iso(self.start), "backfill_to": _iso(self.end)},
        }

    def create(self, attempts: int = 6, locked_for_s: float | None = None) -> dict[str, Any]:
        """The backfill, made. A 409 (the previous backfill's end lagging its runs) is asked again up to
        ``attempts`` times; a refusal on a locked database for up to ``locked_for_s`` (``LOCKED_PATIENCE_S``): on
        SQLite a busy scheduler held it for over 25 s under load (CI, two test workers)."""
        refused: int | None = 0  # how Airflow last refused this create on a locked database: 0 (it did not), 503, 500
        deadline = time.monotonic() + (LOCKED_PATIENCE_S if locked_for_s is None else locked_for_s)
        attempt = tries = 0
        while True:
            if tries >= attempts and time.monotonic() >= deadline:  # every path below asks again: a bound for all
                raise MillpondError(f"Airflow kept refusing a backfill of {self.dag_id} ({tries} tries): run it again")
            tries += 1
            try:
                return self.api("POST", "/backfills", self.body())
            except MillpondError as exc:
                if status_of(exc) == 409 and refused and (left := self.left_running()) is not None:
                    if refused == 500:  # refused at its audit-log write: the backfill and its runs committed
                        return left
                    # refused at its runs (503): they were rolled back, the backfill row stayed, and it would
                    # never run anything; cancelled (it has no runs to fail), then created again
                    try:
                        self.api("PUT", f"/backfills/{left['id']}/cancel")
                        refused = 0
                    except MillpondError:  # locked again, or completed meanwhile: ask again
                        time.sleep(min(1.0 + 2 * attempt, 10.0))
                    continue
                if status_of(exc) == 409 and attempt < attempts - 1:  # the previous backfill's end can lag its runs
                    time.sleep(2.0 + 2 * attempt)
                    attempt += 1
                    continue
                if status_of(exc) == 409:
                    raise MillpondError(f"a backfill of {self.dag_id} is already running: wait for it or cancel "
                                        "it in the UI (Browse -> Backfills)") from exc
                # On SQLite, Airflow refuses to create a backfill while the scheduler holds the database
                # ("Database is locked", 503; or a 500 "Database error" when the lock hits its audit-log
                # write): a passing condition, so wait and ask again.
                text, status = str(exc).lower(), status_of(exc)
                if (status == 503 and "locked" in text) or (status == 500 and "database error" in text):
                    if time.monotonic() < deadline:
                        refused = status
                        time.sleep(min(1.0 + 2 * min(tries, 5), 10.0))
                        continue
                    raise MillpondError(f"Airflow kept refusing a backfill of {self.dag_id} (its database was "
                                        f"locked for {tries} tries): run it again") from exc
                raise

    def left_running(self) -> dict[str, Any] | None:
        """The running backfill of this very range that a refused create left behind: Airflow commits the
        backfill before its runs, and on SQLite its clean-up after a "locked" refusal can fail as well (or
        come late: ``BackfillGone``)."""
        body = self.body()
        found = self.api("GET", f"/backfills?{urlencode({'dag_id': self.dag_id, 'limit': 100})}")
        for b in found.get("backfills", []):
            if b.get("completed_at") is None and parse_time(b["from_date"]) == parse_time(body["from_date"]) \
                    and parse_time(b["to_date"]) == parse_time(body["to_date"]):
                return b
        return None

    def runs(self) -> list[dict[str, Any]]:
        query = urlencode({
            "logical_date_gte": _iso(self.start),
            "logical_date_lte": _iso(self.end - self.info.batch_interval),
            "order_by": "logical_date", "limit": 1000,
        })
        return self.api("GET", f"/dags/{self.dag_id}/dagRuns?{query}")["dag_runs"]

    def batch_summary(self, run_id: str) -> dict[str, Any] | None:
        path = (f"/dags/{self.dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances/{TASK_ID}"
                "/xcomEntries/return_value?deserialize=true")
        for attempt in range(3):  # the XCom can lag the run's state by a moment
            try:
                value = self.api("GET", path).get("value")
            except MillpondError:
                value = None
            if isinstance(value, dict):
                return value
            time.sleep(1.0 + attempt)
        return None

    def wait(self, backfill_id: int, timeout: float, echo=print) -> dict[str, str]:
        """Print progress (batches done / total, events per batch) until every run ended; return states.

        A run Airflow left as it was (queued before this backfill was made) is not this backfill's: its old summary
        is not reported, and ``_state`` says what it is (in a reprocess, ``NOT_RERUN`` whatever its old state)."""
        deadline = time.monotonic() + timeout
        reported: set[str] = set()
        last_line = ""
        while True:
            self._revive(echo)
            backfill = self._backfill(backfill_id)
            runs = self.runs()
            states = {r["dag_run_id"]: self._state(r, backfill) for r in runs}
            for r in runs:
                if states[r["dag_run_id"]] in TERMINAL and r["dag_run_id"] not in reported:
                    reported.add(r["dag_run_id"])
                    echo(f"  {r['data_interval_end']}  {self._detail(r)}")
            done = sum(1 for v in states.values() if v in TERMINAL)
            line = f"{self.dag_id}: {done}/{self.total} batches done"
            if line != last_line:
                echo(line)
                last_line = line
            # Airflow queues (or queues again) every run of a backfill as it makes it: once every run of the range
            # is there and ended (or was left as it was), nothing is left to run, and the backfill need not wait
            # for the scheduler to mark it completed (every 30 s): ``_create_and_wait`` ends it
            if all(v in TERMINAL | {NOT_RERUN, FAILED_BEFORE} for v in states.values()) and (
                    backfill.get("completed_at") or {NOT_RERUN, FAILED_BEFORE} & set(states.values())
                    or len(states) >= self.total):
                return states
            if time.monotonic() > deadline:
                raise MillpondError(f"backfill {backfill_id} of {self.dag_id} not finished after {timeout:.0f}s "
                                    f"({done}/{self.total} done): it keeps running in Airflow")
            time.sleep(2.0)

    def _backfill(self, backfill_id: int) -> dict[str, Any]:
        try:
            return self.api("GET", f"/backfills/{backfill_id}")
        except MillpondError as exc:
            if status_of(exc) == 404:
                raise BackfillGone(f"backfill {backfill_id} of {self.dag_id} is gone from Airflow") from exc
            raise

    def _state(self, run: dict[str, Any], backfill: dict[str, Any]) -> str:
        """The run's state for this backfill. Airflow queues the runs it makes or redoes as it makes the backfill
        (their ``queued_at`` is then at or after its ``created_at``, both the API server's clock); one ended
        before was left as it was: ``NOT_RERUN`` where the reprocess behaviour redoes it, ``FAILED_BEFORE`` for a
        failure a plain backfill leaves alone, else its state."""
        state, queued = run["state"], run.get("queued_at")
        if state not in TERMINAL or (queued and parse_time(queued) >= parse_time(backfill["created_at"])):
            return state
        if self.behaviour == "completed" or (self.behaviour == "failed" and state == "failed"):
            return NOT_RERUN
        return FAILED_BEFORE if state == "failed" else state

    def _detail(self, run: dict[str, Any]) -> str:
        s = self.batch_summary(run["dag_run_id"]) if run["state"] == "success" else None
        if not s:
            return run["state"].upper()
        counts = s.get("counts") or {}
        return (f"batch {s.get('batch')}: {counts.get('input', 0)} events in, {counts.get('panes', 0)} panes"
                f"{' (already committed)' if s.get('skipped') else ''}")

    def _revive(self, echo) -> None:
        for component in self.stack.revive():
            echo(f"Airflow {component} had stopped: restarted it (its log: {self.stack.logfile(component)})")

    def check_order(self) -> None:
        """Batches commit in processing-time order: refuse up front what the engine would refuse per run."""
        from millpond.lake.tables import Tables

        tables = Tables(self.stack.settings)
        if not tables.exists(self.info.name, "batches"):
            return
        done = {
            _iso(t) for t in tables.read_arrow(self.info.name, "batches", columns=["processing_time"])
            .column("processing_time").to_pylist()
        }
        last = max(done) if done else None
        for i in range(1, self.total + 1):
            p = _iso(self.start + i * self.info.batch_interval)
            if last is not None and p < last and p not in done:
                raise MillpondError(
                    f"{self.info.name} has committed batches up to {last}: a backfill cannot insert the batch at "
                    f"{p} before them (batches run in order); backfill from {last} on, or replay history into "
                    "another table root"
                )

    def rewind(self, echo=print) -> None:
        """For a reprocess: rewind the pipeline's tables to the last batch at or before FROM (new Delta
        commits, ``runtime.rewind``), and reach on to the last committed batch, so the pipeline ends where it
        was, recomputed. The runs carry the reprocess's name (``reprocess_id``): a reprocess rewinds once, so a
        run done again after later runs of it committed (a retry, a cleared run) rewinds nothing and skips."""
        from millpond.lake.tables import Tables
        from millpond.model.timeutil import iso, to_datetime, to_us
        from millpond.orchestration.dagfactory import load_spec
        from millpond.runtime import rewind

        settings = self.stack.settings
        # the reprocess's name, which its runs carry: they find its rewind recorded and rewind nothing again
        reprocess_id = f"{self.dag_id} from {_iso(self.start)} at {datetime.now(UTC).isoformat()}"
        r = rewind.run(settings, Tables(settings), load_spec(settings, self.info.name), to_us(self.start),
                       by=f"backfill of {self.dag_id} from {_iso(self.start)}", reprocess=reprocess_id)
        if not r.noop:
            echo(f"{self.info.name}: rewound to batch {r.to_batch or 0} "
                 f"({iso(r.to_time) if r.to_time else 'before the first batch'}); the old results stay in the "
                 f"tables' history; reprocessing to {iso(r.last_time)}")
        self.end = max(self.end, align(self.start, to_datetime(r.last_time), self.info.batch_interval)[1])
        self.conf["reprocess"] = True
        self.conf["reprocess_id"] = reprocess_id

    def run(self, wait: bool = True, timeout: float = 3600.0, echo=print) -> dict[str, str]:
        if not any(self.stack.pids().values()):
            raise MillpondError("Airflow is not running: start it with `make up`")
        self._revive(echo)
        self.wait_for_dag()
        if self.reprocess == "completed":
            self.rewind(echo)
        else:
            self.check_order()
        return self._run(wait, timeout, echo)

    def hold_live_runs(self) -> None:
        """Live runs of the pipeline leave their files to the backfill until it reaches TO (bounded: see
        ``runtime.catchup.catching_up``); ``release_live_runs`` when it ends."""
        from millpond.lake.tables import Tables
        from millpond.model.timeutil import to_us
        from millpond.runtime import catchup

        settings = self.stack.settings
        catchup.hold_live_runs(settings, Tables(settings), self.info.name, to_us(self.end), self.total,
                              by=f"backfill of {self.dag_id}")

    def release_live_runs(self) -> None:
        from millpond.lake.tables import Tables
        from millpond.runtime import catchup

        catchup.release_live_runs(Tables(self.stack.settings), self.info.name, by=f"backfill of {self.dag_id}")

    def redo_idle_runs(self, echo=print) -> bool:
        """A plain backfill leaves the range's ended runs as they are. A run that succeeded without committing its
        batch (a scheduled run while ``airflow.scheduled_runs`` is off, or a live run a backfill held, does
        nothing) would then leave its interval uncommitted, whatever backfill ran. With such a run in the range,
        Airflow is asked to redo the range's ended runs (its reprocess "completed", without a rewind: a committed
        batch skips, a failed run is redone too). True when it widened the backfill so."""
        if self.behaviour == "completed" or self.conf.get("dry_run"):
            return False
        reached = self.reached()
        idle = [r["dag_run_id"] for r in self.runs() if r["state"] == "success"
                and (reached is None or parse_time(r["data_interval_end"]) > reached)]
        if idle:
            self.behaviour = "completed"
            echo(f"{len(idle)} of the range's runs of {self.dag_id} had succeeded without committing a batch "
                 f"(e.g. {idle[0]}: a scheduled run while airflow.scheduled_runs is off, or a live run a backfill "
                 "held, does nothing): the backfill redoes the range's ended runs (committed batches skip)")
        return bool(idle)

    def _run(self, wait: bool, timeout: float, echo) -> dict[str, str]:
        if self.reprocess != "completed":  # a reprocess's rewind holds them already
            self.hold_live_runs()
        try:
            self.redo_idle_runs(echo)
            return self._create_and_wait(wait, timeout, echo)
        finally:
            if wait:
                self.release_live_runs()

    def _create_and_wait(self, wait: bool, timeout: float, echo) -> dict[str, str]:
        created = self.create()
        if self.unpause:
            self.api("PATCH", f"/dags/{self.dag_id}", {"is_paused": False})
        echo(f"backfill {created['id']} of {self.dag_id}: {self.total} batches over "
             f"[{_iso(self.start)}, {_iso(self.end)}) every {self.info.batch_interval} -> {self.stack.url}/dags/"
             f"{self.dag_id}")
        if not wait:
            return {}
        for attempt in range(3):
            try:
                states = self.wait(created["id"], timeout, echo)
            except BackfillGone:
                if attempt == 2:
                    raise
                # its runs went with it; batches already committed are skipped by their transactions
                echo(f"backfill {created['id']} of {self.dag_id} was removed by Airflow (a create it refused "
                     "half-way): creating it again")
                created = self.create()
                continue
            stale = sorted(k for k, v in states.items() if v == NOT_RERUN)
            self._end(created["id"])  # its runs ended: completed now, not at the scheduler's next pass
            if not stale or attempt == 2:
                break
            # On SQLite a create Airflow refused half-way can leave the backfill without its runs queued again.
            # Made again, it queues them (runs that did redo their batch skip it).
            echo(f"backfill {created['id']} of {self.dag_id} ended without running {len(stale)} of its runs again "
                 f"(e.g. {stale[0]}): creating it again")
            created = self.create()
        failed = [k for k, v in states.items() if v == "failed"]
        if failed:
            raise MillpondError(f"{len(failed)} of {len(states)} backfill runs of {self.dag_id} failed "
                                f"(e.g. {failed[0]}): see the task logs in the UI")
        if before := sorted(k for k, v in states.items() if v == FAILED_BEFORE):
            raise MillpondError(f"{len(before)} of the range's runs of {self.dag_id} had failed before this backfill, "
                                f"which leaves them as they are (e.g. {before[0]}): backfill with --reprocess failed "
                                "to redo them")
        if self.redo_idle_runs(echo):  # a live run of the range held meanwhile: it ended without its batch
            return self._create_and_wait(wait, timeout, echo)
        self.check_committed(created["id"])
        return {k: "success" if v == NOT_RERUN else v for k, v in states.items()}

    def _end(self, backfill_id: int) -> None:
        """End a backfill with no run left to run now, not at the scheduler's next pass (every 30 s), so the
        next backfill of the DAG can be made at once."""
        try:
            self.api("PUT", f"/backfills/{backfill_id}/cancel")
        except MillpondError:  # completed meanwhile (409): ``create`` waits out what is left
            pass

    def reached(self) -> datetime | None:
        """The processing time of the pipeline's last committed batch (None before its first)."""
        from millpond.lake.tables import Tables

        tables = Tables(self.stack.settings)
        if not tables.exists(self.info.name, "batches"):
            return None
        return max(tables.read_arrow(self.info.name, "batches", columns=["processing_time"])
                   .column("processing_time").to_pylist(), default=None)

    def check_committed(self, backfill_id: int) -> None:
        """A backfill that says done has reached the end of its range: its last batch is committed (a reprocess:
        again, as its rewind removed it). Airflow's word that the runs succeeded is not enough: on SQLite, a create
        it refused half-way can leave a backfill that ends with none of its runs made, or made again. (A batch
        missing before a committed one is not lost: the later batch took its files.)"""
        if self.conf.get("dry_run"):
            return
        reached = self.reached()
        due = [self.start + i * self.info.batch_interval for i in range(1, self.total + 1)]
        if missing := [_iso(t) for t in due if reached is None or t > reached]:
            what, verb = ("reprocess", "redo") if self.reprocess == "completed" else ("backfill", "commit")
            span = missing[0] + (f" to {missing[-1]}" if len(missing) > 1 else "")
            raise MillpondError(f"the {what} of {self.info.name} did not {verb} {len(missing)} of its {len(due)} "
                                f"batches ({span}): Airflow ended backfill {backfill_id} without running them; "
                                f"run the same {what} again")


def status_of(exc: BaseException) -> int | None:
    """The HTTP status an API call failed with (``errors.ApiRefused``), or None (unreachable, timed out)."""
    return exc.status if isinstance(exc, ApiRefused) else None
