"""The documented extension points: a custom window function (assign + merge) and a user combiner
(create / add / merge / extract, with uncombine), named in a pipeline config and run by the real job."""

from __future__ import annotations

from millpond.model.aggregations import Combiner
from millpond.model.spec import pipeline_from_dict
from millpond.model.timeutil import parse_duration
from millpond.model.windows import Window, WindowFn
from millpond.surface.replay import replay


class Bursts(WindowFn):
    """Sessions whose gap grows with the hour of day (a data-driven, merging window function)."""

    merging = True

    def __init__(self, gap: str, night_gap: str) -> None:
        self.gap, self.night_gap = parse_duration(gap), parse_duration(night_gap)

    def assign(self, ts: int) -> list[Window]:
        hour = (ts // 3_600_000_000) % 24
        return [Window(ts, ts + (self.night_gap if hour < 6 else self.gap))]

    def merge(self, windows: list[Window]) -> list[tuple[Window, list[Window]]]:
        out: list[tuple[Window, list[Window]]] = []
        for w in sorted(set(windows)):
            if out and out[-1][0].intersects(w):
                out[-1] = (out[-1][0].span(w), out[-1][1] + [w])
            else:
                out.append((w, [w]))
        return out


class DistinctCount(Combiner):
    """Distinct values seen (JSON-serialisable accumulator: a sorted list)."""

    output_type = "int"

    def create(self) -> list:
        return []

    def add(self, acc: list, value) -> list:
        return sorted(set(acc) | {value})

    def merge(self, accs: list[list]) -> list:
        return sorted(set().union(*accs))

    def extract(self, acc: list) -> int:
        return len(acc)


def ev(i: int, key: str, value: int, t: str, arrival: str) -> dict:
    return {"id": str(i), "key": key, "value": value, "event_time": f"2026-05-01T{t}Z",
            "arrival_time": f"2026-05-01T{arrival}Z"}


def test_custom_window_and_combiner_through_the_job(settings, tables, pipeline_name) -> None:
    spec = pipeline_from_dict({
        "name": pipeline_name, "source": {"prefix": f"{pipeline_name}/"},
        "window": {"type": "custom", "class": "test_custom_strategies:Bursts", "gap": "1m", "night_gap": "10m"},
        "aggregation": "test_custom_strategies:DistinctCount", "accumulation": "accumulating_and_retracting",
        "trigger": "AtWatermark(early=AtCount(1))", "allowed_lateness": "0s", "batch_interval": "1m",
        "watermark": {"policy": "explicit", "values": ["2026-05-01T00:00:00Z", "2026-05-01T00:00:00Z"]},
    })
    events = [
        ev(1, "a", 7, "03:00:00", "12:00:10"), ev(2, "a", 7, "03:05:00", "12:00:20"),  # night: 10m gap merges
        ev(3, "a", 9, "12:00:00", "12:00:30"),  # day: its own 1m session
        ev(4, "a", 8, "03:12:00", "12:01:10"),  # extends the night session: retraction, then 2 distinct
    ]
    panes = replay(settings, spec, events)
    got = [(p["batch"], p["window_start"][11:19], p["window_end"][11:19], p["kind"][0], p["value"], p["timing"])
           for p in panes]
    assert got == [
        (1, "03:00:00", "03:15:00", "v", 1, "EARLY"),
        (1, "12:00:00", "12:01:00", "v", 1, "EARLY"),
        (2, "03:00:00", "03:15:00", "r", 1, "EARLY"),
        (2, "03:00:00", "03:22:00", "v", 2, "EARLY"),
        (3, "03:00:00", "03:22:00", "r", 2, "ON_TIME"),
        (3, "03:00:00", "03:22:00", "v", 2, "ON_TIME"),
        (3, "12:00:00", "12:01:00", "r", 1, "ON_TIME"),
        (3, "12:00:00", "12:01:00", "v", 1, "ON_TIME"),
    ]
    current = tables.read_arrow(pipeline_name, "current").to_pylist()
    assert sorted(r["value"] for r in current) == [1, 2]


def test_unknown_custom_class_is_a_clear_error() -> None:
    import pytest

    with pytest.raises(ValueError, match="not a millpond.model.windows.WindowFn"):
        pipeline_from_dict({"name": "x", "window": {"type": "custom", "class": "test_custom_strategies:DistinctCount"}})
    with pytest.raises(ValueError, match="unknown aggregation"):
        pipeline_from_dict({"name": "x", "aggregation": "median"})


def test_a_window_s_elements_added_together_equal_one_by_one() -> None:
    """The engine hands a window its batch's elements at once (``add_all``): every builtin combiner and a
    user combiner without an override give what ``add`` gives element by element, onto an accumulator
    that already holds earlier batches, float rounding included (a regrouped float sum differs)."""
    from millpond.model.aggregations import BUILTIN

    floats = [1.0, 1.0, -1e16, 0.1, 0.3]  # onto 1e16: 1.0 is below its rounding step, 2.0 is not
    ints = [5, -3, 12, 0, 7]
    for name, cls in [*BUILTIN.items(), ("distinct", DistinctCount)]:
        comb = cls()
        for first, values in ((1e16, floats), (4, ints), (4, [])):
            start = comb.add(comb.create(), first)
            one_by_one = start
            for v in values:
                one_by_one = comb.add(one_by_one, v)
            assert comb.add_all(start, list(values)) == one_by_one, (name, values)
    assert BUILTIN["sum"]().add_all(1e16, floats) == 0.4
