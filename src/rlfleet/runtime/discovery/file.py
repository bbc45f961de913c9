"""The file store: one JSON file per entry in a directory (one host, or a filesystem that all
hosts share). ``file:///path/to/dir``. Records (`Discovery.put_record`) are files in its ``records/``
subdirectory, which listings never read.

Every file operation runs in a worker thread, never on the event loop: a slow disk, a FIFO
or a huge file named ``*.json`` cannot stall a server. Files that cannot be read are skipped
and reported (:class:`~rlfleet.runtime.discovery.base.Skipped`). An owner deregisters by
renaming its file to a tombstone (``.<name>.gone``, deleted a minute later); a file gone
without one was removed by someone else (a directory removed, replaced or emptied, one file
at a time or at once), and its entry keeps its lease until it expires or its owner rewrites
it (owners recreate the directory at their next keep-alive), so a few seconds without the
directory never empty a frontend's pool.

A keep-alive touches its file (its modification time is the lease's start) rather than
rewriting it, so the directory itself changes only when an entry is added, replaced or
removed. A watch (`_FileView`) on a local filesystem reads just the files the kernel says
changed (inotify) and lists the directory whole only at its start or when it lost track;
on a filesystem shared between hosts it stats the directory once a tick and lists it only
when it changed (or changed within the last `HOT` seconds: timestamps are coarse). Either
way it reads the file of an entry again only when that entry's lease would have run out:
its cost follows the changes and the leases, not the listing.

This module stays whole because the store, its watch and its wake-ups share one on-disk
layout and one lease arithmetic.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import heapq
import json
import math
import os
import secrets
import stat
import struct
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

import msgspec

from rlfleet.runtime.discovery import base
from rlfleet.runtime.discovery.base import DiscoveryError, Entry, Skipped, entry_key, log

# file name -> (inode, mtime_ns, size), the parsed record or None, the reason it is unusable,
# the record's entry key (None with no record)
_Cached = tuple[tuple[int, int, int], dict[str, Any] | None, str | None, str | None]
_decode = msgspec.json.Decoder().decode


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
    TMP_MAX_AGE = 60.0  # delete temp files (crashed writers) and tombstones older than this
    MAX_RECORD_BYTES = 1 << 20  # an entry is a few hundred bytes; anything this big is not one
    DEADLINE = 10.0  # seconds for one scan or write (a hung filesystem becomes a DiscoveryError)
    HOT = 1.0  # a directory changed this recently is listed again at every watch tick

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory).absolute()
        super().__init__(self.directory.as_uri())
        self._dir = f"{self.directory}{os.sep}"  # a file's path is this and its name
        self._keys_of_names: dict[str, str | None] = {}  # file name -> `_key_of_name`
        self._outside_memo: dict[tuple, dict[str, bool]] = {}  # `_key_outside`, by filter
        self._cache: dict[str, _Cached] = {}
        self._lock = threading.Lock()  # one scan or write at a time; they run in threads
        self._dir_id: tuple[int, int] | None = None  # (st_dev, st_ino) when last seen
        self._last: dict[str, tuple[Entry, float]] = {}  # key -> (entry, expires_at), last scan
        self._held: dict[str, tuple[Entry, float]] = {}  # files removed with no goodbye (`_hold`)
        self._names_of_last: dict[str, str] = {}  # entry key -> its file, last scan
        self._names_of_keys: dict[str, str] = {}  # entry key -> its file's name (`_name`)
        self._pending: list[tuple[Any, tuple, asyncio.Future]] = []  # ops for the next trip
        self._batcher: asyncio.Task[None] | None = None

    def _new_registration(self, key: str, entry: Entry, ttl: float) -> base.Registration:
        return _FileRegistration(self, key, entry, ttl)

    def _changes(self, namespace: str | None, component: str | None,
                 endpoint: str | None) -> base.ChangeSource:
        return _FileView(self, (namespace, component, endpoint))

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
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancel that
            # lands as the thread finishes, and a watch loop cancelled so keeps running
            async with asyncio.timeout(self.DEADLINE + 1):
                return await asyncio.to_thread(locked)
        except TimeoutError:
            raise DiscoveryError(f"file discovery {self.directory}: no answer from the "
                                 f"filesystem in {self.DEADLINE:g}s") from None

    def _path(self, key: str) -> Path:
        return self.directory / self._name(key)

    def _name(self, key: str) -> str:
        """The name of `key`'s file (remembered: a watch asks for it at every lease end)."""
        name = self._names_of_keys.get(key)
        if name is None:
            name = urllib.parse.quote(key, safe="")
            if len(name) > 200:  # '#' never occurs in a quoted name
                name = "#" + hashlib.sha256(key.encode()).hexdigest()
            name += ".json"
            if len(self._names_of_keys) > 100_000:
                self._names_of_keys.clear()
            self._names_of_keys[key] = name
        return name

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
        path = self._path(key)
        self._write_json(path, record, key)
        with contextlib.suppress(OSError):  # registered again: a removal is not a goodbye
            os.unlink(self._tombstone(path.name))

    def _tombstone(self, name: str) -> str:
        """Where the owner of the file `name` leaves it when it deregisters (`_delete`)."""
        return f"{self._dir}.{name}.gone"

    def _removed(self, name: str) -> bool:
        """Whether the file `name` went without its owner's goodbye (no tombstone)."""
        return not os.path.lexists(self._tombstone(name))

    def _hold(self, key: str, now: float, name: str | None = None
              ) -> tuple[Entry, float] | None:
        """The entry `key` as last read, held until its lease ends, where its file (`name`)
        is gone without its owner's goodbye; None where it said goodbye, its lease ended
        or the file is there."""
        last = self._last.get(key) or self._held.get(key)
        if last is None or last[1] <= now:
            return None
        name = name or self._names_of_last.get(key) or self._name(key)
        if os.path.lexists(self._dir + name) or not self._removed(name):
            return None
        self._held[key] = last
        return last

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
        path = self._path(key)
        try:
            os.rename(path, self._tombstone(path.name))  # the goodbye (`_removed`)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise DiscoveryError(f"file discovery {self.directory}: cannot delete "
                                 f"{key}: {exc}") from exc
        self._last.pop(key, None)
        self._held.pop(key, None)

    def _name_key(self, name: str) -> str | None:
        """`_key_of_name`, remembered (a watch and a listing ask for every name)."""
        try:
            return self._keys_of_names[name]
        except KeyError:
            if len(self._keys_of_names) > 100_000:
                self._keys_of_names.clear()
            key = self._keys_of_names[name] = self._key_of_name(name)
            return key

    def _outside(self, name: str, where: tuple[str | None, str | None, str | None]) -> bool:
        """Whether the file `name` holds an entry outside the filter `where`, as its name
        tells (a file whose name tells no key may hold any entry: not outside)."""
        key = self._name_key(name)
        return key is not None and self._key_outside(key, where)

    def _key_outside(self, key: str, where: tuple[str | None, str | None, str | None]) -> bool:
        """Whether entry key `key` is outside the filter `where` (remembered)."""
        memo = self._outside_memo.get(where)
        if memo is None or len(memo) > 100_000:
            if len(self._outside_memo) > 16:
                self._outside_memo.clear()
            memo = self._outside_memo[where] = {}
        out = memo.get(key)
        if out is None:
            out = memo[key] = any(want is not None and part != want
                                  for part, want in zip(key.split("/", 3), where, strict=False))
        return out

    def _read(self, name: str, touched: bool = False
              ) -> tuple[dict[str, Any] | None, str | None, float, str | None]:
        """(the parsed record, None), or (None, why it is unusable), or (None, None) when the
        file is gone; the file's mtime (when its lease was last renewed); the record's entry
        key (None without a record). Cached by
        inode/mtime/size (`touched`: the caller knows nothing wrote the file since it was
        last read, only keep-alives touched it: cached by inode/size); never blocks (FIFOs
        and devices are refused before they are opened, and opened non-blocking in case of
        a race)."""
        path = self._dir + name
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None, None, 0.0, None
        except OSError as exc:
            return None, f"cannot stat: {exc}", 0.0, None
        sig = (st.st_ino, st.st_mtime_ns, st.st_size)
        cached = self._cache.get(name)
        if cached is not None and (cached[0] == sig or (
                touched and (cached[0][0], cached[0][2]) == (sig[0], sig[2]))):
            # (a touched record keeps its cached time: a write that may follow is parsed)
            return cached[1], cached[2], st.st_mtime, cached[3]
        record, error, key = self._parse(path, st)
        self._cache[name] = (sig, record, error, key)
        return record, error, st.st_mtime, key

    def _parse(self, path: str, st: os.stat_result
               ) -> tuple[dict[str, Any] | None, str | None, str | None]:
        """(the record, None, its entry's key) or (None, why it is unusable, None)."""
        if not stat.S_ISREG(st.st_mode):
            return None, "not a regular file", None
        if st.st_size > self.MAX_RECORD_BYTES:
            return None, f"{st.st_size} bytes: too large to be a discovery record", None
        data, error = _read_file(path, self.MAX_RECORD_BYTES + 1)
        if data is None:
            return None, error, None
        try:
            try:
                record = _decode(data)
            except msgspec.DecodeError:  # what json says of it (or a value only json reads)
                record = json.loads(data.decode("utf-8"))
            if not (isinstance(record, dict) and isinstance(record.get("entry"), dict)
                    and isinstance(record.get("expires_at"), int | float)):
                raise ValueError('not a discovery record ({"entry", "expires_at", "ttl"})')
            key = entry_key(record["entry"])
        except UnicodeDecodeError as exc:
            return None, f"not UTF-8 text: {exc}", None
        except (ValueError, TypeError) as exc:
            return None, str(exc), None
        return record, None, key

    def _scan(self, where: tuple[str | None, str | None, str | None] | None = None
              ) -> tuple[dict[str, tuple[Entry, float]], list[Skipped]]:
        """Live entries by key (with their expiry) and the files that had to be skipped;
        with a filter `where` (namespace, component, endpoint), the files whose names tell
        an entry outside it are not read (a listing of one endpoint stats only its files;
        the store writes each entry under its key's name)."""
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
                log.warning("discovery: %s %s; keeping its %d entries until their leases end",
                            self.directory, "vanished" if dir_id is None else "was replaced",
                            len(self._last))
            self._dir_id = dir_id
            self._cache.clear()
        if dir_id is None and self._held:
            skipped.append(Skipped(str(self.directory), "the discovery directory is missing; "
                                   "its entries are kept until their leases end"))
        live: dict[str, tuple[Entry, float]] = {}
        names_of: dict[str, str] = {}  # entry key -> its file's name
        for name in names:
            if name.startswith("."):
                if name.endswith((".tmp", ".gone")):
                    self._gc_dot(name, now)
                continue
            if not name.endswith(".json") or (where is not None and self._outside(name, where)):
                continue
            record, error, renewed, key = self._read(name)
            if error is not None:
                skipped.append(Skipped(self._dir + name, error, self._key_of_name(name)))
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
                        os.unlink(self._dir + name)
                continue
            live[key] = (record["entry"], expires_at)  # type: ignore[index]
            names_of[key] = name  # type: ignore[index]
        if len(self._cache) > len(names):
            for gone in self._cache.keys() - set(names):
                del self._cache[gone]
        outside = self._key_outside
        for key in self._last.keys() - live.keys():  # gone since: said goodbye, or removed?
            if where is None or not outside(key, where):
                self._hold(key, now)
        for key, (entry, expires_at) in list(self._held.items()):
            if expires_at <= now or key in live:
                del self._held[key]
            elif where is None or not outside(key, where):
                live[key] = (entry, expires_at)
        if where is None:
            self._names_of_last, self._last = names_of, live
        else:  # the entries outside the filter stand as last read
            self._names_of_last.update(names_of)
            last = {k: v for k, v in self._last.items() if outside(k, where)}
            last.update(live)
            self._last = last
        return live, skipped

    def _renew(self, quiet: dict[str, str]) -> dict[str, float]:
        """The new lease end of each file of `quiet` (name -> the key of its entry) that no
        write changed since it was read (a kernel watch named none): a stat alone, where
        its inode and size are those of its cached record, which holds that key and whose
        lease runs on. The files left out (gone, rewritten, unreadable, ended) are for
        `_read_names`."""
        now = time.time()
        out: dict[str, float] = {}
        for name, key in quiet.items():
            cached = self._cache.get(name)
            if cached is None or cached[3] != key:
                continue
            try:
                st = os.stat(self._dir + name)
            except OSError:
                continue
            if st.st_ino != cached[0][0] or st.st_size != cached[0][2]:
                continue
            record: dict[str, Any] = cached[1]  # type: ignore[assignment]
            ttl = _ttl(record)
            expires_at = max(float(record["expires_at"]), st.st_mtime + ttl if ttl else 0.0)
            if expires_at > now:
                self._last[key] = (record["entry"], expires_at)
                out[name] = expires_at
        return out

    def _read_changes(self, names: set[str], quiet: dict[str, str]
                      ) -> tuple[dict[str, float],
                                 dict[str, tuple[str | None, Entry | None, float,
                                                 Skipped | None]]]:
        """One trip of a watch: the leases of `quiet` renewed (`_renew`), and the files of
        `names` and those of `quiet` not renewed, read (`_read_names`)."""
        renewed = self._renew(quiet)
        rest = quiet.keys() - renewed.keys()
        return renewed, self._read_names(names | rest, frozenset(rest))

    def _read_names(self, names: set[str], touched: frozenset[str] = frozenset()
                    ) -> dict[str, tuple[str | None, Entry | None, float, Skipped | None]]:
        """Read just these files of the directory (a watch told they changed, or their
        lease is due; `touched`: those of them nothing wrote since they were read, whose
        records are not parsed again): for each, (its live entry's key, the entry, when
        its lease ends, None), or (None, None, 0, why it is skipped), or (None, None, 0,
        None) when it is gone, expired or not an entry's file."""
        now = time.time()
        out: dict[str, tuple[str | None, Entry | None, float, Skipped | None]] = {}
        gone: tuple[str | None, Entry | None, float, Skipped | None] = (None, None, 0.0, None)
        for name in names:
            if name.startswith(".") or not name.endswith(".json"):
                continue
            before = self._cache.get(name)
            was = None if before is None else before[3]  # the key it held when last read
            record, error, renewed, key = self._read(name, name in touched)
            held = None if was is None or record is not None or error is not None \
                else self._hold(was, now, name)
            if was is not None and key != was and held is None:
                self._last.pop(was, None)
            if error is not None:
                out[name] = (None, None, 0.0, Skipped(self._dir + name, error,
                                                      self._key_of_name(name)))
                continue
            if record is None:
                self._cache.pop(name, None)
                out[name] = gone if held is None else (was, held[0], held[1], None)
                continue
            ttl = _ttl(record)
            expires_at = max(float(record["expires_at"]), renewed + ttl if ttl else 0.0)
            entry = record["entry"]
            if expires_at <= now:
                self._last.pop(key, None)  # type: ignore[arg-type]
                out[name] = gone
                continue
            self._last[key] = (entry, expires_at)
            self._held.pop(key, None)
            out[name] = (key, entry, expires_at, None)
        return out

    def _gc_dot(self, name: str, now: float) -> None:
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
        listing = await self._list_shared(namespace, component, endpoint)
        # callers get private copies (not the parsed records the cache keeps)
        listing.entries = msgspec.json.decode(msgspec.json.encode(listing.entries))
        return listing

    async def _list_shared(self, namespace: str | None, component: str | None,
                           endpoint: str | None) -> base.Listing:
        where = (namespace, component, endpoint)
        if not any(where):
            live, skipped = await self._io(self._scan)
            return base.Listing.of(((key, entry) for key, (entry, _) in live.items()),
                                   skipped, namespace, component, endpoint)
        live, skipped = await self._io(self._scan, where)
        # an entry's key is its namespace, component and endpoint: the filter reads it
        outside = self._key_outside
        return base.Listing([live[key][0] for key in sorted(live) if not outside(key, where)],
                            [s for s in skipped if s.matches(*where)])


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


