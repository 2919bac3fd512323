"""One place chooses the engine (``runtime.engines.choose``), and every entry point asks it: the deployment's
``engine.name``, or a command's ``--engine``; with spark, nothing answering at the Connect endpoint is one
line naming `make up` and `--engine local`, never a silent in-process run. (On a running Connect server:
tests/test_spark_connect.py.)"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
from millpond.config import load_settings
from millpond.errors import MillpondError
from millpond.orchestration.processes import free_port
from millpond.runtime.engines import choose, engine_for, spark_for
from millpond.runtime.microbatch import BatchResult
from millpond.surface.cli import main

SCENARIOS = Path(__file__).parent / "scenarios"


def _nowhere() -> str:
    """A Connect endpoint nothing listens at."""
    return f"sc://127.0.0.1:{free_port()}"


@pytest.mark.unit
def test_the_deployments_engine_unless_a_command_forces_one() -> None:
    spark, local = (load_settings(env={"MILLPOND_ENGINE": e}) for e in ("spark", "local"))
    assert load_settings(env={}).engine == "spark"  # the shipped conf/millpond.yaml (docs/settings.md)
    assert engine_for(spark) == "spark" and engine_for(local) == "local"
    assert engine_for(spark, "local") == "local" and engine_for(local, "spark") == "spark"
    with pytest.raises(MillpondError, match="engine 'flink': use local or spark"):
        engine_for(local, "flink")
    # local: no session, nothing dialled (the endpoint here answers nothing)
    chosen, session = choose(spark.with_overrides(spark_connect=_nowhere()), "local")
    assert (chosen.engine, session) == ("local", None)
    assert spark_for(local.with_overrides(spark_connect=_nowhere())) is None


@pytest.mark.unit
def test_spark_with_no_server_is_one_line_that_says_what_to_do() -> None:
    s = load_settings(env={"MILLPOND_ENGINE": "spark"}).with_overrides(spark_connect=_nowhere())
    with pytest.raises(MillpondError) as err:
        choose(s, hint="or run in-process with --engine local")
    text = str(err.value)
    assert "is not answering: start it with `make up`" in text and text.endswith("--engine local")
    assert "\n" not in text
    with pytest.raises(MillpondError) as err:  # forced spark over a local deployment: the same
        choose(load_settings(env={"MILLPOND_ENGINE": "local"}).with_overrides(spark_connect=_nowhere()), "spark")
    assert "`make up`" in str(err.value)


@pytest.mark.unit
def test_the_summary_names_the_engine_that_ran() -> None:
    at = datetime(2026, 1, 1, 12, tzinfo=UTC)
    assert "; engine spark/plan; plan 0.10s" in BatchResult("p", 1, at, at, {"input": 1}, {"plan": 0.1},
                                                            engine="spark/plan").summary()
    assert "engine" not in BatchResult("p", 1, at, at, skipped=True, reason="done").summary()


@pytest.mark.unit
@pytest.mark.parametrize("command", ["batch", "replay", "replay-spark", "run"])
def test_commands_on_spark_with_no_server_fail_in_one_line(command, monkeypatch, capsys, tmp_path) -> None:
    """`millpond batch`, `replay`, `run --direct` with engine spark and nothing at the endpoint: exit 1, one line
    naming `make up` and `--engine local`; `replay --spark` (deprecated) says so once and means --engine spark."""
    monkeypatch.setenv("MILLPOND_ENGINE", "local" if command == "replay-spark" else "spark")
    monkeypatch.setenv("MILLPOND_SPARK_CONNECT", _nowhere())
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(json.dumps({"name": "p_nowhere", "window": {"type": "sessions", "gap": "1m"}}))
    scenario = ["--pipeline", str(SCENARIOS / "fig14_sessions_retracting.yaml"),
                "--events", str(SCENARIOS / "fig14_sessions_retracting.jsonl")]
    argv = {"batch": ["batch", str(pipeline), "--at", "2026-01-01T12:05:00Z"], "replay": ["replay", *scenario],
            "replay-spark": ["replay", *scenario, "--spark"],
            "run": ["run", "--direct", "--pipelines", "no_such_pipeline"]}[command]
    if command == "run":  # its pipelines are checked first: an unknown one is its own line
        assert main(argv) == 1 and "unknown pipeline(s) no_such_pipeline" in capsys.readouterr().err
        argv = ["run", "--direct", "--batches", "1"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    if command == "replay-spark":
        assert err[0] == "millpond: replay --spark is deprecated: use --engine spark"
        err = err[1:]
    assert len(err) == 1, err
    assert err[0].startswith("millpond: error: Spark Connect server at sc://127.0.0.1:") and "`make up`" in err[0]
    assert err[0].endswith("or run in-process with --engine local"), err[0]


@pytest.mark.unit
def test_replay_refuses_spark_and_local_at_once(capsys) -> None:
    argv = ["replay", "--pipeline", str(SCENARIOS / "fig14_sessions_retracting.yaml"),
            "--events", str(SCENARIOS / "fig14_sessions_retracting.jsonl"), "--spark", "--engine", "local"]
    assert main(argv) == 1
    assert "--spark and --engine local contradict each other" in capsys.readouterr().err


def test_batch_told_local_runs_in_process_where_the_deployment_says_spark(settings, monkeypatch, capsys, tmp_path,
                                                                         pipeline_name) -> None:
    """`millpond batch --engine local`: the batch runs in this process; the Connect endpoint (nothing there)
    is never dialled."""
    from millpond.lake.landing import arrival_tag
    from millpond.lake.objectstore import ObjectStore
    from millpond.model.timeutil import to_us

    monkeypatch.setenv("MILLPOND_ENGINE", "spark")
    monkeypatch.setenv("MILLPOND_SPARK_CONNECT", _nowhere())
    conf = tmp_path / f"{pipeline_name}.yaml"
    conf.write_text(json.dumps({"name": pipeline_name, "window": {"type": "sessions", "gap": "1m"},
                                "batch_interval": "1m"}))
    body = "".join(json.dumps({"id": f"e{i}", "key": "k", "value": i, "event_time": "2026-01-01T12:01:00Z"}) + "\n"
                   for i in range(3))
    ObjectStore(settings).put_bytes(settings.bucket_landing,
                                    f"{pipeline_name}/{arrival_tag(to_us('2026-01-01T12:02:00Z'))}-a.jsonl",
                                    body.encode())
    assert main(["batch", str(conf), "--at", "2026-01-01T12:03:00Z", "--engine", "local"]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert "input 3, accepted 3" in summary and "; engine local/in-process; " in summary, summary
    from millpond.surface.inputs import history

    marker = history(settings, pipeline_name)[0].select(["engine", "strategy"]).to_pylist()
    assert marker == [{"engine": "local", "strategy": "in-process"}]  # the marker names what ran
