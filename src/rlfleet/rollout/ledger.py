"""The sample ledger: every attempt of every sample, and at most one admitted per sample.

A SQLite table (WAL mode) with one row per attempt. Admission is one UPDATE statement,
hence one transaction, that succeeds only if the attempt is still open and no other
attempt of the sample is admitted; a UNIQUE partial index on `sample_id WHERE admitted = 1`
makes the second condition the database's job. So a late completion of an abandoned
attempt is refused, also by another process or after the trainer restarts on the same
file. Starting an attempt of a sample closes (as `canceled`, reason `abandoned`) any
earlier attempt of it still open (say, from a trainer process that died). Each write is one
statement in autocommit mode: one small transaction, no fsync (WAL, synchronous=NORMAL:
durable across a crash of the process, not of the machine). One ledger object may be used
from any number of threads: its connection is shared, and a lock makes each method's
statements one unit.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from rlfleet.rollout.attempt import OPEN_STATES, TRANSITIONS, AttemptState

_SCHEMA = """
CREATE TABLE IF NOT EXISTS attempts (
    sample_id      TEXT    NOT NULL,
    attempt        INTEGER NOT NULL,
    request_id     TEXT    NOT NULL,
    state          TEXT    NOT NULL,
    reason         TEXT,
    started_at     REAL    NOT NULL,
    first_token_at REAL,
    finished_at    REAL,
    admitted       INTEGER NOT NULL DEFAULT 0 CHECK (admitted IN (0, 1)),
    PRIMARY KEY (sample_id, attempt)
) WITHOUT ROWID;
CREATE UNIQUE INDEX IF NOT EXISTS one_admitted_attempt_per_sample
    ON attempts (sample_id) WHERE admitted = 1;
