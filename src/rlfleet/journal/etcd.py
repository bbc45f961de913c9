"""The journal in etcd v3, for coordinators on several hosts (``etcd://host:port[/name]``)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import urllib.parse
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import aetcd
import aetcd.exceptions

from rlfleet.journal.base import JournalBounds, JournalError, RefreshJournal, fold
from rlfleet.journal.record import SERVED_MARK, JournalRecord, journal_record

log = logging.getLogger("rlfleet.journal")
T = TypeVar("T")

#: bytes of workers' entries per key (etcd refuses a value, and a request, over 1.5 MiB)
BATCH_BYTES = 256 << 10
#: bytes of writes sent in one etcd transaction (the rest of a large record goes first)
REQUEST_BYTES = 1 << 20
#: etcd revisions kept when the journal compacts etcd's history (None: it does not). A
#: revision holds one write: this many of the journal's largest (a record's workers' entries,
#: a batch of up to 256 KiB each) must fit in etcd's quota beside what is live
KEEP_REVISIONS = 1000
#: transactions opened between two compactions of etcd's history
COMPACT_EVERY = 32
#: transactions opened between two compactions of the journal's records (each costs a few
#: round trips to etcd whatever it finds to do): the bounds are kept within as many
COMPACT_RECORDS_EVERY = 8


class EtcdJournal(RefreshJournal):
    """The journal in etcd v3 (through aetcd, on a loop of its own so that callers stay
    synchronous), under ``/rlfleet/journal/`` (``/rlfleet/journal/<name>/`` for a journal
    opened as ``etcd://host:port/<name>``):

    - ``next_id``: the next record id;
    - ``fleets/<fleet>``: the fleet's epoch, its open transactions, its last served record
      and worker holdings per model selection (what a coordinator reads at start);
    - ``records/<id>``: one record, but its workers' entries;
    - ``workers/<id>/<n>``: those entries, in batches of at most 256 KiB (`workers_batches`
      in the record says how many), so that no value grows with the fleet past etcd's limit
      and a reader that wants the record alone (`last_served(workers=False)`) reads none;
    - ``bounds``: how far compaction has gone (rlfleet.journal.base.JournalBounds; it runs
      every COMPACT_RECORDS_EVERY transactions this journal opens, so the bounds hold
      within as many);
    - ``history/<fleet, model>``: the folded transactions' counts.

    Every write is one etcd transaction that compares the revisions it read (retried when
    another coordinator wrote first); a record whose workers' entries do not fit in one
    request writes those first. Every call has a deadline. Every `compact_every` transactions
    the journal compacts etcd's history older than `keep_revisions` revisions (etcd keeps
    every revision of every key until compacted, and refuses writes past its quota:
    NOSPACE); `keep_revisions=None` leaves that to etcd's own --auto-compaction."""

    PREFIX = "/rlfleet/journal/"

    def __init__(self, host: str, port: int, name: str = "", deadline: float = 10.0, *,
                 bounds: JournalBounds | None = None, keep_revisions: int | None = KEEP_REVISIONS,
                 compact_every: int = COMPACT_EVERY) -> None:
        name = name.strip("/")
        self.path = f"etcd://{host}:{port}" + (f"/{name}" if name else "")
        self.prefix = self.PREFIX + (f"{name}/" if name else "")
        self.deadline = deadline
        self.bounds = bounds or JournalBounds()
        self.keep_revisions, self.compact_every = keep_revisions, max(1, compact_every)
        self._opened = 0  # transactions this journal opened (the history is compacted by them)
        self._compacted_to = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="rlfleet-journal-etcd")
        self._thread.start()

        async def connect() -> aetcd.Client:  # the client binds to the loop that makes it
            return aetcd.Client(host=host, port=port, timeout=deadline)
        self._client = self._run(connect(), "connect")

    # ---------------------------------------------------------------- plumbing

    def _run(self, coro: Coroutine[Any, Any, T], what: str) -> T:
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
    def _workers_key(refresh_id: int, batch: int | None = None) -> str:
        return f"workers/{refresh_id:012d}/" + ("" if batch is None else f"{batch:04d}")

    @staticmethod
    def _model_key(model: str | None) -> str:
        return json.dumps(model)

    @staticmethod
    def _history_key(fleet: str | None, model: str | None) -> str:
        return "history/" + urllib.parse.quote(json.dumps([fleet, model]), safe="")

    def _get(self, name: str) -> tuple[Any, int | None]:
        """(value, mod revision); (None, None) when absent."""
        r = self._run(self._client.get(self._key(name)), f"get {name}")
        return (json.loads(r.value), r.mod_revision) if r is not None else (None, None)

    def _range(self, start: str, end: str, what: str) -> list[tuple[str, Any]]:
        r = self._run(self._client.get_range(self._key(start), self._key(end)), what)
        cut = len(self.prefix)
        return [(kv.key.decode()[cut:], json.loads(kv.value)) for kv in r]

    def _commit(self, reads: dict[str, int | None], writes: dict[str, Any],
                removes: tuple[tuple[str, str], ...] = ()) -> bool:
        """Write `writes` and remove the key ranges `removes` ([start, end)) if every key in
        `reads` is still at the revision read."""
        t = self._client.transactions
        compare = [t.version(self._key(k)) == 0 if rev is None else t.mod(self._key(k)) == rev
                   for k, rev in reads.items()]
        ops = [t.put(self._key(k), json.dumps(v).encode()) for k, v in writes.items()]
        ops += [t.delete(self._key(a), range_end=self._key(b)) for a, b in removes]
        ok, _ = self._run(self._client.transaction(compare, ops, []), "commit")
        return bool(ok)

    def _retry(self, attempt: Callable[[], tuple[bool, T]]) -> T:
        for _ in range(200):
            done, result = attempt()
            if done:
                return result
            time.sleep(0.005)
        raise JournalError(f"journal {self.path}: too much contention")

    # ---------------------------------------------------------------- workers' entries

    def _batches(self, refresh_id: int, workers: dict[str, Any]) -> dict[str, Any]:
        """The batch keys of a record's workers' entries, each at most BATCH_BYTES."""
        out: dict[str, Any] = {}
        batch: dict[str, Any] = {}
        size = 0
        for iid, w in workers.items():
            n = len(json.dumps(w))
            if batch and size + n > BATCH_BYTES:
                out[self._workers_key(refresh_id, len(out))] = batch
                batch, size = {}, 0
            batch[iid], size = w, size + n
        if batch:
            out[self._workers_key(refresh_id, len(out))] = batch
        return out

    def _write_ahead(self, writes: dict[str, Any]) -> dict[str, Any]:
        """Put the batches of `writes` that would make one request too large on their own
        (before the transaction that names them); the writes left for it."""
        total = sum(len(json.dumps(v)) for v in writes.values())
        for k in [k for k in writes if k.startswith("workers/")]:
            if total <= REQUEST_BYTES:
                break
            value = writes.pop(k)
            total -= len(json.dumps(value))
            self._run(self._client.put(self._key(k), json.dumps(value).encode()), f"put {k}")
        return writes

    def _attach_workers(self, records: list[dict[str, Any]], start: int, end: int) -> None:
        """Fill each of `records` (ids in [start, end)) with its workers' entries."""
        by_id: dict[int, dict[str, Any]] = {}
        for key, batch in self._range(self._workers_key(start), self._workers_key(end),
                                      "list workers"):
            rid, n = (int(x) for x in key.removeprefix("workers/").split("/"))
            by_id.setdefault(rid, {})[n] = batch
        for rec in records:
            if "workers_batches" not in rec:  # written before entries were kept apart
                continue
            batches = by_id.get(rec["id"], {})
            rec["workers"] = {iid: w for n in sorted(batches)
                              if n < rec.get("workers_batches", len(batches))
                              for iid, w in batches[n].items()}

    # ---------------------------------------------------------------- writes

    def _open(self, fleet: str | None, floor_epoch: int,
              columns: dict[str, Any]) -> tuple[int, int]:
        fleet_key = self._fleet_key(fleet)
        workers = columns.pop("workers", None) or {}

        def attempt() -> tuple[bool, tuple[int, int]]:
            nxt, nxt_rev = self._get("next_id")
            doc, doc_rev = self._get(fleet_key)
            doc = doc or _empty_fleet()
            rid = (nxt or {"id": 1})["id"]
            epoch = max(doc["epoch"], floor_epoch) + 1
            doc["epoch"] = epoch
            doc["open"][str(rid)] = epoch
            batches = self._batches(rid, workers)
            rec = {"id": rid, **columns, "fleet_epoch": epoch, "workers_batches": len(batches)}
            writes = self._write_ahead({**batches, "next_id": {"id": rid + 1}, fleet_key: doc,
                                        self._record_key(rid): rec})
            ok = self._commit({"next_id": nxt_rev, fleet_key: doc_rev}, writes)
            return ok, (rid, epoch)
        opened = self._retry(attempt)
        self._opened += 1
        return opened

    def _update(self, refresh_id: int, only_open: bool, columns: dict[str, Any]) -> bool:
        key = self._record_key(refresh_id)
        workers = columns.pop("workers", None)

        def attempt() -> tuple[bool, bool]:
            rec, rev = self._get(key)
            if rec is None:
                raise KeyError(f"no refresh {refresh_id} in {self.path}")
            if only_open and rec.get("ended_at") is not None:
                return True, False
            rec.update(columns)
            reads: dict[str, int | None] = {key: rev}
            writes: dict[str, Any] = {key: rec}
            removes: tuple[tuple[str, str], ...] = ()
            if workers is not None:
                batches = self._batches(refresh_id, workers)
                rec.pop("workers", None)  # kept inline by a journal written before batches
                rec["workers_batches"] = len(batches)
                writes.update(batches)
                removes = ((self._workers_key(refresh_id, len(batches)),
                            self._workers_key(refresh_id + 1)),)
            if {"ended_at", SERVED_MARK} & columns.keys() or workers is not None:
                fleet_key = self._fleet_key(rec.get("fleet"))
                doc, doc_rev = self._get(fleet_key)
                if doc is not None:
                    _index(doc, refresh_id, rec, workers or {},
                           self._model_key(rec.get("model")))
                    reads[fleet_key], writes[fleet_key] = doc_rev, doc
            return self._commit(reads, self._write_ahead(writes), removes), True
        return self._retry(attempt)

    # ---------------------------------------------------------------- reads

    def _find(self, refresh_id: int, workers: bool = True) -> JournalRecord | None:
        rec, _ = self._get(self._record_key(refresh_id))
        if rec is None:
            return None
        if workers:
            self._attach_workers([rec], refresh_id, refresh_id + 1)
        return journal_record(_public(rec))

    def recent(self, limit: int = 20) -> list[JournalRecord]:
        nxt, _ = self._get("next_id")
        end = (nxt or {"id": 1})["id"]
        start = max(1, end - limit)
        recs = [rec for _, rec in self._range(self._record_key(start), self._record_key(end),
                                              "list records")]
        self._attach_workers(recs, start, end)
        return [journal_record(_public(rec)) for rec in reversed(recs)]

    def _fleet_doc(self, fleet: str | None) -> dict[str, Any]:
        doc, _ = self._get(self._fleet_key(fleet))
        return doc or _empty_fleet()

    def last_served(self, fleet: str | None, model: str | None, *,
                    workers: bool = True) -> JournalRecord | None:
        rid = self._fleet_doc(fleet)["served"].get(self._model_key(model))
        if not rid:
            return None
        row = self._find(rid, workers)
        if row is None:
            raise KeyError(f"no refresh {rid} in {self.path}")
        return row

    def _holdings(self, fleet: str | None, model: str | None) -> dict[int, dict[str, Any]]:
        held = self._fleet_doc(fleet)["holdings"].get(self._model_key(model), {})
        return {int(iid): h["holds"] for iid, h in held.items()}

    def unfinished(self, fleet: str | None, model: str | None,
                   before_epoch: int) -> list[JournalRecord]:
        doc = self._fleet_doc(fleet)
        out = []
        for rid, epoch in sorted(doc["open"].items(), key=lambda kv: int(kv[0])):
            if epoch < before_epoch:
                rec = self.get(int(rid))
                if rec["model"] == model and rec["ended_at"] is None:
                    out.append(rec)
        return out

    def fleet_epoch(self, fleet: str | None) -> int:
        return self._fleet_doc(fleet)["epoch"]

    def history(self) -> list[dict[str, Any]]:
        out = []
        for key, h in self._range("history/", "history0", "list history"):
            fleet, model = json.loads(urllib.parse.unquote(key.removeprefix("history/")))
            out.append({"fleet": fleet, "model": model, **h})
        return out

    def size(self) -> dict[str, int]:
        """Reads every key of the journal (for benchmarks and tests)."""
        r = self._run(self._client.get_prefix(self._key("")), "list the journal")
        records = summaries = nbytes = 0
        for kv in r:
            nbytes += len(kv.key) + len(kv.value)
            if kv.key.startswith(self._key("records/")):
                records += 1
                summaries += bool(json.loads(kv.value).get("compacted"))
        folded = sum(h["transactions"] for h in self.history())
        return {"records": records, "full": records - summaries, "summaries": summaries,
                "folded": folded, "bytes": nbytes}

    # ---------------------------------------------------------------- bounds

    def _compact(self, bounds: JournalBounds) -> dict[str, int]:
        out = {"compacted": 0, "folded": 0}
        if self._opened % COMPACT_RECORDS_EVERY == 0:
            out = self._compact_records(bounds)
        if self.keep_revisions is not None and self._opened % self.compact_every == 0:
            self._compact_revisions()
        return out

    def _compact_records(self, bounds: JournalBounds) -> dict[str, int]:
        nxt, _ = self._get("next_id")
        newest = (nxt or {"id": 1})["id"] - 1
        meta, meta_rev = self._get("bounds")
        meta = meta or {"full_below": 1, "fold_below": 1, "open_c": [], "open_f": []}
        whole_from = newest - bounds.keep_full + 1  # these stay whole
        fold_from = whole_from - bounds.keep_summaries  # older ones are folded
        docs = [doc for _, doc in self._range("fleets/", "fleets0", "list fleets")]
        open_ids = {int(i) for d in docs for i in d["open"]}
        served = {int(i) for d in docs for i in d["served"].values()}
        out = {"compacted": 0, "folded": 0}
        behind_c, behind_f = [], []
        for rid in sorted(set(meta["open_c"]) | set(range(meta["full_below"], whole_from))):
            if rid in open_ids:
                behind_c.append(rid)
            else:
                out["compacted"] += self._summarize(rid)
        for rid in sorted(set(meta["open_f"]) | set(range(meta["fold_below"], fold_from))):
            if rid in open_ids or rid in served:
                behind_f.append(rid)
            else:
                out["folded"] += self._fold(rid)
        new = {"full_below": max(meta["full_below"], whole_from),
               "fold_below": max(meta["fold_below"], fold_from),
               "open_c": behind_c, "open_f": behind_f}
        if new != meta:
            self._commit({"bounds": meta_rev}, {"bounds": new})  # lost: another did it
        if out["compacted"]:
            self._forget_holdings(whole_from)
        return out

    def _summarize(self, refresh_id: int) -> int:
        """Compact one ended record to its summary (1 when this call did)."""
        key = self._record_key(refresh_id)
        rec, rev = self._get(key)
        if rec is None or rec.get("compacted") or rec.get("ended_at") is None:
            return 0
        rec.pop("workers", None)
        rec.update(steps=[], compacted=1, workers_batches=0)
        return int(self._commit({key: rev}, {key: rec}, (
            (self._workers_key(refresh_id, 0), self._workers_key(refresh_id + 1)),)))

    def _fold(self, refresh_id: int) -> int:
        """Fold one record into its fleet's history (1 when this call did)."""
        key = self._record_key(refresh_id)

        def attempt() -> tuple[bool, int]:
            rec, rev = self._get(key)
            if rec is None or rec.get("ended_at") is None:
                return True, 0
            hkey = self._history_key(rec.get("fleet"), rec.get("model"))
            history, hrev = self._get(hkey)
            ok = self._commit({key: rev, hkey: hrev}, {hkey: fold(history, rec)}, (
                (key, key + "\0"),
                (self._workers_key(refresh_id, 0), self._workers_key(refresh_id + 1))))
            return ok, int(ok)
        return self._retry(attempt)

    def _forget_holdings(self, whole_from: int) -> None:
        """Drop from every fleet's document the holdings seen only in compacted records."""
        for key, _ in self._range("fleets/", "fleets0", "list fleets"):
            doc, rev = self._get(key)
            if doc is None:
                continue
            changed = False
            for held in doc["holdings"].values():
                for iid in [i for i, h in held.items() if h["seen_in"] < whole_from]:
                    del held[iid]
                    changed = True
            if changed:
                self._commit({key: rev}, {key: doc})  # lost: the next compaction does it

    def _compact_revisions(self) -> None:
        """Compact etcd's history older than `keep_revisions` revisions (the whole store's:
        etcd compacts by revision; watchers behind it list again, as discovery's do)."""
        _, revision = self._get("next_id")
        target = (revision or 0) - self.keep_revisions
        if target <= self._compacted_to:
            return
        try:
            self._run(self._client.compact(target), "compact")
            self._compacted_to = target
        except JournalError as e:  # another compacted past it already
            if "compacted" not in str(e):
                raise
            self._compacted_to = target

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


def _public(rec: dict[str, Any]) -> dict[str, Any]:
    """A stored record as readers get it (the store's bookkeeping dropped)."""
    rec.pop("workers_batches", None)
    return rec


def _empty_fleet() -> dict[str, Any]:
    """A fleet's document before its first transaction: its epoch, its open transactions
    ({id: epoch}), and per model selection its last served record and worker holdings."""
    return {"epoch": 0, "open": {}, "served": {}, "holdings": {}}


def _index(doc: dict[str, Any], refresh_id: int, rec: dict[str, Any],
           workers: dict[str, Any], model: str) -> None:
    """Bring the fleet's document up to date with record `refresh_id` as now written."""
    if rec.get("ended_at") is not None:
        doc["open"].pop(str(refresh_id), None)
    if rec.get(SERVED_MARK) is not None:
        doc["served"][model] = max(refresh_id, doc["served"].get(model, 0))
    held = doc["holdings"].setdefault(model, {})
    for iid, w in workers.items():
        seen = held.get(str(iid))
        if w.get("holds") and (seen is None or seen["seen_in"] <= refresh_id):
            held[str(iid)] = {"holds": w["holds"], "seen_in": refresh_id}
