"""A corpus of bad landing input, one case per class of badness, each mixed with good rows.

Every case is a landing object (its name under the pipeline's prefix and its stored bytes) and what must
become of it: how many input rows it holds, which are quarantined (reason prefixes, in line order), which
the per-key step drops (reason prefixes), and whether the whole object is skipped as not input. The
generator is pure (times are given), so the unit tests parse the bytes and the batch tests land them.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from typing import Any

from millpond.lake.landing import arrival_tag
from millpond.model.aggregations import Combiner
from millpond.model.step import SUM_OUT_OF_RANGE
from millpond.model.timeutil import iso

BIG = 2**62 + 2**61  # two of these overflow an int64 sum; each fits


@dataclass(frozen=True)
class Case:
    name: str
    #: the object's name under the prefix (``{tag}`` is replaced by the arrival tag)
    filename: str
    body: bytes
    #: input rows the batch counts for this object (0 for a skipped object)
    rows: int
    #: reasons (prefixes) of the quarantined rows, in line order
    quarantined: tuple[str, ...] = ()
    #: reasons (prefixes) of rows accepted then dropped by the per-key step (the ``late`` table)
    dropped: tuple[str, ...] = ()
    #: the reason (prefix) the object is skipped as not input
    skipped: str | None = None
    #: a file quarantined whole (line 0)
    whole: bool = False
    notes: dict[str, Any] = field(default_factory=dict)

    def key(self, prefix: str, arrival_us: int) -> str:
        return prefix + self.filename.replace("{tag}", arrival_tag(arrival_us))


def row(case: str, i: int, t0: int, **kw: Any) -> dict[str, Any]:
    """A good row of the case's own key (cases never share windows), event time ``t0`` + ``i`` seconds."""
    base = {"id": f"{case}-{i}", "key": case, "value": 1, "event_time": iso(t0 + i * 1_000_000)}
    base.update(kw)
    return base


def lines(*rows: dict[str, Any] | str | bytes) -> bytes:
    out = []
    for r in rows:
        out.append(r if isinstance(r, bytes) else r.encode() if isinstance(r, str) else json.dumps(r).encode())
    return b"\n".join(out) + b"\n"


