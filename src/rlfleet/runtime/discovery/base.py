"""What every discovery store shares: entries and their keys, leased registrations, the
list/watch loop, and the report of entries a store holds but cannot read.

An entry is a JSON object with at least ``namespace``, ``component``, ``endpoint`` (non-empty
strings without ``/``) and ``instance_id`` (unsigned 64-bit int); its key is
``namespace/component/endpoint/instance_id``. Entries live as long as their lease is kept
alive, so a crashed owner disappears after ``ttl`` seconds.

A store never lets one bad entry (unreadable bytes, a FIFO, a record that fails validation)
break a listing or a watch: it skips it, logs it once, and reports it in
:meth:`Discovery.listing` so that a caller can show it.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Self

log = logging.getLogger("rlfleet.runtime.discovery")

_FIELDS = ("namespace", "component", "endpoint")
_U64 = 1 << 64

Entry = dict[str, Any]
Entries = list[Entry]


class DiscoveryError(RuntimeError):
    """The discovery backend is unreachable or an operation on it failed."""


# ---------------------------------------------------------------- entries and keys


def new_instance_id() -> int:
    """A random non-zero unsigned 64-bit instance id."""
    while True:
        value = secrets.randbits(64)
        if value:
            return value


def entry_key(entry: Entry) -> str:
    """Validate ``entry`` and return its key ``namespace/component/endpoint/instance_id``."""
    if not isinstance(entry, dict):
        raise TypeError(f"discovery entry must be a dict, not {type(entry).__name__}")
    parts = []
    for name in _FIELDS:
        value = entry.get(name)
        if not isinstance(value, str) or not value or "/" in value:
            raise ValueError(f"discovery entry {name!r} must be a non-empty string without '/'"
                             f", got {value!r}")
        parts.append(value)
    iid = entry.get("instance_id")
    if not isinstance(iid, int) or isinstance(iid, bool) or not 0 <= iid < _U64:
        raise ValueError(f"discovery entry 'instance_id' must be an unsigned 64-bit int, "
                         f"got {iid!r}")
    parts.append(str(iid))
    return "/".join(parts)


def _normalize(entry: Entry) -> tuple[str, Entry]:
    """Validate, and return (key, a JSON round-tripped copy of the entry)."""
    key = entry_key(entry)
    try:
        copy = json.loads(json.dumps(entry))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"discovery entry {key} is not JSON-serialisable: {exc}") from exc
    return key, copy


def _filter_prefix(namespace: str | None, component: str | None, endpoint: str | None) -> str:
    """The longest key prefix implied by the filter ('' when namespace is not given)."""
    prefix = ""
    for value in (namespace, component, endpoint):
        if value is None or "/" in value:
            break
        prefix += value + "/"
    return prefix


def _matches(entry: Entry, namespace: str | None, component: str | None,
             endpoint: str | None) -> bool:
    return all(want is None or entry.get(name) == want
               for name, want in zip(_FIELDS, (namespace, component, endpoint), strict=True))


def _sorted_entries(items: list[tuple[str, Entry]]) -> Entries:
    return [entry for _, entry in sorted(items, key=lambda item: item[0])]


@dataclass(frozen=True)
class Skipped:
    """An entry the store holds but could not read: skipped from listings, reported here."""

    where: str  # the file or etcd key it came from
    error: str  # what is wrong with it, for an operator
    key: str | None = None  # namespace/component/endpoint/instance_id, when it can be told

    def matches(self, namespace: str | None, component: str | None,
                endpoint: str | None) -> bool:
        """False only when the key is known and outside the filter."""
        if self.key is None:
            return True
        parts = self.key.split("/")
        return all(want is None or (i < len(parts) and parts[i] == want)
                   for i, want in enumerate((namespace, component, endpoint)))

    def dump(self) -> dict[str, Any]:
        return {"where": self.where, "error": self.error,
                **({"key": self.key} if self.key else {})}


@dataclass
class Listing:
    """The live entries matching a filter (sorted by key), and what the store skipped."""

    entries: Entries
    skipped: list[Skipped] = field(default_factory=list)

    @classmethod
    def of(cls, items: Iterable[tuple[str, Entry]], skipped: list[Skipped],
           namespace: str | None, component: str | None, endpoint: str | None) -> Listing:
        """The listing a filter selects from a store's (key, entry) items and skipped
        entries (every store lists through this)."""
        return cls(_sorted_entries([(key, entry) for key, entry in items
                                    if _matches(entry, namespace, component, endpoint)]),
                   [s for s in skipped if s.matches(namespace, component, endpoint)])


RECORD_MAX_BYTES = 64 << 10  # a record is a few hundred bytes; anything this big is not one


def _check_record(name: str, value: Any = None) -> None:
    """A record's name is a non-empty path of non-empty parts; its value a JSON object."""
    if not isinstance(name, str) or not name or len(name) > 1024 \
            or any(part in ("", ".", "..") for part in name.split("/")):
        raise ValueError(f"a discovery record name is a path like 'ns/kind/name' (no empty, "
                         f"'.' or '..' parts), not {name!r}")
    if value is None:
        return
    if not isinstance(value, dict):
        raise TypeError(f"a discovery record is a JSON object, not {type(value).__name__}")
    try:
        size = len(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"discovery record {name} is not JSON-serialisable: {exc}") from exc
    if size > RECORD_MAX_BYTES:
        raise ValueError(f"discovery record {name} is {size} bytes; at most "
                         f"{RECORD_MAX_BYTES} are kept")


