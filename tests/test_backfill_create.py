"""A backfill's create against an Airflow whose database stays locked (SQLite under a busy scheduler): refused with
a 500 "Database error" or a 503 "locked" for longer than six tries (CI, two test workers: over 25 s), it is asked
again until ``backfill.LOCKED_PATIENCE_S`` has passed, then ends with one line. Airflow's answers are injected into
the real ``Backfill`` (as ``tests/test_airflow_dagtest.py`` injects a half-made create)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import airflow_env
import pytest
from millpond.config import load_settings
from millpond.errors import ApiRefused, MillpondError
from millpond.orchestration import backfill

T0 = datetime(2026, 1, 5, 12, 0, tzinfo=UTC)
LOCKED = ('Airflow API POST /api/v2/backfills answered 500: {"detail":{"reason":"Database error","statement":'
          '"hidden"}}', 500)


class Locked(backfill.Backfill):
    """Airflow refusing the first ``refusals`` creates as a locked database does, then making the backfill."""

    def __init__(self, *args, refusals: int, answer: tuple[str, int] = LOCKED, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.refusals, self.answer, self.asked = refusals, answer, 0

    def api(self, method: str, path: str, body=None):
        assert (method, path) == ("POST", "/backfills"), (method, path)
        self.asked += 1
        if self.asked <= self.refusals:
            raise ApiRefused(*self.answer)
        return {"id": 7, "dag_id": self.dag_id}


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(backfill.time, "sleep", lambda s: None)  # the waits, not their length, are under test
    return load_settings(env={}).with_overrides(conf_dir=airflow_env.write_conf_dir(tmp_path / "conf"))


@pytest.mark.unit
@pytest.mark.parametrize("answer", [LOCKED, ("Airflow API POST /api/v2/backfills answered 503: database is locked",
                                              503)])
def test_a_create_waits_out_a_database_locked_longer_than_six_tries(settings, answer) -> None:
    made = Locked(settings, airflow_env.PIPELINE, T0, T0 + timedelta(minutes=5), stack=object(), refusals=9,
                  answer=answer)
    assert made.create() == {"id": 7, "dag_id": made.dag_id} and made.asked == 10


@pytest.mark.unit
def test_a_create_still_refused_past_its_patience_ends_with_one_line(settings) -> None:
    made = Locked(settings, airflow_env.PIPELINE, T0, T0 + timedelta(minutes=5), stack=object(), refusals=10**6)
    with pytest.raises(MillpondError, match=r"Airflow kept refusing a backfill of millpond_\w+ .*run it again"):
        made.create(locked_for_s=0.0)
    assert made.asked == 1
