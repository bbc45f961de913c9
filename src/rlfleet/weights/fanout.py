"""Pipelined fan-out of a staged version between workers: every worker that stages a version
keeps a `ChunkBoard` of it (which chunks of which tensors it has so far) and serves those
chunks on its system server while it still receives the rest (`add_fanout_routes`; the wire
is rlfleet.protocol.fanout). A downstream stages with ``{"kind": "peer", "url": UPSTREAM,
"fanout": {...}}`` (rlfleet.protocol.admin_vllm.PeerFanout) and pulls chunk by chunk
(rlfleet.weights.staging), so that a chain (or a tree) of workers moves the version at link
speed with the origin sending each byte about once. `fanout_sources` lays the chain or tree
out over the workers a coordinator found in discovery."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
from fastapi import APIRouter, Request  # resolved at import: FastAPI reads the handler's annotations
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rlfleet.protocol import fanout as wire
from rlfleet.protocol.admin_vllm import FanoutOrigin, FanoutProgress, PeerFanout
from rlfleet.runtime.http import shared_routes
from rlfleet.weights import artifacts as art
from rlfleet.weights.artifacts import TensorSpec
from rlfleet.weights.publish import unauthorized

CHUNK_BYTES = int(os.environ.get("RLFLEET_FANOUT_CHUNK_BYTES", 256 << 10))
POLL = 0.005  # seconds between looks at the board while a stream waits for a chunk


@dataclass(frozen=True)
class Chunk:
    index: int
    name: str  # the tensor
    start: int  # byte range within the tensor
    end: int


def chunk_table(specs: Sequence[TensorSpec], chunk_bytes: int) -> list[Chunk]:
    """The version's chunks: each tensor, in the order given, cut into `chunk_bytes` pieces
    (an empty tensor is one empty chunk). Holder and downstream compute the same table."""
    out: list[Chunk] = []
    for s in specs:
        n = s.nbytes
        for start in range(0, max(n, 1), chunk_bytes):
            out.append(Chunk(len(out), s.name, start, min(n, start + chunk_bytes)))
    return out


class ChunkBoard:
    """What a worker holds of one version, chunk by chunk, over its staged buffers: the
    transfer thread marks what it wrote (`advance`), the event loop serves what is marked.
    `stats` is the handle's FanoutProgress (chunks ready and served are counted here)."""

    def __init__(self, specs: Sequence[TensorSpec], slots: dict[str, np.ndarray],
                 checksums: dict[str, str | None] | None = None,
                 chunk_bytes: int = CHUNK_BYTES, stats: FanoutProgress | None = None) -> None:
        self.specs = list(specs)
        self.slots = dict(slots)  # keeps the buffers mapped while the board serves them
        self.checksums = dict(checksums or {})
        self.chunk_bytes = chunk_bytes
        self.chunks = chunk_table(self.specs, chunk_bytes)
        self._by_tensor: dict[str, list[Chunk]] = {}
        for c in self.chunks:
            self._by_tensor.setdefault(c.name, []).append(c)
        self._ready = bytearray(len(self.chunks))
        self._lock = threading.Lock()
        self.count = 0
        self.stats = stats if stats is not None else FanoutProgress()
        self.stats.chunks_total = len(self.chunks)
        self.closed = False

    def advance(self, name: str, upto: int) -> None:
        """Tensor `name`'s bytes [0, upto) are written: the chunks inside are ready."""
        with self._lock:
            for c in self._by_tensor.get(name, ()):
                if c.end <= upto and not self._ready[c.index]:
                    self._ready[c.index] = 1
                    self.count += 1
            self.stats.chunks_ready = self.count

    def complete(self) -> None:
        for s in self.specs:
            self.advance(s.name, s.nbytes)

    def withdraw(self, name: str) -> None:
        """Tensor `name` is written again (it failed its check): none of it is served."""
        with self._lock:
            for c in self._by_tensor.get(name, ()):
                if self._ready[c.index]:
                    self._ready[c.index] = 0
                    self.count -= 1
            self.stats.chunks_ready = self.count

    def is_ready(self, index: int) -> bool:
        return not self.closed and bool(self._ready[index])

    def read(self, index: int) -> bytes:
        c = self.chunks[index]
        data = bytes(self.slots[c.name][c.start:c.end])
        self.stats.chunks_served += 1
        return data

    def manifest(self, version: str, state: str, digest: str | None) -> wire.FanoutManifest:
        return wire.FanoutManifest(
            version=version, state=state, chunk_bytes=self.chunk_bytes,
            tensors=[wire.FanoutTensor(s.name, s.dtype, list(s.shape),
                                       self.checksums.get(s.name)) for s in self.specs],
            chunks_total=len(self.chunks), chunks_ready=self.count, digest=digest)

    def close(self) -> None:
        """The buffers go (released): nothing more is served from them."""
        self.closed = True
        self.slots = {}


def specs_of(manifest: wire.FanoutManifest) -> list[TensorSpec]:
    return [TensorSpec(t.name, t.dtype, tuple(t.shape)) for t in manifest.tensors]


