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

Exactly-once needs a sample's record only while a retry of it can still come. A ledger
with a `RetryWindow` (seconds after the sample was first issued, or trainer steps after
the step it belongs to: whichever the client sets) keeps each sample's attempts for that
window and then prunes them, so that it stays the same size however long the run. Every
attempt of a sample records the sample's *origin*: the step it belongs to (`advance(step)`
sets the current one, the default), or the time it was first issued (its first attempt,
or what the caller says). Pruning moves a watermark; an attempt whose sample's origin is
below it is refused by name (`RetryWindowPassed`): its earlier admission may have been
pruned, so it is never admitted (never twice). A retry that comes from a new process
(a trainer restarted) names the sample's origin (`start(..., origin=)`): without it, a
sample whose records were pruned would count as new. The window must be longer than the
longest attempt: one still open when its sample is pruned is refused at admission.
"""

from __future__ import annotations

import math
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from rlfleet.rollout.attempt import OPEN_STATES, TRANSITIONS, AttemptState
from rlfleet.runtime import sqlite

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
CREATE TABLE IF NOT EXISTS retry_window (
    id           INTEGER PRIMARY KEY CHECK (id = 1),
    pruned_below REAL    NOT NULL,  -- samples of an origin below it were pruned
    step         INTEGER            -- the trainer's current step (a window in steps)
);
INSERT OR IGNORE INTO retry_window (id, pruned_below) VALUES (1, -1e308);
"""
#: a ledger written before origins were kept gets the column (null: never pruned)
_ORIGIN = ("ALTER TABLE attempts ADD COLUMN origin REAL",
           "CREATE INDEX IF NOT EXISTS attempts_by_origin ON attempts (origin)")
#: starts between two prunes of a ledger with a window in seconds
PRUNE_EVERY = 256


def _states_into(target: AttemptState) -> str:
    """The SQL list of states the transition table allows into `target`."""
    return ", ".join(f"'{s}'" for s, nxt in TRANSITIONS.items() if target in nxt)


_OPEN = ", ".join(f"'{s}'" for s in sorted(OPEN_STATES))
_START = ("INSERT INTO attempts (sample_id, attempt, request_id, state, started_at, origin) "
          "SELECT :sample, COALESCE(MAX(attempt), 0) + 1, :request, 'accepted', :now, "
          "COALESCE(MIN(origin), :origin) FROM attempts WHERE sample_id = :sample "
          "HAVING NOT EXISTS (SELECT 1 FROM attempts WHERE sample_id = :sample AND admitted = 1) "
          "RETURNING attempt")
_ABANDON = (f"UPDATE attempts SET state = 'canceled', reason = 'abandoned', finished_at = :now "
            f"WHERE sample_id = :sample AND attempt < :attempt AND state IN ({_OPEN})")
_ADMIT = (f"UPDATE attempts SET state = 'succeeded', admitted = 1, finished_at = :now "
          f"WHERE sample_id = :sample AND attempt = :attempt AND state IN "
          f"({_states_into(AttemptState.SUCCEEDED)})")
_STREAMING = (f"UPDATE attempts SET state = 'streaming', first_token_at = :now "
              f"WHERE sample_id = :sample AND attempt = :attempt AND state IN "
              f"({_states_into(AttemptState.STREAMING)})")
_CLOSE = {target: (f"UPDATE attempts SET state = '{target}', reason = :reason, "
                   f"finished_at = :now WHERE sample_id = :sample AND attempt = :attempt "
                   f"AND state IN ({_states_into(target)})")
          for target in (AttemptState.CANCELED, AttemptState.FAILED)}


class AlreadyAdmitted(Exception):
    """The sample already has an admitted attempt; nothing more of it is admitted."""

    reason = "already_admitted"

    def __init__(self, sample_id: str, admitted_attempt: int | None) -> None:
        super().__init__(f"sample {sample_id!r} is already admitted (attempt {admitted_attempt})")
        self.sample_id, self.admitted_attempt = sample_id, admitted_attempt


