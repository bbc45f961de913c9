"""Staging from a fan-out upstream (a `peer` source with `fanout`): a version pulled chunk
by chunk from a worker that may itself still be staging it, each chunk checked as it lands
and served on to this worker's own downstreams (its ChunkBoard), failing over to the other
holders, then to the version's origin in the store (rlfleet.weights.fanout plans the
tree)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np

from rlfleet.protocol import fanout as fanout_wire
from rlfleet.protocol.admin_vllm import FanoutOrigin, FanoutProgress
from rlfleet.protocol.fanout import FanoutManifest, FanoutTensor
from rlfleet.runtime.progress import Progress
from rlfleet.weights import artifacts as art
from rlfleet.weights.artifacts import ArtifactError, TensorSpec, VersionPlan
from rlfleet.weights.fanout import CHUNK_BYTES, Chunk, ChunkBoard, specs_of
from rlfleet.weights.stage_transfer import (
    READ_TIMEOUT,
    Fetcher,
    Resident,
    Source,
    StagedFiles,
    StagedVersion,
    staged_resident,
)

log = logging.getLogger("rlfleet.weights.staging")

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
        self.fetch: Fetcher | None = None

    def _open(self) -> VersionPlan:
        if self.origin is None:
            raise ArtifactError(f"fan-out of {self.h.version}: no holder could serve it and "
                                "the source names no origin")
        if self.plan is None:
            parent, key = art.split_version_uri(self.origin.uri)
            self.storage = art.open_storage(parent, self.origin.endpoint_url, READ_TIMEOUT)
            self.fetch = Fetcher(self.storage, f"fan-out origin {self.origin.uri}",
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
        return staged_resident(h.version, staged, moved, lambda: _pull_chunks(
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
