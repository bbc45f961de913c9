"""Staging on a worker: pull a version into host buffers while the engine keeps serving,
check every tensor as it lands and the whole version before it is READY, then hand it to
the engine at a safe point.

Sources (a stage request's ``source``):
  ``{"kind": "disk", "path": DIR}``                      a full or delta version directory,
                                                          or a plain HF checkpoint
  ``{"kind": "s3", "uri": "s3://b/prefix/V", "endpoint_url": URL}``
  ``{"kind": "trainer", "url": URL}``                     a trainer's publisher
  ``{"kind": "peer", "url": SYSTEM_URL}`` or ``{"kind": "peer"}`` (any holder in the catalog)
  ``{"kind": "peer", "url": UPSTREAM, "fanout": {"holders": [URL, ...], "origin": {"uri":
  URI, "endpoint_url": URL}, "stall": S}}``   chunk by chunk from a worker that may itself
                                          still be staging it, failing over to `holders`,
                                          then `origin` (rlfleet.weights.fanout)
Options on any source: ``"timeout"`` (seconds for the whole transfer), ``"chain": true``
(replay a delta's chain from the last full version when the worker does not hold its
base), ``"max_bytes_per_s"`` (leave bandwidth to serving), ``"base"``: the delta's base,
``{"version": LABEL, "digest": CONTENT_DIGEST, "path": DIR}`` (any of them): the label its
index must name, the content digest it must have (a resident copy with that digest is the
base whatever its label, and so is the checkpoint the worker was started from when its
files have that digest), a local directory holding it (e.g. ModelExpress's seed
checkpoint, never uploaded). Any other field is refused by name.

The staged buffers are a full-layout version directory (index + shards with Adler-32
metadata) in the staging root, by default in shared memory: the engine loads from it, and
once applied it is the worker's resident copy, served to peers and used as the base of the
next delta. While a version is staged its chunks are served to fan-out downstreams as they
land (the handle's ChunkBoard). Every transfer has a deadline, re-requests a dropped range
(resume), and ends READY or FAILED with a message that says what happened; nothing is
applied from a handle that is not READY."""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import mmap
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from rlfleet.protocol import fanout as fanout_wire
from rlfleet.protocol.admin_base import AdminRequestError
from rlfleet.protocol.admin_vllm import FanoutOrigin, FanoutProgress, PeerFanout
from rlfleet.protocol.fanout import FanoutManifest, FanoutTensor
from rlfleet.runtime.paths import weights_path
from rlfleet.runtime.progress import Progress
from rlfleet.weights import artifacts as art
from rlfleet.weights.artifacts import ArtifactError, Entry, TensorSpec, VersionPlan
from rlfleet.weights.digest import DigestBuilder, checkpoint_digest, checkpoint_files, non_finite
from rlfleet.weights.fanout import CHUNK_BYTES, Chunk, ChunkBoard, Held, specs_of

log = logging.getLogger("rlfleet.weights.staging")

SOURCE_KINDS = ("disk", "s3", "trainer", "peer")
DEFAULT_TIMEOUT = float(os.environ.get("RLFLEET_STAGE_TIMEOUT", 600))
READ_TIMEOUT = 10.0  # one request's connect/read deadline
CHUNK = 32 << 20  # bytes per ranged read (the unit of resume)


class StageRequestError(AdminRequestError):
    """The stage request cannot be accepted; the message says what to send instead (the
    system server answers it in the contract's error shape)."""


class CannotStage(ArtifactError):
    """This worker cannot stage the version the way it was asked to (no room for a shadow
    of the model, an engine that does not prepare versions while it serves): its caller
    installs it from disk instead. Nothing is wrong with the version."""


class StageState(enum.StrEnum):
    STAGING = "STAGING"
    READY = "READY"
    FAILED = "FAILED"
    RELEASED = "RELEASED"


_S = StageState
TRANSITIONS: dict[StageState, frozenset[StageState]] = {
    _S.STAGING: frozenset({_S.READY, _S.FAILED, _S.RELEASED}),
    _S.READY: frozenset({_S.RELEASED, _S.FAILED}),
    _S.FAILED: frozenset({_S.RELEASED}),
    _S.RELEASED: frozenset(),
}


@dataclass(frozen=True)
class DeltaBase:
    """The base a delta is applied on, as the stage request (or the catalog) names it."""

    version: str | None = None  # the label the delta's index must name as base_version
    digest: str | None = None  # its content digest: the base is matched by content
    path: Path | None = None  # a local directory holding it (full version or checkpoint)

    def describe(self) -> dict[str, str]:
        return {k: str(v) for k, v in (("version", self.version), ("digest", self.digest),
                                       ("path", self.path)) if v is not None}


_COMMON_FIELDS = ("kind", "timeout", "chain", "max_bytes_per_s", "base")
SOURCE_FIELDS: dict[str, tuple[str, ...]] = {
    "disk": ("path",), "s3": ("uri", "endpoint_url"), "trainer": ("url",),
    "peer": ("url", "fanout")}


@dataclass(frozen=True)
class Source:
    kind: str
    location: str  # path, s3 URI (parent of the version), or base URL; "" = from the catalog
    key: str  # the version's directory below `location`
    endpoint_url: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    chain: bool = False
    max_bytes_per_s: float | None = None
    base: DeltaBase = DeltaBase()
    fanout: PeerFanout | None = None  # a peer source pulled chunk by chunk (weights.fanout)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        if self.base != DeltaBase():
            out["base"] = self.base.describe()
        if self.kind == "disk":
            out["path"] = str(Path(self.location) / self.key)
        elif self.kind == "s3":
            out["uri"] = f"{self.location}/{self.key}"
            if self.endpoint_url:
                out["endpoint_url"] = self.endpoint_url
        else:
            out["url"] = self.location or None
        if self.fanout is not None:
            out["fanout"] = msgspec.to_builtins(self.fanout)
        return out


def parse_source(raw: Any, version: str, allowed_roots: list[Path] | None = None) -> Source:
    """A stage request's `source` object → Source (StageRequestError says what is wrong)."""
    if not isinstance(raw, dict):
        raise StageRequestError('source is required: {"kind": "disk"|"s3"|"trainer"|"peer", ...}')
    kind = raw.get("kind")
    if kind not in SOURCE_KINDS:
        raise StageRequestError(f"source.kind must be one of {', '.join(SOURCE_KINDS)}, "
                                f"not {kind!r}")
    known = _COMMON_FIELDS + SOURCE_FIELDS[kind]
    unknown = sorted(str(k) for k in raw if k not in known)
    if unknown:
        raise StageRequestError(f"source: unknown field{'s' if len(unknown) > 1 else ''} "
                                f"{', '.join(unknown)} for a {kind} source (it takes "
                                f"{', '.join(known)})")
    timeout = raw.get("timeout", DEFAULT_TIMEOUT)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise StageRequestError("source.timeout must be a positive number of seconds")
    chain = raw.get("chain", False)
    if not isinstance(chain, bool):
        raise StageRequestError("source.chain must be a boolean")
    rate = raw.get("max_bytes_per_s")
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float))
                             or rate <= 0):
        raise StageRequestError("source.max_bytes_per_s must be a positive number")
    common = {"timeout": float(timeout), "chain": chain,
              "max_bytes_per_s": float(rate) if rate else None,
              "base": parse_base(raw.get("base"), allowed_roots)}
    if kind == "disk":
        path = raw.get("path")
        if not isinstance(path, str) or not path:
            raise StageRequestError("source.path is required for a disk source (a version "
                                    "directory on this worker's disk)")
        p = _local_dir("source.path", path, allowed_roots)
        return Source("disk", str(p.parent), p.name, **common)
    if kind == "s3":
        uri = raw.get("uri")
        if not isinstance(uri, str) or not uri.startswith("s3://"):
            raise StageRequestError("source.uri is required for an s3 source: "
                                    "s3://bucket/prefix/VERSION")
        try:
            parent, key = art.split_version_uri(uri)
        except ValueError as e:
            raise StageRequestError(str(e)) from None
        endpoint = raw.get("endpoint_url")
        if endpoint is not None and not isinstance(endpoint, str):
            raise StageRequestError("source.endpoint_url must be a string (http://host:port)")
        return Source("s3", parent, key, endpoint_url=endpoint, **common)
    url = raw.get("url")
    if kind == "trainer" and (not isinstance(url, str) or not url.startswith(("http://", "https://"))):
        raise StageRequestError("source.url is required for a trainer source: the trainer "
                                "publisher's http://host:port")
    if kind == "peer" and url is not None and (
            not isinstance(url, str) or not url.startswith(("http://", "https://"))):
        raise StageRequestError("source.url must be a peer's system URL (http://host:port), or "
                                "leave it out to take any peer the catalog lists")
    fanout = _parse_fanout(raw["fanout"], url) if "fanout" in raw else None
    return Source(kind, (url or "").rstrip("/"), version, fanout=fanout, **common)


