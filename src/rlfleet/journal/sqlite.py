"""The journal in one SQLite file (the default store), or in memory: a table of records
(`refreshes`, one column per rlfleet.journal.record.COLUMNS) and one of fleet epochs."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import msgspec

from rlfleet.journal.base import (
    JournalBounds,
    JournalError,
    JournalMissing,
    RefreshJournal,
    fold,
)
from rlfleet.journal.record import (
    COLUMNS,
    JSON_COLUMNS,
    SERVED_MARK,
    JournalRecord,
    journal_record,
)
from rlfleet.runtime import sqlite

#: a record's columns but its workers' entries (`last_served(workers=False)`)
_BRIEF = ", ".join(c for c in COLUMNS if c != "workers")
EPOCHS = "CREATE TABLE IF NOT EXISTS fleet_epochs (fleet TEXT PRIMARY KEY, epoch INTEGER NOT NULL)"
#: the folded transactions per fleet and model selection (rlfleet.journal.base.fold)
HISTORY = ("CREATE TABLE IF NOT EXISTS history (fleet TEXT, model TEXT, summary TEXT NOT NULL, "
           "PRIMARY KEY (fleet, model))")
#: the records still kept whole (what compaction looks through)
WHOLE = "CREATE INDEX IF NOT EXISTS whole_records ON refreshes (id) WHERE compacted IS NULL"


class SqliteJournal(RefreshJournal):
    """Safe across threads and processes (SQLite's own locking). `create=False`: a reader's
    open, which raises JournalMissing rather than make a file.

    What each worker was last seen holding (`holdings`) is read from the records once and
    then kept up to date in memory with this journal's own writes; it is read again from
    the records when another connection (another coordinator, process or journal object)
    has committed since (SQLite's `PRAGMA data_version`), or when one of this journal's
    writes changes a record it cannot follow (one it did not open, or a worker's holds
    taken back). A coordinator's refreshes of a thousand workers would otherwise decode
    every record's workers on every refresh."""

    def __init__(self, path: str | Path = ":memory:", *, create: bool = True,
                 bounds: JournalBounds | None = None) -> None:
        self.path = str(path)
        self.bounds = bounds or JournalBounds()
        if self.path != ":memory:":
            if not create and not Path(self.path).exists():
                raise JournalMissing(f"no journal at {self.path}")
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite.connect(self.path)
        self._lock = threading.Lock()
        with self._lock:
            columns = ", ".join(f"{name} {kind}" for name, kind in COLUMNS.items())
            self._db.execute(f"CREATE TABLE IF NOT EXISTS refreshes ({columns})")
            self._db.execute(EPOCHS)
            self._db.execute(HISTORY)
            # a journal written before a column existed gets it
            have = {row[1] for row in self._db.execute("PRAGMA table_info(refreshes)")}
            for name, kind in COLUMNS.items():
                if name not in have:
                    self._db.execute(f"ALTER TABLE refreshes ADD COLUMN {name} {kind}")
            self._db.execute(WHOLE)
        # holdings per (fleet, model): {worker: (the record that saw it, its holds)}, valid
        # while the store's data_version is `_version` (no other connection committed)
        self._held: dict[tuple[str | None, str | None], dict[int, tuple[int, dict[str, Any]]]] = {}
        self._version: int | None = None
        self._mine: dict[int, tuple[str | None, str | None]] = {}  # records opened here

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
                rid = int(cur.lastrowid)
                self._mine[rid] = (fleet, columns.get("model"))
                self._wrote(rid, columns, opened=True)
                return rid, epoch
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
            if cur.rowcount == 1:
                self._wrote(refresh_id, columns)
            return cur.rowcount == 1

    def _wrote(self, refresh_id: int, columns: dict[str, Any], opened: bool = False) -> None:
        """Bring the holdings kept in memory up to date with a write of this journal's to
        record `refresh_id` (under the lock; `opened`: the write that made it); what they
        cannot follow is dropped, to be read again."""
        if not self._held:
            return
        if not opened and ({"fleet", "model"} & columns.keys()
                           or ("workers" in columns and refresh_id not in self._mine)):
            self._held.clear()  # a record moved between fleets, or one not opened here
            return
        if "workers" not in columns or (held := self._held.get(self._mine[refresh_id])) is None:
            return
        seen = {int(iid): w.get("holds") for iid, w in (columns["workers"] or {}).items()
                if isinstance(w, dict)}
        if any(rid == refresh_id and not seen.get(iid) for iid, (rid, _) in held.items()):
            del self._held[self._mine[refresh_id]]  # holds taken back: older records tell
            return
        for iid, holds in seen.items():
            if holds and held.get(iid, (0, None))[0] <= refresh_id:
                held[iid] = (refresh_id, dict(holds))

    # ---------------------------------------------------------------- reads

    def _find(self, refresh_id: int) -> JournalRecord | None:
        rows = self._select("WHERE id = ?", (refresh_id,))
        return rows[0] if rows else None

    def recent(self, limit: int = 20) -> list[JournalRecord]:
        return self._select("ORDER BY id DESC LIMIT ?", (limit,))

    def last_served(self, fleet: str | None, model: str | None, *,
                    workers: bool = True) -> JournalRecord | None:
        rows = self._select(f"WHERE {SERVED_MARK} IS NOT NULL AND fleet IS ? AND model IS ? "
                            "ORDER BY id DESC LIMIT 1", (fleet, model),
                            "*" if workers else _BRIEF)
        return rows[0] if rows else None

    def _holdings(self, fleet: str | None, model: str | None) -> dict[int, dict[str, Any]]:
        """Per worker, what the newest of the newest 1,000 records saw it holding, reading
        only each record's workers' `holds` (their calls are skipped, not decoded); kept in memory while no
        other connection writes (see the class)."""
        with self._lock:
            version = self._db.execute("PRAGMA data_version").fetchone()[0]
            if version != self._version:
                self._held.clear()
                self._version = version
            held = self._held.get((fleet, model))
            if held is None:
                rows = self._db.execute("SELECT id, workers FROM refreshes WHERE fleet IS ? AND "
                                        "model IS ? ORDER BY id DESC LIMIT 1000",
                                        (fleet, model)).fetchall()
                held = self._held[(fleet, model)] = _newest_holds(rows)
            return {iid: holds for iid, (_, holds) in held.items()}

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

    # ---------------------------------------------------------------- bounds

    def _compact(self, bounds: JournalBounds) -> dict[str, int]:
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                newest = db.execute("SELECT MAX(id) FROM refreshes").fetchone()[0] or 0
                whole = newest - bounds.keep_full + 1  # the newest keep_full stay whole
                compacted = db.execute(
                    "UPDATE refreshes SET workers = '{}', steps = '[]', compacted = 1 "
                    "WHERE id < ? AND ended_at IS NOT NULL AND compacted IS NULL",
                    (whole,)).rowcount
                folded = self._fold_below(whole - bounds.keep_summaries)
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
            if compacted:
                self._held.clear()  # holdings come from the records kept whole
            return {"compacted": compacted, "folded": folded}

    def _fold_below(self, kept: int) -> int:
        """Fold the ended records older than `kept` into the history (under the write lock),
        but each fleet and model selection's last verified one."""
        db = self._db
        rows = db.execute(f"SELECT id, fleet, model, started_at, ended_at, decision FROM "
                          f"refreshes WHERE id < ? AND ended_at IS NOT NULL AND id NOT IN "
                          f"(SELECT MAX(id) FROM refreshes WHERE {SERVED_MARK} IS NOT NULL "
                          f"GROUP BY fleet, model) ORDER BY id", (kept,)).fetchall()
        histories: dict[tuple[Any, Any], dict[str, Any] | None] = {}
        for rid, fleet, model, started, ended, decision in rows:
            if (fleet, model) not in histories:
                got = db.execute("SELECT summary FROM history WHERE fleet IS ? AND model IS ?",
                                 (fleet, model)).fetchone()
                histories[fleet, model] = json.loads(got[0]) if got else None
            histories[fleet, model] = fold(histories[fleet, model], {
                "id": rid, "started_at": started, "ended_at": ended, "decision": decision})
        for (fleet, model), h in histories.items():
            db.execute("DELETE FROM history WHERE fleet IS ? AND model IS ?", (fleet, model))
            db.execute("INSERT INTO history (fleet, model, summary) VALUES (?, ?, ?)",
                       (fleet, model, json.dumps(h)))
        db.executemany("DELETE FROM refreshes WHERE id = ?", [(r[0],) for r in rows])
        return len(rows)

    def history(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute("SELECT fleet, model, summary FROM history").fetchall()
        return [{"fleet": f, "model": m, **json.loads(h)} for f, m, h in rows]

    def size(self) -> dict[str, int]:
        with self._lock:
            records, summaries = self._db.execute(
                "SELECT COUNT(*), COUNT(compacted) FROM refreshes").fetchone()
            pages, page = (self._db.execute(f"PRAGMA {n}").fetchone()[0]
                           for n in ("page_count", "page_size"))
        folded = sum(h["transactions"] for h in self.history())
        return {"records": records, "full": records - summaries, "summaries": summaries,
                "folded": folded, "bytes": pages * page}

    def _select(self, tail: str, args: tuple, columns: str = "*") -> list[JournalRecord]:
        with self._lock:
            cur = self._db.execute(f"SELECT {columns} FROM refreshes {tail}", args)
            names = [d[0] for d in cur.description]
            rows = cur.fetchall()
        return [journal_record({name: _decode(name, value)
                                for name, value in zip(names, row, strict=True)})
                for row in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _newest_holds(rows: list[tuple[int, str | None]]) -> dict[int, tuple[int, dict[str, Any]]]:
    """Per worker, the newest of `rows` (id, workers; newest first) that has its `holds`."""
    out: dict[int, tuple[int, dict[str, Any]]] = {}
    for rid, raw in rows:
        if not raw:
            continue
        try:
            held = {k: w.holds for k, w in (_HOLDS.decode(raw) or {}).items()}
        except (msgspec.DecodeError, msgspec.ValidationError):  # NaN, as json.dumps wrote
            held = {k: w.get("holds") for k, w in (json.loads(raw) or {}).items()}
        for iid, holds in held.items():
            if holds and int(iid) not in out:
                out[int(iid)] = (rid, holds)
    return out


class _Holds(msgspec.Struct):
    """A journaled worker's `holds`, the rest of its entry skipped."""

    holds: dict[str, Any] | None = None


_HOLDS = msgspec.json.Decoder(dict[str, _Holds] | None)


def _encode(column: str, value: Any) -> Any:
    """A column's value as stored: JSON text for the JSON columns, written by msgspec (a
    tenth of json.dumps's CPU on a record of a thousand workers' calls; a float that is
    not finite, which no worker's JSON carries, is written as null)."""
    return msgspec.json.encode(value).decode() if column in JSON_COLUMNS else value


def _decode(column: str, value: Any) -> Any:
    if column in JSON_COLUMNS:
        return json.loads(value) if value else None
    return value
