"""What a worker stages and how it lands: the stage request's sources, a staged version's
handle and files, the resident copy, and the transfer from a store (disk, S3, a trainer or
a peer's whole files), every tensor checked as it lands. Chunk-by-chunk pulling from a
fan-out upstream is rlfleet.weights.fanout_pull; the staging area that runs both and hands
a READY version to the engine is rlfleet.weights.staging.

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
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from rlfleet.protocol.admin_base import AdminRequestError
from rlfleet.protocol.admin_vllm import FanoutProgress, PeerFanout
from rlfleet.runtime.paths import weights_path
from rlfleet.runtime.progress import Progress
from rlfleet.weights import artifacts as art
from rlfleet.weights.artifacts import ArtifactError, Entry, TensorSpec, VersionPlan
from rlfleet.weights.digest import DigestBuilder, checkpoint_digest, checkpoint_files, non_finite
from rlfleet.weights.fanout import ChunkBoard

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


class Fetcher:
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


def _plan_chain(fetch: Fetcher, base: DeltaBase, first: VersionPlan, mode: str,
                timeout_at: float, cancel: threading.Event
                ) -> list[tuple[Fetcher, VersionPlan]]:
    """The plans to fill in order (from the first full one) when the base is not resident."""
    if mode == "path":
        assert base.path is not None
        local = art.FileStorage(base.path.parent)
        base_fetch = Fetcher(local, f"base {base.path}", timeout_at, cancel, None)
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
    fetch = Fetcher(storage, what, deadline, h.cancel, src.max_bytes_per_s)
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

    return staged_resident(h.version, staged, moved, fill, h.board.complete)


def staged_resident(version: str, staged: StagedFiles, moved: Progress,
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


def _fill_plans(plans: list[tuple[Fetcher, VersionPlan]], staged: StagedFiles,
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


def _fill_full(fetch: Fetcher, plan: VersionPlan, staged: StagedFiles,
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


def _apply_delta(fetch: Fetcher, plan: VersionPlan, staged: StagedFiles,
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
