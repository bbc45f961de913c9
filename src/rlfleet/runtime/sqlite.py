"""A SQLite file several processes share (the version catalog, the refresh journal, the
sample ledger), opened one way: WAL mode, a busy timeout, usable from any thread (callers
serialise their own use)."""

from __future__ import annotations

import sqlite3
import time


def connect(path: str, timeout: float = 30.0) -> sqlite3.Connection:
    """A connection to `path` in WAL mode, in autocommit (callers BEGIN themselves). Processes
    opening a new file at once (two workers' first staging into one catalog) can be refused
    "database is locked" at once, the busy timeout notwithstanding: the switch to WAL is
    tried again until `timeout` has passed."""
    db = sqlite3.connect(path, timeout=timeout, check_same_thread=False, isolation_level=None)
    deadline = time.monotonic() + timeout
    while True:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return db
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                db.close()
                raise
            time.sleep(0.05)