class RetryWindowPassed(AlreadyAdmitted):
    """An attempt of a sample older than the ledger's retry window: its records may have been
    pruned (an admission among them), so it is refused and nothing of it is admitted (an
    AlreadyAdmitted: whoever handles a sample admitted before handles this one)."""

    reason = "retry_window_passed"

    def __init__(self, sample_id: str, origin: float, pruned_below: float,
                 window: RetryWindow) -> None:
        self.admitted_attempt = None  # unknown: pruned
        Exception.__init__(self, f"sample {sample_id!r} ({window.describe(origin)}) is older than the "
                         f"ledger's retry window of {window}: samples before "
                         f"{window.describe(pruned_below)} were pruned, so a retry of it is "
                         "refused rather than risk admitting it twice")
        self.sample_id, self.origin, self.pruned_below = sample_id, origin, pruned_below


@dataclass(frozen=True)
class RetryWindow:
    """How long a sample's records are kept: `seconds` after it was first issued, or `steps`
    trainer steps after the step it belongs to (set one)."""

    seconds: float | None = None
    steps: int | None = None

    def __post_init__(self) -> None:
        if (self.seconds is None) == (self.steps is None):
            raise ValueError("a retry window is in seconds or in steps: set one of them")
        if not (self.seconds or self.steps or 0) > 0:
            raise ValueError(f"a retry window must be positive, not {self}")

    def __str__(self) -> str:
        return f"{self.seconds:g} s" if self.seconds is not None else f"{self.steps} steps"

    def describe(self, origin: float) -> str:
        if self.steps is not None:
            return f"step {int(origin)}"
        return time.strftime("issued %Y-%m-%d %H:%M:%S", time.localtime(origin))


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

    def __init__(self, path: str | Path = ":memory:", busy_timeout: float = 30.0, *,
                 window: RetryWindow | None = None) -> None:
        self.path = str(path)
        self.window = window
        # shared between threads; the lock serialises use (a statement and the reads of its
        # cursor, or the two statements of `start`), the database serialises processes
        self._db = sqlite.connect(self.path, busy_timeout)
        self._lock = threading.RLock()
        self._db.execute("PRAGMA synchronous=NORMAL")  # WAL: durable across a process crash
        self._db.executescript(_SCHEMA)
        if "origin" not in {r[1] for r in self._db.execute("PRAGMA table_info(attempts)")}:
            self._db.execute(_ORIGIN[0])
        self._db.execute(_ORIGIN[1])
        self._starts = 0

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> SampleLedger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ writing

    def start(self, sample_id: str, request_id: str, origin: float | None = None) -> int:
        """Record a new attempt (state accepted) and return its number (1, 2, ...).
        Raises AlreadyAdmitted if the sample has an admitted attempt, RetryWindowPassed if
        its origin (`origin`, else its first attempt's, else the current step or now) is
        older than the retry window."""
        now = time.time()
        with self._lock:
            if self.window is not None:
                origin = self._origin(sample_id, origin, now)
                pruned_below = self._window_row()[0]
                if origin < pruned_below:
                    raise RetryWindowPassed(sample_id, origin, pruned_below, self.window)
            row = self._db.execute(_START, {"sample": sample_id, "request": request_id,
                                            "now": now, "origin": origin}).fetchone()
            if row is None:
                raise AlreadyAdmitted(sample_id, self.admitted_attempt(sample_id))
            if row[0] > 1:  # earlier attempts left open (by a process that died) are abandoned
                self._db.execute(_ABANDON, {"sample": sample_id, "attempt": row[0], "now": now})
            self._starts += 1
            if self.window is not None and self.window.seconds is not None \
                    and self._starts % PRUNE_EVERY == 0:
                self.prune()
            return row[0]

    def _origin(self, sample_id: str, given: float | None, now: float) -> float:
        """The sample's origin: its first attempt's, else `given`, else the current step
        (a window in steps) or `now`."""
        row = self._db.execute("SELECT MIN(origin) FROM attempts WHERE sample_id = ?",
                               (sample_id,)).fetchone()
        if row[0] is not None:
            return row[0]
        if given is not None:
            return float(given)
        if self.window.steps is None:
            return now
        step = self._window_row()[1]
        if step is None:
            raise ValueError("this ledger keeps samples for a window of trainer steps: call "
                             "advance(step) first, or give each sample's step (origin=)")
        return float(step)

    def _window_row(self) -> tuple[float, int | None]:
        return self._db.execute("SELECT pruned_below, step FROM retry_window").fetchone()

    # ------------------------------------------------------------ the retry window

    def advance(self, step: int) -> int:
        """The trainer is at `step` now (a window in steps: samples started without an
        origin belong to it); prunes what the window no longer keeps. Returns the number
        of attempts pruned."""
        with self._lock:
            self._db.execute("UPDATE retry_window SET step = ? WHERE id = 1", (int(step),))
            return self.prune() if self.window is not None else 0

    def prune(self) -> int:
        """Delete the attempts of every sample whose origin is older than the retry window
        and move the watermark up to it; the number of attempts deleted (0 without a
        window)."""
        if self.window is None:
            return 0
        with self._lock:
            if self.window.steps is not None:
                step = self._window_row()[1]
                if step is None:
                    return 0
                cutoff = float(step - self.window.steps)
            else:
                cutoff = time.time() - self.window.seconds
            self._db.execute("BEGIN IMMEDIATE")
            try:
                deleted = self._db.execute("DELETE FROM attempts WHERE origin < ?",
                                           (cutoff,)).rowcount
                self._db.execute("UPDATE retry_window SET pruned_below = MAX(pruned_below, ?)",
                                 (cutoff,))
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
            return deleted

    @property
    def pruned_below(self) -> float | None:
        """The watermark: samples of an origin below it were pruned (None: none yet)."""
        with self._lock:
            value = self._window_row()[0]
        return None if math.isinf(value) or value <= -1e307 else value

    def streaming(self, sample_id: str, attempt: int) -> bool:
        """Record the first streamed tokens; False if the attempt is no longer open."""
        with self._lock:
            return self._db.execute(_STREAMING, {"sample": sample_id, "attempt": attempt,
                                                  "now": time.time()}).rowcount == 1

    def close_attempt(self, sample_id: str, attempt: int, state: AttemptState,
                      reason: str) -> bool:
        """End an open attempt as canceled or failed; False if it was not open."""
        with self._lock:
            return self._db.execute(_CLOSE[state], {
                "sample": sample_id, "attempt": attempt, "reason": reason, "now": time.time(),
            }).rowcount == 1

    def admit(self, sample_id: str, attempt: int) -> None:
        """Admit the attempt, in one transaction: it must be open and the sample must have
        no admitted attempt. Raises AlreadyAdmitted (the attempt is then closed as failed)
        or AttemptClosed; either way nothing was admitted."""
        with self._lock:
            try:
                cur = self._db.execute(_ADMIT, {"sample": sample_id, "attempt": attempt,
                                                "now": time.time()})
            except sqlite3.IntegrityError:
                self.close_attempt(sample_id, attempt, AttemptState.FAILED, AlreadyAdmitted.reason)
                raise AlreadyAdmitted(sample_id, self.admitted_attempt(sample_id)) from None
            if cur.rowcount != 1:
                rec = self.attempt(sample_id, attempt)
                if rec is None and self.pruned_below is not None:
                    raise AttemptClosed(sample_id, attempt, "pruned (its sample passed the "
                                        f"ledger's retry window of {self.window})")
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

    def size(self) -> dict[str, int]:
        """How much the ledger holds: attempts, samples, and the file's bytes (0 in memory;
        with its write-ahead log)."""
        with self._lock:
            attempts, samples = self._db.execute(
                "SELECT COUNT(*), COUNT(DISTINCT sample_id) FROM attempts").fetchone()
        nbytes = 0
        if self.path != ":memory:":
            for f in (Path(self.path), Path(self.path + "-wal")):
                nbytes += f.stat().st_size if f.exists() else 0
        return {"attempts": attempts, "samples": samples, "bytes": nbytes}

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
