"""The chunk plane of a pipelined weight fan-out, on a worker's system server: a worker that
holds a version, or part of one it is still staging, serves it to other workers chunk by
chunk (rlfleet.weights.fanout). The stage request that makes a worker a downstream is the
peer source's `fanout` (rlfleet.protocol.admin.PeerFanout).

``GET /fanout/<version>``: the manifest (`FanoutManifest`): the tensors in chunk order, the
chunk size, what the holder has so far and, once it is READY, the version's content digest.
``GET /fanout/<version>/chunks/<k>?wait=S``: chunk k's bytes, with their Adler-32 and the
holder's state in headers; a chunk the holder does not have yet is waited for up to `wait`
seconds (at most `MAX_WAIT`), then 503. 404: the holder has no such version (yet); 410: its
staging of it failed or was released. Both need the admin token when the worker has one."""

from __future__ import annotations

import msgspec

PREFIX = "/fanout"
MANIFEST_PATH = PREFIX + "/{version}"
CHUNK_PATH = PREFIX + "/{version}/chunks/{index}"
#: the chunk's Adler-32 (8 hex digits) as the holder computed it over the bytes it sends
CHUNK_CHECKSUM = "X-Rlfleet-Chunk-Adler32"
#: the holder's staging state when it served the chunk (STAGING: it was still receiving)
HOLDER_STATE = "X-Rlfleet-Holder-State"
#: how many of the version's chunks the holder had when it served this one
HOLDER_CHUNKS = "X-Rlfleet-Holder-Chunks"
MAX_WAIT = 10.0  # seconds a chunk request may wait for the holder to receive the chunk


def manifest_path(version: str) -> str:
    return MANIFEST_PATH.format(version=version)


def chunk_path(version: str, index: int) -> str:
    return CHUNK_PATH.format(version=version, index=index)


class FanoutTensor(msgspec.Struct, array_like=True, frozen=True):
    """One tensor of the version, in chunk order."""

    name: str
    dtype: str  # safetensors code, e.g. "BF16"
    shape: list[int]
    checksum: str | None = None  # the artifact's Adler-32 of its bytes, when known


class FanoutManifest(msgspec.Struct, kw_only=True, frozen=True):
    version: str
    state: str  # the holder's staging state: STAGING | READY (a resident copy is READY)
    chunk_bytes: int  # each tensor is cut into chunks of this size (the last one shorter)
    tensors: list[FanoutTensor]
    chunks_total: int
    chunks_ready: int  # how many the holder has now
    digest: str | None = None  # the version's content digest, once the holder has it all
