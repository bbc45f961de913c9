"""The file store: one JSON file per entry in a directory (one host, or a filesystem that all
hosts share). ``file:///path/to/dir``. Records (`Discovery.put_record`) are files in its ``records/``
subdirectory, which listings never read.

Every file operation runs in a worker thread, never on the event loop: a slow disk, a FIFO
or a huge file named ``*.json`` cannot stall a server. Files that cannot be read are skipped
and reported (:class:`~rlfleet.runtime.discovery.base.Skipped`). A directory that vanishes
or is replaced does not end its entries: each keeps its lease until it expires or its owner
rewrites it (owners recreate the directory at their next keep-alive), so a few seconds
without the directory never empty a frontend's pool.

A keep-alive touches its file (its modification time is the lease's start) rather than
rewriting it, so the directory itself changes only when an entry is added, replaced or
removed. A watch therefore stats one directory per tick and lists it only when it changed
(or changed within the last `HOT` seconds: timestamps are coarse), and stats the file of an
entry only when that entry's lease would have run out: its cost follows the changes and
the leases, not the listing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import secrets
import stat
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

from rlfleet.runtime.discovery import base
from rlfleet.runtime.discovery.base import DiscoveryError, Entry, Skipped, entry_key, log

# file name -> (inode, mtime_ns, size), the parsed record or None, the reason it is unusable
_Cached = tuple[tuple[int, int, int], dict[str, Any] | None, str | None]


def default_file_dir() -> Path:
    """``$XDG_RUNTIME_DIR/rlfleet/discovery`` if usable, else ``/tmp/rlfleet-<uid>/discovery``."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK | os.X_OK):
        return Path(xdg) / "rlfleet" / "discovery"
    return Path("/tmp") / f"rlfleet-{os.getuid()}" / "discovery"


class _FileRegistration(base.Registration):
    _owner: FileDiscovery

    async def _establish(self) -> None:
        await self._owner._batched(self._owner._write, self.key, self.entry, self.ttl)

    async def _refresh(self) -> bool:
        return await self._owner._batched(self._owner._touch, self.key)

    async def _put(self) -> None:
        await self._establish()

    async def _remove(self) -> None:
        await self._owner._batched(self._owner._delete, self.key)


