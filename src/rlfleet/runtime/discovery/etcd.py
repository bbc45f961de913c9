"""The etcd store (etcd v3 through ``aetcd``): multi-host. ``etcd://host:port[,host:port...]``,
keys ``/rlfleet/discovery/<namespace>/<component>/<endpoint>/<instance_id>``; records
(`Discovery.put_record`) under ``/rlfleet/discovery-records/<name>``, with no lease. A
client's registrations of one TTL share one lease (etcd's session pattern: `_EtcdLease`),
kept alive by one call every ttl/3 however many entries it holds (a process of many
simulated workers holds thousands); closing a registration deletes its key, and the last
one out revokes the lease. A watch lists the prefix once and then applies etcd's watch
events to that view in revision order (`_EtcdView`), listing again only when the watch is
lost or compacted. Every call has a deadline; with several endpoints a failed one hands over to
the next. A value that is not a valid entry is skipped and reported, never fatal.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aetcd
import aetcd.exceptions
import aetcd.rtypes
import msgspec

from rlfleet.runtime.discovery.base import (
    Change,
    ChangeSource,
    Discovery,
    DiscoveryError,
    Entry,
    FailureStreak,
    Listing,
    Registration,
    Skipped,
    _filter_prefix,
    _matches,
    _normalize,
    entry_key,
    log,
)

_decode = msgspec.json.Decoder().decode
ETCD_PREFIX = "/rlfleet/discovery/"
ETCD_DEFAULT_PORT = 2379
DEFAULT_DEADLINE = 3.0  # seconds, for every etcd call
WATCH_IDLE = 30.0  # seconds a watch loop sleeps when etcd sends nothing (it lists nothing)
REPUBLISH_CONCURRENCY = 64  # puts in flight when a lost lease's entries are put again
CANCEL_GRACE = 0.5  # seconds a call past its deadline is given to end once cancelled

T = TypeVar("T")


class _LeaseNotFound(DiscoveryError):
    """etcd says the lease does not exist (expired or revoked)."""


async def _within(aw: Awaitable[T], deadline: float, stuck: set[asyncio.Task[Any]]) -> T:
    """`aw`'s result, or TimeoutError after `deadline` seconds whether or not it ends once
    cancelled. `asyncio.wait_for` waits for the cancelled call to end, and a gRPC call may
    not (one hung a test's etcd client for 20 minutes); such a call is left in `stuck`
    until it does. Cancelling the caller cancels the call and returns at once."""
    task = asyncio.ensure_future(aw)
    try:
        if (await asyncio.wait({task}, timeout=deadline))[0]:
            return task.result()
        task.cancel()
        await asyncio.wait({task}, timeout=CANCEL_GRACE)
        raise TimeoutError
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        if not task.done():
            stuck.add(task)
            task.add_done_callback(_forget(stuck))


def _forget(stuck: set[asyncio.Task[Any]]) -> Callable[[asyncio.Task[Any]], None]:
    def done(task: asyncio.Task[Any]) -> None:
        stuck.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("discovery: an etcd call past its deadline ended with %r",
                      task.exception())
    return done


def _grpc_detail(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class _EtcdLease:
    """One etcd lease shared by a client's registrations of one TTL (etcd's session
    pattern), kept alive by one loop every ttl/3 whatever their number. When it is lost
    (etcd no longer knows it, or it was not kept alive for a whole ttl: a stopped process)
    a new one is granted and every entry is put under it again, each calling its
    ``on_lapse`` first; an entry whose last update did not reach etcd is put again too.
    It is revoked when its last registration closes."""

    def __init__(self, owner: EtcdDiscovery, ttl: float) -> None:
        self._owner = owner
        self.ttl = ttl
        self.id = 0  # the etcd lease; 0: none (not granted yet, or lost)
        self.kept = 0.0  # loop time it was last known to be alive
        self.regs: set[_EtcdRegistration] = set()
        self._granting = asyncio.Lock()  # one grant at a time
        self._task: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return f"<etcd lease {self.id:x} ttl={self.ttl:g} entries={len(self.regs)}>"

    def join(self, reg: _EtcdRegistration) -> None:
        self.regs.add(reg)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._keepalive(), name=f"discovery-keepalive:etcd-lease-{self.ttl:g}s")

    async def leave(self, reg: _EtcdRegistration) -> None:
        """`reg` closed; the last one out stops the keep-alive and revokes the lease."""
        self.regs.discard(reg)
        if not self.regs:
            await self.close()

    async def close(self) -> None:
        """Stop the keep-alive and revoke the lease (best effort: it expires anyway)."""
        if self._owner._leases.get(self.ttl) is self:
            del self._owner._leases[self.ttl]  # a registration from now on gets a new one
        task, self._task = self._task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        lease_id, self.id = self.id, 0
        if lease_id:
            try:
                await self._owner._call(f"revoke lease {lease_id:x}",
                                        lambda c: c.revoke_lease(lease_id))
            except DiscoveryError as exc:  # its keys are gone already; it will expire
                log.debug("discovery: %s", exc)

    async def granted(self) -> int:
        """The lease's id, granting a new one if there is none."""
        async with self._granting:
            if not self.id:
                ttl = max(1, math.ceil(self.ttl))
                lease = await self._owner._call(f"grant a {ttl}s lease",
                                                lambda c: c.lease(ttl))
                self.id, self.kept = lease.id, asyncio.get_running_loop().time()
            return self.id

    def drop(self, lease_id: int) -> None:
        """`lease_id` is gone: the next `granted` grants a new lease, and every entry that
        was under it re-joins (its ``on_lapse``) under that one."""
        if lease_id and self.id == lease_id:
            self.id = 0
            for reg in self.regs:
                if reg._lease_id == lease_id:
                    reg._lost = True

    async def _refresh(self) -> bool:
        """One keep-alive; False when etcd no longer knows the lease."""
        lease_id = self.id
        try:
            reply = await self._owner._call(f"keep-alive of lease {lease_id:x}",
                                            lambda c: c.refresh_lease(lease_id))
        except _LeaseNotFound:
            return False
        if reply is None or reply.TTL <= 0:
            return False
        if self.id == lease_id:
            self.kept = asyncio.get_running_loop().time()
        return True

    async def _tick(self) -> None:
        """Refresh the lease (a new one where it is lost or lapsed), then put every entry
        that is not under it or whose last update did not reach etcd."""
        lease_id = self.id
        if lease_id and asyncio.get_running_loop().time() - self.kept > self.ttl:
            log.warning("discovery: the %gs etcd lease %x was not kept alive for a whole "
                        "ttl; its %d entries re-join", self.ttl, lease_id, len(self.regs))
            self.drop(lease_id)
        elif lease_id and not await self._refresh():
            log.warning("discovery: the %gs etcd lease %x was lost; re-registering its %d "
                        "entries", self.ttl, lease_id, len(self.regs))
            self.drop(lease_id)
        await self.granted()
        due = [reg for reg in self.regs if reg._lease_id != self.id or reg._dirty]
        if not due:
            return
        limit = asyncio.Semaphore(REPUBLISH_CONCURRENCY)

        async def one(reg: _EtcdRegistration) -> None:
            async with limit:
                await reg._republish()
        results = await asyncio.gather(*(one(reg) for reg in due), return_exceptions=True)
        errors = [r for r in results if isinstance(r, DiscoveryError)]
        for reg, result in zip(due, results, strict=True):
            if isinstance(result, Exception) and not isinstance(result, DiscoveryError):
                log.error("discovery: unexpected error re-publishing %s", reg.key,
                          exc_info=result)
        if errors:
            raise DiscoveryError(f"{len(errors)} of {len(due)} entries not published "
                                 f"again: {errors[0]}")

    async def _keepalive(self) -> None:
        period = self.ttl / 3
        streak = FailureStreak(f"keep-alive of the {self.ttl:g}s etcd lease", period)
        while True:
            await asyncio.sleep(period)
            try:
                await self._tick()
                streak.ended()
            except DiscoveryError as exc:
                streak.failed(exc)
            except Exception:  # a bug; keep the entries alive anyway
                log.exception("discovery: unexpected keep-alive error for the %gs etcd lease",
                              self.ttl)