def _parse_fanout(raw: Any, url: Any) -> PeerFanout:
    """A peer source's `fanout` object → PeerFanout (StageRequestError names what is wrong)."""
    if url is None:
        raise StageRequestError("source.url is required with source.fanout: the upstream "
                                "worker's system URL")
    try:
        return msgspec.convert(raw, PeerFanout)
    except msgspec.ValidationError as e:
        if isinstance(e.__cause__, AdminRequestError):
            raise StageRequestError(str(e.__cause__)) from None
        raise StageRequestError(f"source.fanout: {e} (it takes holders: [SYSTEM_URL, ...], "
                                "origin: {uri, endpoint_url}, stall: SECONDS)") from None


def _local_dir(field_name: str, path: str, allowed_roots: list[Path] | None) -> Path:
    """The same checks as update_weights_from_disk's model_path."""
    try:
        return weights_path(path, allowed_roots or [])
    except AdminRequestError as e:
        raise StageRequestError(f"{field_name}: {e}") from None


def parse_base(raw: Any, allowed_roots: list[Path] | None = None) -> DeltaBase:
    """A source's `base` object → DeltaBase (StageRequestError names what is wrong)."""
    if raw is None:
        return DeltaBase()
    fields = ("version", "digest", "path")
    if not isinstance(raw, dict) or not raw:
        raise StageRequestError('source.base must be an object: {"version": LABEL, "digest": '
                                'CONTENT_DIGEST, "path": DIR} (any of them)')
    unknown = sorted(str(k) for k in raw if k not in fields)
    if unknown:
        raise StageRequestError(f"source.base: unknown field{'s' if len(unknown) > 1 else ''} "
                                f"{', '.join(unknown)} (it takes {', '.join(fields)})")
    for k in fields:
        if k in raw and (not isinstance(raw[k], str) or not raw[k]):
            raise StageRequestError(f"source.base.{k} must be a non-empty string")
    path = raw.get("path")
    return DeltaBase(raw.get("version"), raw.get("digest"),
                     _local_dir("source.base.path", path, allowed_roots) if path else None)


def open_source_storage(src: Source, read_timeout: float = READ_TIMEOUT,
                        admin_token: str | None = None) -> art.Storage:
    if src.kind == "disk":
        return art.FileStorage(src.location)
    if src.kind == "s3":
        return art.open_storage(src.location, src.endpoint_url, read_timeout)
    headers = {"Authorization": f"Bearer {admin_token}"} if admin_token and src.kind == "peer" \
        else None
    return art.HttpStorage(src.location, read_timeout, headers)


@dataclass
class StagedVersion:
    """One staging handle: a version being pulled into (or held in) host buffers."""

    handle: str
    version: str
    source: Source
    expected_digest: str | None
    state: StageState = StageState.STAGING
    format: str | None = None
    base_version: str | None = None
    bytes_done: int = 0
    bytes_total: int = 0
    tensors_done: int = 0
    tensors_total: int = 0
    error: str | None = None
    digest: str | None = None
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    applied: bool = False
    dir: Path | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    done: asyncio.Event | None = None  # set when the transfer ends (READY or FAILED)
    peer: str | None = None  # the peer actually used
    prepared: str | None = None  # how the engine prepared it while serving (None: it did not)
    prepare_seconds: float | None = None  # how long the engine took to prepare it
    #: the caller wants it only swapped in (prepared while serving), else installed from disk
    require_swap: bool = False
    prepare: bool = True  # the engine prepares it while serving (False: installed at once)
    cannot: str | None = None  # why this worker cannot stage it so (FAILED): install from disk
    base: DeltaBase = DeltaBase()  # a delta's base: the request's, completed from the catalog
    board: ChunkBoard | None = None  # what of it this worker holds and serves to downstreams
    fanout: FanoutProgress | None = None  # its chunks received and served (with `board`)

    def move(self, new: StageState) -> None:
        if new not in TRANSITIONS[self.state]:
            raise ArtifactError(f"staged version {self.handle} cannot go from "
                                f"{self.state.value} to {new.value}")
        self.state = new

    def summary(self) -> dict[str, Any]:
        src = self.source.describe()
        if self.peer:
            src["url"] = self.peer
        return {"handle": self.handle, "version": self.version, "state": self.state.value,
                "format": self.format, "base_version": self.base_version, "source": src,
                "bytes_done": self.bytes_done, "bytes_total": self.bytes_total,
                "tensors_done": self.tensors_done, "tensors_total": self.tensors_total,
                "digest": self.digest, "error": self.error, "applied": self.applied,
                "prepared": self.prepared, "prepare_seconds": self.prepare_seconds,
                "cannot_stage": self.cannot, "fanout": self.fanout,
                "seconds": round((self.finished_at or time.time()) - self.started_at, 3)}


# ---------------------------------------------------------------- staged buffers on disk


class StagedFiles:
    """A full-layout version directory whose shards are allocated up front and filled in
    place through memory maps: each tensor's slot is a writable uint8 view."""

    def __init__(self, directory: Path, specs: list[TensorSpec],
                 shard_limit: int = art.SHARD_LIMIT) -> None:
        self.dir = directory
        self.specs = {s.name: s for s in specs}
        self.dir.mkdir(parents=True, exist_ok=False)
        batches = art._batches([(s.name, s.nbytes) for s in art.order_specs(specs)], shard_limit)
        self.checksums: dict[str, str] = {}
        # each tensor's digest, taken as its bytes landed (`landed`): the version's digest
        # is their root, without a second pass over the bytes
        self.digests: dict[str, bytes] = {}
        self.files: list[tuple[str, list[TensorSpec], int]] = []  # name, specs, header len
        self._maps: list[mmap.mmap] = []
        self.slots: dict[str, np.ndarray] = {}
        for i, batch in enumerate(batches, start=1):
            fname = art.shard_name(i, len(batches))
            bspecs = [self.specs[n] for n in batch]
            header, offsets = art.build_header(bspecs, dict.fromkeys(batch, "00000000"))
            size = len(header) + sum(s.nbytes for s in bspecs)
            with open(self.dir / fname, "wb+") as f:
                f.write(header)
                f.truncate(size)
                m = mmap.mmap(f.fileno(), size) if size else None
            self.files.append((fname, bspecs, len(header)))
            if m is None:
                continue
            self._maps.append(m)
            view = np.frombuffer(m, dtype=np.uint8)
            for name, (b, e) in offsets.items():
                self.slots[name] = view[len(header) + b:len(header) + e]

    def finish(self) -> None:
        """Write the real checksums into the headers (same length) and the index; make the
        files read-only: from here on they are what the engine receives."""
        missing = sorted(set(self.specs) - set(self.checksums))
        if missing:
            raise ArtifactError(f"internal: no checksum for {missing[:3]}")
        weight_map = {}
        for (fname, bspecs, hlen), m in zip(self.files, self._maps, strict=False):
            header, _ = art.build_header(bspecs, {s.name: self.checksums[s.name] for s in bspecs})
            if len(header) != hlen:
                raise ArtifactError("internal: header length changed")
            m[:hlen] = header
            m.flush()
            weight_map.update({s.name: fname for s in bspecs})
        total = sum(s.nbytes for s in self.specs.values())
        (self.dir / art.INDEX).write_text(json.dumps(
            {"metadata": {"total_size": total, "checksum_format": art.CHECKSUM_FORMAT},
             "weight_map": weight_map}, sort_keys=True, separators=(",", ":")))
        for fname, _, _ in self.files:
            os.chmod(self.dir / fname, 0o444)

    def landed(self, name: str) -> None:
        """Tensor `name` holds its final bytes: hash it and check it finite now, while its
        bytes are in the cache (once per tensor per pass; a later pass that changes it, a
        delta, calls this again). ArtifactError for non-finite values."""
        t = self.specs[name].as_tensor(self.slots[name])
        one = DigestBuilder()
        why = non_finite([(name, t)], one)
        if why:
            raise ArtifactError(f"{why} (the version is not staged)")
        self.digests[name] = one.digest_of(name)

    def digest(self) -> str:
        """The version's content digest, from each tensor's (taken as it landed; those not
        yet taken now); non-finite values are refused here, while the worker serves, so that
        applying these bytes checks neither again."""
        for name in sorted(set(self.specs) - set(self.digests)):
            self.landed(name)
        b = DigestBuilder()
        for name in sorted(self.digests):
            b.add_digest(name, self.digests[name])
        return b.root()

    def close(self) -> None:
        self.slots = {}
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a view is still alive somewhere; the GC closes it
                pass
        self._maps = []