class _FileView(base.ChangeSource):
    """The entries of the directory, kept by reading only the files that changed.

    Where the kernel says which files changed (inotify on a local filesystem: `_Notify`) a
    tick drains its events and reads just those files; the directory is listed whole only
    at the start and when the watch lost track (its queue overflowed; the directory was
    removed, renamed or replaced). Elsewhere (a network filesystem, where other hosts'
    writes raise no event here) a tick stats the directory and lists it whole when it
    changed (or changed within `HOT` seconds: timestamps are coarse). Either way the file of
    an entry is read again when its lease would have run out (it was renewed, or it ends):
    the cost follows the changes and the leases, not the fleet."""

    def __init__(self, owner: FileDiscovery,
                 where: tuple[str | None, str | None, str | None]) -> None:
        super().__init__(owner, where)
        self._owner: FileDiscovery = owner
        self._notify: _Notify | None = None
        self._whole = True  # list the directory whole at the next step
        self._dirty: set[str] = set()  # file names changed since the last step
        self._sig: tuple[int, int, int] | None = None  # the directory when last listed
        self._leases: dict[str, float] = {}  # key -> when its lease ends, as last read
        self._ends: list[tuple[float, str]] = []  # heap of (lease end, key); stale ones skipped
        self._names: dict[str, str] = {}  # file name -> the entry key it holds
        self._bad: dict[str, Skipped] = {}  # file's path -> why it was skipped
        self._prefix = f"{owner.directory}{os.sep}"  # of a file's path
        self._wants: dict[str, bool] = {}  # file name -> `_wanted`

    async def _list_whole(self) -> base.Change:
        owner = self._owner
        # watch first, then list: a change made in between is both listed and told
        if self._notify is not None:
            self._notify.close()
        self._notify = await owner._io(_Notify.open, owner.directory)
        self._sig = await owner._io(owner._dir_sig)
        live, skipped = await owner._io(owner._scan)
        owner.lists += 1
        self._whole, self._dirty = False, set()
        names = owner._names_of_last
        fresh: dict[str, Entry] = {}
        self._names, self._leases, self._bad = {}, {}, {}
        for key, (entry, expires_at) in live.items():
            if base._matches(entry, *self._where):
                fresh[key] = entry
                self._leases[key] = expires_at
                self._names[names.get(key) or owner._name(key)] = key
        self._ends = [(end, key) for key, end in self._leases.items()]
        heapq.heapify(self._ends)
        for s in skipped:
            if s.matches(*self._where):
                self._bad[s.where] = s
        return self._replace(fresh, list(self._bad.values()))

    def _wanted(self, name: str) -> bool:
        """Whether a change of the file `name` may change the view: an entry's file whose
        name does not tell an entry outside the filter (its file is not read otherwise)."""
        wanted = self._wants.get(name)
        if wanted is None:
            if len(self._wants) > 100_000:
                self._wants.clear()
            wanted = self._wants[name] = name.endswith(".json") and not name.startswith(".") \
                and not self._owner._outside(name, self._where)
        return wanted

    def _due(self, now: float) -> set[str]:
        """The keys whose lease ended by `now` (as last read), out of the heap."""
        due: set[str] = set()
        while self._ends and self._ends[0][0] <= now:
            end, key = heapq.heappop(self._ends)
            if self._leases.get(key) == end:
                due.add(key)
        return due

    def _next_due(self) -> float:
        while self._ends and self._leases.get(self._ends[0][1]) != self._ends[0][0]:
            heapq.heappop(self._ends)  # replaced or gone since
        return self._ends[0][0] if self._ends else math.inf

    async def step(self) -> base.Change:
        if self._whole:
            return await self._list_whole()
        names, self._dirty = self._dirty, set()
        due = self._due(time.time())
        renew = {self._owner._name(k): k for k in due}
        # a kernel watch told of every write: a due file it did not name was only touched
        # (its lease is renewed from a stat: `_renew`); without one, every due file is read
        quiet = {n: k for n, k in renew.items() if n not in names} \
            if self._notify is not None else {}
        names |= renew.keys() - quiet.keys()
        try:
            renewed, got = await self._owner._io(self._owner._read_changes, names, quiet)
        except BaseException:
            self._dirty |= names | quiet.keys()
            raise
        for name, expires_at in renewed.items():
            key = renew[name]
            self._leases[key] = expires_at
            heapq.heappush(self._ends, (expires_at, key))
        changed: set[str] = set()
        bad_moved = False
        outside = self._owner._key_outside  # an entry's key is its namespace, component, endpoint
        for name, (key, entry, expires_at, bad) in got.items():
            old = self._names.pop(name, None)
            if old is not None and old != key and self.entries.pop(old, None) is not None:
                changed.add(old)
                self._leases.pop(old, None)
            if self._bad or bad is not None:
                where = self._prefix + name
                if self._bad.pop(where, None) is not None:
                    bad_moved = True
                if bad is not None and bad.matches(*self._where):
                    self._bad[where] = bad
                    bad_moved = True
            if entry is None or key is None or outside(key, self._where):
                if key is not None and self.entries.pop(key, None) is not None:
                    changed.add(key)  # it moved out of the filter
                    self._leases.pop(key, None)
                continue
            self._names[name] = key
            if self._leases.get(key) != expires_at or key in due:
                self._leases[key] = expires_at
                heapq.heappush(self._ends, (expires_at, key))
            now = self.entries.get(key)
            if now is not entry and now != entry:
                self.entries[key] = entry
                changed.add(key)
        for key in due:  # an entry whose file is not (or no longer) where its key says
            if self._names.get(self._owner._name(key)) == key:
                continue
            if self.entries.pop(key, None) is not None:
                changed.add(key)
            self._leases.pop(key, None)
        return self._change(changed, list(self._bad.values()) if bad_moved else self.skipped)

    async def wait(self, interval: float, failing: bool) -> None:
        while True:
            await asyncio.sleep(interval)
            if failing or self._whole:
                return
            if self._next_due() <= time.time():
                return  # read the files of the leases due again: renewed, or ended
            if self._notify is not None:
                try:
                    names, lost = self._notify.read()
                except OSError as exc:
                    log.warning("discovery: the watch of %s failed (%s); listing it again",
                                self._owner.directory, exc)
                    names, lost = set(), True
                if lost:
                    self._whole = True
                    return
                self._dirty |= {n for n in names if self._wanted(n)}
                if self._dirty:
                    return
                continue
            try:  # no kernel watch: the directory's own time says when to list it again
                changed, sig, _ = await self._owner._io(self._owner._poll, self._sig, {})
            except DiscoveryError:
                return  # the listing reports it
            if changed:
                self._whole = True
                return

    async def aclose(self) -> None:
        if self._notify is not None:
            self._notify.close()
            self._notify = None


