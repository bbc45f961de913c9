"""The refresh journal: one row per policy refresh, with everything needed to tell later
what happened and why (SQLite). It is also what a coordinator started later (another
process, after a crash) knows about its fleet: the last verified policy (`last_served`) and
what each worker was last seen holding (`holdings`)."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS refreshes (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    started_at REAL NOT NULL,
    ended_at REAL,
    framework_step INTEGER,
    fleet TEXT,
    model TEXT,
    update_path TEXT NOT NULL,
    target_path TEXT,
    target_version TEXT,
    target_digest TEXT,
    previous_version TEXT,
    previous_digest TEXT,
    served_version TEXT,
    served_digest TEXT,
    served_path TEXT,
    verified_workers TEXT NOT NULL DEFAULT '[]',
    intended_workers TEXT NOT NULL DEFAULT '[]',
    decision TEXT,
    reason TEXT,
    steps TEXT NOT NULL DEFAULT '[]',
    workers TEXT NOT NULL DEFAULT '{}'
)
"""

_JSON = ("intended_workers", "verified_workers", "steps", "workers")
# columns added after the first release: journals written before get them on open
_ADDED = {"fleet": "TEXT", "model": "TEXT", "served_version": "TEXT", "served_digest": "TEXT",
          "served_path": "TEXT", "verified_workers": "TEXT NOT NULL DEFAULT '[]'"}


class Journal:
    def __init__(self, path: str | Path = ":memory:") -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(SCHEMA)
            have = {row[1] for row in self._db.execute("PRAGMA table_info(refreshes)")}
            for col, kind in _ADDED.items():
                if col not in have:
                    self._db.execute(f"ALTER TABLE refreshes ADD COLUMN {col} {kind}")

    def begin(self, **fields: Any) -> int:
        fields.setdefault("started_at", time.time())
        cols = ", ".join(fields)
        marks = ", ".join("?" for _ in fields)
        with self._lock:
            cur = self._db.execute(f"INSERT INTO refreshes ({cols}) VALUES ({marks})",
                                   [self._enc(k, v) for k, v in fields.items()])
            return int(cur.lastrowid)

    def update(self, refresh_id: int, **fields: Any) -> None:
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self._lock:
            self._db.execute(f"UPDATE refreshes SET {sets} WHERE id = ?",
                             [*(self._enc(k, v) for k, v in fields.items()), refresh_id])

    def get(self, refresh_id: int) -> dict[str, Any]:
        rows = self._select("WHERE id = ?", (refresh_id,))
        if not rows:
            raise KeyError(f"no refresh {refresh_id} in {self.path}")
        return rows[0]

    def recent(self, limit: int = 20) -> list[dict[str, Any]]:
        return self._select("ORDER BY id DESC LIMIT ?", (limit,))

    def last_served(self, fleet: str | None, model: str | None) -> dict[str, Any] | None:
        """The latest refresh of this fleet (and model selection) that ended with verified
        workers serving one policy (`served_*`): what a rollback returns to."""
        rows = self._select("WHERE served_digest IS NOT NULL AND fleet IS ? AND model IS ? "
                            "ORDER BY id DESC LIMIT 1", (fleet, model))
        return rows[0] if rows else None

    def holdings(self, fleet: str | None, model: str | None) -> dict[int, dict[str, Any]]:
        """What each worker of this fleet was last seen holding ({version, digest}), from
        the newest refresh that saw it."""
        out: dict[int, dict[str, Any]] = {}
        for row in self._select("WHERE fleet IS ? AND model IS ? ORDER BY id DESC LIMIT 1000",
                                (fleet, model)):
            for iid, w in (row["workers"] or {}).items():
                if w.get("holds") and int(iid) not in out:
                    out[int(iid)] = w["holds"]
        return out

    def _select(self, tail: str, args: tuple) -> list[dict[str, Any]]:
        with self._lock:
            cur = self._db.execute(f"SELECT * FROM refreshes {tail}", args)
            names = [d[0] for d in cur.description]
            rows = cur.fetchall()
        out = []
        for row in rows:
            rec = dict(zip(names, row, strict=True))
            for k in _JSON:
                rec[k] = json.loads(rec[k]) if rec[k] else None
            out.append(rec)
        return out

    @staticmethod
    def _enc(key: str, value: Any) -> Any:
        return json.dumps(value) if key in _JSON else value

    def close(self) -> None:
        with self._lock:
            self._db.close()