@dataclass
class Resident:
    """The version the engine serves, as staged bytes: peers read it, deltas start from it."""

    version: str
    digest: str
    dir: Path
    specs: dict[str, TensorSpec]
    checksums: dict[str, str]
    engine_digest: str | None = None  # what the engine reported when it applied these bytes
    digests: dict[str, bytes] = field(default_factory=dict)  # each tensor's, where known
    #: the directory is this staging area's (removed when the copy is dropped); False: the
    #: source's own directory, read in place (a checkpoint staged straight into the engine)
    owned: bool = True

    def drop(self) -> None:
        """Remove the copy's files, when they are this staging area's."""
        if self.owned:
            shutil.rmtree(self.dir, ignore_errors=True)

    def slots(self) -> dict[str, np.ndarray]:
        """Read-only views of every tensor's bytes (memory-mapped)."""
        plan = art.plan_version(art.FileStorage(self.dir.parent).read, self.dir.name)
        out = {}
        for e in plan.entries:
            mm = np.memmap(self.dir / e.file, dtype=np.uint8, mode="r")
            out[e.name] = mm[e.start:e.end]
        return out


class StartupCheckpoint:
    """The checkpoint directory the worker was started from: a delta whose base is named by
    content digest alone starts from its files when they have that digest (digested from
    the files, once per state of the files; the staged copy is checked again before the
    delta is applied)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._known: tuple[tuple, str] | None = None  # (state of the files, their digest)

    def _files_state(self) -> tuple | None:
        try:
            return tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns)
                         for f in checkpoint_files(self.path))
        except (ValueError, OSError):
            return None

    def digest(self) -> str | None:
        """The files' content digest now; None when the directory holds no checkpoint."""
        with self._lock:
            state = self._files_state()
            if state is None:
                return None
            if self._known is None or self._known[0] != state:
                self._known = (state, checkpoint_digest(self.path))
            return self._known[1]


# ---------------------------------------------------------------- the transfer


