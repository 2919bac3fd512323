"""The foundation against the real embedded store: Delta round trips, idempotent commits, errors."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pyarrow as pa
import pytest
from millpond.errors import BadCredentials, BucketMissing, MillpondError, StoreUnreachable
from millpond.lake.objectstore import ObjectStore
from millpond.lake.tables import Tables, Txn
from millpond.orchestration.store import EmbeddedStore


def rows(t: pa.Table) -> list[dict]:
    return sorted(t.to_pylist(), key=lambda r: r["k"])


def test_delta_roundtrip_merge_update_insert_delete(tables: Tables, pipeline_name: str) -> None:
    base = pa.table({"k": ["a", "b", "c"], "v": [1, 2, 3], "gone": [False, False, False]})
    assert tables.append(pipeline_name, "t", base)
    change = pa.table({"k": ["b", "c", "d"], "v": [20, 0, 4], "gone": [False, True, False]})
    metrics = tables.merge(pipeline_name, "t", change, on=["k"], delete_when="s.gone")
    assert metrics["num_target_rows_updated"] == 1
    assert metrics["num_target_rows_deleted"] == 1
    assert metrics["num_target_rows_inserted"] == 1
    got = rows(tables.read_arrow(pipeline_name, "t"))
    assert got == [
        {"k": "a", "v": 1, "gone": False},
        {"k": "b", "v": 20, "gone": False},
        {"k": "d", "v": 4, "gone": False},
    ]
    # Time travel and history: version 0 is the first append.
    assert rows(tables.read_arrow(pipeline_name, "t", version=0)) == rows(base)
    ops = [h["operation"] for h in tables.history(pipeline_name, "t")]
    assert ops[0] == "MERGE" and "WRITE" in ops


def test_idempotent_commit_is_skipped_on_retry(tables: Tables, pipeline_name: str) -> None:
    data = pa.table({"k": ["x"], "v": [1]})
    txn = Txn(app_id=f"{pipeline_name}", version=7)
    assert tables.append(pipeline_name, "t", data, txn=txn) is True
    assert tables.append(pipeline_name, "t", data, txn=txn) is False  # the retry
    assert tables.merge(pipeline_name, "t", data, on=["k"], txn=txn) is None
    assert tables.read_arrow(pipeline_name, "t").num_rows == 1
    assert tables.txn_version(pipeline_name, "t", pipeline_name) == 7
    assert tables.append(pipeline_name, "t", data, txn=Txn(pipeline_name, 8)) is True
    assert tables.read_arrow(pipeline_name, "t").num_rows == 2


def test_replace_is_one_commit_at_its_base_version_and_an_append_after(tables: Tables, pipeline_name: str) -> None:
    """A compaction that drops rows in the commit that adds new ones: only over the version the rows
    were derived from; a table that moved on gets the new rows appended, and a retry is skipped."""
    def ids() -> list[str]:
        return sorted(tables.read_arrow(pipeline_name, "t").column("id").to_pylist())

    for i in range(3):
        tables.append(pipeline_name, "t", pa.table({"id": [f"a{i}"]}))
    base = tables.version(pipeline_name, "t")
    kept = pa.table({"id": ["a1", "a2"]})  # a0 expires
    assert tables.replace(pipeline_name, "t", pa.concat_tables([kept, pa.table({"id": ["b"]})]),
                          pa.table({"id": ["b"]}), base, txn=Txn(pipeline_name, 1), unique=["id"]) is True
    assert ids() == ["a1", "a2", "b"] and len(tables.open(pipeline_name, "t").file_uris()) == 1
    assert tables.replace(pipeline_name, "t", kept, pa.table({"id": ["b"]}), base,
                          txn=Txn(pipeline_name, 1)) is False  # the retry (the table moved on: it appends, skipped)
    # Rows derived from an older version replace nothing: the new ones are appended, nothing is lost.
    assert tables.replace(pipeline_name, "t", pa.table({"id": ["c"]}), pa.table({"id": ["c"]}), base,
                          txn=Txn(pipeline_name, 2)) is True
    assert ids() == ["a1", "a2", "b", "c"]


def test_read_whole_reads_each_data_file_once_and_sees_every_kind_of_commit(tables: Tables,
                                                                             pipeline_name: str) -> None:
    """The bookkeeping tables are read whole by every batch: files read before are reused (a Delta data
    file never changes), and appends, compactions, overwrites, MERGEs and another writer's commits all
    give the rows ``read_arrow`` gives, in its order."""
    schema = pa.schema([("k", pa.string()), ("v", pa.int64())])
    assert tables.read_whole(pipeline_name, "t", schema) == schema.empty_table()  # not created yet

    def same() -> pa.Table:
        got = tables.read_whole(pipeline_name, "t", schema)
        assert got.equals(tables.read_arrow(pipeline_name, "t"))
        return got

    tables.append(pipeline_name, "t", pa.table({"k": ["k0"], "v": [0]}, schema=schema))
    same()
    kept = tables._file_rows[tables.uri(pipeline_name, "t")]
    for i in range(1, 4):
        tables.append(pipeline_name, "t", pa.table({"k": [f"k{i}"], "v": [i]}, schema=schema))
        before = dict(kept.files)
        assert sorted(same().column("v").to_pylist()) == list(range(i + 1))
        assert all(kept.files[p] is rows for p, rows in before.items())  # reused, not read again
        assert len(kept.files) == len(before) + 1
    assert tables.compact(pipeline_name, "t", over_files=2)
    assert sorted(same().column("v").to_pylist()) == [0, 1, 2, 3] and len(kept.files) == 1
    tables.merge(pipeline_name, "t", pa.table({"k": ["k1", "k9"], "v": [10, 9]}, schema=schema), on=["k"])
    assert sorted(same().column("v").to_pylist()) == [0, 2, 3, 9, 10]
    # another process's commit, seen through the snapshot's update
    code = ("import pyarrow as pa; from millpond.config import load_settings; from millpond.lake.tables import Tables; "
            f"Tables(load_settings()).append({pipeline_name!r}, 't', pa.table({{'k': ['x'], 'v': [42]}}))")
    subprocess.run([sys.executable, "-c", code], check=True)  # the session's store, from the environment
    assert 42 in same().column("v").to_pylist()
    tables.overwrite(pipeline_name, "t", pa.table({"k": ["z"], "v": [7]}, schema=schema))
    assert same().to_pylist() == [{"k": "z", "v": 7}] and len(kept.files) == 1


def test_reads_at_a_version_see_that_version_in_any_order_and_from_any_thread(tables: Tables,
                                                                               pipeline_name: str) -> None:
    """A batch reads its state at the versions its plan pinned; the one snapshot kept per table for
    those reads moves forward and back between versions, and two threads never see each other's."""
    from concurrent.futures import ThreadPoolExecutor

    for v in range(12):
        tables.append(pipeline_name, "t", pa.table({"k": [f"k{v}"], "v": [v]}))
        if v == 5:
            assert tables.checkpoint(pipeline_name, "t")

    def at(version: int) -> list[int]:
        return sorted(tables.read_arrow(pipeline_name, "t", columns=["v"], version=version).column("v").to_pylist())

    def sql_at(version: int) -> list[int]:
        return sorted(tables.select(pipeline_name, "t", "v >= 0", columns=["v"], version=version)
                      .column("v").to_pylist())

    order = [3, 4, 9, 11, 2, 7, 7, 0, 10]  # forward one, forward past a checkpoint, back, the same again
    assert [at(v) for v in order] == [list(range(v + 1)) for v in order]
    assert [sql_at(v) for v in order] == [list(range(v + 1)) for v in order]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda v: (at(v), sql_at(v)), order * 6))
    assert got == [(list(range(v + 1)),) * 2 for v in order * 6]
    assert tables.read_arrow(pipeline_name, "t").num_rows == 12  # the latest snapshot is untouched
    with pytest.raises(MillpondError):
        tables.read_arrow(pipeline_name, "t", version=40)  # a version the table never had
    assert at(8) == list(range(9))  # and the next read at a version still works