class _EtcdRegistration(Registration):
    """An entry under its client's shared lease for its TTL (`_EtcdLease`), which keeps it
    alive: the registration has no keep-alive task of its own."""

    _owner: EtcdDiscovery

    def __init__(self, owner: EtcdDiscovery, key: str, entry: Entry, ttl: float) -> None:
        super().__init__(owner, key, entry, ttl)
        self._lease = owner._lease_for(ttl)
        self._lease_id = 0  # the lease its value was last put under
        self._etcd_key = owner._etcd_key(key)

    def _value(self) -> bytes:
        return json.dumps(self.entry).encode()

    async def _establish(self) -> None:
        self._lease.join(self)  # from now on the lease is not revoked under it
        try:
            async with self._lock:
                await self._put()
        except BaseException:
            await self._lease.leave(self)
            raise

    def _start(self) -> None:
        return None  # the shared lease's loop keeps it alive

    async def _put(self) -> None:
        """Put the value under the shared lease (granting one if there is none, and once
        more if etcd says it is gone)."""
        value = self._value()
        for attempt in range(2):
            lease_id = await self._lease.granted()
            try:
                await self._owner._call(f"put {self.key}", lambda c, lease=lease_id: c.put(
                    self._etcd_key, value, lease=lease))
            except _LeaseNotFound:
                self._lease.drop(lease_id)
                if attempt:
                    raise
                continue
            self._lease_id = lease_id
            return

    async def _republish(self) -> None:
        """Put the entry under the lease now, first asking ``on_lapse`` for the entry to
        publish where the lease it was under lapsed (the shared lease's loop)."""
        async with self._lock:
            if self._closed or (self._lease_id == self._lease.id and not self._dirty):
                return
            if self._lost and self.on_lapse is not None:
                log.warning("discovery: the lease for %s lapsed; it re-joins", self.key)
                self.entry = _normalize(await self.on_lapse(self.entry))[1]
            await self._put()
            self._lost = self._dirty = False

    async def _remove(self) -> None:
        try:
            await self._owner._call(f"delete {self.key}", lambda c: c.delete(self._etcd_key))
        finally:
            self._lease_id = 0
            await self._lease.leave(self)