# ---------------------------------------------------------------- registration


class FailureStreak:
    """A keep-alive loop's failures, logged once a streak: its first failure (a warning) and
    the success that ends it, not every retry in between."""

    def __init__(self, what: str, period: float) -> None:
        self.what, self.period = what, period
        self.failing = False

    def failed(self, exc: Exception) -> None:
        if not self.failing:
            log.warning("discovery: %s failed, retrying every %.2gs: %s", self.what,
                        self.period, exc)
        self.failing = True

    def ended(self) -> None:
        if self.failing:
            log.info("discovery: %s recovered", self.what)
        self.failing = False


class Registration:
    """A registered entry whose lease is kept alive in the background until :meth:`close`."""

    key: str

    def __init__(self, owner: Discovery, key: str, entry: Entry, ttl: float) -> None:
        self.key = key
        self.entry = entry
        self.ttl = ttl
        self._owner = owner
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._lost = False  # the lease is gone: re-register on the next tick
        self._dirty = False  # the last update() did not reach the store
        # called with the entry when the lease lapsed (lost, or not kept alive for a whole
        # ttl: a stopped process): returns the entry to publish again (the owner may have
        # to change it: readers saw it gone, so it re-joins)
        self.on_lapse: Callable[[Entry], Awaitable[Entry]] | None = None

    # backend hooks; all use self.entry / self.ttl
    async def _establish(self) -> None:
        """Publish the entry under a fresh lease."""
        raise NotImplementedError

    async def _refresh(self) -> bool:
        """Keep the lease alive; False when it was lost."""
        raise NotImplementedError

    async def _put(self) -> None:
        """Replace the value under the current lease (re-establishing if it was lost)."""
        raise NotImplementedError

    async def _remove(self) -> None:
        """Delete the entry and drop the lease."""
        raise NotImplementedError

    def _start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
            self._keepalive(), name=f"discovery-keepalive:{self.key}")

    async def _keepalive(self) -> None:
        period = self.ttl / 3
        streak = FailureStreak(f"keep-alive for {self.key}", period)
        loop = asyncio.get_running_loop()
        kept = loop.time()  # when the lease was last known to be alive
        while True:
            await asyncio.sleep(period)
            async with self._lock:
                try:
                    if self.on_lapse is not None and (self._lost or loop.time() - kept > self.ttl):
                        log.warning("discovery: the lease for %s lapsed; it re-joins", self.key)
                        self.entry = _normalize(await self.on_lapse(self.entry))[1]
                        self._lost = True  # publish the new entry under a fresh lease
                    if self._lost or not await self._refresh():
                        if not self._lost:
                            log.warning("discovery: lease for %s was lost; re-registering",
                                        self.key)
                        self._lost = True
                        await self._establish()
                        self._lost = self._dirty = False
                        log.info("discovery: re-registered %s", self.key)
                    elif self._dirty:
                        await self._put()
                        self._dirty = False
                    kept = loop.time()
                    streak.ended()
                except DiscoveryError as exc:
                    streak.failed(exc)
                except Exception:  # a bug; keep the entry alive anyway
                    log.exception("discovery: unexpected keep-alive error for %s", self.key)

    async def update(self, entry: Entry) -> None:
        """Replace the value under the same key and lease."""
        key, entry = _normalize(entry)
        if key != self.key:
            raise ValueError(f"update() cannot change the key: {key} != {self.key}")
        if self._closed:
            raise DiscoveryError(f"registration {self.key} is closed")
        async with self._lock:
            self.entry = entry
            try:
                await self._put()
                self._dirty = self._lost = False
            except DiscoveryError:
                self._dirty = True  # the keep-alive publishes it once the store is back
                raise

    async def close(self) -> None:
        """Stop the keep-alive and delete the entry now (idempotent).

        Raises :class:`DiscoveryError` if the store could not be reached; the entry then
        expires on its own after ``ttl``.
        """
        if self._closed:
            return
        self._closed = True
        self._owner._registrations.discard(self)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        async with self._lock:
            await self._remove()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.key} ttl={self.ttl}>"


