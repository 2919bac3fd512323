"""Issue 37: the single-writer lease (MillWheel's sequencer) against a real embedded store.

(9) a holder on this host whose process is gone is dead: its lease is taken over at once; one elsewhere is
refused in one line saying until when. (5b) a batch's lease renewals are retried, and ``check()`` stops the
batch before its lease can lapse. (6) the store's conditional puts under races: of N takers of one lease
exactly one wins, and N delta-rs commits at one version all land. (5a) what the Delta log itself fences.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pytest
from millpond.errors import LeaseLost, StoreUnreachable
from millpond.lake import lease as lease_mod
from millpond.lake.lease import Lease, lease_key, s3_client

#: a child process that takes the lease, says so, and waits to be killed
HOLDER = """
import sys, time
from millpond.config import load_settings
from millpond.lake.lease import Lease
lease = Lease.acquire(load_settings(), sys.argv[1], owner=sys.argv[2], ttl_s=float(sys.argv[3]))
print(lease.token, flush=True)
time.sleep(600)
"""


def hold_in_child(pipeline: str, owner: str, ttl_s: float = 600.0) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", HOLDER, pipeline, owner, str(ttl_s)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    line = child.stdout.readline()
    assert line.strip().isdigit(), child.stderr.read() if child.poll() is not None else line
    return child


def kill(child: subprocess.Popen) -> None:
    child.kill()  # SIGKILL: no cleanup, the lease stays as it was
    child.wait(timeout=30)
    child.stdout.close()
    child.stderr.close()


def lease_record(settings, pipeline: str) -> dict:
    body = s3_client(settings).get_object(Bucket=settings.bucket_lake, Key=lease_key(settings, pipeline))["Body"]
    return json.loads(body.read())


def put_record(settings, pipeline: str, record: dict) -> None:
    s3_client(settings).put_object(Bucket=settings.bucket_lake, Key=lease_key(settings, pipeline),
                                   Body=json.dumps(record).encode())


def dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# -- (9) a dead holder on this host ------------------------------------------------------------------


def test_a_sigkilled_holder_on_this_host_is_taken_over_at_once(settings, pipeline_name) -> None:
    child = hold_in_child(pipeline_name, "crashed-run")
    held = lease_record(settings, pipeline_name)
    assert (held["owner"], held["pid"]) == ("crashed-run", child.pid)
    kill(child)
    start = time.monotonic()
    rerun = Lease.acquire(settings, pipeline_name, owner="rerun")  # no wait asked: none needed
    assert time.monotonic() - start < 5
    assert rerun.token == held["token"] + 1
    rerun.check()
    rerun.release()


def test_a_live_holder_on_this_host_is_refused_at_once_saying_so(settings, pipeline_name) -> None:
    child = hold_in_child(pipeline_name, "running-batch")
    try:
        with pytest.raises(LeaseLost) as refused:
            Lease.acquire(settings, pipeline_name, owner="second")
        message = str(refused.value)
        assert "\n" not in message
        assert "is being run by running-batch" in message and "stops without writing" in message
        assert f"pid {child.pid}" in message and "alive" in message  # it names the process, checked live
    finally:
        kill(child)


def test_a_holder_whose_pid_was_reused_is_dead(settings, pipeline_name) -> None:
    """The lease names the holder's pid and its start time: a live process with that pid but another start
    (the pid came round again) is not the holder."""
    child = hold_in_child(pipeline_name, "crashed-run")
    kill(child)
    record = lease_record(settings, pipeline_name)
    assert record.get("start") is not None  # the process's start time is recorded
    put_record(settings, pipeline_name, {**record, "pid": os.getpid()})  # a live pid, another start time
    taken = Lease.acquire(settings, pipeline_name, owner="rerun")
    assert taken.token == record["token"] + 1
    taken.release()


def test_a_holder_elsewhere_is_refused_until_its_lease_lapses(settings, pipeline_name) -> None:
    """Across hosts the holder cannot be checked: its lease lapses one TTL after its last renewal, and the
    refusal says what it waits for and until when."""
    child = hold_in_child(pipeline_name, "remote-run", ttl_s=300)
    kill(child)
    record = lease_record(settings, pipeline_name)
    put_record(settings, pipeline_name, {**record, "host": "worker-7", "pid": dead_pid()})
    until = time.strftime("%H:%M:%SZ", time.gmtime(record["expires"]))
    with pytest.raises(LeaseLost) as refused:
        Lease.acquire(settings, pipeline_name, owner="rerun")
    message = str(refused.value)
    assert "\n" not in message and "stops without writing" in message
    assert "remote-run" in message and "worker-7" in message
    assert f"rerun after {until}" in message  # what to do, and when


def test_a_dead_holder_of_a_lease_meant_to_outlive_it_is_not_taken_over(settings, pipeline_name) -> None:
    """A rewind holds its lease past its process (a rewind cut off half-way keeps the pipeline stopped until
    the same reprocess runs again): a batch on the same host does not take it over."""
    child = hold_in_child(pipeline_name, f"rewind/{pipeline_name}", ttl_s=7 * 86400)
    kill(child)
    with pytest.raises(LeaseLost, match="is being run by rewind/"):
        Lease.acquire(settings, pipeline_name, owner="a-batch")
    again = Lease.acquire(settings, pipeline_name, owner=f"rewind/{pipeline_name}")  # its owner takes it back
    again.release()


# -- (5b) renewals retried; no commit on a lapsing lease --------------------------------------------------


def test_a_failed_renewal_is_retried_and_the_lease_kept(settings, pipeline_name, monkeypatch) -> None:
    held = Lease.acquire(settings, pipeline_name, owner="long-batch", ttl_s=1.5)
    real, failures = held.renew, []

    def flaky() -> None:
        if len(failures) < 2:
            failures.append(1)
            raise StoreUnreachable("object store unreachable (a blip)")
        real()

    monkeypatch.setattr(held, "renew", flaky)
    with held.keep() as keeper:
        time.sleep(3.5)  # more than two TTLs: only renewals after the blip keep it
        assert len(failures) == 2
        with pytest.raises(LeaseLost, match="is being run by long-batch"):
            Lease.acquire(settings, pipeline_name, owner="intruder", ttl_s=1.5)
        keeper.check()
    held.release()


def test_renewals_failing_stop_the_batch_before_its_lease_lapses(settings, pipeline_name, monkeypatch) -> None:
    held = Lease.acquire(settings, pipeline_name, owner="long-batch", ttl_s=1.5)
    lapses = time.time() + 1.5
    tries = []

    def down() -> None:
        tries.append(time.time())
        raise StoreUnreachable("object store unreachable (down)")

    monkeypatch.setattr(held, "renew", down)
    stopped = None
    with held.keep() as keeper:
        while time.time() < lapses + 1 and stopped is None:
            try:
                keeper.check()
            except LeaseLost as exc:
                stopped = (time.time(), str(exc))
            time.sleep(0.02)
    assert stopped is not None, "check() let the batch commit on a lapsed lease"
    at, message = stopped
    assert at < lapses - 0.2  # before the lapse, with a margin for the commit it would start
    assert len(tries) >= 2  # the renewal was retried, not given up after one failure
    assert "\n" not in message and "renew" in message


def test_check_refuses_a_lease_past_its_expiry(settings, pipeline_name) -> None:
    """Nobody took the lease over, yet it lapsed: anyone may take it at any instant, so no commit."""
    held = Lease.acquire(settings, pipeline_name, owner="paused-run", ttl_s=0.5)
    held.check()
    time.sleep(0.7)
    with pytest.raises(LeaseLost, match="lapsed"):
        held.check()


# -- (6) conditional puts under races -------------------------------------------------------------------


def race(monkeypatch, n: int, take) -> list:
    """``n`` threads call ``take(i)`` at once; each has read the lease before any of them writes it."""
    barrier, seen, real = threading.Barrier(n, timeout=60), threading.local(), lease_mod._read

    def read_then_wait(*args, **kwargs):
        out = real(*args, **kwargs)
        if not getattr(seen, "done", False):
            seen.done = True
            barrier.wait()
        return out

    monkeypatch.setattr(lease_mod, "_read", read_then_wait)
    results: list = [None] * n

    def run(i: int) -> None:
        try:
            results[i] = take(i)
        except Exception as exc:  # noqa: BLE001 - the losers' errors are the result
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


def exactly_one_wins(results: list) -> Lease:
    winners = [r for r in results if isinstance(r, Lease)]
    losers = [r for r in results if not isinstance(r, Lease)]
    assert len(winners) == 1, results
    assert all(isinstance(r, LeaseLost) for r in losers), losers
    return winners[0]


def test_racing_acquisitions_of_a_free_lease_exactly_one_wins(settings, pipeline_name, monkeypatch) -> None:
    results = race(monkeypatch, 8, lambda i: Lease.acquire(settings, pipeline_name, owner=f"racer-{i}"))
    won = exactly_one_wins(results)
    monkeypatch.undo()
    assert won.token == 1
    won.check()
    assert lease_record(settings, pipeline_name)["owner"] == won.owner


def test_racing_takeovers_of_an_expired_lease_exactly_one_wins(settings, pipeline_name, monkeypatch) -> None:
    Lease.acquire(settings, pipeline_name, owner="lapsed", ttl_s=0.0)
    results = race(monkeypatch, 8, lambda i: Lease.acquire(settings, pipeline_name, owner=f"racer-{i}"))
    won = exactly_one_wins(results)
    monkeypatch.undo()
    assert won.token == 2
    won.check()


def test_racing_takeovers_of_a_dead_holder_exactly_one_wins(settings, pipeline_name, monkeypatch) -> None:
    child = hold_in_child(pipeline_name, "crashed-run")
    kill(child)
    results = race(monkeypatch, 8, lambda i: Lease.acquire(settings, pipeline_name, owner=f"racer-{i}"))
    won = exactly_one_wins(results)
    monkeypatch.undo()
    assert won.token == 2
    won.check()


ROW = pa.schema([("writer", pa.int64())])


@pytest.mark.parametrize("same_app", [False, True], ids=["appends", "same-app-txn"])
def test_concurrent_delta_commits_at_one_version_all_land(settings, pipeline_name, same_app) -> None:
    """N writers read version 0 and commit at once (delta-rs's commit is a put-if-absent of the next log
    entry). Plain appends do not conflict: each lands at its own version. Appends carrying a transaction of
    the same application conflict: the losers get a conflict error, reload and retry. None is lost."""
    from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
    from deltalake.exceptions import CommitFailedError
    from millpond.lake.delta_options import storage_options

    n, opts = 6, storage_options(settings)
    uri = settings.table_uri(pipeline_name, "race")
    write_deltalake(uri, pa.table({"writer": [-1]}, schema=ROW), storage_options=opts)
    handles = [DeltaTable(uri, storage_options=opts) for _ in range(n)]
    barrier, versions, conflicts = threading.Barrier(n, timeout=60), [None] * n, [0] * n

    def write(i: int) -> None:
        dt = handles[i]
        barrier.wait()
        for _ in range(2 * n):
            props = CommitProperties(app_transactions=[Transaction("race-app", i)]) if same_app else None
            try:
                write_deltalake(dt, pa.table({"writer": [i]}, schema=ROW), mode="append", commit_properties=props)
            except CommitFailedError:
                conflicts[i] += 1
                dt.update_incremental()
                continue
            versions[i] = dt.version()
            return

    threads = [threading.Thread(target=write, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    final = DeltaTable(uri, storage_options=opts)
    assert sorted(versions) == list(range(1, n + 1))  # distinct versions, each writer's own
    assert sorted(final.to_pyarrow_table().column("writer").to_pylist()) == [-1, *range(n)]
    assert final.version() == n
    if same_app:
        assert sum(conflicts) >= n - 1  # every loser saw the conflict at least once
    else:
        assert sum(conflicts) == 0


# -- (5a) what the Delta log fences -------------------------------------------------------------------------


def _props(*txns: tuple[str, int]):
    from deltalake import CommitProperties, Transaction

    return CommitProperties(app_transactions=[Transaction(app_id, version) for app_id, version in txns])


def _table(settings, pipeline: str, name: str):
    from deltalake import DeltaTable, write_deltalake
    from millpond.lake.delta_options import storage_options

    opts = storage_options(settings)
    uri = settings.table_uri(pipeline, name)
    write_deltalake(uri, pa.table({"writer": [0]}, schema=ROW), storage_options=opts)
    return DeltaTable(uri, storage_options=opts), DeltaTable(uri, storage_options=opts)


def test_delta_conflicts_a_commit_with_a_later_commit_of_the_same_app_id(settings, pipeline_name) -> None:
    """delta-rs 1.6.6: a commit carrying a txn action for app X fails ("Concurrent transaction") when a
    commit carrying a txn for X landed after its snapshot, whatever the versions; for another app it lands."""
    from deltalake import write_deltalake
    from deltalake.exceptions import CommitFailedError

    zombie, holder = _table(settings, pipeline_name, "fence_same")
    app, fence = f"millpond/{pipeline_name}", f"millpond/{pipeline_name}/fence"
    write_deltalake(holder, pa.table({"writer": [2]}, schema=ROW), mode="append",
                    commit_properties=_props((f"{app}#2", 1), (fence, 8)))  # a new holder, after a rewind
    with pytest.raises(CommitFailedError, match="Concurrent transaction"):
        write_deltalake(zombie, pa.table({"writer": [1]}, schema=ROW), mode="append",
                        commit_properties=_props((app, 3), (fence, 7)))
    other, holder = _table(settings, pipeline_name, "fence_other")
    write_deltalake(holder, pa.table({"writer": [2]}, schema=ROW), mode="append", commit_properties=_props(("Y", 8)))
    write_deltalake(other, pa.table({"writer": [1]}, schema=ROW), mode="append", commit_properties=_props(("X", 7)))
    assert other.version() == 2  # no shared app id: rebased and committed


def test_the_conflict_alone_does_not_fence_a_zombie_that_read_after_the_bump(settings, pipeline_name) -> None:
    """The conflict covers only commits after the writer's snapshot. A zombie that (re)loads its snapshot
    after the new holder's RESTORE commits on top of it, and even moves the fence's version back: the
    snapshot's own fence version must be checked too (higher than the writer's token: stop)."""
    from deltalake import write_deltalake

    zombie, holder = _table(settings, pipeline_name, "fence_late")
    fence = f"millpond/{pipeline_name}/fence"
    write_deltalake(holder, pa.table({"writer": [1]}, schema=ROW), mode="append", commit_properties=_props((fence, 7)))
    holder.restore(0, commit_properties=_props((f"millpond/{pipeline_name}/rewind", 1), (fence, 8)))
    zombie.update_incremental()  # the zombie's write opens the table after the RESTORE
    assert zombie.transaction_version(fence) == 8 > 7  # what a snapshot check would refuse on
    write_deltalake(zombie, pa.table({"writer": [9]}, schema=ROW), mode="append", commit_properties=_props((fence, 7)))
    assert zombie.transaction_version(fence) == 7  # landed after the RESTORE, fence moved back


def test_every_commit_of_a_batch_is_fenced_by_its_lease_token(settings, tables, pipeline_name) -> None:
    """Issue 37 (5): a zombie batch (an older lease token) still writing after a reprocess's rewind is refused
    by the Delta log, not by a read of the lease before the write: on a table the rewind restored, on one it
    left unchanged (only its fence is committed there), and when the rewind lands between the zombie's
    snapshot and its commit (delta-rs's conflict check). The batches after the rewind are not refused."""
    from deltalake import DeltaTable, write_deltalake
    from millpond.errors import MillpondError
    from millpond.lake.delta_options import Txn, _commit, fence_app, storage_options
    from millpond.lake.landing import arrival_tag
    from millpond.lake.objectstore import ObjectStore
    from millpond.model.spec import pipeline_from_dict
    from millpond.model.timeutil import US, to_datetime, to_us
    from millpond.runtime import rewind
    from millpond.runtime.job import run_batch

    t0, minute = to_us("2026-05-01T00:00:00Z"), 60 * US
    spec = pipeline_from_dict({
        "name": pipeline_name, "source": {"prefix": f"{pipeline_name}/"}, "value_type": "int", "aggregation": "sum",
        "window": {"type": "fixed", "size": "1m"}, "accumulation": "accumulating", "trigger": "AtWatermark()",
        "allowed_lateness": "10m", "batch_interval": "1m", "watermark": {"policy": "processing_time", "lag": "0s"}})
    store = ObjectStore(settings)
    for m in range(3):
        body = json.dumps({"id": f"e{m}", "key": "k", "value": m + 1,
                           "event_time": to_datetime(t0 + m * minute + 5 * US).isoformat()}) + "\n"
        if m == 0:
            body += '{"id": "bad"\n'  # quarantine: written by batch 1 only, unchanged by the rewind to batch 2
        store.put_bytes(settings.bucket_landing, f"{pipeline_name}/{arrival_tag(t0 + m * minute + 9 * US)}-f.jsonl",
                        body.encode())
    for m in range(1, 4):
        run_batch(settings, spec, to_datetime(t0 + m * minute))
    zombie_txn = Txn(app_id=f"millpond/{pipeline_name}", version=4, fence=(fence_app(pipeline_name), 1))
    uri = tables.uri(pipeline_name, "quarantine")
    before_rewind = DeltaTable(uri, storage_options=storage_options(settings))  # a zombie's snapshot
    quarantine_rows = tables.read_arrow(pipeline_name, "quarantine").num_rows
    rewind.run(settings, tables, spec, t0 + 2 * minute, by="test")
    for name in ("panes", "quarantine"):
        version = tables.version(pipeline_name, name)
        with pytest.raises(LeaseLost, match="fenced off"):
            tables.append(pipeline_name, name, tables.read_arrow(pipeline_name, name).slice(0, 1), txn=zombie_txn)
        assert tables.version(pipeline_name, name) == version
    with pytest.raises(Exception, match="Concurrent transaction"):  # noqa: B017 - delta-rs's CommitFailedError
        write_deltalake(before_rewind, tables.read_arrow(pipeline_name, "quarantine").slice(0, 1), mode="append",
                        commit_properties=_commit(zombie_txn))
    assert tables.read_arrow(pipeline_name, "quarantine").num_rows == quarantine_rows
    result = run_batch(settings, spec, to_datetime(t0 + 3 * minute))  # the reprocess's own batch is not fenced
    assert result.batch == 3 and not result.skipped
    assert isinstance(LeaseLost("x"), MillpondError)