class _EtcdView(ChangeSource):
    """The entries under one prefix, kept by applying the etcd watch's events in revision
    order to one listing: a put adds or replaces its entry, a delete (or a lease expiring)
    removes it. The watch starts at the revision after the listing's, so nothing falls in
    between; the store is listed again only when the watch is lost (a broken stream, an
    endpoint change) or etcd compacted the revisions it still had to send, and the new
    watch then starts after the new listing's revision. A follower's cost follows the
    changes, not the fleet: each event touches one key (the keys it changed are what a
    step reports), and an idle fleet costs nothing but the open stream."""

    def __init__(self, owner: EtcdDiscovery, prefix: bytes,
                 where: tuple[str | None, str | None, str | None]) -> None:
        super().__init__(owner, where)
        self._owner: EtcdDiscovery = owner
        self._prefix = prefix
        # etcd key -> (entry key, entry) or what is wrong with its value; entries outside
        # the filter are not kept
        self._items: dict[str, tuple[str, Entry] | Skipped] = {}
        # entry key -> its entry now (None: removed), for each changed since the last step
        self._pending: dict[str, Entry | None] = {}
        self._skipped_moved = False  # a skipped value came, changed or went since then
        self.revision = 0  # etcd's revision the view is current to
        self._listed = 0  # the revision of the listing it started from
        self._stale = True  # list (again) before the next step
        self._event = asyncio.Event()  # an event was applied, or the watch ended
        self._watch: Any = None
        self._pump: asyncio.Task[None] | None = None
        self._warned = False

    async def step(self) -> Change:
        if self._stale:
            await self._resync()
            return self._replace(self._live(), self._skipped_now())
        pending, self._pending = self._pending, {}
        for key, entry in pending.items():
            if entry is None:
                self.entries.pop(key, None)
            else:
                self.entries[key] = entry
        skipped = self._skipped_now() if self._skipped_moved else self.skipped
        self._skipped_moved = False
        return self._change(set(pending), skipped)

    def _live(self) -> dict[str, Entry]:
        return {v[0]: v[1] for v in self._items.values() if not isinstance(v, Skipped)}

    def _skipped_now(self) -> list[Skipped]:
        return [v for v in self._items.values() if isinstance(v, Skipped)]

    def _parse(self, kv: Any) -> tuple[str, Entry] | Skipped | None:
        """The key-value's entry, what is wrong with it, or None: outside the filter (as
        its etcd key tells, before its value is read, or as its entry does)."""
        if self._owner._outside(kv.key, self._where):
            return None
        got = self._owner._parse(kv)
        if isinstance(got, Skipped):
            return got if got.matches(*self._where) else None
        return got if _matches(got[1], *self._where) else None

    async def _resync(self) -> None:
        """List the prefix, then watch it from the next revision on."""
        await self._drop()
        self._event.clear()
        result = await self._owner._range(self._prefix)
        self._owner.lists += 1
        items = {}
        for kv in result.kvs:
            got = self._parse(kv)
            if got is not None:
                items[kv.key.decode("utf-8", errors="replace")] = got
        self._items = items
        self._pending.clear()
        self._skipped_moved = False
        self.revision = self._listed = result.header.revision
        start = self.revision + 1
        try:
            watch = await self._owner._call(
                f"watch {self._prefix.decode()}",
                lambda c: c.watch_prefix(self._prefix, start_revision=start))
        except DiscoveryError as exc:  # listed: the next wait lists again after its interval
            if not self._warned:
                log.warning("discovery: cannot watch etcd, listing every tick instead: %s", exc)
                self._warned = True
            return
        if self._warned:
            log.info("discovery: etcd watch on %s re-established", self._owner.url)
            self._warned = False
        self._stale = False
        self._watch = watch
        self._pump = asyncio.get_running_loop().create_task(self._run(watch))

    def _apply(self, event: Any) -> None:
        kv = event.kv
        if kv.mod_revision <= self._listed:
            return  # in the listing already (a watch that starts after it never sends one)
        self.revision = kv.mod_revision
        name = kv.key.decode("utf-8", errors="replace")
        old = self._items.get(name)
        new = self._parse(kv) if event.kind == aetcd.rtypes.EventKind.PUT else None
        if new is None:
            self._items.pop(name, None)
        else:
            self._items[name] = new
        if old == new:
            return  # the same value put again
        for got, now in ((old, None), (new, new)):
            if isinstance(got, Skipped):
                self._skipped_moved = True
            elif got is not None:
                self._pending[got[0]] = None if now is None else now[1]  # type: ignore[index]

    async def _run(self, watch: Any) -> None:
        try:
            async for event in watch:
                self._apply(event)
                self._event.set()
        except aetcd.exceptions.RevisionCompactedError as exc:
            log.info("discovery: etcd compacted the revisions the watch on %s still had to "
                     "read (%s); listing again", self._owner.url, exc)
        except Exception as exc:  # noqa: BLE001 - any stream failure means: list and re-watch
            if not self._owner._closed:
                log.warning("discovery: etcd watch broke, listing again: %s", _grpc_detail(exc))
        finally:
            self._stale = True
            self._event.set()

    async def wait(self, interval: float, failing: bool) -> None:
        if self._stale or failing:
            await asyncio.sleep(interval)
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(WATCH_IDLE):  # (not wait_for: file.py's _io says why)
                await self._event.wait()
        if self._event.is_set():
            # the rest of a burst (a fleet changing: N events) lands in the same step
            await asyncio.sleep(interval)
            self._event.clear()

    async def _drop(self) -> None:
        pump, watch = self._pump, self._watch
        self._pump = self._watch = None
        if pump is not None:  # bounded: a watch stream may not end once cancelled
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await _within(pump, 1.0, self._owner._stuck)
        if watch is not None:
            with contextlib.suppress(Exception):
                await _within(watch.cancel(), 1.0, self._owner._stuck)
        self._stale = True

    async def aclose(self) -> None:
        await self._drop()