# ---------------------------------------------------------------- base class


class Discovery(abc.ABC):
    """A discovery backend; see :func:`open_discovery`."""

    url: str

    def __init__(self, url: str) -> None:
        self.url = url
        self._registrations: set[Registration] = set()
        self._closed = False
        self._reported: set[tuple[str, str]] = set()  # skipped entries already logged
        self.lists = 0  # whole listings read from the store (a directory scan, a prefix range)

    def _report(self, listing: Listing) -> Listing:
        """Log each skipped entry once (a watch lists every quarter second)."""
        for s in listing.skipped:
            if (s.where, s.error) not in self._reported:
                if len(self._reported) > 10_000:
                    self._reported.clear()
                self._reported.add((s.where, s.error))
                log.warning("discovery %s: skipping %s: %s", self.url, s.where, s.error)
        return listing

    @abc.abstractmethod
    def _new_registration(self, key: str, entry: Entry, ttl: float) -> Registration: ...

    @abc.abstractmethod
    async def _list(self, namespace: str | None, component: str | None,
                    endpoint: str | None) -> Listing:
        """Entries matching the filter and what was skipped; never raises for one bad entry
        (DiscoveryError when the store itself cannot be read)."""

    async def _list_shared(self, namespace: str | None, component: str | None,
                           endpoint: str | None) -> Listing:
        """`_list`, whose entries may be the store's own objects (`listing(shared=True)`)."""
        return await self._list(namespace, component, endpoint)

    @abc.abstractmethod
    def _changes(self, namespace: str | None, component: str | None,
                 endpoint: str | None) -> ChangeSource: ...

    async def _put_record(self, name: str, value: dict[str, Any]) -> None:
        raise DiscoveryError(f"discovery {self.url} keeps no records")

    async def _get_record(self, name: str) -> dict[str, Any] | None:
        raise DiscoveryError(f"discovery {self.url} keeps no records")

    async def _close_backend(self) -> None:
        return None

    def _check_open(self) -> None:
        if self._closed:
            raise DiscoveryError(f"discovery {self.url} is closed")

    async def register(self, entry: Entry, ttl: float = 10.0) -> Registration:
        """Publish ``entry`` under a ``ttl``-second lease kept alive until ``close()``."""
        key, entry = _normalize(entry)
        if not ttl > 0:
            raise ValueError(f"ttl must be positive, got {ttl!r}")
        self._check_open()
        reg = self._new_registration(key, entry, float(ttl))
        await reg._establish()
        reg._start()
        self._registrations.add(reg)
        return reg

    async def list(self, namespace: str | None = None, component: str | None = None,
                   endpoint: str | None = None) -> Entries:
        """Live entries matching the filter, sorted by key."""
        return (await self.listing(namespace, component, endpoint)).entries

    async def listing(self, namespace: str | None = None, component: str | None = None,
                      endpoint: str | None = None, *, shared: bool = False) -> Listing:
        """Like :meth:`list`, with the entries the store had to skip and why. `shared`: the
        entries may be the store's own (a store that keeps what it read, the file store,
        hands out the same object for an entry until it changes; a caller that keeps what
        it made of an entry can tell an unchanged one by identity); read them, never change
        them."""
        self._check_open()
        self.lists += 1
        got = self._list_shared if shared else self._list
        return self._report(await got(namespace, component, endpoint))

    async def watch(self, namespace: str | None = None, interval: float = 0.25, *,
                    component: str | None = None,
                    endpoint: str | None = None) -> AsyncIterator[Entries]:
        """Yield the live list now, then whenever it changes; survives store outages and
        bad entries (the last good list stands while the store cannot be read).

        Use with ``contextlib.aclosing`` so the generator is closed when you stop iterating.
        It ends when the discovery object is closed. Each yield builds the whole sorted
        list; a follower of a large fleet wants :meth:`follow`, which says what changed.
        """
        async with contextlib.aclosing(self.follow(namespace, interval, component=component,
                                                   endpoint=endpoint)) as changes:
            async for change in changes:
                yield _sorted_entries(list(change.entries.items()))

    async def follow(self, namespace: str | None = None, interval: float = 0.25, *,
                     component: str | None = None,
                     endpoint: str | None = None) -> AsyncIterator[Change]:
        """Yield the live entries now, then after each change with the keys that changed:
        a store's watch applies each change it is told of (etcd's events in revision order,
        the file store's changed files) and lists the whole store only at the start and
        when it lost track (a compacted or broken etcd watch, a directory replaced, an
        overflowing file watch), so a follower's work per change does not grow with the
        fleet (a discovery directory on a filesystem shared between hosts, which raises no
        event for other hosts' writes, is listed again after each change instead).
        Survives store outages and bad entries as :meth:`watch` does.
        """
        if not interval > 0:
            raise ValueError(f"interval must be positive, got {interval!r}")
        self._check_open()
        failing = False
        first = True
        source = self._changes(namespace, component, endpoint)
        try:
            await source.start()
            while not self._closed:
                try:
                    change = await source.step()
                except Exception as exc:  # noqa: BLE001 - a watch never dies; it reports and retries
                    if not failing:
                        if isinstance(exc, DiscoveryError):
                            log.warning("discovery: watch on %s failing, retrying: %s",
                                        self.url, exc)
                        else:
                            log.exception("discovery: watch on %s failed unexpectedly, retrying",
                                          self.url)
                    failing = True
                else:
                    if failing:
                        log.info("discovery: watch on %s recovered", self.url)
                        failing = False
                    if first or change.skipped_changed:
                        self._report(Listing([], list(change.skipped)))
                    if first or change.changed:
                        first = False
                        yield change
                if self._closed:
                    break
                await source.wait(interval, failing)
        finally:
            await source.aclose()

    async def put_record(self, name: str, value: dict[str, Any]) -> None:
        """Publish a small JSON object under `name`, beside the entries and under no lease
        (it stays until it is replaced): what one writer states for every reader of the
        store, such as a model's committed policy (rlfleet.protocol.rl.CommittedPolicy).
        Records are never in listings or watches."""
        self._check_open()
        _check_record(name, value)
        await self._put_record(name, json.loads(json.dumps(value)))

    async def get_record(self, name: str) -> dict[str, Any] | None:
        """The record under `name` (None: none was published, or it cannot be read: that
        is logged)."""
        self._check_open()
        _check_record(name)
        return await self._get_record(name)

    async def close(self) -> None:
        """Deregister this object's registrations (best effort) and release the backend."""
        if self._closed:
            return
        regs = list(self._registrations)
        results = await asyncio.gather(*(reg.close() for reg in regs), return_exceptions=True)
        for reg, result in zip(regs, results, strict=True):
            if isinstance(result, Exception):
                log.warning("discovery: could not deregister %s: %s", reg.key, result)
        self._closed = True
        await self._close_backend()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url}>"