# inotify(7): what a directory watch asks for, and what it is told
_IN_CLOSE_WRITE, _IN_MOVED_FROM, _IN_MOVED_TO = 0x8, 0x40, 0x80
_IN_CREATE, _IN_DELETE, _IN_DELETE_SELF, _IN_MOVE_SELF = 0x100, 0x200, 0x400, 0x800
_IN_UNMOUNT, _IN_Q_OVERFLOW, _IN_IGNORED, _IN_ONLYDIR = 0x2000, 0x4000, 0x8000, 0x1000000
_IN_WATCH = (_IN_CLOSE_WRITE | _IN_MOVED_FROM | _IN_MOVED_TO | _IN_CREATE | _IN_DELETE
             | _IN_DELETE_SELF | _IN_MOVE_SELF | _IN_ONLYDIR)
_IN_LOST = _IN_DELETE_SELF | _IN_MOVE_SELF | _IN_UNMOUNT | _IN_Q_OVERFLOW | _IN_IGNORED
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name
# statfs(2) f_type of filesystems shared between hosts: another host's writes raise no
# inotify event here, so a directory on one of them is polled instead
_SHARED_FS = {0x6969, 0x517B, 0xFF534D42, 0xFE534D42, 0x65735546, 0x00C36400, 0x01021997,
              0x01161970, 0x7461636F, 0x0BD00BD0, 0x5346414F, 0x47504653, 0x6B414653,
              0x013111A8, 0x564C}


