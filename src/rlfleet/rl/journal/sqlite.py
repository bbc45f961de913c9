"""The journal in one SQLite file (the default store), or in memory: a table of records
(`refreshes`, one column per rlfleet.rl.journal.record.COLUMNS) and one of fleet epochs."""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

from rlfleet.rl.journal.base import JournalError, JournalMissing, RefreshJournal, holdings_of
from rlfleet.rl.journal.record import (
    COLUMNS,
    JSON_COLUMNS,
    SERVED_MARK,
    JournalRecord,
    journal_record,
)

EPOCHS = "CREATE TABLE IF NOT EXISTS fleet_epochs (fleet TEXT PRIMARY KEY, epoch INTEGER NOT NULL)"


class SqliteJournal(RefreshJournal):
    """Safe across threads and processes (SQLite's own locking). `create=False`: a reader's
    open, which raises JournalMissing rather than make a file."""

    def __init__(self, path: str | Path = ":memory:", *, create: bool = True) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            if not create and not Path(self.path).exists():
                raise JournalMissing(f"no journal at {self.path}")
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, timeout=30, check_same_thread=False,
                                   isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            columns = ", ".join(f"{name} {kind}" for name, kind in COLUMNS.items())
            self._db.execute(f"CREATE TABLE IF NOT EXISTS refreshes ({columns})")
            self._db.execute(EPOCHS)
            # a journal written before a column existed gets it
            have = {row[1] for row in self._db.execute("PRAGMA table_info(refreshes)")}
            for name, kind in COLUMNS.items():
                if name not in have:
                    self._db.execute(f"ALTER TABLE refreshes ADD COLUMN {name} {kind}")

    # ---------------------------------------------------------------- writes

    def _open(self, fleet: str | None, floor_epoch: int,
              columns: dict[str, Any]) -> tuple[int, int]:
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")  # the write lock: one epoch taken at a time
            try:
                epoch = self._next_epoch(fleet, floor_epoch)
                columns = {**columns, "fleet_epoch": epoch}
                marks = ", ".join("?" for _ in columns)
                cur = db.execute(f"INSERT INTO refreshes ({', '.join(columns)}) VALUES "
                                 f"({marks})", [_encode(k, v) for k, v in columns.items()])
                db.execute("COMMIT")
                return int(cur.lastrowid), epoch
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise

    def _next_epoch(self, fleet: str | None, floor_epoch: int) -> int:
        """Take the fleet's next epoch (under the write lock)."""
        db = self._db
        row = db.execute("SELECT epoch FROM fleet_epochs WHERE fleet = ?",
                         (fleet or "",)).fetchone()
        epoch = max(row[0] if row else 0, floor_epoch) + 1
        if row is None:
            db.execute("INSERT INTO fleet_epochs (fleet, epoch) VALUES (?, ?)",
                       (fleet or "", epoch))
        elif db.execute("UPDATE fleet_epochs SET epoch = ? WHERE fleet = ? AND epoch = ?",
                        (epoch, fleet or "", row[0])).rowcount != 1:
            raise JournalError(f"journal {self.path}: the epoch of fleet {fleet} changed "
                               "under the write lock")
        return epoch

    def _update(self, refresh_id: int, only_open: bool, columns: dict[str, Any]) -> bool:
        sets = ", ".join(f"{k} = ?" for k in columns)
        cond = " AND ended_at IS NULL" if only_open else ""
        with self._lock:
            cur = self._db.execute(f"UPDATE refreshes SET {sets} WHERE id = ?{cond}",
                                   [*(_encode(k, v) for k, v in columns.items()), refresh_id])
            return cur.rowcount == 1

    # ---------------------------------------------------------------- reads

    def _find(self, refresh_id: int) -> JournalRecord | None:
        rows = self._select("WHERE id = ?", (refresh_id,))
        return rows[0] if rows else None

    def recent(self, limit: int = 20) -> list[JournalRecord]:
        return self._select("ORDER BY id DESC LIMIT ?", (limit,))

    def last_served(self, fleet: str | None, model: str | None) -> JournalRecord | None:
        rows = self._select(f"WHERE {SERVED_MARK} IS NOT NULL AND fleet IS ? AND model IS ? "
                            "ORDER BY id DESC LIMIT 1", (fleet, model))
        return rows[0] if rows else None

    def _holdings(self, fleet: str | None, model: str | None) -> dict[int, dict[str, Any]]:
        return holdings_of(self._select("WHERE fleet IS ? AND model IS ? ORDER BY id DESC "
                                        "LIMIT 1000", (fleet, model)))

    def unfinished(self, fleet: str | None, model: str | None,
                   before_epoch: int) -> list[JournalRecord]:
        return self._select("WHERE ended_at IS NULL AND fleet IS ? AND model IS ? AND "
                            "COALESCE(fleet_epoch, 0) < ? ORDER BY id",
                            (fleet, model, before_epoch))

    def fleet_epoch(self, fleet: str | None) -> int:
        with self._lock:
            row = self._db.execute("SELECT epoch FROM fleet_epochs WHERE fleet = ?",
                                   (fleet or "",)).fetchone()
        return row[0] if row else 0

    def _select(self, tail: str, args: tuple) -> list[JournalRecord]:
        with self._lock:
            cur = self._db.execute(f"SELECT * FROM refreshes {tail}", args)
            names = [d[0] for d in cur.description]
            rows = cur.fetchall()
        return [journal_record({name: _decode(name, value)
                                for name, value in zip(names, row, strict=True)})
                for row in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _encode(column: str, value: Any) -> Any:
    return json.dumps(value) if column in JSON_COLUMNS else value


def _decode(column: str, value: Any) -> Any:
    if column in JSON_COLUMNS:
        return json.loads(value) if value else None
    return value