"""


def _states_into(target: AttemptState) -> str:
    """The SQL list of states the transition table allows into `target`."""
    return ", ".join(f"'{s}'" for s, nxt in TRANSITIONS.items() if target in nxt)


_OPEN = ", ".join(f"'{s}'" for s in sorted(OPEN_STATES))
_START = ("INSERT INTO attempts (sample_id, attempt, request_id, state, started_at) "
          "SELECT ?1, COALESCE(MAX(attempt), 0) + 1, ?2, 'accepted', ?3 FROM attempts "
          "WHERE sample_id = ?1 "
          "HAVING NOT EXISTS (SELECT 1 FROM attempts WHERE sample_id = ?1 AND admitted = 1) "
          "RETURNING attempt")
_ABANDON = (f"UPDATE attempts SET state = 'canceled', reason = 'abandoned', finished_at = ?3 "
            f"WHERE sample_id = ?1 AND attempt < ?2 AND state IN ({_OPEN})")
_ADMIT = (f"UPDATE attempts SET state = 'succeeded', admitted = 1, finished_at = ?3 "
          f"WHERE sample_id = ?1 AND attempt = ?2 AND state IN "
          f"({_states_into(AttemptState.SUCCEEDED)})")
_STREAMING = (f"UPDATE attempts SET state = 'streaming', first_token_at = ?3 "
              f"WHERE sample_id = ?1 AND attempt = ?2 AND state IN "
              f"({_states_into(AttemptState.STREAMING)})")
_CLOSE = {target: (f"UPDATE attempts SET state = '{target}', reason = ?3, finished_at = ?4 "
                   f"WHERE sample_id = ?1 AND attempt = ?2 AND state IN ({_states_into(target)})")
          for target in (AttemptState.CANCELED, AttemptState.FAILED)}


class AlreadyAdmitted(Exception):
    """The sample already has an admitted attempt; nothing more of it is admitted."""

    reason = "already_admitted"

    def __init__(self, sample_id: str, admitted_attempt: int | None) -> None:
        super().__init__(f"sample {sample_id!r} is already admitted (attempt {admitted_attempt})")
        self.sample_id, self.admitted_attempt = sample_id, admitted_attempt


class AttemptClosed(Exception):
    """The attempt is not open (unknown, abandoned or finished): its result is refused."""

    reason = "attempt_closed"

    def __init__(self, sample_id: str, attempt: int, state: str | None) -> None:
        super().__init__(f"attempt {attempt} of sample {sample_id!r} is "
                         f"{state or 'unknown'}, not open: its result is refused")
        self.sample_id, self.attempt, self.state = sample_id, attempt, state


@dataclass(frozen=True)
class AttemptRecord:
    sample_id: str
    attempt: int
    request_id: str
    state: AttemptState
    reason: str | None
    started_at: float
    first_token_at: float | None
    finished_at: float | None
    admitted: bool


class SampleLedger:
    """`SampleLedger()` keeps the ledger in memory; `SampleLedger(path)` in a file that a
    restarted trainer reopens. Usable from any thread."""

    def __init__(self, path: str | Path = ":memory:", busy_timeout: float = 30.0) -> None:
        self.path = str(path)
        # shared between threads; the lock serialises use (a statement and the reads of its
        # cursor, or the two statements of `start`), the database serialises processes
        self._db = sqlite3.connect(self.path, timeout=busy_timeout, isolation_level=None,
                                   check_same_thread=False)
        self._lock = threading.RLock()
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # WAL: durable across a process crash
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> SampleLedger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ writing

    def start(self, sample_id: str, request_id: str) -> int:
        """Record a new attempt (state accepted) and return its number (1, 2, ...).
        Raises AlreadyAdmitted if the sample has an admitted attempt."""
        now = time.time()
        with self._lock:
            row = self._db.execute(_START, (sample_id, request_id, now)).fetchone()
            if row is None:
                raise AlreadyAdmitted(sample_id, self.admitted_attempt(sample_id))
            if row[0] > 1:  # earlier attempts left open (by a process that died) are abandoned
                self._db.execute(_ABANDON, (sample_id, row[0], now))
            return row[0]

    def streaming(self, sample_id: str, attempt: int) -> bool:
        """Record the first streamed tokens; False if the attempt is no longer open."""
        with self._lock:
            return self._db.execute(_STREAMING, (sample_id, attempt, time.time())).rowcount == 1

    def close_attempt(self, sample_id: str, attempt: int, state: AttemptState,
                      reason: str) -> bool:
        """End an open attempt as canceled or failed; False if it was not open."""
        with self._lock:
            return self._db.execute(_CLOSE[state], (sample_id, attempt, reason, time.time())
                                    ).rowcount == 1

    def admit(self, sample_id: str, attempt: int) -> None:
        """Admit the attempt, in one transaction: it must be open and the sample must have
        no admitted attempt. Raises AlreadyAdmitted (the attempt is then closed as failed)
        or AttemptClosed; either way nothing was admitted."""
        with self._lock:
            try:
                cur = self._db.execute(_ADMIT, (sample_id, attempt, time.time()))
            except sqlite3.IntegrityError:
                self.close_attempt(sample_id, attempt, AttemptState.FAILED, AlreadyAdmitted.reason)
                raise AlreadyAdmitted(sample_id, self.admitted_attempt(sample_id)) from None
            if cur.rowcount != 1:
                rec = self.attempt(sample_id, attempt)
                raise AttemptClosed(sample_id, attempt, rec.state if rec else None)

    # ------------------------------------------------------------ reading

    def admitted_attempt(self, sample_id: str) -> int | None:
        with self._lock:
            row = self._db.execute("SELECT attempt FROM attempts WHERE sample_id = ? AND "
                                   "admitted = 1", (sample_id,)).fetchone()
        return row[0] if row else None

    def admitted(self) -> dict[str, tuple[int, str]]:
        """sample_id -> (attempt, request_id) of every admitted sample."""
        with self._lock:
            return {s: (a, r) for s, a, r in self._db.execute(
                "SELECT sample_id, attempt, request_id FROM attempts WHERE admitted = 1")}

    def attempt(self, sample_id: str, attempt: int) -> AttemptRecord | None:
        rows = self._records("WHERE sample_id = ? AND attempt = ?", (sample_id, attempt))
        return rows[0] if rows else None

    def attempts(self, sample_id: str | None = None) -> list[AttemptRecord]:
        if sample_id is None:
            return self._records("ORDER BY sample_id, attempt", ())
        return self._records("WHERE sample_id = ? ORDER BY attempt", (sample_id,))

    def counts(self) -> dict[str, int]:
        """Attempts by state."""
        with self._lock:
            return dict(self._db.execute("SELECT state, COUNT(*) FROM attempts GROUP BY state"))

    def _records(self, where: str, args: tuple) -> list[AttemptRecord]:
        with self._lock:
            rows = self._db.execute(
                "SELECT sample_id, attempt, request_id, state, reason, started_at, "
                f"first_token_at, finished_at, admitted FROM attempts {where}", args).fetchall()
        return [AttemptRecord(s, a, r, AttemptState(st), why, t0, t1, t2, bool(adm))
                for s, a, r, st, why, t0, t1, t2, adm in rows]