def test_spark_reads_delta_table(spark, tables: Tables, pipeline_name: str) -> None:
    tables.append(pipeline_name, "t", pa.table({"k": ["a", "b"], "v": [1, 2]}))
    df = tables.read_spark(spark, pipeline_name, "t")
    assert df.groupBy().sum("v").collect()[0][0] == 3


def test_wrong_credentials_are_refused(settings) -> None:
    bad = ObjectStore(settings.with_overrides(s3_secret_key="not-the-secret"))
    with pytest.raises(BadCredentials, match="refused the credentials"):
        bad.check()
    with pytest.raises(MillpondError, match="credentials|refused|failed"):
        Tables(settings.with_overrides(s3_secret_key="not-the-secret")).append("x", "t", pa.table({"k": [1]}))


def test_missing_bucket_is_named(settings) -> None:
    with pytest.raises(BucketMissing, match="no-such-bucket"):
        ObjectStore(settings.with_overrides(bucket_reports="no-such-bucket")).check()


def test_store_down_gives_clear_error_and_restart_keeps_data(tmp_path, tables: Tables, pipeline_name: str) -> None:
    """A second, private store: stop it and see the one-line error, not a stack trace."""
    from conftest import free_store_env
    from millpond.config import load_settings

    env = free_store_env(tmp_path)
    s = load_settings(env=env)
    store = EmbeddedStore(s)
    assert store.start() is True
    try:  # stopped whatever fails (``stop`` is idempotent): no store outlives the test
        assert store.start() is False  # idempotent
        # every port it listens on is one it was given (the session's store runs too: weed would shift a busy one)
        pinned = {q for p in s.weed_ports.values() for q in (p, p + 10000)}
        proc = psutil.Process(int(store.pidfile.read_text()))
        listening = {c.laddr.port for c in proc.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        assert listening and listening <= pinned, sorted(listening - pinned)
        # and every data file it keeps is in its own directory (WebDAV's cache went to a new /tmp dir per start)
        kept = {f.path for f in proc.open_files() if f.path.endswith((".dat", ".idx", ".ldb", "LOCK"))}
        assert kept and all(Path(f).is_relative_to(store.data_dir) for f in kept), sorted(kept)[:5]
        Tables(s).append(pipeline_name, "t", pa.table({"k": ["a"]}))
        assert store.stop() is True
        assert store.stop() is False
        with pytest.raises(StoreUnreachable, match="make up"):
            ObjectStore(s).check()
        # The CLI prints one line and exits non-zero.
        proc = subprocess.run(
            [sys.executable, "-m", "millpond", "check"], capture_output=True, text=True, env={**_base_env(), **env}
        )
        assert proc.returncode != 0
        assert proc.stderr.strip().count("\n") == 0 and "unreachable" in proc.stderr
        # Restarted on the same data dir: the committed table is still there.
        store.start()
        assert Tables(s).read_arrow(pipeline_name, "t").num_rows == 1
    finally:
        store.stop()


def test_a_generic_s3_error_while_the_store_stops_is_called_unreachable(settings) -> None:
    """Commits of different tables run at once: one can fail ("Generic S3 error") while the store is still
    shutting down and accepting connections. The error waits a moment for the endpoint to close, and says
    what to do, not a bare Delta failure (CI saw the bare one once, the store a few ms from gone)."""
    import socket
    import threading

    from millpond.lake.delta_options import _wrap, store_failure

    listener = socket.create_server(("127.0.0.1", 0))
    endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
    closer = threading.Timer(0.8, listener.close)
    closer.start()
    try:
        err = _wrap(OSError("Kernel error -> Generic S3 error"), "s3://lake/t", settings.with_overrides(
            s3_endpoint=endpoint))
    finally:
        closer.cancel()
        listener.close()
    assert isinstance(err, StoreUnreachable) and "make up" in str(err), err
    # A store that stays up: the error is the Delta operation's own, after the settle time; at a batch's boundary
    # such an error is left to the batch's own failure line (its way forward), as is anything not the store's.
    with socket.create_server(("127.0.0.1", 0)) as up:
        up_settings = settings.with_overrides(s3_endpoint=f"http://127.0.0.1:{up.getsockname()[1]}")
        err = _wrap(OSError("Kernel error -> Generic S3 error"), "s3://lake/t", up_settings)
        assert store_failure(OSError("Kernel error -> Generic S3 error"), up_settings) is None
    assert not isinstance(err, StoreUnreachable) and "Generic S3 error" in str(err)
    assert store_failure(ValueError("Generic S3 error"), settings) is None
    assert store_failure(OSError("[Errno 2] No such file or directory"), settings) is None


def test_busy_port_is_reported(tmp_path) -> None:
    import socket

    from conftest import free_store_env
    from millpond.config import load_settings

    env = free_store_env(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", int(env["MILLPOND_S3_PORT"])))
        s.listen()
        with pytest.raises(MillpondError, match="in use"):
            EmbeddedStore(load_settings(env=env)).start()


def test_free_ports_stay_below_the_ephemeral_range(tmp_path) -> None:
    """A store's ports and their gRPC twins are below the range the kernel picks connections' own ports from,
    so a store restarted after an outage finds them still free; the ports differ from each other."""
    from millpond.orchestration.processes import ephemeral_ports, free_port
    from millpond.orchestration.store import PORT_VARS, isolated_store_env

    low = ephemeral_ports()[0]
    env = isolated_store_env(tmp_path)
    ports = [int(env[var]) for var in PORT_VARS.values()]
    assert len({*ports, *(p + 10000 for p in ports)}) == 2 * len(ports)
    assert all(p + 10000 < low for p in ports), (ports, low)
    assert free_port() < low and free_port(twin=10000) + 10000 < low


def test_a_free_port_is_not_handed_to_another_process_while_its_taker_is_down(monkeypatch) -> None:
    """A store stopped for an outage leaves its ports unbound until it restarts; another process's free port
    (a second test worker's server) must not be one of them, or the restart fails on a port in use (a CI run
    failed so). Both processes pick with the same seeded sequence, so without the lease they pick alike."""
    import random

    from millpond.orchestration import processes

    class Seeded(random.Random):
        def __init__(self) -> None:
            super().__init__(20261204)

    monkeypatch.setattr(processes.random, "SystemRandom", Seeded)
    mine = {processes.free_port(twin=10000), processes.free_port()}  # handed out, not bound: a store that is down
    other = ("import random, sys\n"
             "from millpond.orchestration import processes\n"
             "class Seeded(random.Random):\n"
             "    def __init__(self):\n"
             "        super().__init__(20261204)\n"
             "processes.random.SystemRandom = Seeded\n"
             "print(processes.free_port(twin=10000), processes.free_port())\n")
    theirs = set(map(int, subprocess.run([sys.executable, "-c", other], capture_output=True, text=True,
                                         check=True).stdout.split()))
    assert len(theirs) == 2 and not theirs & mine, (mine, theirs)
    assert all(processes.port_free(p) for p in mine | theirs)  # free to bind: leased, not held


def test_stopping_a_service_stops_a_child_that_outlives_its_leader(tmp_path) -> None:
    """A service whose leader exits on SIGTERM while its child ignores it (a Spark driver program stuck in its
    shutdown once its JVM has gone): stopping it leaves no process of its group, and soon."""
    import time

    from millpond.orchestration.processes import FOLLOW_S, group_members, stop_group

    child = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
             "time.sleep(600)")
    leader = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', sys.argv[1]], "
              "stdout=subprocess.PIPE, text=True); p.stdout.readline(); print(p.pid, flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", leader, child], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        child_pid = int(proc.stdout.readline())
        pidfile = tmp_path / "service.pid"
        pidfile.write_text(str(proc.pid))
        assert sorted(group_members(proc.pid)) == sorted([proc.pid, child_pid])
        started = time.monotonic()
        assert stop_group(pidfile) is True
        took = time.monotonic() - started
        assert group_members(proc.pid) == [] and not pidfile.exists()
        assert took < FOLLOW_S + 5, took  # not the whole SIGTERM wait
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("MILLPOND_")}


