"""The refresh journal: one row per policy refresh, with everything needed to tell later
what happened and why (SQLite)."""

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
    update_path TEXT NOT NULL,
    target_path TEXT,
    target_version TEXT,
    target_digest TEXT,
    previous_version TEXT,
    previous_digest TEXT,
    intended_workers TEXT NOT NULL DEFAULT '[]',
    decision TEXT,
    reason TEXT,
    steps TEXT NOT NULL DEFAULT '[]',
    workers TEXT NOT NULL DEFAULT '{}'
)
"""

_JSON = ("intended_workers", "steps", "workers")


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