@dataclass
class Change:
    """One step of :meth:`Discovery.follow`: the live entries matching its filter, by key,
    and the keys whose entry was added, replaced or removed since the step before (at the
    first step: every key). `entries` is the watch's own view, changed in place by the
    next step: read it, do not keep the dict (the entries in it are never changed in
    place, and may be kept; none may be changed by a reader)."""

    entries: dict[str, Entry]
    changed: set[str]
    skipped: list[Skipped] = field(default_factory=list)  # what the store holds but cannot read
    skipped_changed: bool = False  # `skipped` differs from the step before

    def __repr__(self) -> str:
        return f"<Change {len(self.entries)} entries, {len(self.changed)} changed>"


class ChangeSource:
    """Keeps the view a :meth:`Discovery.follow` yields and tells it when to look again.
    This default lists the store at every tick and compares (a store with a watch of its
    own applies its changes instead: etcd's events, the file store's changed files)."""

    def __init__(self, owner: Discovery, where: tuple[str | None, str | None, str | None]
                 ) -> None:
        self._owner, self._where = owner, where
        self.entries: dict[str, Entry] = {}
        self.skipped: list[Skipped] = []
        self.started = False  # a step has been made (the first one changes every key)

    async def start(self) -> None:
        return None

    async def step(self) -> Change:
        """The view now and what changed since the last step (raises DiscoveryError when
        the store cannot be read; the view then stays as it was)."""
        listing = await self._owner._list(*self._where)
        self._owner.lists += 1
        return self._replace({entry_key(e): e for e in listing.entries}, listing.skipped)

    def _replace(self, fresh: dict[str, Entry], skipped: list[Skipped]) -> Change:
        """The view becomes `fresh` (a whole listing): the keys that differ changed."""
        changed = {k for k in self.entries.keys() | fresh.keys()
                   if self.entries.get(k) != fresh.get(k)}
        if not self.started:
            changed = set(fresh)
        self.entries.clear()
        self.entries.update(fresh)
        return self._change(changed, skipped)

    def _change(self, changed: set[str], skipped: list[Skipped]) -> Change:
        moved = skipped != self.skipped
        self.skipped, self.started = skipped, True
        return Change(self.entries, changed, skipped, moved)

    async def wait(self, interval: float, failing: bool) -> None:
        await asyncio.sleep(interval)

    async def aclose(self) -> None:
        return None