class FileDiscovery(base.Discovery):
    """``<dir>/<quoted key>.json`` = ``{"entry", "expires_at", "ttl"}``."""

    GC_TTLS = 3.0  # delete files expired for longer than this many ttls
    TMP_MAX_AGE = 60.0  # delete leftover temp files older than this (crashed writers)
    MAX_RECORD_BYTES = 1 << 20  # an entry is a few hundred bytes; anything this big is not one
    DEADLINE = 10.0  # seconds for one scan or write (a hung filesystem becomes a DiscoveryError)
    HOT = 1.0  # a directory changed this recently is listed again at every watch tick

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory).absolute()
        super().__init__(self.directory.as_uri())
        self._cache: dict[str, _Cached] = {}
        self._lock = threading.Lock()  # one scan or write at a time; they run in threads
        self._dir_id: tuple[int, int] | None = None  # (st_dev, st_ino) when last seen
        self._last: dict[str, tuple[Entry, float]] = {}  # key -> (entry, expires_at), last scan
        self._held: dict[str, tuple[Entry, float]] = {}  # from a vanished directory, until expiry
        self._pending: list[tuple[Any, tuple, asyncio.Future]] = []  # ops for the next trip
        self._batcher: asyncio.Task[None] | None = None

    def _new_registration(self, key: str, entry: Entry, ttl: float) -> base.Registration:
        return _FileRegistration(self, key, entry, ttl)

    def _changes(self, namespace: str | None, component: str | None,
                 endpoint: str | None) -> base.ChangeSource:
        return _FileChanges(self)

    async def _batched(self, fn, *args):
        """`fn(*args)` in a thread, in one trip with the other writes, touches and deletes
        asked for meanwhile (a process of many simulated workers writes thousands of
        entries: one thread hop each would queue them behind the interpreter lock)."""
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((fn, args, fut))
        if self._batcher is None or self._batcher.done():
            self._batcher = asyncio.get_running_loop().create_task(self._run_batches())
        return await asyncio.shield(fut)

    async def _run_batches(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                results = await self._io(_each_op, [(fn, args) for fn, args, _ in batch])
            except BaseException as exc:  # the whole trip failed (a hung filesystem)
                err = exc if isinstance(exc, DiscoveryError) else DiscoveryError(repr(exc))
                results = [err] * len(batch)
            for (_, _, fut), result in zip(batch, results, strict=True):
                if fut.done():
                    continue
                if isinstance(result, BaseException):
                    fut.set_exception(result)
                else:
                    fut.set_result(result)

    async def _io(self, fn, *args):
        """Run a file operation in a thread under the lock and a deadline."""
        def locked():
            if not self._lock.acquire(timeout=self.DEADLINE):
                raise DiscoveryError(f"file discovery {self.directory}: busy for "
                                     f"{self.DEADLINE:g}s (is the filesystem hung?)")
            try:
                return fn(*args)
            finally:
                self._lock.release()
        try:
            return await asyncio.wait_for(asyncio.to_thread(locked), self.DEADLINE + 1)
        except TimeoutError:
            raise DiscoveryError(f"file discovery {self.directory}: no answer from the "
                                 f"filesystem in {self.DEADLINE:g}s") from None

    def _path(self, key: str) -> Path:
        name = urllib.parse.quote(key, safe="")
        if len(name) > 200:  # '#' never occurs in a quoted name
            name = "#" + hashlib.sha256(key.encode()).hexdigest()
        return self.directory / f"{name}.json"

    @staticmethod
    def _key_of_name(name: str) -> str | None:
        """The entry key a file name stands for (None for hashed names and strangers)."""
        if name.startswith("#") or not name.endswith(".json"):
            return None
        key = urllib.parse.unquote(name[: -len(".json")])
        return key if key.count("/") == 3 else None

    # ------------------------------------------------------------ in a thread

    def _write(self, key: str, entry: Entry, ttl: float) -> None:
        record = {"entry": entry, "expires_at": time.time() + ttl, "ttl": ttl}
        self._write_json(self._path(key), record, key)

    def _write_json(self, path: Path, value: dict[str, Any], what: str) -> None:
        """`value` as `path`, whole or not at all (a temporary file, then a rename)."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(value, fh)
            os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise DiscoveryError(f"file discovery {self.directory}: cannot write {what}: "
                                 f"{exc}") from exc

    def _touch(self, key: str) -> bool:
        """Renew `key`'s lease: its file's mtime is now. False when the file is gone."""
        try:
            os.utime(self._path(key))
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise DiscoveryError(f"file discovery {self.directory}: cannot renew "
                                 f"{key}: {exc}") from exc
        return True

    def _dir_sig(self) -> tuple[int, int, int] | None:
        """(st_dev, st_ino, st_mtime_ns) of the directory; None when it is missing."""
        try:
            st = os.stat(self.directory)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise DiscoveryError(f"file discovery {self.directory}: cannot stat: {exc}") from exc
        return st.st_dev, st.st_ino, st.st_mtime_ns

    def _poll(self, sig: tuple[int, int, int] | None, due: dict[str, float]
              ) -> tuple[bool, tuple[int, int, int] | None, dict[str, float]]:
        """Whether a watch that listed at directory state `sig` must list again: the
        directory changed (or changed within HOT seconds), or one of the entries `due`
        (key -> ttl) was not renewed in time. Also the directory's state now and the new
        expiry of each renewed entry."""
        now = time.time()
        current = self._dir_sig()
        changed = current != sig or (current is not None and now - current[2] / 1e9 < self.HOT)
        renewed: dict[str, float] = {}
        for key, ttl in due.items():
            try:
                expires = os.stat(self._path(key)).st_mtime + ttl
            except OSError:  # gone (or unreadable): the listing says which
                changed = True
                continue
            if expires <= now:
                changed = True
            else:
                renewed[key] = expires
        return changed, current, renewed

    def _delete(self, key: str) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as exc:
            raise DiscoveryError(f"file discovery {self.directory}: cannot delete "
                                 f"{key}: {exc}") from exc
        self._last.pop(key, None)
        self._held.pop(key, None)

    def _read(self, name: str) -> tuple[dict[str, Any] | None, str | None, float]:
        """(the parsed record, None), or (None, why it is unusable), or (None, None) when the
        file is gone; and the file's mtime (when its lease was last renewed). Cached by
        inode/mtime/size; never blocks (FIFOs and devices are refused before they are
        opened, and opened non-blocking in case of a race)."""
        path = self.directory / name
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None, None, 0.0
        except OSError as exc:
            return None, f"cannot stat: {exc}", 0.0
        sig = (st.st_ino, st.st_mtime_ns, st.st_size)
        cached = self._cache.get(name)
        if cached is not None and cached[0] == sig:
            return cached[1], cached[2], st.st_mtime
        record, error = self._parse(path, st)
        self._cache[name] = (sig, record, error)
        return record, error, st.st_mtime

    def _parse(self, path: Path, st: os.stat_result) -> tuple[dict[str, Any] | None, str | None]:
        if not stat.S_ISREG(st.st_mode):
            return None, "not a regular file"
        if st.st_size > self.MAX_RECORD_BYTES:
            return None, f"{st.st_size} bytes: too large to be a discovery record"
        data, error = _read_file(path, self.MAX_RECORD_BYTES + 1)
        if data is None:
            return None, error
        try:
            record = json.loads(data.decode("utf-8"))
            if not (isinstance(record, dict) and isinstance(record.get("entry"), dict)
                    and isinstance(record.get("expires_at"), int | float)):
                raise ValueError('not a discovery record ({"entry", "expires_at", "ttl"})')
            entry_key(record["entry"])
        except UnicodeDecodeError as exc:
            return None, f"not UTF-8 text: {exc}"
        except (ValueError, TypeError) as exc:
            return None, str(exc)
        return record, None

    def _scan(self) -> tuple[dict[str, tuple[Entry, float]], list[Skipped]]:
        """Live entries by key (with their expiry) and the files that had to be skipped."""
        now = time.time()
        skipped: list[Skipped] = []
        try:
            st = os.stat(self.directory)
            dir_id: tuple[int, int] | None = (st.st_dev, st.st_ino)
            names = os.listdir(self.directory)
        except FileNotFoundError:
            dir_id, names = None, []
        except OSError as exc:
            raise DiscoveryError(f"file discovery {self.directory}: cannot list: {exc}") from exc
        if dir_id != self._dir_id:
            if self._dir_id is not None and self._last:
                # not an owner's deregistration (owners delete their own file): the leases
                # still run, so hold the entries until they expire or are rewritten
                log.warning("discovery: %s %s; keeping its %d entries until their leases end",
                            self.directory, "vanished" if dir_id is None else "was replaced",
                            len(self._last))
                self._held.update(self._last)
            self._dir_id = dir_id
            self._cache.clear()
        if dir_id is None and self._held:
            skipped.append(Skipped(str(self.directory), "the discovery directory is missing; "
                                   "its entries are kept until their leases end"))
        live: dict[str, tuple[Entry, float]] = {}
        for name in names:
            if name.startswith("."):
                if name.endswith(".tmp"):
                    self._gc_tmp(name, now)
                continue
            if not name.endswith(".json"):
                continue
            record, error, renewed = self._read(name)
            if error is not None:
                skipped.append(Skipped(str(self.directory / name), error, self._key_of_name(name)))
                continue
            if record is None:
                continue
            ttl = _ttl(record)
            # written with its expiry; each keep-alive since moved its mtime (`_touch`)
            expires_at = max(float(record["expires_at"]), renewed + ttl if ttl else 0.0)
            if expires_at <= now:
                grace = self.GC_TTLS * (ttl or 10.0)
                if now - expires_at > grace:
                    with contextlib.suppress(OSError):
                        (self.directory / name).unlink()
                continue
            entry = record["entry"]
            live[entry_key(entry)] = (entry, expires_at)
        for gone in self._cache.keys() - set(names):
            del self._cache[gone]
        for key, (entry, expires_at) in list(self._held.items()):
            if expires_at <= now or key in live:
                del self._held[key]
            else:
                live[key] = (entry, expires_at)
        self._last = live
        return live, skipped

    def _gc_tmp(self, name: str, now: float) -> None:
        path = self.directory / name
        with contextlib.suppress(OSError):
            if now - path.lstat().st_mtime > self.TMP_MAX_AGE:
                path.unlink()

    def _record_path(self, name: str) -> Path:
        return self.directory / "records" / f"{urllib.parse.quote(name, safe='')}.json"

    def _write_record(self, name: str, value: dict[str, Any]) -> None:
        self._write_json(self._record_path(name), {"record": value, "written_at": time.time()},
                         f"record {name}")

    def _read_record(self, name: str) -> dict[str, Any] | None:
        path = self._record_path(name)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise DiscoveryError(f"file discovery {self.directory}: cannot read record "
                                 f"{name}: {exc}") from exc
        record, error = self._parse_record(path, st)
        if error is not None:
            log.warning("discovery %s: record %s (%s) is unusable: %s", self.url, name, path,
                        error)
        return record

    @staticmethod
    def _parse_record(path: Path, st: os.stat_result) -> tuple[dict[str, Any] | None, str | None]:
        if not stat.S_ISREG(st.st_mode) or st.st_size > base.RECORD_MAX_BYTES + 4096:
            return None, "not a regular file of a record's size"
        data, error = _read_file(path, base.RECORD_MAX_BYTES + 4097)
        if data is None:
            return None, error
        try:
            outer = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            return None, f"not a JSON record: {exc}"
        if not isinstance(outer, dict) or not isinstance(outer.get("record"), dict):
            return None, 'not a discovery record ({"record": {...}})'
        return outer["record"], None

    # ------------------------------------------------------------ on the loop

    async def _put_record(self, name: str, value: dict[str, Any]) -> None:
        await self._io(self._write_record, name, value)

    async def _get_record(self, name: str) -> dict[str, Any] | None:
        return await self._io(self._read_record, name)

    async def _list(self, namespace: str | None, component: str | None,
                    endpoint: str | None) -> base.Listing:
        live, skipped = await self._io(self._scan)
        listing = base.Listing.of(((key, entry) for key, (entry, _) in live.items()), skipped,
                             namespace, component, endpoint)
        listing.entries = json.loads(json.dumps(listing.entries))  # callers get private copies
        # ttl 0 (not known: an entry held from a vanished directory): listed again at expiry
        listing.leases = {key: (expires_at, _ttl_of(self, key) or 0.0)
                          for key, (_, expires_at) in live.items()}
        return listing


def _each_op(ops: list[tuple[Any, tuple]]) -> list[Any]:
    """Run each (fn, args); each one's result or DiscoveryError."""
    out: list[Any] = []
    for fn, args in ops:
        try:
            out.append(fn(*args))
        except DiscoveryError as exc:
            out.append(exc)
    return out


def _ttl(record: dict[str, Any]) -> float | None:
    ttl = record.get("ttl")
    return float(ttl) if isinstance(ttl, int | float) and ttl > 0 else None


def _ttl_of(store: FileDiscovery, key: str) -> float | None:
    cached = store._cache.get(store._path(key).name)
    return _ttl(cached[1]) if cached is not None and cached[1] is not None else None


class _FileChanges(base.ChangeSource):
    """Wakes the watch loop when the directory changed or a listed lease ran out; between
    changes each tick costs one stat (and one per lease that is due)."""

    def __init__(self, owner: FileDiscovery) -> None:
        self._owner = owner
        self._sig: tuple[int, int, int] | None = None  # the directory when last listed
        self._leases: dict[str, tuple[float, float]] = {}  # key -> (expires_at, ttl)

    async def start(self) -> None:
        self._sig = await self._owner._io(self._owner._dir_sig)

    def listed(self, listing: base.Listing) -> None:
        self._leases = dict(listing.leases or {})

    async def wait(self, interval: float, failing: bool) -> None:
        while True:
            await asyncio.sleep(interval)
            if failing:
                return
            now = time.time()
            due = {k: ttl for k, (expires, ttl) in self._leases.items() if expires <= now}
            try:
                changed, sig, renewed = await self._owner._io(self._owner._poll, self._sig, due)
            except DiscoveryError:
                return  # the listing reports it
            for key, expires in renewed.items():
                self._leases[key] = (expires, self._leases[key][1])
            if changed:
                self._sig = sig  # stat before the listing: a later change differs from it
                return


def _read_file(path: Path, limit: int) -> tuple[bytes | None, str | None]:
    """Up to `limit` bytes of the regular file at `path`, opened without blocking (a FIFO
    put there must not hang the reader); (None, why) when it cannot be read, (None, None)
    when it is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"cannot open: {exc}"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None, "not a regular file"
        return os.read(fd, limit), None
    except OSError as exc:
        return None, f"cannot read: {exc}"
    finally:
        os.close(fd)