class _Fetcher:
    """Ranged reads with a deadline: a dropped connection or a server error is retried
    (the same range again) until the deadline; a missing object is not."""

    def __init__(self, storage: art.Storage, what: str, deadline: float, cancel: threading.Event,
                 max_bytes_per_s: float | None) -> None:
        self.storage, self.what, self.deadline, self.cancel = storage, what, deadline, cancel
        self.rate = max_bytes_per_s
        self.t0 = time.monotonic()
        self.moved = 0

    def __call__(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        delay, last = 0.1, None
        while True:
            if self.cancel.is_set():
                raise ArtifactError("released while staging")
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise ArtifactError(f"{self.what}: transfer deadline passed "
                                    f"(last error: {last})" if last else
                                    f"{self.what}: transfer deadline passed")
            try:
                data = self.storage.read(key, start, end)
            except Exception as e:  # noqa: BLE001 - any transport failure: retry the range
                last = self._worth_retrying(key, e)
            else:
                if start is not None and end is not None and len(data) != end - start:
                    last = f"short read of {key} ({len(data)} of {end - start} bytes)"
                else:
                    self._throttle(len(data))
                    return data
            log.warning("%s: %s; retrying", self.what, last)
            time.sleep(min(delay, max(0.0, self.deadline - time.monotonic())))
            delay = min(delay * 2, 2.0)

    def _worth_retrying(self, key: str, e: Exception) -> str:
        """What a failed transfer of `key` says when trying again may help (a transport
        failure, a 5xx); raises when it cannot (the object is missing, any other refusal)."""
        if isinstance(e, FileNotFoundError):
            raise art.ArtifactMissing(f"{self.what}: {key} not found ({e})") from None
        if isinstance(e, ArtifactError):
            if "HTTP 5" not in str(e):
                raise e
            return str(e)
        return f"{type(e).__name__}: {e}"

    def _throttle(self, n: int) -> None:
        self.moved += n
        if self.rate:
            ahead = self.moved / self.rate - (time.monotonic() - self.t0)
            if ahead > 0:
                if time.monotonic() + ahead > self.deadline:
                    time.sleep(max(0.0, self.deadline - time.monotonic()))
                else:
                    self.cancel.wait(ahead)

    def fill(self, key: str, start: int, end: int, dst: np.ndarray,
             progress: Callable[[int], None]) -> None:
        """Bytes [start, end) of `key` into `dst`, streamed: `progress(n)` after each piece
        written; a transfer that breaks off resumes after the last byte written, until the
        deadline."""
        got, delay, last = 0, 0.1, None
        while got < end - start:
            if self.cancel.is_set():
                raise ArtifactError("released while staging")
            if time.monotonic() >= self.deadline:
                raise ArtifactError(f"{self.what}: transfer deadline passed"
                                    + (f" (last error: {last})" if last else ""))
            try:
                for piece in self.storage.stream(key, start + got, end):
                    n = min(len(piece), end - start - got)
                    dst[got:got + n] = np.frombuffer(piece, dtype=np.uint8, count=n)
                    got += n
                    self._throttle(n)
                    progress(n)
                    if self.cancel.is_set():
                        raise ArtifactError("released while staging")
                if got < end - start:
                    last = f"short read of {key} ({got} of {end - start} bytes)"
            except Exception as e:  # noqa: BLE001 - any transport failure: resume the range
                last = self._worth_retrying(key, e)
            if got < end - start:
                log.warning("%s: %s; resuming at byte %d", self.what, last, start + got)
                time.sleep(min(delay, max(0.0, self.deadline - time.monotonic())))
                delay = min(delay * 2, 2.0)

    def read_entry(self, plan: VersionPlan, e: Entry, out: np.ndarray | None,
                   progress: Callable[[int], None],
                   filled: Callable[[int], None] | None = None) -> np.ndarray:
        """The entry's bytes, range by range, streamed (a failure resumes after the last
        byte written); into `out` when given, else a new array. `filled(n)`: the first n
        bytes are written."""
        n = e.end - e.start
        dst = out if out is not None else np.empty(n, dtype=np.uint8)
        pos = 0
        chunk = CHUNK if not self.rate else max(1 << 16, min(CHUNK, int(self.rate / 4)))
        while pos < n:
            m = min(chunk, n - pos)
            done = pos

            def landed(k: int) -> None:
                nonlocal done
                done += k
                progress(k)
                if filled is not None:
                    filled(done)
            self.fill(f"{plan.key}/{e.file}", e.start + pos, e.start + pos + m,
                      dst[pos:pos + m], landed)
            pos += m
        return dst


def _needs_base(first: VersionPlan, base: DeltaBase, chain: bool, resident: Resident | None,
                applied: tuple[str | None, str | None], startup: StartupCheckpoint | None
                ) -> tuple[str, DeltaBase]:
    """Where a delta's base comes from: "resident" (the staged copy the engine serves, matched
    by content: its digest is the served one, and its label or digest is the base's),
    "path" (the request's base.path, or the startup checkpoint when the base is named by a
    digest its files have), "chain" (replayed from the last full version), or WrongBase
    saying what to send. Returns the mode and the base to fill from."""
    served_version, served_digest = applied
    if resident is not None and served_digest == (resident.engine_digest or resident.digest):
        digests = {resident.digest, resident.engine_digest} - {None}
        if resident.version == first.base_version or base.digest in digests:
            return "resident", base
    if base.path is not None:
        return "path", base
    started = startup.digest() if startup is not None and base.digest is not None else None
    if started is not None and started == base.digest:
        return "path", DeltaBase(base.version, base.digest, startup.path)
    if chain:
        return "chain", base
    serving = (f"{served_version or 'an unversioned model'} (digest {served_digest})"
               if served_digest else served_version or "an unversioned model")
    named = ""
    if base.digest is not None:
        named = (f" The base digest {base.digest} is neither a staged copy's nor that of "
                 + (f"the checkpoint this worker started from ({startup.path}: {started})."
                    if started is not None else "a checkpoint this worker started from."))
    raise art.WrongBase(f"this delta needs base {first.base_version}; the worker serves "
                        f"{serving}.{named} Stage the base or a full version first, name the "
                        "base (\"base\": {\"path\": DIR}, or {\"digest\": D} of a staged copy "
                        "or of the startup checkpoint), or send \"chain\": true to replay the "
                        "chain from the last full version")


def _plan_chain(fetch: _Fetcher, base: DeltaBase, first: VersionPlan, mode: str,
                timeout_at: float, cancel: threading.Event
                ) -> list[tuple[_Fetcher, VersionPlan]]:
    """The plans to fill in order (from the first full one) when the base is not resident."""
    if mode == "path":
        assert base.path is not None
        local = art.FileStorage(base.path.parent)
        base_fetch = _Fetcher(local, f"base {base.path}", timeout_at, cancel, None)
        plan = art.plan_version(base_fetch, base.path.name, local.list_version)
        if plan.format == "xor-delta":
            raise ArtifactError(f"base {base.path}: a delta; base.path must hold a full "
                                "version or a checkpoint")
        return [(base_fetch, plan), (fetch, first)]
    list_files = fetch.storage.list_version if isinstance(fetch.storage, art.FileStorage) \
        else None
    plans = [first]
    while plans[-1].format == "xor-delta":
        if len(plans) >= 64:
            raise ArtifactError(f"{fetch.what}: delta chain longer than 64")
        name = plans[-1].base_version
        plans.append(art.plan_version(fetch, name, list_files, version=name))
    return [(fetch, p) for p in reversed(plans)]


def transfer(h: StagedVersion, src: Source, storage: art.Storage, root: Path,
             resident: Resident | None, applied: tuple[str | None, str | None],
             startup: StartupCheckpoint | None = None) -> Resident:
    """Pull `h`'s version from `src` into a new staged directory under `root`; returns it
    as a Resident-to-be. `startup`: the checkpoint the worker started from (a delta's base
    when named by its digest). Raises ArtifactError (WrongBase for a delta on the wrong
    base)."""
    what = f"{src.kind} source {storage.uri}/{src.key}"
    deadline = time.monotonic() + src.timeout
    fetch = _Fetcher(storage, what, deadline, h.cancel, src.max_bytes_per_s)
    list_files = storage.list_version if isinstance(storage, art.FileStorage) else None
    first = art.plan_version(fetch, src.key, list_files, version=h.version,
                             base_version=h.base.version)
    h.format, h.base_version = first.format, first.base_version
    mode, base = ("full", h.base) if first.format != "xor-delta" else \
        _needs_base(first, h.base, src.chain, resident, applied, startup)
    plans = [(fetch, first)] if mode in ("full", "resident") else \
        _plan_chain(fetch, base, first, mode, deadline, h.cancel)
    if mode == "resident":
        specs = list(resident.specs.values())
    else:
        specs = [e.spec for e in plans[0][1].entries]
    h.tensors_total = len(specs)
    h.bytes_total = sum(p.stored_bytes for _, p in plans)

    moved = Progress(f"staging {h.version} from {what}", h.bytes_total)

    def progress(n: int) -> None:
        h.bytes_done += n
        moved.add(n)

    staged = StagedFiles(root / f"{h.version}.{h.handle}", specs)
    h.dir = staged.dir
    # downstreams may pull what has landed: in the order it lands (a full version's entries,
    # a delta's tensors by name); what a base is overwritten by is served only at the end
    order = specs if mode == "full" else sorted(specs, key=lambda s: s.name)
    live = mode in ("full", "resident")
    h.fanout = FanoutProgress()
    h.board = ChunkBoard(order, staged.slots, {e.name: e.checksum for e in first.entries}
                         if mode == "full" else None, stats=h.fanout)

    def fill() -> None:
        if mode == "resident":
            _apply_delta(fetch, first, staged, resident.slots(), resident.checksums, progress, h,
                         h.board, resident.digests)
        else:
            _fill_plans(plans, staged, progress, h, base if mode == "path" else None,
                        h.board if live else None)
        h.tensors_done = len(specs)

    return _staged_resident(h.version, staged, moved, fill, h.board.complete)


def _staged_resident(version: str, staged: StagedFiles, moved: Progress,
                     fill: Callable[[], None], landed: Callable[[], None] = lambda: None
                     ) -> Resident:
    """Fill `staged` and seal it as the Resident-to-be of `version`; on any failure its
    files are removed and the progress line says why."""
    try:
        fill()
        staged.finish()
        landed()
        digest = staged.digest()
    except BaseException as e:
        moved.fail(repr(e))
        staged.close()
        shutil.rmtree(staged.dir, ignore_errors=True)
        raise
    moved.finish()
    checksums, digests = dict(staged.checksums), dict(staged.digests)
    staged.close()
    return Resident(version, digest, staged.dir, staged.specs, checksums, digests=digests)


def _fill_plans(plans: list[tuple[_Fetcher, VersionPlan]], staged: StagedFiles,
                progress: Callable[[int], None], h: StagedVersion, base: DeltaBase | None,
                board: ChunkBoard | None = None) -> None:
    """Fill `staged` from a full version (or checkpoint), then apply each delta in place; a
    `base` given with a digest is checked to have it before the first delta is applied."""
    for i, (fetch, plan) in enumerate(plans):
        h.tensors_done = 0
        if plan.format == "xor-delta":
            _apply_delta(fetch, plan, staged, staged.slots, dict(staged.checksums), progress, h)
            continue
        _fill_full(fetch, plan, staged, progress, h, board)
        if i == 0 and base is not None and base.digest is not None:
            got = staged.digest()
            if got != base.digest:
                raise art.WrongBase(f"the base at {base.path} has content digest {got}, not "
                                    f"the {base.digest} named")


def _fill_full(fetch: _Fetcher, plan: VersionPlan, staged: StagedFiles,
               progress: Callable[[int], None], h: StagedVersion,
               board: ChunkBoard | None = None) -> None:
    """Each tensor's bytes into its slot (marked on `board` as they land), checked against
    the artifact's Adler-32."""
    names = {e.name for e in plan.entries}
    if names != set(staged.specs):
        raise ArtifactError(f"{plan.key}: holds different tensors than expected")
    for e in plan.entries:
        if staged.specs[e.name] != e.spec:
            raise ArtifactError(f"{plan.key}: tensor {e.name} is {e.spec.dtype}{list(e.spec.shape)}, "
                                f"expected {staged.specs[e.name].dtype}{list(staged.specs[e.name].shape)}")
        slot = staged.slots[e.name]
        fetch.read_entry(plan, e, slot, progress, None if board is None else
                         (lambda n, name=e.name: board.advance(name, n)))
        got = art.adler32_hex(slot)
        if e.checksum is not None and got != e.checksum:
            raise ArtifactError(f"tensor {e.name}: Adler-32 {got} does not match the artifact's "
                                f"{e.checksum} (corrupt or truncated transfer)")
        staged.checksums[e.name] = got
        staged.landed(e.name)
        h.tensors_done += 1


def _apply_delta(fetch: _Fetcher, plan: VersionPlan, staged: StagedFiles,
                 base: dict[str, np.ndarray], base_sums: dict[str, str],
                 progress: Callable[[int], None], h: StagedVersion,
                 board: ChunkBoard | None = None,
                 base_digests: dict[str, bytes] | None = None) -> None:
    """Apply `plan` (a delta) on `base` into `staged`: the changed tensors decoded (one per
    core), the others copied from the base; each tensor hashed once it holds its bytes
    (an unchanged one keeps the digest `base_digests` has for it)."""
    changed = {e.name: e for e in plan.entries}
    unknown = sorted(set(changed) - set(staged.specs))
    if unknown:
        raise ArtifactError(f"{plan.key}: delta tensors not in its base: {unknown[:3]}")
    known = base_digests or {}

    def jobs():  # read here, decoded one tensor per core
        for name in sorted(staged.specs):
            slot = staged.slots[name]
            e = changed.get(name)
            if e is None:  # unchanged: the base's bytes
                if slot is not base[name]:
                    slot[:] = base[name]
                staged.checksums[name] = base_sums.get(name) or art.adler32_hex(slot)
                if name in known:
                    staged.digests[name] = known[name]
                elif name not in staged.digests:
                    staged.landed(name)
                h.tensors_done += 1
                if board is not None:
                    board.advance(name, slot.nbytes)
            else:
                yield name, fetch.read_entry(plan, e, None, progress), base[name], slot, e.checksum

    def done(name: str, checksum: str) -> None:
        staged.checksums[name] = checksum
        staged.landed(name)
        h.tensors_done += 1
        if board is not None:
            board.advance(name, staged.specs[name].nbytes)

    art.decode_deltas(jobs(), done)


# ---------------------------------------------------------------- a fan-out downstream


class _Holders:
    """Where a fan-out downstream takes chunks from: its upstream, then each failover holder
    in turn (never back: a holder that failed is passed for good), then the origin."""

    def __init__(self, h: StagedVersion, src: Source, admin_token: str | None) -> None:
        import httpx

        assert src.fanout is not None
        self.h, self.urls, self.i = h, [src.location, *src.fanout.holders], 0
        self.stall = src.fanout.stall
        self.refusal = ""  # the current holder's last refusal
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else None
        # a holder that sends nothing for `stall` seconds is passed (read timeout)
        self.http = httpx.Client(timeout=httpx.Timeout(self.stall, connect=READ_TIMEOUT),
                                 headers=headers)

    @property
    def current(self) -> str | None:
        return self.urls[self.i].rstrip("/") if self.i < len(self.urls) else None

    def fail_over(self, why: str) -> None:
        was = self.current
        self.i += 1
        self.h.fanout.failovers += 1
        self.h.fanout.holder = self.current or "origin"
        log.warning("fan-out of %s: holder %s: %s; going on at %s", self.h.version, was, why,
                    self.h.fanout.holder)

    def manifest(self, deadline: float) -> FanoutManifest | None:
        """The first holder's manifest (each may take `stall` seconds to have one: it may
        not have started staging yet); None when none answers (the origin's turn)."""
        import httpx

        while (url := self.current) is not None:
            since = time.monotonic()
            while True:
                _check_live(self.h, deadline)
                try:
                    r = self.http.get(url + fanout_wire.manifest_path(self.h.version))
                except httpx.HTTPError as e:
                    self.fail_over(f"{type(e).__name__}: {e}")
                    break
                if r.status_code == 200:
                    return msgspec.json.decode(r.content, type=FanoutManifest)
                if r.status_code in (404, 503) and time.monotonic() - since < self.stall:
                    time.sleep(0.05)
                    continue
                self.fail_over(f"manifest: HTTP {r.status_code} {r.text[:200]}")
                break
        return None

    def stream(self, start: int, accept: Callable[[int, bytes, bool], None],
               deadline: float) -> bool:
        """Chunks from `start` on, streamed from the current holder into `accept(index,
        bytes, holder_was_staging)` (each checked by its Adler-32 first). Returns False when
        the holder cannot serve (yet): the caller tries again or fails over; raises
        _Corrupt for a chunk that fails its check; returns True when the stream ended."""
        import httpx

        url = self.current
        assert url is not None
        frame = fanout_wire.FRAME
        with self.http.stream("GET", url + fanout_wire.stream_path(self.h.version),
                              params={"start": start}) as r:
            if r.status_code != 200:
                self.refusal = f"HTTP {r.status_code} {r.read()[:200]!r}"
                if r.status_code == 404:
                    return False
                raise httpx.HTTPStatusError(self.refusal, request=r.request, response=r)
            buf = bytearray()
            for piece in r.iter_raw():
                buf += piece
                while len(buf) >= frame.size:
                    index, length, checksum, staging = frame.unpack_from(buf)
                    if len(buf) < frame.size + length:
                        break
                    data = bytes(buf[frame.size:frame.size + length])
                    del buf[:frame.size + length]
                    if int(art.adler32_hex(data), 16) != checksum:
                        raise _Corrupt(index)
                    accept(index, data, bool(staging))
                _check_live(self.h, deadline)
        return True

    def close(self) -> None:
        self.http.close()


class _Origin:
    """The version's artifact, read only for what no holder could serve (opened on first
    use)."""

    def __init__(self, h: StagedVersion, origin: FanoutOrigin | None, deadline: float) -> None:
        self.h, self.origin, self.deadline = h, origin, deadline
        self.storage: art.Storage | None = None
        self.plan: VersionPlan | None = None
        self.fetch: _Fetcher | None = None

    def _open(self) -> VersionPlan:
        if self.origin is None:
            raise ArtifactError(f"fan-out of {self.h.version}: no holder could serve it and "
                                "the source names no origin")
        if self.plan is None:
            parent, key = art.split_version_uri(self.origin.uri)
            self.storage = art.open_storage(parent, self.origin.endpoint_url, READ_TIMEOUT)
            self.fetch = _Fetcher(self.storage, f"fan-out origin {self.origin.uri}",
                                  self.deadline, self.h.cancel, None)
            plan = art.plan_version(self.fetch, key, version=self.h.version)
            if plan.format == "xor-delta":
                raise ArtifactError(f"fan-out origin {self.origin.uri} is a delta; the origin "
                                    "must be a full version")
            self.plan = plan
        return self.plan

    def manifest(self) -> FanoutManifest:
        plan = self._open()
        return FanoutManifest(
            version=self.h.version, state="READY", chunk_bytes=CHUNK_BYTES,
            tensors=[FanoutTensor(e.name, e.spec.dtype, list(e.spec.shape), e.checksum)
                     for e in plan.entries], chunks_total=0, chunks_ready=0)

    def read(self, c: Chunk, spec: TensorSpec) -> bytes:
        plan = self._open()
        e = next((e for e in plan.entries if e.name == c.name), None)
        if e is None or e.spec != spec:
            raise ArtifactError(f"fan-out origin {self.origin.uri}: tensor {c.name} is not "
                                "the holders' one")
        out = np.empty(c.end - c.start, dtype=np.uint8)
        self.fetch.fill(f"{plan.key}/{e.file}", e.start + c.start, e.start + c.end, out,
                        lambda n: None)
        self.h.fanout.origin_chunks += 1
        return out.tobytes()

    def close(self) -> None:
        if self.storage is not None:
            self.storage.close()


def _check_live(h: StagedVersion, deadline: float) -> None:
    if h.cancel.is_set():
        raise ArtifactError("released while staging")
    if time.monotonic() >= deadline:
        raise ArtifactError(f"fan-out of {h.version}: transfer deadline passed")


def fanout_transfer(h: StagedVersion, src: Source, root: Path,
                    admin_token: str | None = None) -> Resident:
    """Pull `h`'s version chunk by chunk from the source's holders (its upstream first, the
    failover holders, then the origin), serving what has landed to this worker's own
    downstreams meanwhile (h.board); returns it as a Resident-to-be."""
    assert src.fanout is not None
    deadline = time.monotonic() + src.timeout
    h.fanout = FanoutProgress(holder=src.location)
    holders = _Holders(h, src, admin_token)
    origin = _Origin(h, src.fanout.origin, deadline)
    try:
        manifest = holders.manifest(deadline) or origin.manifest()
        if h.expected_digest is None and manifest.digest is not None:
            h.expected_digest = manifest.digest
        specs = specs_of(manifest)
        h.format, h.tensors_total = "full", len(specs)
        h.bytes_total = sum(s.nbytes for s in specs)
        staged = StagedFiles(root / f"{h.version}.{h.handle}", specs)
        h.dir = staged.dir
        h.board = ChunkBoard(specs, staged.slots, {t.name: t.checksum for t in manifest.tensors},
                             manifest.chunk_bytes, stats=h.fanout)
        moved = Progress(f"staging {h.version} by fan-out from {src.location}", h.bytes_total)
        return _staged_resident(h.version, staged, moved, lambda: _pull_chunks(
            h, h.board, staged, holders, origin, deadline, moved))
    finally:
        holders.close()
        origin.close()


class _Corrupt(Exception):
    """A chunk failed its Adler-32 on the way."""

    def __init__(self, index: int) -> None:
        super().__init__(f"chunk {index} fails its Adler-32")
        self.index = index


class _Rewind(Exception):
    """A whole tensor failed the artifact's Adler-32: fetch it again from elsewhere."""


def _pull_chunks(h: StagedVersion, board: ChunkBoard, staged: StagedFiles, holders: _Holders,
                 origin: _Origin, deadline: float, moved: Progress) -> None:
    """Every chunk in order into its slot: streamed from the current holder, resumed at the
    chunk it lacks after a broken stream, from the next holder after a refusal, a stall or
    three corrupt chunks in a row, from the origin once no holder is left."""
    import httpx

    first: dict[str, int] = {}
    for c in board.chunks:
        first.setdefault(c.name, c.index)
    nxt, corrupt, since = 0, 0, time.monotonic()

    def accept(index: int, data: bytes, staging: bool) -> None:
        nonlocal nxt, corrupt, since
        if index != nxt:
            raise ArtifactError(f"fan-out of {h.version}: holder sent chunk {index}, not {nxt}")
        nxt = _land(h, board, staged, board.chunks[index], data, first, moved)
        corrupt, since = 0, time.monotonic()
        if staging:
            h.fanout.chunks_from_staging += 1

    while nxt < len(board.chunks):
        _check_live(h, deadline)
        if holders.current is None:
            c = board.chunks[nxt]
            nxt = _land(h, board, staged, c, origin.read(c, staged.specs[c.name]), first, moved)
            continue
        try:
            if holders.stream(nxt, accept, deadline):
                continue  # ended: resume (a holder whose staging failed refuses next)
            if time.monotonic() - since < holders.stall:
                time.sleep(0.05)  # it has not started on this version yet
                continue
            holders.fail_over(f"no copy after {holders.stall:g} s ({holders.refusal})")
        except _Corrupt as e:
            h.fanout.corrupt_chunks += 1
            corrupt += 1
            log.warning("fan-out of %s: %s from %s; fetching it again", h.version, e,
                        holders.current)
            if corrupt >= 3:
                holders.fail_over(f"chunk {e.index} came corrupt {corrupt} times")
                corrupt = 0
        except _Rewind as e:
            nxt = first[board.chunks[nxt].name]  # the failed tensor's first chunk
            holders.fail_over(str(e))
        except httpx.HTTPError as e:
            holders.fail_over(f"{type(e).__name__}: {e}")
        since = time.monotonic()


def _land(h: StagedVersion, board: ChunkBoard, staged: StagedFiles, c: Chunk, data: bytes,
          first: dict[str, int], moved: Progress) -> int:
    """Chunk `c` into its slot and onto the board; at a tensor's end, the tensor checked
    against the manifest's Adler-32 (_Rewind, the tensor withdrawn, when it fails).
    Returns the next chunk's index."""
    spec = staged.specs[c.name]
    slot = staged.slots.get(c.name)
    if len(data) != c.end - c.start:
        raise ArtifactError(f"chunk {c.index} has {len(data)} bytes, not {c.end - c.start}")
    if slot is not None:
        slot[c.start:c.end] = np.frombuffer(data, dtype=np.uint8)
    board.advance(c.name, c.end)
    h.bytes_done += len(data)
    moved.add(len(data))
    if c.end < spec.nbytes:
        return c.index + 1
    got = art.adler32_hex(slot if slot is not None else b"")
    want = board.checksums.get(c.name)
    if want is not None and got != want:
        board.withdraw(c.name)
        h.bytes_done -= spec.nbytes
        if h.fanout.holder == "origin":
            raise ArtifactError(f"tensor {c.name}: Adler-32 {got} does not match the "
                                f"artifact's {want}, from the origin too")
        raise _Rewind(f"tensor {c.name} fails its Adler-32 ({got}, not {want})")
    staged.checksums[c.name] = got
    h.tensors_done += 1
    return c.index + 1


# ---------------------------------------------------------------- the staging area


def default_staging_root() -> Path:
    """This process's staging directory in /dev/shm (else the temp directory); those of
    processes that are gone are removed first."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    _remove_orphans(base)
    return base / f"rlfleet-staging-{os.getpid()}"


class StagingArea:
    """A worker's staged versions and its resident one. The transfer runs in a thread; the
    catalog (when the worker has one) is asked for a lease on the version while it is
    pulled, for peers when the source is ``{"kind": "peer"}``, and told which versions this
    worker holds applied."""

    def __init__(self, root: str | Path | None = None, *, catalog=None, worker_id: str = "",
                 system_url: str | None = None, allowed_roots: list[str] | None = None,
                 lease_ttl: float = 60.0, admin_token: str | None = None,
                 engine: Any = None, startup_checkpoint: str | Path | None = None) -> None:
        """`engine`: the worker's EngineControl; a version is READY once its bytes are
        checked and the engine has prepared it (prepare_staged) while serving.
        `startup_checkpoint`: the checkpoint directory the worker was started from (the base
        of a delta named by its content digest alone, when its files have that digest)."""
        self.root = Path(root) if root is not None else default_staging_root()
        self.root.mkdir(parents=True, exist_ok=True)
        self.catalog = catalog  # a Catalog, or its URL (opened on first use, in the loop)
        self._own_catalog = isinstance(catalog, (str, Path))
        self.worker_id = worker_id
        self.admin_token = admin_token  # peers' /weights routes want it when they have one
        self.system_url = system_url
        self.roots = [Path(r).resolve() for r in allowed_roots or []]
        self.lease_ttl = lease_ttl
        self.engine = engine
        self.startup = StartupCheckpoint(startup_checkpoint) if startup_checkpoint else None
        self.handles: dict[str, StagedVersion] = {}
        self.resident: Resident | None = None
        self._staged: dict[str, Resident] = {}  # handle -> READY buffers
        self._resident_board: ChunkBoard | None = None  # the resident copy, for downstreams
        self._tasks: set[asyncio.Task] = set()
        #: other copies this worker serves to peers on its /weights route (its adapters'
        #: resident versions: rlfleet.worker.lora_admin), looked up after its own
        self.also_serves: list[Callable[[str], Path | None]] = []

    def attach(self, worker_id: str, system_url: str | None) -> None:
        """Who this worker is, once its system server listens (peers find it there)."""
        self.worker_id, self.system_url = worker_id, system_url

    def _open_catalog(self) -> None:
        if isinstance(self.catalog, (str, Path)):
            from rlfleet.weights.catalog import Catalog

            self.catalog = Catalog(self.catalog)

    # ------------------------------------------------------------ stage

    async def _started_from(self, digest: str) -> bool:
        """Whether the checkpoint this worker started from has content `digest` (its files
        digested once per state, off the event loop)."""
        return self.startup is not None and await asyncio.to_thread(self.startup.digest) == digest

    async def stage(self, version: str, source: Any, *, applied: tuple[str | None, str | None],
                    digest: str | None = None, require_swap: bool = False,
                    prepare: bool = True) -> StagedVersion:
        """Start staging `version` from `source` (a handle, STAGING). `require_swap`: only
        where the engine prepares it while serving, so that installing it is a swap; a
        worker that cannot (CannotStage, raised at once: no room for a shadow of the model,
        an engine that does not prepare versions) is installed from disk instead.
        `prepare` False: the caller installs it at once, inside a pause (vLLM's weight
        transfer): the engine does not prepare a shadow of it, it reloads it in place."""
        if not isinstance(version, str) or not version or "/" in version or version in (".", ".."):
            raise StageRequestError("version is required: a version name (no '/')")
        self._open_catalog()
        expected = digest
        entry = None
        if self.catalog is not None:
            from rlfleet.weights.catalog import CatalogError

            try:
                entry = await self.catalog.find(version)
            except CatalogError as e:  # staging goes on without it; the digest check stays
                log.warning("catalog unavailable while staging %s: %s", version, e)
            if entry is not None and entry.state.value == "EVICTED" and isinstance(source, dict) \
                    and source.get("kind") in ("disk", "s3"):  # said before the path's checks
                raise StageRequestError(
                    f"version {version} is EVICTED in the catalog; only a READY version is "
                    f"staged from its artifact (its bytes were removed after it was released: "
                    f"{entry.release_reason or 'deleted'})")
        src = parse_source(source, version, self.roots)
        if require_swap:
            why = ("this worker has no engine to prepare it" if self.engine is None
                   else await self.engine.staging_refusal())
            if why is not None:
                raise CannotStage(why)
        if self.catalog is not None:
            if entry is not None and expected is None:
                expected = entry.digest
            if entry is not None and expected != entry.digest:
                raise StageRequestError(f"digest {expected} differs from the catalog's "
                                        f"{entry.digest} for {version}")
        if entry is not None and src.kind in ("disk", "s3") and entry.state.value != "READY":
            raise StageRequestError(f"version {version} is {entry.state.value} in the catalog; "
                                    "only a READY version is staged from its artifact")
        base = src.base
        if entry is not None and entry.base_version and entry.format.value == "xor-delta":
            base = await self._catalog_base(src.base, entry.base_version)
            if (not src.chain and base.path is None and src.kind in ("disk", "s3")
                    and applied[0] != base.version
                    and (base.digest is None
                         or (applied[1] != base.digest
                             and not await self._started_from(base.digest)))):
                serving = applied[0] if applied[0] is not None else "an unversioned model"
                raise StageRequestError(
                    f"this delta needs base {base.version}; the worker serves {serving} "
                    f"(content digest {applied[1]}, the base's is {base.digest}). Stage the "
                    "base or a full version first, name a local copy of it (\"base\": "
                    "{\"path\": DIR}), or send \"chain\": true to replay the chain from the "
                    "last full version")
        if src.kind == "peer" and not src.location and entry is None:
            raise StageRequestError(f"no peer URL given and version {version} is not in the "
                                    "catalog" + ("" if self.catalog else
                                                 " (this worker has no catalog)"))
        h = StagedVersion(uuid.uuid4().hex[:16], version, src, expected, done=asyncio.Event(),
                          base=base, require_swap=require_swap, prepare=prepare)
        self._forget_old()
        self.handles[h.handle] = h
        task = asyncio.get_running_loop().create_task(self._run(h, applied))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return h

    async def _catalog_base(self, base: DeltaBase, base_version: str) -> DeltaBase:
        """The request's base completed from the catalog: the label the catalog records for
        the delta, and that version's content digest (a worker serving it under another
        label still holds the base)."""
        if base.version is not None and base.version != base_version:
            raise StageRequestError(f"source.base.version is {base.version}; the catalog "
                                    f"records this delta's base as {base_version}")
        digest = base.digest
        if digest is None:
            from rlfleet.weights.catalog import CatalogError

            try:
                found = await self.catalog.find(base_version)
            except CatalogError as e:
                log.warning("catalog unavailable for base %s: %s", base_version, e)
                found = None
            digest = found.digest if found is not None else None
        return DeltaBase(base_version, digest, base.path)

    def _forget_old(self, keep: int = 64) -> None:
        """Released and failed handles are listed for a while, not forever."""
        done = [k for k, h in self.handles.items()
                if h.state in (StageState.RELEASED, StageState.FAILED)]
        for k in done[:max(0, len(done) - keep)]:
            del self.handles[k]

    def _holder_urls(self, entry) -> list[str]:
        """The system URLs of the other workers the catalog entry lists holding it."""
        return [d.get("system_url") for w, d in sorted((entry.holders if entry else {}).items())
                if w != self.worker_id and d.get("system_url")]

    async def holder_urls(self, version: str) -> list[str]:
        """The other workers the catalog lists holding `version` applied, by system URL
        (none without a catalog, or while it cannot be read)."""
        self._open_catalog()
        if self.catalog is None:
            return []
        from rlfleet.weights.catalog import CatalogError

        try:
            return self._holder_urls(await self.catalog.find(version))
        except CatalogError as e:
            log.warning("catalog unavailable for the holders of %s: %s", version, e)
            return []

    def _peers(self, h: StagedVersion, entry) -> list[str]:
        if h.source.location:
            return [h.source.location]
        urls = self._holder_urls(entry)
        if not urls:
            raise ArtifactError(f"no peer holds {h.version} applied (catalog {self.catalog.url})")
        return urls

    async def _run(self, h: StagedVersion, applied: tuple[str | None, str | None]) -> None:
        lease = None
        renew: asyncio.Task | None = None
        try:
            entry, lease = await self._lease(h)
            if lease is not None:
                renew = asyncio.get_running_loop().create_task(self._renew(h.version, lease))
            result = await self._pull(h, entry, applied)
            if h.expected_digest is not None and result.digest != h.expected_digest:
                await self._forget(h, result)
                raise ArtifactError(f"the staged tensors have digest {result.digest}, the "
                                    f"version's is {h.expected_digest}; not applying it")
            if h.state is not StageState.STAGING:  # released meanwhile
                await self._forget(h, result)
                return
            h.digest = result.digest
            if h.prepared is None:
                await self._prepare(h, result)
            if h.state is not StageState.STAGING:  # released while the engine prepared it
                await self._forget(h, result)
                return
            self._staged[h.handle] = result
            h.move(StageState.READY)
            log.info("staged %s (%s from %s%s) in %.2f s", h.version, h.format,
                     h.source.kind, ", read straight into the engine" if not result.owned
                     else "", time.time() - h.started_at)
        except Exception as e:  # noqa: BLE001 - every failure ends the handle FAILED
            if h.state is StageState.STAGING:
                h.error = str(e) if isinstance(e, ArtifactError) else f"{type(e).__name__}: {e}"
                if isinstance(e, CannotStage):
                    h.cannot = str(e)
                h.move(StageState.FAILED)
                log.warning("staging %s failed: %s", h.version, h.error)
        finally:
            h.finished_at = time.time()
            # how the transfer ended, taken before the lease is let go: a READY handle may be
            # applied meanwhile (its directory is then the resident copy, not to be removed)
            ended = h.state
            if renew is not None:
                renew.cancel()
            if lease is not None:
                try:
                    await self.catalog.release_lease(h.version, lease.lease_id)
                except Exception as e:  # noqa: BLE001 - the lease expires anyway
                    log.warning("releasing the lease on %s: %r", h.version, e)
            if ended is not StageState.READY:
                if h.board is not None:  # downstreams pulling from it go elsewhere (410)
                    h.board.close()
                if h.dir is not None:
                    shutil.rmtree(h.dir, ignore_errors=True)
            h.done.set()

    async def _lease(self, h: StagedVersion) -> tuple[Any, Any]:
        """The version's catalog entry (None without one) and a lease on its bytes while they
        are pulled from their artifact (None: none taken)."""
        if self.catalog is None:
            return None, None
        from rlfleet.weights.catalog import CatalogError, VersionState

        entry = None
        try:
            entry = await self.catalog.find(h.version)
            if entry is not None and entry.state is VersionState.READY \
                    and h.source.kind in ("disk", "s3"):  # the bytes the lease keeps
                return entry, await self.catalog.acquire_lease(
                    h.version, self.worker_id or "worker", self.lease_ttl)
        except CatalogError as e:  # pulled without a lease: the digest still checks
            log.warning("no catalog lease on %s: %s", h.version, e)
        return entry, None

    async def _pull(self, h: StagedVersion, entry, applied: tuple[str | None, str | None]
                    ) -> Resident:
        """The version's bytes, checked: staged into this area's buffers, or (a full version
        or checkpoint on this host's disk, and an engine that prepares it while it serves)
        read once, straight into the engine's shadow of the model."""
        if h.source.fanout is not None:
            return await asyncio.to_thread(fanout_transfer, h, h.source, self.root,
                                           self.admin_token)
        if h.source.kind == "peer":
            return await self._from_peers(h, entry, applied)
        storage = open_source_storage(h.source, min(READ_TIMEOUT, h.source.timeout))
        try:
            plan = await self._direct_plan(h, storage)
            if plan is not None:
                return await self._into_engine(h, plan)
            return await asyncio.to_thread(transfer, h, h.source, storage, self.root,
                                           self.resident, applied, self.startup)
        finally:
            storage.close()

    async def _direct_plan(self, h: StagedVersion, storage: art.Storage) -> VersionPlan | None:
        """The plan of a version the engine can read in place (a full version or plain
        checkpoint from a disk source, an engine that prepares versions while it serves);
        None: it is staged into this area's buffers."""
        if h.source.kind != "disk" or self.engine is None or not h.prepare or not isinstance(
                storage, art.FileStorage):
            return None
        plan = await asyncio.to_thread(art.plan_version, storage.read, h.source.key,
                                       storage.list_version, version=h.version,
                                       base_version=h.base.version)
        if plan.format == "xor-delta":
            return None
        why = await self.engine.staging_refusal()
        if why is not None:
            if h.require_swap:
                raise CannotStage(why)
            return None
        return plan

    async def _into_engine(self, h: StagedVersion, plan: VersionPlan) -> Resident:
        """Have the engine read `plan`'s files once into its shadow, each tensor hashed and
        checked (finite; its Adler-32 where the artifact has one) as it is loaded; the
        source's directory is the resident copy from then on (not this area's: kept)."""
        where = Path(h.source.location) / h.source.key
        h.format, h.base_version = plan.format, plan.base_version
        h.tensors_total, h.bytes_total = len(plan.entries), plan.stored_bytes
        sums = {e.name: e.checksum for e in plan.entries if e.checksum is not None}
        # ArtifactError when a tensor is bad (non-finite, a wrong Adler-32)
        prepared = await self.engine.prepare_staged(where, None, sums)
        if prepared is None:
            raise CannotStage(f"the engine could not prepare {h.version} in its own format "
                              "while serving (see its log)")
        h.prepared, h.prepare_seconds = prepared.how, prepared.seconds
        h.bytes_done, h.tensors_done = h.bytes_total, h.tensors_total
        return Resident(h.version, prepared.digest, where,
                        {e.name: e.spec for e in plan.entries}, sums, owned=False)

    async def _prepare(self, h: StagedVersion, result: Resident) -> None:
        """The engine prepares the staged bytes in its own format while it serves (so that
        installing them is a swap); a handle that asked for a swap and got none fails as
        `cannot` (its caller installs from disk instead), any other is installed by an
        in-place reload."""
        if self.engine is None or not h.prepare:
            return
        try:
            prepared = await self.engine.prepare_staged(result.dir, result.digest)
        except Exception as e:  # noqa: BLE001 - applying it reloads in place
            log.warning("the engine did not prepare %s (%r); applying it reloads in place",
                        h.version, e)
            prepared = None
        if prepared is not None:
            h.prepared, h.prepare_seconds = prepared.how, prepared.seconds
        elif h.require_swap:
            result.drop()
            raise CannotStage(f"the engine did not prepare {h.version} in its own format while "
                              "serving (see its log); installing it would reload it in place")

    async def _from_peers(self, h: StagedVersion, entry, applied) -> Resident:
        errors = []
        for url in self._peers(h, entry):
            src = Source("peer", url, h.version, timeout=h.source.timeout,
                         max_bytes_per_s=h.source.max_bytes_per_s)
            h.peer = url
            storage = open_source_storage(src, min(READ_TIMEOUT, src.timeout), self.admin_token)
            h.bytes_done = h.tensors_done = 0
            try:
                return await asyncio.to_thread(transfer, h, src, storage, self.root,
                                               self.resident, applied, self.startup)
            except ArtifactError as e:
                errors.append(f"{url}: {e}")
                if h.cancel.is_set():
                    break
            finally:
                storage.close()
        raise ArtifactError("no peer could serve it: " + "; ".join(errors))

    async def _renew(self, version: str, lease) -> None:
        while True:
            await asyncio.sleep(self.lease_ttl / 3)
            try:
                await self.catalog.renew_lease(version, lease.lease_id, self.lease_ttl)
            except Exception as e:  # noqa: BLE001 - keep pulling; the lease may lapse
                log.warning("renewing the lease on %s: %r", version, e)

    # ------------------------------------------------------------ queries

    def get(self, handle: Any) -> StagedVersion:
        if not isinstance(handle, str) or handle not in self.handles:
            raise StageRequestError(f"unknown staging handle {handle!r}; list them with "
                                    "get_staged_weights")
        return self.handles[handle]

    def summaries(self) -> list[dict[str, Any]]:
        return [h.summary() for h in self.handles.values()]

    def ready(self, handle: Any) -> tuple[StagedVersion, Resident]:
        """The READY handle and its buffers, for the engine to load (StageRequestError when
        the handle is not READY)."""
        h = self.get(handle)
        if h.state is not StageState.READY:
            why = f": {h.error}" if h.error else ""
            raise StageRequestError(f"staging handle {h.handle} ({h.version}) is "
                                    f"{h.state.value}{why}; only a READY handle can be applied")
        return h, self._staged[h.handle]

    def resident_dir(self, version: str) -> Path | None:
        r = self.resident
        if r is not None and r.version == version:
            return r.dir
        return next((d for find in self.also_serves if (d := find(version)) is not None), None)

    def held(self, version: str) -> Held | None:
        """What this worker can serve of `version` to fan-out downstreams: the newest handle
        staging it (or READY), else the resident copy (rlfleet.weights.fanout routes)."""
        for h in reversed(self.handles.values()):
            if h.version == version and h.board is not None and not h.board.closed \
                    and h.state in (StageState.STAGING, StageState.READY):
                return Held(h.board, lambda h=h: h.state.value, lambda h=h: h.digest)
        r, board = self.resident, self._resident_board
        if r is not None and r.version == version and board is not None and not board.closed:
            return Held(board, lambda: StageState.READY.value, lambda: r.digest)
        return None

    # ------------------------------------------------------------ apply / release

    async def applied(self, handle: str, engine_digest: str | None = None) -> None:
        """The engine now serves `handle`'s version (and reports `engine_digest` for it): its
        buffers become the resident copy (peers may read it, the next delta starts from it);
        the previous one is dropped."""
        h, staged = self.ready(handle)
        staged.engine_digest = engine_digest
        old, self.resident = self.resident, staged
        if self._resident_board is not None:
            self._resident_board.close()
        self._resident_board, h.board = h.board, None
        del self._staged[handle]
        h.applied = True
        h.move(StageState.RELEASED)
        if old is not None:
            old.drop()
            await self._holder(old.version, add=False)
        await self._holder(staged.version, add=True)

    async def weights_replaced(self) -> None:
        """The engine's weights came from elsewhere (disk, a trainer broadcast): the resident
        copy no longer describes them."""
        old, self.resident = self.resident, None
        if self._resident_board is not None:
            self._resident_board.close()
            self._resident_board = None
        if old is not None:
            old.drop()
            await self._holder(old.version, add=False)

    async def _holder(self, version: str, add: bool) -> None:
        if self.catalog is None or not self.worker_id:
            return
        try:
            if add:
                await self.catalog.add_holder(version, self.worker_id, system_url=self.system_url)
            else:
                await self.catalog.remove_holder(version, self.worker_id)
        except Exception as e:  # noqa: BLE001 - a version not in the catalog has no holders
            log.info("catalog holder update for %s: %s", version, e)

    async def release(self, handle: Any) -> StagedVersion:
        """Drop a handle's buffers (idempotent); a transfer under way stops."""
        h = self.get(handle)
        if h.state in (StageState.STAGING, StageState.READY, StageState.FAILED):
            h.cancel.set()
            h.move(StageState.RELEASED)
            if h.board is not None:
                h.board.close()
            staged = self._staged.pop(handle, None)
            if staged is not None:
                await self._forget(h, staged)
        return h

    async def _forget(self, h: StagedVersion, staged: Resident) -> None:
        """Drop a handle's buffers that will not be applied, and what the engine prepared
        of them."""
        staged.drop()
        if h.prepared and self.engine is not None:
            await self.engine.discard_staged(staged.dir)

    async def close(self) -> None:
        for h in list(self.handles.values()):
            h.cancel.set()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.resident is not None:
            await self._holder(self.resident.version, add=False)
        shutil.rmtree(self.root, ignore_errors=True)
        if self.catalog is not None and not isinstance(self.catalog, (str, Path)) and \
                self._own_catalog:
            await self.catalog.close()


def _remove_orphans(base: Path) -> None:
    """Staging directories of worker processes that died without cleaning up (they hold
    shared memory until removed)."""
    for d in base.glob("rlfleet-staging-*"):
        try:
            pid = int(d.name.rsplit("-", 1)[1])
            os.kill(pid, 0)
        except ValueError:
            continue
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except PermissionError:  # another user's live process
            continue


__all__ = ["CannotStage", "DeltaBase", "default_staging_root",
           "StageState", "StagedVersion", "StagingArea", "StageRequestError",
           "Source", "StartupCheckpoint", "parse_source", "parse_base", "transfer", "Resident"]
