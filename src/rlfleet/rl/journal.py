"""The refresh journal: one record per fleet transaction (a policy refresh, the admission of
new workers, the recovery of an interrupted one) with everything needed to tell later what
happened and why, and the fleet's epoch counter.

It is the source of truth a coordinator starts from: the fleet's last verified policy
(`last_served`), what each worker was last seen holding (`holdings`), and the transactions
a coordinator began but never finished (`unfinished`: it crashed, or was paused and taken
over). Each transaction takes the fleet's next epoch with a compare-and-set in the same
write that records it (`open_transaction`), so two coordinators on one store never share an
epoch, and workers refuse the older one (rlfleet.worker.system_server.FleetFence).

Stores, chosen by `open_journal`: a SQLite file (the default; `:memory:` for a coordinator
that keeps nothing) or etcd (``etcd://host:port``) for coordinators on several hosts."""

from __future__ import annotations

import abc
import asyncio
import json
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

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
EPOCHS = "CREATE TABLE IF NOT EXISTS fleet_epochs (fleet TEXT PRIMARY KEY, epoch INTEGER NOT NULL)"

_JSON = ("intended_workers", "verified_workers", "steps", "workers", "target_source",
         "served_source")
# columns added after the first release: journals written before get them on open
_ADDED = {"fleet": "TEXT", "model": "TEXT", "served_version": "TEXT", "served_digest": "TEXT",
          "served_path": "TEXT", "verified_workers": "TEXT NOT NULL DEFAULT '[]'",
          "kind": "TEXT", "fleet_epoch": "INTEGER", "state": "TEXT", "served_step": "INTEGER",
          "target_source": "TEXT", "served_source": "TEXT", "recovery_of": "INTEGER"}
_DEFAULTS = {"verified_workers": [], "intended_workers": [], "steps": [], "workers": {}}


class JournalError(RuntimeError):
    """The journal's store failed or refused an operation; the message says which."""


class RefreshJournal(abc.ABC):
    """What a coordinator reads and writes; `path` names the store in messages."""

    path: str

    @abc.abstractmethod
    def open_transaction(self, *, fleet: str | None, floor_epoch: int = 0,
                         **fields: Any) -> tuple[int, int]:
        """Take the fleet's next epoch (above `floor_epoch`, the newest its workers report)
        and record a transaction that holds it, in one atomic write; (id, epoch)."""

    def begin(self, **fields: Any) -> int:
        """Record a transaction (it takes the next epoch of its `fleet`); its id."""
        return self.open_transaction(**{"fleet": None, **fields})[0]

    @abc.abstractmethod
    def update(self, refresh_id: int, *, only_open: bool = False, **fields: Any) -> bool:
        """Change a record; with `only_open`, only while it has not ended (a coordinator
        that was taken over must not rewrite what its successor recorded). Whether it
        changed."""

    @abc.abstractmethod
    def get(self, refresh_id: int) -> dict[str, Any]: ...

    @abc.abstractmethod
    def recent(self, limit: int = 20) -> list[dict[str, Any]]:
        """The newest records, newest first."""

    @abc.abstractmethod
    def last_served(self, fleet: str | None, model: str | None) -> dict[str, Any] | None:
        """The latest transaction of this fleet (and model selection) that ended with
        verified workers serving one policy (`served_*`): what a rollback returns to."""

    @abc.abstractmethod
    def holdings(self, fleet: str | None, model: str | None) -> dict[int, dict[str, Any]]:
        """What each worker of this fleet was last seen holding ({version, digest, step}),
        from the newest transaction that saw it."""

    @abc.abstractmethod
    def unfinished(self, fleet: str | None, model: str | None,
                   before_epoch: int) -> list[dict[str, Any]]:
        """Transactions of this fleet and model selection, from an epoch older than
        `before_epoch`, that never ended (oldest first)."""

    @abc.abstractmethod
    def fleet_epoch(self, fleet: str | None) -> int:
        """The newest epoch the fleet's transactions took (0: none yet)."""

    def close(self) -> None:  # noqa: B027 - a store may hold nothing to release
        """Release the store."""


def _record(rec: dict[str, Any]) -> dict[str, Any]:
    """Every field a reader may ask for, null when never written."""
    out = dict.fromkeys((*SCHEMA_FIELDS, *_ADDED), None)
    out.update(_DEFAULTS)
    out.update(rec)
    return out