class EtcdDiscovery(Discovery):
    """Multi-host backend on etcd v3; keys are ``/rlfleet/discovery/<key>``."""

    def __init__(self, url: str, endpoints: list[tuple[str, int]],
                 deadline: float = DEFAULT_DEADLINE, prefix: str = ETCD_PREFIX) -> None:
        if not endpoints:
            raise ValueError("etcd discovery needs at least one host:port")
        super().__init__(url)
        self.endpoints = endpoints
        self.deadline = deadline
        self.prefix = prefix
        self._current = 0
        self._client: aetcd.Client | None = None
        self._leases: dict[float, _EtcdLease] = {}  # ttl -> the lease its registrations share
        self._retired: set[asyncio.Task[None]] = set()
        self._stuck: set[asyncio.Task[Any]] = set()  # calls past their deadline (`_within`)

    @property
    def endpoint(self) -> str:
        host, port = self.endpoints[self._current]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def _etcd_key(self, key: str) -> bytes:
        return (self.prefix + key).encode()

    def _get_client(self) -> aetcd.Client:
        if self._client is None:
            host, port = self.endpoints[self._current]
            self._client = aetcd.Client(
                host=host, port=port, timeout=self.deadline,
                # reconnect quickly after an etcd restart (gRPC backs off up to 120 s)
                options={"grpc.initial_reconnect_backoff_ms": 200,
                         "grpc.max_reconnect_backoff_ms": 1000,
                         # a watch lists nothing while etcd is quiet: pings tell a dead
                         # connection (etcd accepts one every 5 s or slower while a
                         # stream is open)
                         "grpc.keepalive_time_ms": 10_000,
                         "grpc.keepalive_timeout_ms": 5_000,
                         "grpc.http2.max_pings_without_data": 0},
            )
        return self._client

    def _failover(self, client: aetcd.Client) -> None:
        """After a connection failure, move on to the next endpoint (if there are several)."""
        if len(self.endpoints) < 2 or self._client is not client:
            return
        self._current = (self._current + 1) % len(self.endpoints)
        self._client = None
        task = asyncio.get_running_loop().create_task(self._close_client(client))
        self._retired.add(task)
        task.add_done_callback(self._retired.discard)
        log.info("discovery: switching to etcd endpoint %s", self.endpoint)

    async def _close_client(self, client: aetcd.Client) -> None:
        try:
            await _within(client.close(), 2.0, self._stuck)
        except Exception as exc:  # noqa: BLE001 - closing is best effort
            log.warning("discovery: closing etcd client failed: %r", exc)

    async def _call(self, what: str, fn: Callable[[aetcd.Client], Awaitable[T]]) -> T:
        """Run one etcd operation under the deadline; failures become DiscoveryError.

        With several endpoints, a connection failure or timeout moves on to the next one
        (each endpoint is tried at most once per call).
        """
        self._check_open()
        failures: list[str] = []
        for _ in self.endpoints:
            endpoint = self.endpoint
            client = self._get_client()
            try:
                return await _within(fn(client), self.deadline, self._stuck)
            except TimeoutError:
                failures.append(f"{endpoint}: timed out after {self.deadline:g}s")
            except (aetcd.exceptions.ConnectionFailedError,
                    aetcd.exceptions.ConnectionTimeoutError) as exc:
                failures.append(f"{endpoint} unreachable: {_grpc_detail(exc)}")
            except aetcd.exceptions.ClientError as exc:
                cls = _LeaseNotFound if "lease not found" in str(exc) else DiscoveryError
                raise cls(f"etcd {endpoint}: {what} failed: {_grpc_detail(exc)}") from exc
            self._failover(client)
        raise DiscoveryError(f"etcd {what} failed: " + "; ".join(failures))

    def _new_registration(self, key: str, entry: Entry, ttl: float) -> Registration:
        return _EtcdRegistration(self, key, entry, ttl)

    def _lease_for(self, ttl: float) -> _EtcdLease:
        """The lease this client's registrations of `ttl` share (made on first use)."""
        lease = self._leases.get(ttl)
        if lease is None:
            lease = self._leases[ttl] = _EtcdLease(self, ttl)
        return lease

    def _changes(self, namespace: str | None, component: str | None,
                 endpoint: str | None) -> ChangeSource:
        prefix = self._etcd_key(_filter_prefix(namespace, component, endpoint))
        return _EtcdView(self, prefix, (namespace, component, endpoint))

    async def _range(self, prefix: bytes) -> Any:
        """Every key under `prefix` and the revision they are current to (one listing)."""
        return await self._call(f"list {prefix.decode()}", lambda c: c.get_prefix(prefix))

    def _outside(self, etcd_key: bytes, where: tuple[str | None, str | None, str | None]
                 ) -> bool:
        """Whether an etcd key names an entry outside the filter `where` (a key that names
        no entry's key may hold any entry: not outside)."""
        if not any(where):
            return False
        key = self._key_of(etcd_key.decode("utf-8", errors="replace"))
        return key is not None and any(
            want is not None and part != want
            for part, want in zip(key.split("/", 3), where, strict=False))

    def _parse(self, kv: Any) -> tuple[str, Entry] | Skipped:
        """An etcd key-value as (entry key, entry), or what is wrong with it."""
        name = kv.key.decode("utf-8", errors="replace")
        try:
            try:
                entry = _decode(kv.value)
            except msgspec.DecodeError:  # what json says of it (or a value only json reads)
                entry = json.loads(kv.value.decode("utf-8"))
            return entry_key(entry), entry
        except UnicodeDecodeError as exc:
            return Skipped(name, f"not UTF-8 text: {exc}", self._key_of(name))
        except (ValueError, TypeError) as exc:
            return Skipped(name, str(exc), self._key_of(name))

    async def _list(self, namespace: str | None, component: str | None,
                    endpoint: str | None) -> Listing:
        result = await self._range(self._etcd_key(_filter_prefix(namespace, component,
                                                                 endpoint)))
        where = (namespace, component, endpoint)
        parsed = [self._parse(kv) for kv in result.kvs if not self._outside(kv.key, where)]
        return Listing.of([p for p in parsed if not isinstance(p, Skipped)],
                          [p for p in parsed if isinstance(p, Skipped)],
                          namespace, component, endpoint)

    def _record_key(self, name: str) -> bytes:
        """Beside the entries' prefix, never under it: `<prefix>-records/<name>`."""
        return (self.prefix.rstrip("/") + "-records/" + name).encode()

    async def _put_record(self, name: str, value: dict[str, Any]) -> None:
        key, data = self._record_key(name), json.dumps(value).encode()
        await self._call(f"put record {name}", lambda c: c.put(key, data))

    async def _get_record(self, name: str) -> dict[str, Any] | None:
        key = self._record_key(name)
        kv = await self._call(f"get record {name}", lambda c: c.get(key))
        if kv is None:
            return None
        try:
            value = json.loads(kv.value.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            log.warning("discovery %s: record %s is unusable: %s", self.url, name, exc)
            return None
        if not isinstance(value, dict):
            log.warning("discovery %s: record %s is not a JSON object", self.url, name)
            return None
        return value

    def _key_of(self, etcd_key: str) -> str | None:
        key = etcd_key.removeprefix(self.prefix)
        return key if key != etcd_key and key.count("/") == 3 else None

    async def _close_backend(self) -> None:
        for lease in list(self._leases.values()):  # none: the last registration out closes it
            await lease.close()
        client, self._client = self._client, None
        if client is not None:
            await self._close_client(client)
        if self._retired:
            await asyncio.gather(*self._retired, return_exceptions=True)
        if self._stuck:  # cancelled already; the closed channel ends them, or they are left
            await asyncio.wait(set(self._stuck), timeout=CANCEL_GRACE)
        # gRPC completes the calls it just cancelled from its poller thread; let those land on
        # this loop now, not on a closed one ("Event loop is closed" noise in per-test loops).
        await asyncio.sleep(0.02)
