"""The version catalog: every policy version a fleet can stage, with its lifecycle.

A version is created ``STAGING`` with the parts (files) its publisher will write; the last
part published flips it to ``READY`` (atomically, once). ``delete`` moves it to
``RELEASING``: leases already held stay valid and renewable, no new lease is granted, and
an install already under way is never cancelled. Its bytes are evicted (``EVICTED``) only
after release, when no unexpired lease holds it. Which versions a run keeps, and the
collection that releases and evicts the rest, are rlfleet.weights.retention's; every step
of it is recorded on the version itself (`released_at` and why, `evicted_at`, `removed_at`
once its bytes are gone), so a collection cut short is finished by the next one.

Every version records the model, the content digest of its tensors as the engine receives
them (`rlfleet.weights.digest`), its base version and format (``full`` | ``xor-delta``),
where its bytes are, their size, and the workers that hold it applied (peer sources).

Stores: a SQLite file (the default, nothing to start) or etcd (``etcd://host:port``) for a
fleet across hosts. Both offer one primitive, an atomic compare-and-swap over a few keys;
the lifecycle is written once above it."""

from __future__ import annotations

import abc
import asyncio
import enum
import json
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rlfleet.runtime import sqlite

#: A delta chain longer than this is not replayed (ModelExpress uses the same bound).
MAX_CHAIN = 64
DEFAULT_LEASE_TTL = 60.0


class CatalogError(RuntimeError):
    """A catalog operation was refused; the message says why and what to do."""


class CatalogConflict(CatalogError):
    """A create replayed under a used idempotency key with a different request."""


class VersionState(enum.StrEnum):
    STAGING = "STAGING"  # created; parts still being published
    READY = "READY"  # every part published: stageable, leasable
    RELEASING = "RELEASING"  # deleted: existing leases stay valid, no new ones
    EVICTED = "EVICTED"  # bytes removed (terminal)


_V = VersionState
TRANSITIONS: dict[VersionState, frozenset[VersionState]] = {
    _V.STAGING: frozenset({_V.READY, _V.RELEASING}),
    _V.READY: frozenset({_V.RELEASING}),
    _V.RELEASING: frozenset({_V.EVICTED}),
    _V.EVICTED: frozenset(),
}


def check_transition(old: VersionState, new: VersionState, version: str) -> VersionState:
    if new not in TRANSITIONS[old]:
        raise CatalogError(f"version {version} cannot go from {old.value} to {new.value}")
    return new


class PayloadFormat(enum.StrEnum):
    FULL = "full"
    XOR_DELTA = "xor-delta"


@dataclass
class Lease:
    lease_id: str
    holder: str
    expires_at: float  # wall clock (time.time()), comparable across hosts


@dataclass
class WeightVersion:
    version: str
    model: str
    format: PayloadFormat
    digest: str
    base_version: str | None
    locations: list[str]
    size: int  # bytes of the tensors (the full model), not of the artifact
    parts: dict[str, bool]  # part name -> published
    idempotency_key: str
    state: VersionState = VersionState.STAGING
    created_at: float = field(default_factory=time.time)
    ready_at: float | None = None
    holders: dict[str, dict[str, Any]] = field(default_factory=dict)  # worker -> details
    leases: dict[str, Lease] = field(default_factory=dict)
    released_at: float | None = None  # RELEASING since
    release_reason: str | None = None  # who released it and why (retention says so)
    evicted_at: float | None = None  # EVICTED since (its bytes are then removed)
    removed_at: float | None = None  # its bytes were removed from every location

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["format"], d["state"] = self.format.value, self.state.value
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> WeightVersion:
        d = dict(d)
        d["format"], d["state"] = PayloadFormat(d["format"]), VersionState(d["state"])
        d["leases"] = {k: Lease(**v) for k, v in d.get("leases", {}).items()}
        return cls(**d)

    def request(self) -> dict[str, Any]:
        """What a create asked for: a replay under the same key must ask for the same."""
        return {"version": self.version, "model": self.model, "format": self.format.value,
                "digest": self.digest, "base_version": self.base_version,
                "locations": list(self.locations), "size": self.size,
                "parts": sorted(self.parts)}

    def live_leases(self, now: float | None = None) -> list[Lease]:
        now = time.time() if now is None else now
        return [lease for lease in self.leases.values() if lease.expires_at > now]