class _Notify:
    """A non-blocking inotify watch of one directory (Linux, through libc), read by the
    watch loop at each tick: which file names were created, written, moved or deleted,
    and whether it lost track (overflow; the directory itself went)."""

    _libc: Any = None

    def __init__(self, fd: int) -> None:
        self.fd = fd

    @classmethod
    def open(cls, directory: Path) -> _Notify | None:
        """A watch of `directory`, or None where there can be none (not Linux, a shared
        filesystem, no directory yet, no inotify instance left): the caller polls."""
        libc = cls._load()
        if libc is None:
            return None
        path = os.fsencode(directory)
        buf = ctypes.create_string_buffer(256)  # struct statfs; f_type comes first
        if libc.statfs(path, buf) != 0:
            return None
        f_type = ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF
        if f_type in _SHARED_FS:
            return None
        fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            return None
        if libc.inotify_add_watch(fd, path, _IN_WATCH) < 0:
            os.close(fd)
            return None
        return cls(fd)

    @classmethod
    def _load(cls) -> Any:
        if cls._libc is None:
            cls._libc = False
            if sys.platform.startswith("linux"):
                with contextlib.suppress(OSError, AttributeError):
                    libc = ctypes.CDLL(None, use_errno=True)
                    libc.inotify_init1.argtypes = [ctypes.c_int]
                    libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p,
                                                       ctypes.c_uint32]
                    libc.statfs.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
                    cls._libc = libc
        return cls._libc or None

    def read(self) -> tuple[set[str], bool]:
        """The file names changed since the last read, and whether track was lost."""
        raw: set[bytes] = set()
        lost = False
        unpack, head = _EVENT.unpack_from, _EVENT.size
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                break
            at, end = 0, len(data)
            while at + head <= end:
                _, mask, _, size = unpack(data, at)
                at += head
                if mask & _IN_LOST:
                    lost = True
                if size and data[at] != 0x2E:  # not a dot file (a writer's temporary)
                    raw.add(data[at:at + size])
                at += size
        return {os.fsdecode(n.rstrip(b"\0")) for n in raw}, lost

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


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
