"""Discovery plane: workers register leased entries, the frontend lists and watches them.

Backends, chosen by URL (see :func:`open_discovery`):

* ``file:///path/to/dir`` - one JSON file per entry, single host (the default);
* ``etcd://host:port[,host:port...]`` - etcd v3 through ``aetcd``, multi-host.

An entry is a JSON object with at least ``namespace``, ``component``, ``endpoint`` (non-empty
strings without ``/``) and ``instance_id`` (unsigned 64-bit int); its key is
``namespace/component/endpoint/instance_id``. Entries live as long as their lease is kept
alive, so a crashed owner disappears after ``ttl`` seconds.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import hashlib
import json
import logging
import math
import os
import secrets
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Self, TypeVar

import aetcd
import aetcd.exceptions

__all__ = [
    "Discovery",
    "DiscoveryError",
    "EtcdDiscovery",
    "FileDiscovery",
    "Registration",
    "default_file_dir",
    "entry_key",
    "new_instance_id",
    "open_discovery",
]

log = logging.getLogger(__name__)

ENV_VAR = "RLFLEET_DISCOVERY"
ETCD_PREFIX = "/rlfleet/discovery/"
ETCD_DEFAULT_PORT = 2379
DEFAULT_DEADLINE = 3.0  # seconds, for every etcd call
WATCH_RESYNC = 5.0  # seconds, re-list even when the etcd watch is quiet
_FIELDS = ("namespace", "component", "endpoint")
_U64 = 1 << 64

Entry = dict[str, Any]
Entries = list[Entry]
T = TypeVar("T")


class DiscoveryError(RuntimeError):
    """The discovery backend is unreachable or an operation on it failed."""


class _LeaseNotFound(DiscoveryError):
    """etcd says the lease does not exist (expired or revoked)."""


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
    for field in _FIELDS:
        value = entry.get(field)
        if not isinstance(value, str) or not value or "/" in value:
            raise ValueError(f"discovery entry {field!r} must be a non-empty string without '/'"
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
    return all(want is None or entry.get(field) == want
               for field, want in zip(_FIELDS, (namespace, component, endpoint), strict=True))


def _sorted_entries(items: list[tuple[str, Entry]]) -> Entries:
    return [entry for _, entry in sorted(items, key=lambda item: item[0])]


# ---------------------------------------------------------------- registration


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
        failing = False
        while True:
            await asyncio.sleep(period)
            async with self._lock:
                try:
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
                    if failing:
                        log.info("discovery: keep-alive for %s recovered", self.key)
                        failing = False
                except DiscoveryError as exc:
                    if not failing:
                        log.warning("discovery: keep-alive for %s failed, retrying every "
                                    "%.2gs: %s", self.key, period, exc)
                    failing = True
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

    @abc.abstractmethod
    def _new_registration(self, key: str, entry: Entry, ttl: float) -> Registration: ...

    @abc.abstractmethod
    async def _list(self, namespace: str | None, component: str | None,
                    endpoint: str | None) -> Entries: ...

    @abc.abstractmethod
    def _changes(self, namespace: str | None) -> _ChangeSource: ...

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
        self._check_open()
        return await self._list(namespace, component, endpoint)

    async def watch(self, namespace: str | None = None, interval: float = 0.25, *,
                    component: str | None = None,
                    endpoint: str | None = None) -> AsyncIterator[Entries]:
        """Yield the live list now, then whenever it changes; survives backend outages.

        Use with ``contextlib.aclosing`` so the generator is closed when you stop iterating.
        It ends when the discovery object is closed.
        """
        if not interval > 0:
            raise ValueError(f"interval must be positive, got {interval!r}")
        self._check_open()
        last: Entries | None = None
        failing = False
        changes = self._changes(namespace)
        try:
            await changes.start()
            while not self._closed:
                try:
                    entries = await self._list(namespace, component, endpoint)
                except DiscoveryError as exc:
                    if not failing:
                        log.warning("discovery: watch on %s failing, retrying: %s",
                                    self.url, exc)
                    failing = True
                else:
                    if failing:
                        log.info("discovery: watch on %s recovered", self.url)
                        failing = False
                    if entries != last:
                        last = entries
                        yield entries
                if self._closed:
                    break
                await changes.wait(interval, failing)
        finally:
            await changes.aclose()

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


class _ChangeSource:
    """Tells a watch loop when to re-list; the default just polls."""

    async def start(self) -> None:
        return None

    async def wait(self, interval: float, failing: bool) -> None:
        await asyncio.sleep(interval)

    async def aclose(self) -> None:
        return None


# ---------------------------------------------------------------- file backend


def default_file_dir() -> Path:
    """``$XDG_RUNTIME_DIR/rlfleet/discovery`` if usable, else ``/tmp/rlfleet-<uid>/discovery``."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK | os.X_OK):
        return Path(xdg) / "rlfleet" / "discovery"
    return Path("/tmp") / f"rlfleet-{os.getuid()}" / "discovery"