# ---------------------------------------------------------------- stores


class Store(abc.ABC):
    """Key → JSON value with a revision token; `commit` is an atomic compare-and-swap over
    several keys (token None: the key must not exist)."""

    url: str

    @abc.abstractmethod
    async def get(self, key: str) -> tuple[dict[str, Any] | None, Any]: ...

    @abc.abstractmethod
    async def commit(self, writes: Sequence[tuple[str, dict[str, Any], Any]]) -> bool: ...

    @abc.abstractmethod
    async def list(self, prefix: str) -> list[dict[str, Any]]: ...

    @abc.abstractmethod
    async def remove(self, keys: Sequence[str]) -> None:
        """Delete `keys` (those absent are ignored), in one transaction."""

    async def close(self) -> None:
        return None


class SqliteStore(Store):
    """One SQLite file; safe across threads and processes (SQLite's own locking)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.url = f"sqlite://{self.path}"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite.connect(str(self.path))
        self._db.execute("CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT "
                         "NULL, rev INTEGER NOT NULL)")

    async def get(self, key: str) -> tuple[dict[str, Any] | None, Any]:
        with self._lock:
            row = self._db.execute("SELECT value, rev FROM kv WHERE key = ?", (key,)).fetchone()
        return (json.loads(row[0]), row[1]) if row else (None, None)

    async def commit(self, writes: Sequence[tuple[str, dict[str, Any], Any]]) -> bool:
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                for key, _value, token in writes:
                    row = db.execute("SELECT rev FROM kv WHERE key = ?", (key,)).fetchone()
                    if (row[0] if row else None) != token:
                        db.execute("ROLLBACK")
                        return False
                for key, value, _token in writes:
                    db.execute("INSERT INTO kv (key, value, rev) VALUES (?, ?, 1) ON CONFLICT(key)"
                               " DO UPDATE SET value = excluded.value, rev = kv.rev + 1",
                               (key, json.dumps(value)))
                db.execute("COMMIT")
                return True
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise

    async def list(self, prefix: str) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute("SELECT value FROM kv WHERE key >= ? AND key < ? ORDER BY key",
                                    (prefix, prefix + "\uffff")).fetchall()
        return [json.loads(r[0]) for r in rows]

    async def remove(self, keys: Sequence[str]) -> None:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany("DELETE FROM kv WHERE key = ?", [(k,) for k in keys])
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

    async def close(self) -> None:
        with self._lock:
            self._db.close()


class EtcdStore(Store):
    """etcd v3 through aetcd; keys live under ``/rlfleet/weights/``. Every call has a
    deadline and fails with CatalogError naming the endpoint."""

    def __init__(self, host: str, port: int, prefix: str = "/rlfleet/weights/",
                 deadline: float = 10.0) -> None:
        import aetcd

        self.url = f"etcd://{host}:{port}"
        self.prefix = prefix
        self.deadline = deadline
        self._client = aetcd.Client(host=host, port=port, timeout=deadline)

    async def _call(self, what: str, coro) -> Any:
        import aetcd.exceptions

        try:
            return await asyncio.wait_for(coro, self.deadline)
        except TimeoutError:
            raise CatalogError(f"catalog {self.url}: {what} timed out after {self.deadline:g}s")\
                from None
        except aetcd.exceptions.ClientError as e:
            raise CatalogError(f"catalog {self.url}: {what} failed: {e}") from e

    async def get(self, key: str) -> tuple[dict[str, Any] | None, Any]:
        r = await self._call(f"get {key}", self._client.get((self.prefix + key).encode()))
        return (json.loads(r.value), r.mod_revision) if r is not None else (None, None)

    async def commit(self, writes: Sequence[tuple[str, dict[str, Any], Any]]) -> bool:
        t = self._client.transactions
        compare, success = [], []
        for key, value, token in writes:
            k = (self.prefix + key).encode()
            compare.append(t.version(k) == 0 if token is None else t.mod(k) == token)
            success.append(t.put(k, json.dumps(value).encode()))
        ok, _ = await self._call("commit", self._client.transaction(compare, success, []))
        return bool(ok)

    async def list(self, prefix: str) -> list[dict[str, Any]]:
        r = await self._call(f"list {prefix}",
                             self._client.get_prefix((self.prefix + prefix).encode()))
        return [json.loads(kv.value) for kv in r]

    async def remove(self, keys: Sequence[str]) -> None:
        t = self._client.transactions
        deletes = [t.delete((self.prefix + k).encode()) for k in keys]
        if deletes:
            await self._call("remove", self._client.transaction([], deletes, []))

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self._client.close(), 2)
        except Exception:  # noqa: BLE001 - closing is best effort
            pass


def open_store(url: str | Path) -> Store:
    """``sqlite:///abs/path.sqlite``, a plain file path, or ``etcd://host:port``."""
    text = str(url)
    parts = urllib.parse.urlsplit(text)
    if parts.scheme == "etcd":
        if not parts.hostname:
            raise ValueError(f"bad catalog URL {text!r}: expected etcd://host:port")
        return EtcdStore(parts.hostname, parts.port or 2379)
    if parts.scheme == "sqlite":
        return SqliteStore(urllib.parse.unquote(parts.netloc + parts.path))
    if parts.scheme in ("", "file"):
        return SqliteStore(urllib.parse.unquote(parts.path) if parts.scheme else text)
    raise ValueError(f"unsupported catalog URL {text!r}: use sqlite:///path, a file path or "
                     "etcd://host:port")