def test_table_noun_restores_a_version_as_a_new_commit(tables, pipeline_name) -> None:
    """``restore`` makes an old version's rows current as a new commit; history and time travel keep the rest."""
    table = tables.table(pipeline_name, "noun")
    first = pa.table({"k": ["a", "b"], "v": pa.array([1, 2], pa.int64())})
    assert table.append(first, txn=Txn("noun-test", 1))
    assert table.append(pa.table({"k": ["c"], "v": pa.array([3], pa.int64())}), txn=Txn("noun-test", 2))
    assert not table.append(first, txn=Txn("noun-test", 2))  # a retry of an applied transaction is skipped
    assert table.read().num_rows == 3 and table.version() == 1
    restored = table.restore(0, txn=Txn("noun-restore", 1))
    assert restored == 2
    assert sorted(table.read().column("k").to_pylist()) == ["a", "b"]
    assert table.read(version=1).num_rows == 3  # time travel still sees the undone commit
    assert table.restore(0, txn=Txn("noun-restore", 1)) is None  # applied already: no second commit
    assert [h["operation"] for h in table.history()][0] == "RESTORE"


def test_a_cluster_master_ui_that_answers_html_is_not_up_yet(settings, tmp_path: Path) -> None:
    """While the standalone master's web UI starts (or when another server answers on its port), ``/json/`` can
    return an HTML page: that is "no worker registered yet", to be asked again until the start's deadline, not a
    JSON error that ends the start at once (a CI run failed so)."""
    import http.server
    import threading

    from millpond.orchestration.processes import free_port
    from millpond.orchestration.spark_server import StandaloneCluster

    class Html(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = b'<!DOCTYPE html><html data-bs-theme="light"><body>Spark</body></html>'
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    port = free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Html)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cluster = StandaloneCluster(settings.with_overrides(home=tmp_path), workers=2)
        assert cluster.alive_workers(port) == 0
    finally:
        server.shutdown()
        server.server_close()


def test_a_cluster_start_that_fails_midway_stops_the_jvms_it_launched(settings, tmp_path: Path) -> None:
    """A start that ends by any error while it waits (a failed probe, an interrupt), not only by its own timeout,
    stops the master and the workers it launched: no JVM outlives the failed start."""
    from millpond.orchestration.processes import group_members, read_pid
    from millpond.orchestration.spark_server import StandaloneCluster

    class ProbeFails(StandaloneCluster):
        def alive_workers(self, ui_port: int) -> int:
            self.launched = [read_pid(self.pidfile(role)) for role in ("master", "worker0")]
            raise RuntimeError("probe failed")

    cluster = ProbeFails(settings.with_overrides(home=tmp_path), workers=1)
    with pytest.raises(RuntimeError, match="probe failed"):
        cluster.start(timeout=30)
    assert all(cluster.launched), "the start launched a master and a worker before its first probe"
    assert [pid for pid in cluster.launched if group_members(pid)] == [], "a JVM outlived the failed start"
