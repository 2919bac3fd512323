"""Landing files: which objects under a pipeline's prefix are input, when each arrived, and their bytes.

A file's arrival time is the ``arrival=<YYYYMMDDTHHMMSS[ffffff]Z>`` tag in its key when present and valid
(injectors and the replay write it), else the object's last-modified time: a malformed tag (another
layout, no zone, month 13) is no tag. A batch at processing time P takes the not-yet-taken files that
arrived before P, so a backfill picks exactly the files a live run would have picked.

Input files are JSON lines, optionally gzip-compressed: ``.jsonl``, ``.json``, ``.ndjson``, each optionally
with ``.gz``, in any case (compression is recognised by the bytes, not the name). ``*.inprogress`` is a
file still being written. Anything else under the prefix is not taken, and is reported by the plan of the
first batch that lists it (``skipped``, with its reason), never ignored in silence.
"""

from __future__ import annotations

import gzip
import io
import re
import zlib
from dataclasses import dataclass
from datetime import UTC, datetime

import pyarrow as pa

from millpond.lake.objectstore import ObjectStore, StoredObject
from millpond.lake.rows import MAX_FUTURE, event_schema, parse_event, parse_rows, parse_rows_table
from millpond.model.timeutil import US, to_us

__all__ = ["MAX_FUTURE", "LandingFile", "arrival_tag", "event_schema", "file_arrival", "list_landing", "not_input",
           "parse_event", "parse_file", "parse_file_table", "unpack"]

TAG = "arrival="
_ARRIVAL = re.compile(r"arrival=(\d{8}T\d{6}(?:\d{6})?)Z")
INPROGRESS = ".inprogress"
DATA_SUFFIXES = (".jsonl", ".json", ".ndjson")
GZIP_MAGIC = b"\x1f\x8b"
UTF8_BOM = b"\xef\xbb\xbf"
#: a compressed file that inflates to more than this is quarantined whole (a gzip bomb, or not JSON lines)
MAX_INFLATED = 4 * 1024**3


@dataclass(frozen=True)
class LandingFile:
    key: str
    arrival: int
    size: int
    etag: str


def arrival_tag(us: int) -> str:
    dt = datetime.fromtimestamp(us / US, tz=UTC)
    return f"arrival={dt.strftime('%Y%m%dT%H%M%S')}{dt.microsecond:06d}Z"


def file_arrival(obj: StoredObject) -> int:
    """The arrival tag's time, or the object's last-modified time when the key has no valid tag."""
    match = _ARRIVAL.search(obj.key)
    if match:
        text = match.group(1)
        try:
            dt = datetime.strptime(text[:15], "%Y%m%dT%H%M%S").replace(tzinfo=UTC)
        except ValueError:  # an impossible date (month 13): no usable tag
            return int(obj.last_modified * US)
        return to_us(dt) + (int(text[15:]) if len(text) > 15 else 0)
    return int(obj.last_modified * US)


def list_landing(store: ObjectStore, bucket: str, prefix: str, since: int | None) -> list[StoredObject]:
    """The objects under ``prefix`` a batch must see (``model.listing``): all of them (``since`` None), or
    all but the keys named ``<prefix>arrival=<time>...`` with a time before ``since``'s second (within one
    second a tag with microseconds sorts before one without, so the cursor keeps the whole second). Two
    ranged listings: the keys before the tagged range (the listing stops where it starts), and those after
    the cursor."""
    if since is None:
        return list(store.list(bucket, prefix))
    tagged = prefix + TAG
    cursor = tagged + datetime.fromtimestamp(since // US, tz=UTC).strftime("%Y%m%dT%H%M%S")
    return [*store.list(bucket, prefix, stop_at=tagged), *store.list(bucket, prefix, start_after=cursor)]


def not_input(key: str) -> str | None:
    """Why an object under the prefix is not a landing file (None: it is one, or is still being written)."""
    if key.endswith("/"):
        return "a folder marker, not a file"
    name = key.rsplit("/", 1)[-1].lower()
    if name.endswith(INPROGRESS):
        return None
    if name.endswith(".gz"):
        name = name[:-3]
    if name.endswith(DATA_SUFFIXES):
        return None
    return "not a landing file: the name does not end in .jsonl, .json or .ndjson (optionally .gz)"


def unpack(data: bytes) -> tuple[bytes, str | None]:
    """The file's JSON-lines bytes (inflated if gzip, a UTF-8 byte-order mark dropped), or why it cannot
    be read at all (the file is then quarantined whole)."""
    if data[:2] == GZIP_MAGIC:
        try:
            with gzip.GzipFile(fileobj=io.BytesIO(data)) as handle:
                data = handle.read(MAX_INFLATED + 1)
        except (OSError, EOFError, zlib.error) as exc:
            return b"", f"unreadable gzip: {exc}"
        if len(data) > MAX_INFLATED:
            return b"", f"gzip inflates to more than {MAX_INFLATED >> 30} GiB"
    if data.startswith(UTF8_BOM):
        data = data[len(UTF8_BOM):]
    return data, None


def parse_file(key: str, data: bytes, *, value_type: str, file_arrival_us: int, processing_time: int
               ) -> tuple[list[tuple], list[tuple]]:
    """(elements, quarantined) of one landing file's stored bytes (see ``rows.parse_rows``)."""
    data, unreadable = unpack(data)
    if unreadable:
        return [], [(key, 0, "", unreadable)]
    return parse_rows(key, data, value_type=value_type, file_arrival_us=file_arrival_us,
                      processing_time=processing_time)


def parse_file_table(key: str, data: bytes, *, value_type: str, file_arrival_us: int, processing_time: int
                     ) -> tuple[pa.Table, list[tuple]]:
    """``parse_file`` in columnar form: a table of ``event_schema`` in line order, and the quarantined rows."""
    data, unreadable = unpack(data)
    if unreadable:
        return event_schema(value_type).empty_table(), [(key, 0, "", unreadable)]
    return parse_rows_table(key, data, value_type=value_type, file_arrival_us=file_arrival_us,
                            processing_time=processing_time)


def missing_file(key: str) -> tuple[str, int, str, str]:
    """The quarantined row of a planned file that is gone from the store when the batch reads it."""
    return (key, 0, "", "the file was deleted from the landing bucket before the batch read it")