# ---------------------------------------------------------------- the catalog


def _vkey(version: str) -> str:
    return f"versions/{version}"


def _kkey(key: str) -> str:
    return f"keys/{key}"


class Catalog:
    """The lifecycle over a Store. Every mutation is a compare-and-swap, retried when
    another writer got there first, so concurrent publishers, workers and coordinators
    see one consistent history."""

    def __init__(self, store: Store | str | Path) -> None:
        self.store = store if isinstance(store, Store) else open_store(store)

    @property
    def url(self) -> str:
        return self.store.url

    async def close(self) -> None:
        await self.store.close()

    async def __aenter__(self) -> Catalog:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------ reads

    async def get(self, version: str) -> WeightVersion:
        data, _ = await self.store.get(_vkey(version))
        if data is None:
            raise CatalogError(f"version {version} is not in the catalog {self.url}")
        return WeightVersion.from_json(data)

    async def find(self, version: str) -> WeightVersion | None:
        data, _ = await self.store.get(_vkey(version))
        return WeightVersion.from_json(data) if data is not None else None

    async def list(self, model: str | None = None) -> list[WeightVersion]:
        out = [WeightVersion.from_json(d) for d in await self.store.list("versions/")]
        return [v for v in out if model is None or v.model == model]

    async def chain(self, version: str, max_length: int = MAX_CHAIN) -> list[WeightVersion]:
        """The versions to replay to build `version`: the last full one first, then each
        delta in order. Every link must be READY or RELEASING (its bytes still there)."""
        out: list[WeightVersion] = []
        seen: set[str] = set()
        name: str | None = version
        while name is not None:
            if name in seen:
                raise CatalogError(f"version {version}: cycle in its base chain at {name}")
            if len(out) >= max_length:
                raise CatalogError(f"version {version}: its delta chain is longer than "
                                   f"{max_length}; publish a full version")
            seen.add(name)
            v = await self.get(name)
            if v.state not in (VersionState.READY, VersionState.RELEASING):
                raise CatalogError(f"version {version} needs {name}, which is {v.state.value}")
            out.append(v)
            name = v.base_version if v.format is PayloadFormat.XOR_DELTA else None
        return list(reversed(out))

    # ------------------------------------------------------------ mutations

    async def _update(self, version: str, change: Callable[[WeightVersion], Any]) -> Any:
        """Read, change, compare-and-swap; `change` may raise CatalogError to refuse."""
        for _ in range(100):
            data, token = await self.store.get(_vkey(version))
            if data is None:
                raise CatalogError(f"version {version} is not in the catalog {self.url}")
            v = WeightVersion.from_json(data)
            result = change(v)
            if await self.store.commit([(_vkey(version), v.to_json(), token)]):
                return result
        raise CatalogError(f"version {version}: too much contention in the catalog")

    async def create(self, *, model: str, version: str, format: PayloadFormat | str,
                     digest: str, base_version: str | None = None,
                     locations: Sequence[str] = (), size: int = 0,
                     parts: Sequence[str] = ("artifact",),
                     idempotency_key: str | None = None) -> WeightVersion:
        """Create `version` STAGING. The same idempotency key with the same request returns
        the version as it is now; a different request under a used key, or a version name
        already taken under another key, is refused with CatalogConflict."""
        fmt = PayloadFormat(format)
        if fmt is PayloadFormat.XOR_DELTA and not base_version:
            raise CatalogError(f"version {version}: an xor-delta needs its base_version")
        if fmt is PayloadFormat.FULL and base_version:
            raise CatalogError(f"version {version}: a full version has no base_version")
        if not parts:
            raise CatalogError(f"version {version}: name at least one part")
        key = idempotency_key or f"version:{version}"
        new = WeightVersion(version=version, model=model, format=fmt, digest=digest,
                            base_version=base_version, locations=list(locations), size=int(size),
                            parts=dict.fromkeys(parts, False), idempotency_key=key)
        for _ in range(100):
            (by_key, ktoken), (existing, vtoken) = await asyncio.gather(
                self.store.get(_kkey(key)), self.store.get(_vkey(version)))
            if by_key is not None and by_key["version"] != version:
                raise CatalogConflict(
                    f"idempotency key {key!r} already created version {by_key['version']}; "
                    f"use a new key for version {version}")
            if existing is not None:
                old = WeightVersion.from_json(existing)
                if old.idempotency_key != key:
                    raise CatalogConflict(
                        f"version {version} already exists (created under another idempotency "
                        "key); choose another version name")
                if old.request() != new.request():
                    diff = sorted(k for k, val in new.request().items() if old.request()[k] != val)
                    raise CatalogConflict(
                        f"idempotency key {key!r} was used for a different request for version "
                        f"{version} (differs in: {', '.join(diff)}); use a new key")
                return old
            if await self.store.commit([(_kkey(key), {"version": version}, ktoken),
                                        (_vkey(version), new.to_json(), vtoken)]):
                return new
        raise CatalogError(f"version {version}: too much contention in the catalog")

    async def publish_part(self, version: str, part: str) -> WeightVersion:
        """Mark one part published; the last one flips STAGING → READY (once)."""
        def change(v: WeightVersion) -> WeightVersion:
            if part not in v.parts:
                raise CatalogError(f"version {version} has no part {part!r} (parts: "
                                   f"{', '.join(sorted(v.parts))})")
            if v.state is not VersionState.STAGING:
                if v.parts[part]:
                    return v  # a replay
                raise CatalogError(f"version {version} is {v.state.value}: no part can be "
                                   "published any more")
            v.parts[part] = True
            if all(v.parts.values()):
                v.state = check_transition(v.state, VersionState.READY, version)
                v.ready_at = time.time()
            return v
        return await self._update(version, change)

    async def delete(self, version: str, *, reason: str = "deleted", if_unused: bool = False,
                     workers: Collection[str] | None = None) -> WeightVersion:
        """STAGING or READY → RELEASING (idempotent). Leases held stay valid. `reason` is
        recorded with it; `if_unused`: only while no live lease holds it and no worker
        holds it applied (among `workers`, when given), checked in the same
        compare-and-swap (a collection planned from an older reading never releases what
        became used since: it stays as it is)."""
        def change(v: WeightVersion) -> WeightVersion:
            if v.state in (VersionState.RELEASING, VersionState.EVICTED):
                return v
            held = [w for w in v.holders if workers is None or w in workers]
            if if_unused and (v.live_leases() or held):
                return v
            v.state = check_transition(v.state, VersionState.RELEASING, version)
            v.released_at, v.release_reason = time.time(), reason
            return v
        return await self._update(version, change)

    async def acquire_lease(self, version: str, holder: str,
                            ttl: float = DEFAULT_LEASE_TTL) -> Lease:
        """A lease on a READY version: its bytes are not evicted while the lease lives."""
        def change(v: WeightVersion) -> Lease:
            if v.state is not VersionState.READY:
                raise CatalogError(f"version {version} is {v.state.value}: a lease is granted "
                                   "only on a READY version")
            now = time.time()
            v.leases = {k: lease for k, lease in v.leases.items() if lease.expires_at > now}
            lease = Lease(uuid.uuid4().hex, holder, now + ttl)
            v.leases[lease.lease_id] = lease
            return lease
        return await self._update(version, change)

    async def renew_lease(self, version: str, lease_id: str,
                          ttl: float = DEFAULT_LEASE_TTL) -> Lease:
        """Extend a live lease on a READY or RELEASING version."""
        def change(v: WeightVersion) -> Lease:
            if v.state not in (VersionState.READY, VersionState.RELEASING):
                raise CatalogError(f"version {version} is {v.state.value}: leases can be "
                                   "renewed only while READY or RELEASING")
            lease = v.leases.get(lease_id)
            now = time.time()
            if lease is None or lease.expires_at <= now:
                raise CatalogError(f"lease {lease_id} on version {version} has expired or "
                                   "does not exist; acquire a new one (needs READY)")
            lease.expires_at = now + ttl
            return lease
        return await self._update(version, change)

    async def release_lease(self, version: str, lease_id: str) -> None:
        """Drop a lease (idempotent)."""
        await self._update(version, lambda v: v.leases.pop(lease_id, None))

    async def evict(self, version: str,
                    remove_bytes: Callable[[WeightVersion], Any] | None = None) -> bool:
        """RELEASING with no live lease → EVICTED, then `remove_bytes(version)`, then the
        version records that its bytes are gone (`removed_at`). Returns False (and changes
        nothing) while the version is not released or a lease holds it. A process that
        dies between the two leaves `removed_at` unset: `remove_evicted` finishes it."""
        def change(v: WeightVersion) -> bool:
            if v.state is VersionState.EVICTED:
                return False
            if v.state is not VersionState.RELEASING:
                raise CatalogError(f"version {version} is {v.state.value}: delete it first "
                                   "(only a RELEASING version is evicted)")
            if v.live_leases():
                return False
            v.state = check_transition(v.state, VersionState.EVICTED, version)
            v.leases = {}
            v.evicted_at = time.time()
            return True
        if not await self._update(version, change):
            return False
        if remove_bytes is not None:
            await self.remove_evicted(version, remove_bytes)
        return True

    async def remove_evicted(self, version: str,
                             remove_bytes: Callable[[WeightVersion], Any]) -> None:
        """Remove the bytes of an EVICTED version (again: removing is idempotent) and record
        that they are gone."""
        v = await self.get(version)
        if v.state is not VersionState.EVICTED:
            raise CatalogError(f"version {version} is {v.state.value}: only an EVICTED "
                               "version's bytes are removed")
        result = remove_bytes(v)
        if asyncio.iscoroutine(result):
            await result

        def mark(v: WeightVersion) -> None:
            v.removed_at = v.removed_at or time.time()
        await self._update(version, mark)

    async def forget(self, version: str) -> bool:
        """Drop the record of an EVICTED version whose bytes are removed, and its
        idempotency key (a create under that key then makes the version anew). False
        (nothing changed) for any other version."""
        data, _ = await self.store.get(_vkey(version))
        if data is None:
            return False
        v = WeightVersion.from_json(data)
        if v.state is not VersionState.EVICTED or v.removed_at is None:
            return False
        await self.store.remove([_vkey(version), _kkey(v.idempotency_key)])
        return True

    async def add_holder(self, version: str, worker: str, **details: Any) -> WeightVersion:
        """Record that `worker` holds `version` applied and can serve its bytes to peers."""
        def change(v: WeightVersion) -> WeightVersion:
            v.holders[worker] = {**details, "since": time.time()}
            return v
        return await self._update(version, change)

    async def remove_holder(self, version: str, worker: str) -> None:
        """`worker` no longer holds `version` (idempotent)."""
        await self._update(version, lambda v: v.holders.pop(worker, None))