class _FileRegistration(Registration):
    _owner: FileDiscovery

    async def _establish(self) -> None:
        self._owner._write(self.key, self.entry, self.ttl)

    async def _refresh(self) -> bool:
        self._owner._write(self.key, self.entry, self.ttl)
        return True

    async def _put(self) -> None:
        self._owner._write(self.key, self.entry, self.ttl)

    async def _remove(self) -> None:
        try:
            self._owner._path(self.key).unlink(missing_ok=True)
        except OSError as exc:
            raise DiscoveryError(f"file discovery {self._owner.directory}: cannot delete "
                                 f"{self.key}: {exc}") from exc


class FileDiscovery(Discovery):
    """Single-host backend: ``<dir>/<quoted key>.json`` = ``{"entry", "expires_at", "ttl"}``."""

    GC_TTLS = 3.0  # delete files expired for longer than this many ttls
    TMP_MAX_AGE = 60.0  # delete leftover temp files older than this (crashed writers)

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory).absolute()
        super().__init__(self.directory.as_uri())
        # file name -> ((inode, mtime_ns, size), parsed record or None if unreadable)
        self._cache: dict[str, tuple[tuple[int, int, int], dict[str, Any] | None]] = {}

    def _new_registration(self, key: str, entry: Entry, ttl: float) -> Registration:
        return _FileRegistration(self, key, entry, ttl)

    def _changes(self, namespace: str | None) -> _ChangeSource:
        return _ChangeSource()

    def _path(self, key: str) -> Path:
        name = urllib.parse.quote(key, safe="")
        if len(name) > 200:  # '#' never occurs in a quoted name
            name = "#" + hashlib.sha256(key.encode()).hexdigest()
        return self.directory / f"{name}.json"

    def _write(self, key: str, entry: Entry, ttl: float) -> None:
        path = self._path(key)
        record = {"entry": entry, "expires_at": time.time() + ttl, "ttl": ttl}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(record, fh)
            os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise DiscoveryError(f"file discovery {self.directory}: cannot write {key}: "
                                 f"{exc}") from exc

    def _read(self, name: str) -> dict[str, Any] | None:
        """The parsed record of ``name`` (cached by inode/mtime/size), or None."""
        path = self.directory / name
        try:
            st = path.stat()
            sig = (st.st_ino, st.st_mtime_ns, st.st_size)
            cached = self._cache.get(name)
            if cached is not None and cached[0] == sig:
                return cached[1]
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.debug("discovery: cannot read %s: %s", path, exc)
            return None
        record: dict[str, Any] | None
        try:
            record = json.loads(text)
            if not (isinstance(record, dict) and isinstance(record.get("entry"), dict)
                    and isinstance(record.get("expires_at"), int | float)):
                raise TypeError("not a discovery record")
            entry_key(record["entry"])
        except (ValueError, TypeError) as exc:
            log.debug("discovery: ignoring %s: %s", path, exc)
            record = None
        self._cache[name] = (sig, record)
        return record

    def _scan(self) -> list[tuple[str, Entry]]:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            self._cache.clear()
            return []
        except OSError as exc:
            raise DiscoveryError(f"file discovery {self.directory}: cannot list: {exc}") from exc
        now = time.time()
        items = []
        for name in names:
            if name.startswith("."):
                if name.endswith(".tmp"):
                    self._gc_tmp(name, now)
                continue
            if not name.endswith(".json"):
                continue
            record = self._read(name)
            if record is None:
                continue
            expires_at = float(record["expires_at"])
            if expires_at <= now:
                ttl = record.get("ttl")
                grace = self.GC_TTLS * (ttl if isinstance(ttl, int | float) and ttl > 0 else 10.0)
                if now - expires_at > grace:
                    with contextlib.suppress(OSError):
                        (self.directory / name).unlink()
                continue
            entry = record["entry"]
            items.append((entry_key(entry), entry))
        for gone in self._cache.keys() - set(names):
            del self._cache[gone]
        return items

    def _gc_tmp(self, name: str, now: float) -> None:
        path = self.directory / name
        with contextlib.suppress(OSError):
            if now - path.stat().st_mtime > self.TMP_MAX_AGE:
                path.unlink()

    async def _list(self, namespace: str | None, component: str | None,
                    endpoint: str | None) -> Entries:
        items = [(key, entry) for key, entry in self._scan()
                 if _matches(entry, namespace, component, endpoint)]
        return json.loads(json.dumps(_sorted_entries(items)))  # callers get private copies


