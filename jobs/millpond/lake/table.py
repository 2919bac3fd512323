"""One Delta table of a pipeline as a noun with typed verbs, in the spirit of delta-rs's own ``DeltaTable``.

``Tables`` keeps the process-wide snapshots and caches; a ``Table`` names one of its tables, so code that
works on a table says ``table.append(rows, txn=txn)`` rather than passing (pipeline, name) each time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from millpond.lake.delta_options import Txn, _commit, _wrap


@dataclass(frozen=True)
class Table:
    """``s3://<lake>/<root>/<pipeline>/<name>``: read, append, merge, history, restore."""

    #: the process's ``millpond.lake.tables.Tables`` (its snapshots and caches)
    tables: Any
    pipeline: str
    name: str

    @property
    def uri(self) -> str:
        return self.tables.uri(self.pipeline, self.name)

    def exists(self) -> bool:
        return self.tables.exists(self.pipeline, self.name)

    def version(self) -> int | None:
        """The latest committed version, or None while the table does not exist."""
        return self.tables.version(self.pipeline, self.name)

    def read(self, version: int | None = None, columns: Sequence[str] | None = None, filters: Any = None,
             schema: pa.Schema | None = None) -> pa.Table:
        """Rows at ``version`` (default: latest); an absent table reads as empty when ``schema`` is given."""
        return self.tables.read_arrow(self.pipeline, self.name, version=version, columns=columns, filters=filters,
                                      schema=schema)

    def select(self, where: str | None = None, columns: Sequence[str] | None = None, version: int | None = None,
               schema: pa.Schema | None = None) -> pa.Table:
        """Rows matching a SQL predicate over the table (registered as ``t``)."""
        return self.tables.select(self.pipeline, self.name, where, columns=columns, version=version, schema=schema)

    def append(self, rows: pa.Table, txn: Txn | None = None, unique: Sequence[str] = ()) -> bool:
        """Append ``rows`` in one commit; False when ``txn`` was applied already (a retry is skipped)."""
        return self.tables.append(self.pipeline, self.name, rows, txn=txn, unique=unique)

    def merge(self, rows: pa.Table, on: Sequence[str], txn: Txn | None = None, **options: Any) -> bool:
        """Upsert ``rows`` by the key columns ``on`` in one commit (``delete_when`` deletes matches)."""
        return self.tables.merge(self.pipeline, self.name, rows, on=list(on), txn=txn, **options)

    def history(self, limit: int | None = None) -> list[dict[str, Any]]:
        """The commits, newest first, as delta-rs reports them (version, timestamp, operation, ...)."""
        return self.tables.history(self.pipeline, self.name, limit)

    def restore(self, version: int, txn: Txn | None = None) -> int | None:
        """Make ``version``'s rows current again as a new commit (history and time travel keep the rest).
        Returns the new version, or None when ``txn`` was applied already. A table still at ``version`` keeps
        its rows (delta-rs refuses to restore a table to its latest version): only ``txn`` is committed, so the
        rewind's fence and its idempotency reach it like the others."""
        dt = self.tables.open(self.pipeline, self.name)
        if dt is None:
            return None
        if self.tables.already_applied(dt, txn):
            return None
        if dt.version() == version:  # nothing to undo: a commit of the transaction alone (its fence too)
            if txn is not None:
                try:
                    dt.create_write_transaction([], "append", dt.schema(), dt.metadata().partition_columns or None,
                                                commit_properties=_commit(txn))
                except Exception as exc:  # noqa: BLE001 - delta-rs errors become one line
                    raise _wrap(exc, self.uri, self.tables.settings) from exc
            return self.version()
        try:
            dt.restore(version, commit_properties=_commit(txn))
        except Exception as exc:  # noqa: BLE001 - delta-rs errors become one line
            raise _wrap(exc, self.uri, self.tables.settings) from exc
        return self.version()

    def clear(self, where: str | None = None, txn: Txn | None = None) -> int | None:
        """Delete the rows matching the SQL predicate ``where`` (default: every row) as a new commit; history
        keeps them. Returns the new version, or None when the table does not exist or ``txn`` was applied."""
        dt = self.tables.open(self.pipeline, self.name)
        if dt is None or self.tables.already_applied(dt, txn):
            return None
        try:
            dt.delete(where, commit_properties=_commit(txn))
        except Exception as exc:  # noqa: BLE001 - delta-rs errors become one line
            raise _wrap(exc, self.uri, self.tables.settings) from exc
        return self.version()
