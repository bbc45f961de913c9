"""The chunk plane of a pipelined weight fan-out, on a worker's system server: a worker that
holds a version, or part of one it is still staging, serves it to other workers chunk by
chunk (rlfleet.weights.fanout). The stage request that makes a worker a downstream is the
peer source's `fanout` (rlfleet.protocol.admin_vllm.PeerFanout).

``GET /fanout/<version>``: the manifest (`FanoutManifest`): the tensors in chunk order, the
chunk size, what the holder has so far and, once it is READY, the version's content digest.
``GET /fanout/<version>/stream?start=K``: chunks K, K + 1, ... to the last, in one streamed
response, each as it arrives at the holder: a `FRAME` (chunk index, length, Adler-32 of the
bytes, whether the holder was still STAGING when it sent it) then the chunk's bytes. The
stream stops short when the holder's staging fails or is released; a reader resumes with
`start` at the chunk it lacks, from this holder or another. 404: the holder has no such
version (yet); 410: its staging of it failed or was released. Both routes need the admin
token when the worker has one."""

from __future__ import annotations

import struct

import msgspec

PREFIX = "/fanout"
MANIFEST_PATH = PREFIX + "/{version}"
STREAM_PATH = PREFIX + "/{version}/stream"
#: a chunk's frame in the stream: index, length, Adler-32, 1 when the holder was STAGING
FRAME = struct.Struct("<QIIB")


def manifest_path(version: str) -> str:
    return MANIFEST_PATH.format(version=version)


def stream_path(version: str) -> str:
    return STREAM_PATH.format(version=version)


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