# ---------------------------------------------------------------- etcd backend


def _grpc_detail(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class _EtcdRegistration(Registration):
    _owner: EtcdDiscovery

    def __init__(self, owner: EtcdDiscovery, key: str, entry: Entry, ttl: float) -> None:
        super().__init__(owner, key, entry, ttl)
        self._lease_id = 0
        self._etcd_key = owner._etcd_key(key)

    def _value(self) -> bytes:
        return json.dumps(self.entry).encode()

    async def _establish(self) -> None:
        d = self._owner
        ttl = max(1, math.ceil(self.ttl))
        lease = await d._call(f"grant lease for {self.key}", lambda c: c.lease(ttl))
        self._lease_id = lease.id
        value = self._value()
        await d._call(f"put {self.key}",
                      lambda c: c.put(self._etcd_key, value, lease=lease.id))

    async def _refresh(self) -> bool:
        lease_id = self._lease_id
        reply = await self._owner._call(f"keep-alive {self.key}",
                                        lambda c: c.refresh_lease(lease_id))
        return reply is not None and reply.TTL > 0

    async def _put(self) -> None:
        value, lease_id = self._value(), self._lease_id
        try:
            await self._owner._call(f"put {self.key}",
                                    lambda c: c.put(self._etcd_key, value, lease=lease_id))
        except _LeaseNotFound:
            await self._establish()

    async def _remove(self) -> None:
        d = self._owner
        await d._call(f"delete {self.key}", lambda c: c.delete(self._etcd_key))
        lease_id, self._lease_id = self._lease_id, 0
        if lease_id:
            try:
                await d._call(f"revoke lease of {self.key}", lambda c: c.revoke_lease(lease_id))
            except DiscoveryError as exc:  # the key is gone already; the lease will expire
                log.debug("discovery: %s", exc)


class _EtcdChanges(_ChangeSource):
    """Wakes the watch loop on etcd watch events; polls while no watch can be held."""

    def __init__(self, owner: EtcdDiscovery, prefix: bytes) -> None:
        self._owner = owner
        self._prefix = prefix
        self._event = asyncio.Event()
        self._watch: Any = None
        self._pump: asyncio.Task[None] | None = None
        self._warned = False

    def _alive(self) -> bool:
        return self._pump is not None and not self._pump.done()

    async def start(self) -> None:
        """(Re)create the etcd watch; on failure stay in polling mode."""
        await self._drop()
        self._event.clear()
        try:
            watch = await self._owner._call(f"watch {self._prefix.decode()}",
                                            lambda c: c.watch_prefix(self._prefix))
        except DiscoveryError as exc:
            if not self._warned:
                log.warning("discovery: cannot watch etcd, polling instead: %s", exc)
                self._warned = True
            return
        if self._warned:
            log.info("discovery: etcd watch on %s re-established", self._owner.url)
            self._warned = False
        self._watch = watch
        self._pump = asyncio.get_running_loop().create_task(self._run(watch))

    async def _run(self, watch: Any) -> None:
        try:
            async for _ in watch:
                self._event.set()
        except Exception as exc:  # noqa: BLE001 - any stream failure means: re-watch
            if not self._owner._closed:
                log.warning("discovery: etcd watch broke, falling back to polling: %s",
                            _grpc_detail(exc))
                self._warned = True
        finally:
            self._event.set()

    async def wait(self, interval: float, failing: bool) -> None:
        if self._alive() and not failing:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._event.wait(), max(interval, WATCH_RESYNC))
            self._event.clear()
            if self._alive():
                return
        else:
            await asyncio.sleep(interval)
        if not self._owner._closed:
            await self.start()  # the next list() then covers anything the watch missed

    async def _drop(self) -> None:
        pump, watch = self._pump, self._watch
        self._pump = self._watch = None
        if pump is not None:
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pump
        if watch is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(watch.cancel(), 1.0)

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
        self._retired: set[asyncio.Task[None]] = set()

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
                         "grpc.max_reconnect_backoff_ms": 1000},
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

    @staticmethod
    async def _close_client(client: aetcd.Client) -> None:
        try:
            await asyncio.wait_for(client.close(), 2.0)
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
                return await asyncio.wait_for(fn(client), self.deadline)
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

    def _changes(self, namespace: str | None) -> _ChangeSource:
        return _EtcdChanges(self, self._etcd_key(_filter_prefix(namespace, None, None)))

    async def _list(self, namespace: str | None, component: str | None,
                    endpoint: str | None) -> Entries:
        prefix = self._etcd_key(_filter_prefix(namespace, component, endpoint))
        result = await self._call(f"list {prefix.decode()}", lambda c: c.get_prefix(prefix))
        items = []
        for kv in result.kvs:
            try:
                entry = json.loads(kv.value)
                key = entry_key(entry)
            except (ValueError, TypeError) as exc:
                log.debug("discovery: ignoring etcd key %r: %s", kv.key, exc)
                continue
            if _matches(entry, namespace, component, endpoint):
                items.append((key, entry))
        return _sorted_entries(items)

    async def _close_backend(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await self._close_client(client)
        if self._retired:
            await asyncio.gather(*self._retired, return_exceptions=True)
        # gRPC completes the calls it just cancelled from its poller thread; let those land on
        # this loop now, not on a closed one ("Event loop is closed" noise in per-test loops).
        await asyncio.sleep(0.02)


# ---------------------------------------------------------------- selection


def _parse_etcd_hosts(netloc: str, url: str) -> list[tuple[str, int]]:
    endpoints = []
    for part in netloc.split(","):
        part = part.strip()
        if not part:
            continue
        if part.startswith("["):  # [ipv6]:port
            host, _, rest = part[1:].partition("]")
            port_text = rest[1:] if rest.startswith(":") else ""
        else:
            host, _, port_text = part.rpartition(":") if ":" in part else (part, "", "")
        try:
            port = int(port_text) if port_text else ETCD_DEFAULT_PORT
        except ValueError:
            raise ValueError(f"bad port in discovery URL {url!r}: {part!r}") from None
        if not host or not 0 < port < 65536:
            raise ValueError(f"bad host:port in discovery URL {url!r}: {part!r}")
        endpoints.append((host, port))
    if not endpoints:
        raise ValueError(f"discovery URL {url!r} names no etcd host")
    return endpoints


def open_discovery(url: str | None = None) -> Discovery:
    """Open the backend for ``url``, else ``$RLFLEET_DISCOVERY``, else the per-user directory.

    Accepted: ``file:///abs/dir`` and ``etcd://host:port[,host:port...]``. Nothing is
    contacted until the first operation.
    """
    url = url or os.environ.get(ENV_VAR) or None
    if url is None:
        return FileDiscovery(default_file_dir())
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "file":
        path = urllib.parse.unquote(parts.path)
        if parts.netloc not in ("", "localhost") or not path.startswith("/"):
            raise ValueError(f"bad discovery URL {url!r}: expected file:///absolute/dir")
        return FileDiscovery(path)
    if scheme == "etcd":
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError(f"bad discovery URL {url!r}: expected etcd://host:port[,host:port]")
        return EtcdDiscovery(url, _parse_etcd_hosts(parts.netloc, url))
    raise ValueError(f"unsupported discovery URL {url!r}: accepted schemes are "
                     "file:// (file:///path/to/dir) and etcd:// (etcd://host:port[,host:port])")