SCHEMA_FIELDS = ("id", "started_at", "ended_at", "framework_step", "update_path",
                 "target_path", "target_version", "target_digest", "previous_version",
                 "previous_digest", "decision", "reason")


def _holds_of(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per worker, what the newest of `records` (newest first) saw it holding."""
    out: dict[int, dict[str, Any]] = {}
    for row in records:
        for iid, w in (row.get("workers") or {}).items():
            if w.get("holds") and int(iid) not in out:
                out[int(iid)] = w["holds"]
    return out


# ---------------------------------------------------------------------------------- SQLite


class Journal(RefreshJournal):
    """The journal in one SQLite file (safe across threads and processes: SQLite's own
    locking), or in memory."""

    def __init__(self, path: str | Path = ":memory:") -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, timeout=30, check_same_thread=False,
                                   isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(SCHEMA)
            self._db.execute(EPOCHS)
            have = {row[1] for row in self._db.execute("PRAGMA table_info(refreshes)")}
            for col, kind in _ADDED.items():
                if col not in have:
                    self._db.execute(f"ALTER TABLE refreshes ADD COLUMN {col} {kind}")

    def open_transaction(self, *, fleet: str | None, floor_epoch: int = 0,
                         **fields: Any) -> tuple[int, int]:
        fields = {"started_at": time.time(), "state": "started", **fields, "fleet": fleet}
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")  # the write lock: one epoch taken at a time
            try:
                row = db.execute("SELECT epoch FROM fleet_epochs WHERE fleet = ?",
                                 (fleet or "",)).fetchone()
                epoch = max(row[0] if row else 0, floor_epoch) + 1
                if row is None:
                    db.execute("INSERT INTO fleet_epochs (fleet, epoch) VALUES (?, ?)",
                               (fleet or "", epoch))
                elif db.execute("UPDATE fleet_epochs SET epoch = ? WHERE fleet = ? AND "
                                "epoch = ?", (epoch, fleet or "", row[0])).rowcount != 1:
                    raise JournalError(f"journal {self.path}: the epoch of fleet {fleet} "
                                       "changed under the write lock")
                fields["fleet_epoch"] = epoch
                cols = ", ".join(fields)
                marks = ", ".join("?" for _ in fields)
                cur = db.execute(f"INSERT INTO refreshes ({cols}) VALUES ({marks})",
                                 [self._enc(k, v) for k, v in fields.items()])
                db.execute("COMMIT")
                return int(cur.lastrowid), epoch
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise

    def update(self, refresh_id: int, *, only_open: bool = False, **fields: Any) -> bool:
        sets = ", ".join(f"{k} = ?" for k in fields)
        cond = " AND ended_at IS NULL" if only_open else ""
        with self._lock:
            cur = self._db.execute(f"UPDATE refreshes SET {sets} WHERE id = ?{cond}",
                                   [*(self._enc(k, v) for k, v in fields.items()), refresh_id])
            return cur.rowcount == 1

    def get(self, refresh_id: int) -> dict[str, Any]:
        rows = self._select("WHERE id = ?", (refresh_id,))
        if not rows:
            raise KeyError(f"no refresh {refresh_id} in {self.path}")
        return rows[0]

    def recent(self, limit: int = 20) -> list[dict[str, Any]]:
        return self._select("ORDER BY id DESC LIMIT ?", (limit,))

    def last_served(self, fleet: str | None, model: str | None) -> dict[str, Any] | None:
        rows = self._select("WHERE served_digest IS NOT NULL AND fleet IS ? AND model IS ? "
                            "ORDER BY id DESC LIMIT 1", (fleet, model))
        return rows[0] if rows else None

    def holdings(self, fleet: str | None, model: str | None) -> dict[int, dict[str, Any]]:
        return _holds_of(self._select("WHERE fleet IS ? AND model IS ? ORDER BY id DESC "
                                      "LIMIT 1000", (fleet, model)))

    def unfinished(self, fleet: str | None, model: str | None,
                   before_epoch: int) -> list[dict[str, Any]]:
        return self._select("WHERE ended_at IS NULL AND fleet IS ? AND model IS ? AND "
                            "COALESCE(fleet_epoch, 0) < ? ORDER BY id", (fleet, model,
                                                                         before_epoch))

    def fleet_epoch(self, fleet: str | None) -> int:
        with self._lock:
            row = self._db.execute("SELECT epoch FROM fleet_epochs WHERE fleet = ?",
                                   (fleet or "",)).fetchone()
        return row[0] if row else 0

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


# ---------------------------------------------------------------------------------- etcd


class EtcdJournal(RefreshJournal):
    """The journal in etcd v3 (through aetcd, on a loop of its own so that callers stay
    synchronous), under ``/rlfleet/journal/`` (``/rlfleet/journal/<name>/`` for a journal
    opened as ``etcd://host:port/<name>``):

    - ``next_id``: the next record id;
    - ``fleets/<fleet>``: the fleet's epoch, its open transactions, its last served record
      and worker holdings per model selection (what a coordinator reads at start);
    - ``records/<id>``: one record.

    Every write is one etcd transaction that compares the revisions it read (retried when
    another coordinator wrote first). Every call has a deadline."""

    PREFIX = "/rlfleet/journal/"

    def __init__(self, host: str, port: int, name: str = "", deadline: float = 10.0) -> None:
        name = name.strip("/")
        self.path = f"etcd://{host}:{port}" + (f"/{name}" if name else "")
        self.prefix = self.PREFIX + (f"{name}/" if name else "")
        self.deadline = deadline
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="rlfleet-journal-etcd")
        self._thread.start()

        async def connect():
            import aetcd

            return aetcd.Client(host=host, port=port, timeout=deadline)
        self._client = self._run(connect(), "connect")

    # ---- plumbing

    def _run(self, coro: Coroutine[Any, Any, T], what: str) -> T:
        import aetcd.exceptions

        fut = asyncio.run_coroutine_threadsafe(
            asyncio.wait_for(coro, self.deadline), self._loop)
        try:
            return fut.result(self.deadline + 5)
        except TimeoutError:
            fut.cancel()
            raise JournalError(f"journal {self.path}: {what} timed out after "
                               f"{self.deadline:g}s") from None
        except aetcd.exceptions.ClientError as e:
            raise JournalError(f"journal {self.path}: {what} failed: {e}") from e

    def _key(self, name: str) -> bytes:
        return (self.prefix + name).encode()

    @staticmethod
    def _fleet_key(fleet: str | None) -> str:
        return "fleets/" + urllib.parse.quote(fleet or "", safe="")

    @staticmethod
    def _record_key(refresh_id: int) -> str:
        return f"records/{refresh_id:012d}"

    @staticmethod
    def _model_key(model: str | None) -> str:
        return json.dumps(model)

    def _get(self, name: str) -> tuple[Any, int | None]:
        """(value, mod revision); (None, None) when absent."""
        r = self._run(self._client.get(self._key(name)), f"get {name}")
        return (json.loads(r.value), r.mod_revision) if r is not None else (None, None)

    def _commit(self, reads: dict[str, int | None], writes: dict[str, Any]) -> bool:
        """Write `writes` if every key in `reads` is still at the revision read."""
        t = self._client.transactions
        compare = [t.version(self._key(k)) == 0 if rev is None else t.mod(self._key(k)) == rev
                   for k, rev in reads.items()]
        puts = [t.put(self._key(k), json.dumps(v).encode()) for k, v in writes.items()]
        ok, _ = self._run(self._client.transaction(compare, puts, []), "commit")
        return bool(ok)

    def _retry(self, attempt) -> Any:
        for _ in range(200):
            done, result = attempt()
            if done:
                return result
            time.sleep(0.005)
        raise JournalError(f"journal {self.path}: too much contention")

    # ---- writes

    def open_transaction(self, *, fleet: str | None, floor_epoch: int = 0,
                         **fields: Any) -> tuple[int, int]:
        fleet_key = self._fleet_key(fleet)

        def attempt():
            nxt, nxt_rev = self._get("next_id")
            doc, doc_rev = self._get(fleet_key)
            doc = doc or {"epoch": 0, "open": {}, "served": {}, "holdings": {}}
            rid = (nxt or {"id": 1})["id"]
            epoch = max(doc["epoch"], floor_epoch) + 1
            doc["epoch"] = epoch
            doc["open"][str(rid)] = epoch
            rec = {"id": rid, "started_at": time.time(), "state": "started", **fields,
                   "fleet": fleet, "fleet_epoch": epoch}
            ok = self._commit({"next_id": nxt_rev, fleet_key: doc_rev},
                              {"next_id": {"id": rid + 1}, fleet_key: doc,
                               self._record_key(rid): rec})
            return ok, (rid, epoch)
        return self._retry(attempt)

    def update(self, refresh_id: int, *, only_open: bool = False, **fields: Any) -> bool:
        key = self._record_key(refresh_id)

        def attempt():
            rec, rev = self._get(key)
            if rec is None:
                raise KeyError(f"no refresh {refresh_id} in {self.path}")
            if only_open and rec.get("ended_at") is not None:
                return True, False
            rec.update(fields)
            reads: dict[str, int | None] = {key: rev}
            writes: dict[str, Any] = {key: rec}
            if {"ended_at", "served_digest", "workers"} & fields.keys():
                fleet_key = self._fleet_key(rec.get("fleet"))
                doc, doc_rev = self._get(fleet_key)
                if doc is not None:
                    model = self._model_key(rec.get("model"))
                    if rec.get("ended_at") is not None:
                        doc["open"].pop(str(refresh_id), None)
                    if rec.get("served_digest") is not None:
                        doc["served"][model] = max(refresh_id, doc["served"].get(model, 0))
                    held = doc["holdings"].setdefault(model, {})
                    for iid, w in (rec.get("workers") or {}).items():
                        seen = held.get(str(iid))
                        if w.get("holds") and (seen is None or seen["seen_in"] <= refresh_id):
                            held[str(iid)] = {"holds": w["holds"], "seen_in": refresh_id}
                    reads[fleet_key], writes[fleet_key] = doc_rev, doc
            return self._commit(reads, writes), True
        return self._retry(attempt)

    # ---- reads

    def get(self, refresh_id: int) -> dict[str, Any]:
        rec, _ = self._get(self._record_key(refresh_id))
        if rec is None:
            raise KeyError(f"no refresh {refresh_id} in {self.path}")
        return _record(rec)

    def recent(self, limit: int = 20) -> list[dict[str, Any]]:
        nxt, _ = self._get("next_id")
        end = (nxt or {"id": 1})["id"]
        start = max(1, end - limit)
        r = self._run(self._client.get_range(self._key(self._record_key(start)),
                                             self._key(self._record_key(end))), "list records")
        return [_record(json.loads(kv.value)) for kv in reversed(list(r))]

    def _fleet_doc(self, fleet: str | None) -> dict[str, Any]:
        doc, _ = self._get(self._fleet_key(fleet))
        return doc or {"epoch": 0, "open": {}, "served": {}, "holdings": {}}

    def last_served(self, fleet: str | None, model: str | None) -> dict[str, Any] | None:
        rid = self._fleet_doc(fleet)["served"].get(self._model_key(model))
        return self.get(rid) if rid else None

    def holdings(self, fleet: str | None, model: str | None) -> dict[int, dict[str, Any]]:
        held = self._fleet_doc(fleet)["holdings"].get(self._model_key(model), {})
        return {int(iid): h["holds"] for iid, h in held.items()}

    def unfinished(self, fleet: str | None, model: str | None,
                   before_epoch: int) -> list[dict[str, Any]]:
        doc = self._fleet_doc(fleet)
        out = []
        for rid, epoch in sorted(doc["open"].items(), key=lambda kv: int(kv[0])):
            if epoch < before_epoch:
                rec = self.get(int(rid))
                if rec.get("model") == model and rec.get("ended_at") is None:
                    out.append(rec)
        return out

    def fleet_epoch(self, fleet: str | None) -> int:
        return self._fleet_doc(fleet)["epoch"]

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        try:
            self._run(self._client.close(), "close")
        except JournalError:
            pass  # closing is best effort
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()


def open_journal(where: RefreshJournal | str | Path) -> RefreshJournal:
    """A journal from what a user gives: one already open, ``etcd://host:port[/name]``,
    ``sqlite:///path``, a file path, or ``:memory:``."""
    if isinstance(where, RefreshJournal):
        return where
    text = str(where)
    parts = urllib.parse.urlsplit(text)
    if parts.scheme == "etcd":
        if not parts.hostname or parts.query or parts.fragment:
            raise ValueError(f"bad journal URL {text!r}: expected etcd://host:port[/name]")
        return EtcdJournal(parts.hostname, parts.port or 2379, parts.path)
    if parts.scheme == "sqlite":
        return Journal(urllib.parse.unquote(parts.netloc + parts.path))
    if parts.scheme not in ("", "file"):
        raise ValueError(f"unsupported journal {text!r}: use a file path, sqlite:///path, "
                         ":memory: or etcd://host:port")
    return Journal(urllib.parse.unquote(parts.path) if parts.scheme == "file" else text)