def corpus(t0: int) -> list[Case]:
    """Every case, its good rows' event times from ``t0`` (the batch runs a few minutes later)."""
    def good(case: str, n: int = 2) -> list[dict[str, Any]]:
        return [row(case, i, t0) for i in range(n)]

    cases = [
        Case("invalid_utf8", "{tag}-invalid_utf8.jsonl",
             lines(*good("invalid_utf8"), b'{"id": "u1", "key": "caf\xe9", "value": 1, "event_time": "' +
                   iso(t0).encode() + b'"}'), 3, ("invalid UTF-8",)),
        Case("lone_surrogate_key", "{tag}-lone_surrogate_key.jsonl",
             lines(*good("lone_surrogate_key"), '{"id": "s1", "key": "\\ud800", "value": 1, "event_time": "'
                   + iso(t0) + '"}'), 3, ("string cannot be stored: key",)),
        Case("lone_surrogate_id", "{tag}-lone_surrogate_id.jsonl",
             lines('{"id": "\\udfff", "key": "lone_surrogate_id", "value": 1, "event_time": "' + iso(t0) + '"}',
                   *good("lone_surrogate_id")), 3, ("string cannot be stored: id",)),
        Case("surrogate_pair", "{tag}-surrogate_pair.jsonl",
             lines(*good("surrogate_pair"), '{"id": "p1", "key": "surrogate_pair", "value": 1, "event_time": "'
                   + iso(t0) + '", "note": "\\ud83d\\ude00"}'), 3),
        Case("sum_overflow", "{tag}-sum_overflow.jsonl",
             lines(row("sum_overflow", 0, t0, value=BIG), row("sum_overflow", 1, t0, value=BIG),
                   row("sum_overflow", 2, t0, value=-5)), 3, dropped=(SUM_OUT_OF_RANGE,)),
        Case("sum_underflow", "{tag}-sum_underflow.jsonl",
             lines(row("sum_underflow", 0, t0, value=-(2**63)), row("sum_underflow", 1, t0, value=-1),
                   row("sum_underflow", 2, t0, value=7)), 3, dropped=(SUM_OUT_OF_RANGE,)),
        Case("int64_bounds", "{tag}-int64_bounds.jsonl",
             lines(row("int64_bounds", 0, t0, value=2**63 - 1), row("int64_bounds_lo", 0, t0, value=-(2**63)),
                   row("int64_bounds", 1, t0, value=2**63)), 3, ("value out of range for a 64-bit integer",)),
        Case("arrival_time_huge", "{tag}-arrival_time_huge.jsonl",
             lines(*good("arrival_time_huge"), row("arrival_time_huge", 9, t0, arrival_time=1e300)), 3,
             ("implausible arrival_time",)),
        Case("arrival_time_year_9999", "{tag}-arrival_time_year_9999.jsonl",
             lines(row("arrival_time_year_9999", 9, t0, arrival_time="9999-12-31T23:59:59Z"),
                   *good("arrival_time_year_9999")), 3, ("implausible arrival_time",)),
        Case("arrival_time_garbage", "{tag}-arrival_time_garbage.jsonl",
             lines(*good("arrival_time_garbage"), row("arrival_time_garbage", 9, t0, arrival_time="soon")), 3,
             ("unparseable arrival_time",)),
        Case("event_time_huge_number", "{tag}-event_time_huge_number.jsonl",
             lines(*good("event_time_huge_number"), row("event_time_huge_number", 9, t0, event_time=1e300)), 3,
             ("implausible event_time",)),
        Case("nan_and_infinity", "{tag}-nan_and_infinity.jsonl",
             lines(*good("nan_and_infinity"),
                   '{"id": "n1", "key": "nan_and_infinity", "value": NaN, "event_time": "' + iso(t0) + '"}',
                   '{"id": "n2", "key": "nan_and_infinity", "value": 1, "event_time": Infinity}',
                   '{"id": "n3", "key": "nan_and_infinity", "value": 1e400, "event_time": "' + iso(t0) + '"}'), 5,
             ("wrong type: value nan", "unparseable event_time", "wrong type: value inf")),
        Case("deep_nesting", "{tag}-deep_nesting.jsonl",
             lines(*good("deep_nesting"), "[" * 100_000 + "]" * 100_000), 3, ("malformed JSON",)),
        Case("huge_line", "{tag}-huge_line.jsonl",
             lines(*good("huge_line"), '{"id": "h1", "key": "' + "x" * 2_000_000), 3, ("malformed JSON",)),
        Case("not_objects", "{tag}-not_objects.jsonl",
             lines("42", '"text"', "null", *good("not_objects"), "{} trailing"), 6,
             ("not a JSON object: int", "not a JSON object: str", "not a JSON object: NoneType", "malformed JSON")),
        Case("nul_in_key", "{tag}-nul_in_key.jsonl",
             lines(*good("nul_in_key"), row("nul_in_key", 5, t0, key="nul\u0000key")), 3),
        Case("byte_order_mark", "{tag}-byte_order_mark.jsonl", b"\xef\xbb\xbf" + lines(*good("byte_order_mark")), 2),
        Case("crlf", "{tag}-crlf.jsonl", lines(*good("crlf", 3)).replace(b"\n", b"\r\n"), 3),
        Case("blank_lines", "{tag}-blank_lines.jsonl", b"\n  \n" + lines(*good("blank_lines")) + b"\n\t\n", 2),
        Case("utf16", "{tag}-utf16.jsonl", json.dumps(row("utf16", 0, t0)).encode("utf-16"), 1,
             ("invalid UTF-8",)),
        Case("duplicates", "{tag}-duplicates.jsonl",
             lines(*good("duplicates"), row("duplicates", 0, t0), row("duplicates", 1, t0, value=5)), 4,
             notes={"duplicates": 2}),
        # whole files
        Case("gzip_jsonl", "{tag}-gzip_jsonl.jsonl.gz", gzip.compress(lines(*good("gzip_jsonl", 3))), 3),
        Case("gzip_json", "{tag}-gzip_json.json.gz", gzip.compress(lines(*good("gzip_json"))), 2),
        Case("ndjson", "{tag}-ndjson.ndjson", lines(*good("ndjson")), 2),
        Case("upper_case", "{tag}-upper_case.JSONL", lines(*good("upper_case")), 2),
        Case("ndjson_gz_upper", "{tag}-ndjson_gz_upper.NDJSON.GZ", gzip.compress(lines(*good("ndjson_gz_upper"))), 2),
        Case("gzip_unnamed", "{tag}-gzip_unnamed.jsonl", gzip.compress(lines(*good("gzip_unnamed"))), 2),
        Case("gzip_multi_member", "{tag}-gzip_multi_member.jsonl.gz",
             gzip.compress(lines(row("gzip_multi_member", 0, t0))) + gzip.compress(lines(row("gzip_multi_member", 1,
                                                                                              t0))), 2),
        Case("gzip_truncated", "{tag}-gzip_truncated.jsonl.gz", gzip.compress(lines(*good("gzip_truncated", 50)))[:-30],
             1, ("unreadable gzip",), whole=True),
        Case("gzip_corrupt", "{tag}-gzip_corrupt.jsonl.gz", b"\x1f\x8b\x08\x00" + b"\x00" * 6 + b"not deflate", 1,
             ("unreadable gzip",), whole=True),
        Case("gzip_empty", "{tag}-gzip_empty.jsonl.gz", gzip.compress(b""), 1, ("empty file",), whole=True),
        Case("empty", "{tag}-empty.jsonl", b"", 1, ("empty file",), whole=True),
        Case("csv", "{tag}-table.csv", b"id,key,value\n1,k,1\n", 0, skipped="not a landing file"),
        Case("success_marker", "_SUCCESS", b"", 0, skipped="not a landing file"),
        Case("parquet_name", "{tag}-part-0.parquet", b"PAR1\x00\x00PAR1", 0, skipped="not a landing file"),
        # arrival tags that do not parse: the object's last-modified time is its arrival
        Case("arrival_month_13", "arrival=20261301T000000Z-month13.jsonl", lines(*good("arrival_month_13")), 2,
             notes={"last_modified": True}),
        Case("arrival_no_zone", "arrival=20260301T120000-nozone.jsonl", lines(*good("arrival_no_zone")), 2,
             notes={"last_modified": True}),
        Case("arrival_iso_layout", "arrival=2026-03-01T12:00:00Z-iso.jsonl", lines(*good("arrival_iso_layout")), 2,
             notes={"last_modified": True}),
        Case("no_tag", "plain-no-tag.jsonl", lines(*good("no_tag")), 2, notes={"last_modified": True}),
    ]
    return cases


class Explosive(Combiner):
    """A user combiner with a bug: it raises on the value 666 (a batch that fails anyway)."""

    def create(self) -> int:
        return 0

    def add(self, acc: int, value: int) -> int:
        if value == 666:
            raise ZeroDivisionError("the combiner's own bug")
        return acc + value

    def merge(self, accs: list[int]) -> int:
        return sum(accs)

    def extract(self, acc: int) -> int:
        return acc
