"""KV-cache events: what a worker's engine says about the prefix blocks it holds, in
vLLM's own wire format (vllm/distributed/kv_events.py, `--kv-events-config`), so that a
frontend reads vLLM's publisher and the mocker's alike.

Transport: a ZMQ PUB socket; each message is three frames, (topic, sequence number as 8
bytes big-endian, msgpack body). The body is an `EventBatch`, encoded as an array
`[ts, events, data_parallel_rank]`; each event a map tagged by its class name
(`{"type": "BlockStored", ...}`). Fields a reader does not know are ignored (vLLM adds
some from release to release).

A worker names its publisher in its discovery entry (`kv_events`, a `tcp://host:port`
endpoint to connect to) with the engine's block size (`kv_block_size`).
"""

from __future__ import annotations

from typing import Any

import msgspec

# vLLM's ExternalBlockHash: bytes (sha256 family) or int (the builtin hash family)
BlockHash = bytes | int


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
    """Blocks now cached: `block_hashes[i]` holds tokens `token_ids[i*block_size:
    (i+1)*block_size]`, chained after `parent_block_hash` (None: the first block of a
    prompt). `extra_keys[i]`: what else went into block i's hash (LoRA name, cache salt)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True):
    """Blocks evicted."""

    block_hashes: list[BlockHash]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True):
    """The whole prefix cache was reset (a weight refresh flushes it)."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None


#: the offloading tiers' media: blocks there are not in the engine's own prefix cache
OFFLOADED_MEDIA = frozenset({"CPU", "STORAGE"})

_decoder = msgspec.msgpack.Decoder(EventBatch)
_encoder = msgspec.msgpack.Encoder()


def decode_batch(body: bytes) -> EventBatch:
    """One message body; msgspec.DecodeError / ValidationError if it is not a batch."""
    return _decoder.decode(body)


def encode_batch(batch: EventBatch) -> bytes:
    return _encoder.encode(batch)


def message(seq: int, batch: EventBatch, topic: bytes = b"") -> tuple[bytes, bytes, bytes]:
    """The three frames of one published batch."""
    return topic, seq.to_bytes(8, "big"), encode_batch(batch)