@dataclass
class Held:
    """What a worker's staging area answers for a version it holds (or stages)."""

    board: ChunkBoard
    state: Callable[[], str]  # STAGING | READY | FAILED | RELEASED, now
    digest: Callable[[], str | None]


def _error(status: int, error: str, message: str) -> JSONResponse:
    return JSONResponse({"error": error, "message": message}, status_code=status)


def add_fanout_routes(app: Any, lookup: Callable[[str], Held | None],
                      admin_token: str | None = None) -> None:
    """The chunk plane (rlfleet.protocol.fanout) on `app`; `lookup(version)` gives what the
    worker holds of it, or None."""
    app.state.fanout = (lookup, admin_token)
    app.router.routes.extend(shared_routes(_fanout_routes))


def _held(request: Request, version: str) -> Held | Response:
    """What this worker holds of `version` (its app's `lookup`), or the refusal: 401 without
    the admin token, 404 when it holds nothing of it."""
    lookup, admin_token = request.app.state.fanout
    if (refused := unauthorized(request, admin_token)) is not None:
        return refused
    held = lookup(version)
    if held is None:
        return _error(404, "Not found", f"version {version} is not staged here (yet)")
    return held


def _fanout_routes(r: APIRouter) -> None:
    """The chunk plane's routes, shared by the process's workers (shared_routes): each
    app's own `lookup` and admin token in `app.state.fanout`."""
    @r.get(wire.MANIFEST_PATH)
    async def manifest(version: str, request: Request):
        held = _held(request, version)
        if isinstance(held, Response):
            return held
        body = held.board.manifest(version, held.state(), held.digest())
        return Response(msgspec.json.encode(body), media_type="application/json")

    @r.get(wire.STREAM_PATH)
    async def stream(version: str, request: Request, start: int = 0):
        held = _held(request, version)
        if isinstance(held, Response):
            return held
        if not 0 <= start < len(held.board.chunks):
            return _error(404, "Not found", f"{version} has chunks 0..{len(held.board.chunks) - 1}, "
                          f"not {start}")
        if held.state() in ("FAILED", "RELEASED"):
            return _error(410, "Gone", f"this worker's staging of {version} is {held.state()}")
        return StreamingResponse(_frames(held, start), media_type="application/octet-stream")


async def _frames(held: Held, start: int) -> AsyncIterator[bytes]:
    """Chunks `start`.. as they arrive on the board, each behind its frame; it stops short
    when the holder's staging ends without them (the reader goes elsewhere)."""
    board = held.board
    for k in range(start, len(board.chunks)):
        while not board.is_ready(k):
            if board.closed or held.state() in ("FAILED", "RELEASED"):
                return
            await asyncio.sleep(POLL)
        staging = held.state() == "STAGING"
        data = board.read(k)
        yield wire.FRAME.pack(k, len(data), int(art.adler32_hex(data), 16), staging)
        yield data


def fanout_sources(system_urls: Sequence[str], version: str, origin: FanoutOrigin, *,
                   degree: int = 1, stall: float = 10.0, timeout: float | None = None
                   ) -> list[dict[str, Any]]:
    """The stage request `source` for each worker (in the order given, e.g. as discovery
    lists them) of a fan-out from `origin`: the first stages from the origin itself, worker i
    > 0 from worker (i - 1) // degree (degree 1: a chain; 2: a binary tree ...), failing over
    to that worker's own upstreams in turn, then to the origin.

    `origin.uri`: ``s3://bucket/prefix/VERSION``, ``file:///dir/VERSION``, or a trainer
    publisher's ``http(s)://host:port/VERSION`` (rlfleet.weights.publish.TrainerServer: the
    first worker stages from the trainer, the others from their peers, and the trainer
    sends the version about once)."""
    if degree < 1:
        raise ValueError("degree must be at least 1")
    common: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    head = _origin_source(origin, version)
    out = [{**head, **common}]
    for i in range(1, len(system_urls)):
        up, above = (i - 1) // degree, []
        j = up
        while j > 0:
            j = (j - 1) // degree
            above.append(system_urls[j])
        spec = PeerFanout(holders=above, origin=origin, stall=stall)
        out.append({"kind": "peer", "url": system_urls[up], **common,
                    "fanout": msgspec.to_builtins(spec)})
    return out


def _origin_source(origin: FanoutOrigin, version: str) -> dict[str, Any]:
    """The stage source that reads the origin artifact whole (the fan-out's first worker)."""
    uri = origin.uri
    if uri.startswith("s3://"):
        return {"kind": "s3", "uri": uri,
                **({"endpoint_url": origin.endpoint_url} if origin.endpoint_url else {})}
    if uri.startswith(("http://", "https://")):
        publisher, named = art.split_version_uri(uri)
        if named != version:
            raise ValueError(f"the fan-out origin {uri} names version {named}, not {version}")
        return {"kind": "trainer", "url": publisher}
    return {"kind": "disk", "path": uri.removeprefix("file://")}


__all__ = ["CHUNK_BYTES", "Chunk", "ChunkBoard", "Held", "add_fanout_routes", "chunk_table",
           "fanout_sources", "specs_of"]
