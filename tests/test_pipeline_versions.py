"""Pipeline files are strict, and a pipeline's semantic spec has a fingerprint whose changes are classified:
reinterpreting stored state (breaking) or safe by construction."""

from __future__ import annotations

import pytest
from millpond.config.pipelines import load_pipelines
from millpond.model.spec import pipeline_from_dict
from millpond.model.versions import changes, fingerprint, semantic_spec

pytestmark = pytest.mark.unit

BASE = {"name": "p", "window": {"type": "sessions", "gap": "5m"}, "trigger": "AtWatermark()",
        "accumulation": "accumulating", "aggregation": "sum", "allowed_lateness": "1h"}


@pytest.mark.parametrize(("doc", "message"), [
    ({**BASE, "allowed_latenes": "2h"}, "unknown key 'allowed_latenes': did you mean 'allowed_lateness'?"),
    ({**BASE, "source": {"prefx": "p/"}}, "unknown key source.'prefx': did you mean 'prefix'?"),
    ({**BASE, "watermark": {"policy": "processing_time", "lags": "1m"}}, "unknown key watermark.'lags'"),
    ({**BASE, "dedup": "3h"}, "dedup: expected a mapping"),
    ({**BASE, "colour": "blue"}, "unknown key 'colour': use one of name, description"),
])
def test_unknown_pipeline_keys_are_errors(doc: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("?", r"\?")):
        pipeline_from_dict(doc)


def test_shipped_pipelines_load() -> None:
    assert set(load_pipelines()) >= {"video_sessions", "query_counts", "zeitgeist"}


def test_breaking_and_safe_changes() -> None:
    old = semantic_spec(BASE)
    assert fingerprint(old) == fingerprint(semantic_spec(dict(BASE)))
    for field, value in [("window", {"type": "sessions", "gap": "10m"}), ("trigger", "Repeat(AtWatermark())"),
                         ("accumulation", "discarding"), ("aggregation", "max"), ("value_type", "float")]:
        new = semantic_spec({**BASE, field: value})
        assert changes(old, new) == ([field], []), field
        assert fingerprint(new) != fingerprint(old)
    longer = semantic_spec({**BASE, "allowed_lateness": "3h", "description": "now documented"})
    assert changes(old, longer) == ([], ["description", "allowed_lateness"])
    assert fingerprint(longer) == fingerprint(old)
    shorter = semantic_spec({**BASE, "allowed_lateness": "10m"})
    assert changes(old, shorter) == (["allowed_lateness (shorter)"], [])
