"""The journal in etcd v3, for coordinators on several hosts (``etcd://host:port[/name]``)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.parse
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import aetcd
import aetcd.exceptions

from rlfleet.journal.base import JournalError, RefreshJournal
from rlfleet.journal.record import SERVED_MARK, JournalRecord, journal_record

T = TypeVar("T")


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

    def _retry(self, attempt: Callable[[], tuple[bool, T]]) -> T:
        for _ in range(200):
            done, result = attempt()
            if done:
                return result
            time.sleep(0.005)
        raise JournalError(f"journal {self.path}: too much contention")

    # ---------------------------------------------------------------- writes

    def _open(self, fleet: str | None, floor_epoch: int,
              columns: dict[str, Any]) -> tuple[int, int]:
        fleet_key = self._fleet_key(fleet)

        def attempt() -> tuple[bool, tuple[int, int]]:
            nxt, nxt_rev = self._get("next_id")
            doc, doc_rev = self._get(fleet_key)
            doc = doc or _empty_fleet()
            rid = (nxt or {"id": 1})["id"]
            epoch = max(doc["epoch"], floor_epoch) + 1
            doc["epoch"] = epoch
            doc["open"][str(rid)] = epoch
            rec = {"id": rid, **columns, "fleet_epoch": epoch}
            ok = self._commit({"next_id": nxt_rev, fleet_key: doc_rev},
                              {"next_id": {"id": rid + 1}, fleet_key: doc,
                               self._record_key(rid): rec})
            return ok, (rid, epoch)
        return self._retry(attempt)

    def _update(self, refresh_id: int, only_open: bool, columns: dict[str, Any]) -> bool:
        key = self._record_key(refresh_id)

        def attempt() -> tuple[bool, bool]:
            rec, rev = self._get(key)
            if rec is None:
                raise KeyError(f"no refresh {refresh_id} in {self.path}")
            if only_open and rec.get("ended_at") is not None:
                return True, False
            rec.update(columns)
            reads: dict[str, int | None] = {key: rev}
            writes: dict[str, Any] = {key: rec}
            if {"ended_at", SERVED_MARK, "workers"} & columns.keys():
                fleet_key = self._fleet_key(rec.get("fleet"))
                doc, doc_rev = self._get(fleet_key)
                if doc is not None:
                    _index(doc, refresh_id, rec, self._model_key(rec.get("model")))
                    reads[fleet_key], writes[fleet_key] = doc_rev, doc
            return self._commit(reads, writes), True
        return self._retry(attempt)

    # ---------------------------------------------------------------- reads

    def _find(self, refresh_id: int) -> JournalRecord | None:
        rec, _ = self._get(self._record_key(refresh_id))
        return None if rec is None else journal_record(rec)

    def recent(self, limit: int = 20) -> list[JournalRecord]:
        nxt, _ = self._get("next_id")
        end = (nxt or {"id": 1})["id"]
        start = max(1, end - limit)
        r = self._run(self._client.get_range(self._key(self._record_key(start)),
                                             self._key(self._record_key(end))), "list records")
        return [journal_record(json.loads(kv.value)) for kv in reversed(list(r))]

    def _fleet_doc(self, fleet: str | None) -> dict[str, Any]:
        doc, _ = self._get(self._fleet_key(fleet))
        return doc or _empty_fleet()

    def last_served(self, fleet: str | None, model: str | None, *,
                    workers: bool = True) -> JournalRecord | None:
        rid = self._fleet_doc(fleet)["served"].get(self._model_key(model))
        if not rid:
            return None
        row = self.get(rid)
        if not workers:
            row["workers"] = {}
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


def _empty_fleet() -> dict[str, Any]:
    """A fleet's document before its first transaction: its epoch, its open transactions
    ({id: epoch}), and per model selection its last served record and worker holdings."""
    return {"epoch": 0, "open": {}, "served": {}, "holdings": {}}


def _index(doc: dict[str, Any], refresh_id: int, rec: dict[str, Any], model: str) -> None:
    """Bring the fleet's document up to date with record `refresh_id` as now written."""
    if rec.get("ended_at") is not None:
        doc["open"].pop(str(refresh_id), None)
    if rec.get(SERVED_MARK) is not None:
        doc["served"][model] = max(refresh_id, doc["served"].get(model, 0))
    held = doc["holdings"].setdefault(model, {})
    for iid, w in (rec.get("workers") or {}).items():
        seen = held.get(str(iid))
        if w.get("holds") and (seen is None or seen["seen_in"] <= refresh_id):
            held[str(iid)] = {"holds": w["holds"], "seen_in": refresh_id}
