"""Dynamo's LoRA facts as a worker applies them to its /v1/loras routes
(rlfleet.protocol.dynamo_lora): the id Dynamo gives an adapter name, the ``file://`` URIs
a worker loads from, and the environment switch that lets a load replace an adapter
already loaded."""

from __future__ import annotations

import blake3

#: the environment variable that lets a load replace an adapter already loaded (Dynamo's)
HOTSWAP_ENV = "DYN_LORA_HOTSWAP_ENABLED"
FILE_SCHEME = "file://"


def lora_name_to_id(name: str) -> int:
    """Dynamo's id of an adapter name: the first 8 bytes of its blake3 hash, big-endian,
    masked to 31 bits; never 0."""
    h = int.from_bytes(blake3.blake3(name.encode()).digest()[:8], "big") & 0x7FFFFFFF
    return h or 1


def local_path(uri: str) -> str:
    """The directory a ``file://`` URI names; ValueError for the schemes not served here."""
    if not uri.startswith(FILE_SCHEME) or len(uri) == len(FILE_SCHEME):
        raise ValueError(f"source.uri {uri!r}: this worker loads adapters from file:// URIs "
                         "only (file:///path/to/adapter)")
    return uri[len(FILE_SCHEME):]


def hotswap_enabled(env: dict[str, str]) -> bool:
    return env.get(HOTSWAP_ENV, "").strip().lower() in ("1", "true", "yes", "on")
