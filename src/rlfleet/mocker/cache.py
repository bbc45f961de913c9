"""The mocker's simulated prefix cache (declared simulator): full blocks of token IDs,
chained as vLLM chains them, kept least-recently-used up to a number of blocks, and
published as vLLM publishes its KV events (rlfleet.protocol.kv_events, on a ZMQ PUB
socket) when the worker is started with `--kv-events-config`.

What it simulates: a request's leading prompt blocks already cached are hits (counted in
`rlfleet_mocker_prefix_cache_{queries,hits}_total`, in tokens, as vLLM counts its
`vllm:prefix_cache_*`; the block of the prompt's last token never is: vLLM computes it),
the others are "computed" (`--prefill-delay` seconds per token before the first one, or in
the engine's iterations: rlfleet.mocker.steps) and stored, and a finished choice's full
blocks of prompt and completion are stored too (unless `--uncached-completions`). A reset
clears it all (AllBlocksCleared). Nothing here says how a real engine's cache behaves."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq
from prometheus_client import Counter

from rlfleet.protocol import kv_events as kv
from rlfleet.runtime.metrics import WORKER

log = logging.getLogger("rlfleet.mocker.cache")

QUERIES = Counter("rlfleet_mocker_prefix_cache_queries_total",
                  "Prompt tokens the simulated prefix cache was asked for", ["model"],
                  registry=WORKER)
HITS = Counter("rlfleet_mocker_prefix_cache_hits_total",
               "Prompt tokens the simulated prefix cache held", ["model"], registry=WORKER)


def parse_events_config(raw: str | None) -> str | None:
    """The endpoint to bind from vLLM's `--kv-events-config` JSON (None: no events);
    ValueError says what is wrong."""
    if raw is None:
        return None
    try:
        cfg = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"--kv-events-config is not JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ValueError("--kv-events-config must be a JSON object, as vLLM takes it")
    if not cfg.get("enable_kv_cache_events", False):
        return None
    if cfg.get("publisher", "zmq") != "zmq":
        raise ValueError("--kv-events-config: the mocker publishes with zmq only")
    endpoint = cfg.get("endpoint", "tcp://*:5557")
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
        raise ValueError(f"--kv-events-config endpoint must be tcp://HOST:PORT, got {endpoint!r}")
    return endpoint


def engine_hash(parent: int | None, tokens: Sequence[int], extra: object) -> int:
    """The simulated engine's block hash (an int, as vLLM's builtin-hash family)."""
    d = hashlib.blake2b(repr((parent, tuple(tokens), extra)).encode(), digest_size=8)
    return int.from_bytes(d.digest(), "big") >> 1


@dataclass(frozen=True)
class BlockSalt:
    """What keys a request's blocks besides their tokens, as vLLM keys them: the request's
    cache salt (its first block) and the LoRA adapter it runs on (every block). vLLM's
    events name the adapter (`lora_name`, and in each block's `extra_keys` before the salt);
    `lora_load` (which load of the adapter it is) goes into the hash only: a reloaded
    adapter's KV is its own."""

    cache_salt: str | None = None
    lora: str | None = None
    lora_load: Any = None

    def key(self, i: int) -> tuple | None:
        """What goes into block i's hash."""
        parts = ((("lora", self.lora, self.lora_load),) if self.lora else ()) + \
            ((self.cache_salt,) if self.cache_salt and i == 0 else ())
        return parts or None

    def published(self, i: int) -> list | None:
        """Block i's `extra_keys` entry in a BlockStored event (vLLM's untagged form)."""
        parts = ([self.lora] if self.lora else []) + \
            ([self.cache_salt] if self.cache_salt and i == 0 else [])
        return parts or None


Salt = BlockSalt | str | None  # a bare string: a cache salt


def _salt(salt: Salt) -> BlockSalt:
    return salt if isinstance(salt, BlockSalt) else BlockSalt(salt)


class PrefixCache:
    def __init__(self, model: str, block_size: int = 16, blocks: int = 8192,
                 endpoint: str | None = None) -> None:
        if block_size < 1 or blocks < 1:
            raise ValueError("block-size and kv-blocks must be at least 1")
        self.block_size, self.capacity = block_size, blocks
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.queries, self.hits = QUERIES.labels(model), HITS.labels(model)
        self.pinned: dict[int, int] = {}  # block hash -> running requests holding it
        self._occupied = 0
        self._pub: zmq.Socket | None = None
        self.endpoint: str | None = None  # where a frontend connects (bound, port known)
        self._seq = 0
        if endpoint is not None:
            self._pub = zmq.Context.instance().socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind(endpoint.replace("tcp://*:", "tcp://0.0.0.0:"))
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)

    def _hashes(self, tokens: Sequence[int], salt: Salt) -> list[int]:
        out: list[int] = []
        parent = None
        key = _salt(salt).key
        for i in range(len(tokens) // self.block_size):
            parent = engine_hash(parent, tokens[i * self.block_size:(i + 1) * self.block_size],
                                 key(i))
            out.append(parent)
        return out

    def match(self, prompt: Sequence[int], salt: Salt = None,
              hashes: list[int] | None = None) -> int:
        """Count a request's prompt: how many of its tokens are cached (as vLLM counts them:
        leading full blocks, at most all but the last token's block: the last token is
        always computed)."""
        hashes = self._hashes(prompt, salt) if hashes is None else hashes
        limit = (len(prompt) - 1) // self.block_size
        hit = 0
        for h in hashes[:limit]:
            if h not in self.blocks:
                break
            hit += 1
        self.queries.inc(len(prompt))
        self.hits.inc(hit * self.block_size)
        return hit * self.block_size

    def lookup(self, prompt: Sequence[int], salt: Salt = None) -> int:
        """`match`, then cache the prompt's full blocks (it is computed at once)."""
        hashes = self._hashes(prompt, salt)
        hit = self.match(prompt, salt, hashes)
        self.store(prompt, salt, hashes)
        return hit

    def store(self, tokens: Sequence[int], salt: Salt = None,
              hashes: list[int] | None = None) -> None:
        """Cache the full blocks of `tokens` (most recently used); publish what is new and
        what that evicted."""
        hashes = self._hashes(tokens, salt) if hashes is None else hashes
        new = [i for i, h in enumerate(hashes) if h not in self.blocks]
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        events: list[kv.KvEvent] = []
        if new:
            first = new[0]  # the new blocks follow the cached ones: one chain from `first`
            bs, salted = self.block_size, _salt(salt)
            events.append(kv.BlockStored(
                block_hashes=hashes[first:], parent_block_hash=hashes[first - 1] if first else None,
                token_ids=list(tokens[first * bs:len(hashes) * bs]), block_size=bs,
                medium="GPU", lora_name=salted.lora,
                extra_keys=[salted.published(i) for i in range(first, len(hashes))]))
        self._evict(events)

    def _evict(self, events: list[kv.KvEvent]) -> None:
        """Drop least-recently-used blocks over the capacity (never a pinned one: a running
        request holds it; all pinned: the cache stays over, as an engine would preempt)."""
        evicted, spared = [], 0
        while len(self.blocks) > self.capacity and spared < len(self.blocks):
            h = self.blocks.popitem(last=False)[0]
            if h in self.pinned:
                self.blocks[h] = None  # held: back to the recent end
                spared += 1
                continue
            evicted.append(h)
        if evicted:
            events.append(kv.BlockRemoved(block_hashes=evicted, medium="GPU"))
        self._publish(events)

    def hashes(self, tokens: Sequence[int], salt: Salt = None) -> list[int]:
        """The engine hash of each full block of `tokens`."""
        return self._hashes(tokens, salt)

    def pin(self, hashes: Sequence[int]) -> None:
        """A running request holds these blocks: they are not evicted until `unpin`."""
        for h in hashes:
            self.pinned[h] = self.pinned.get(h, 0) + 1

    def unpin(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            n = self.pinned.get(h, 0) - 1
            if n > 0:
                self.pinned[h] = n
            else:
                self.pinned.pop(h, None)

    def occupy(self) -> int:
        """One block of generated tokens no prompt will match (as Dynamo's mocker keeps a
        running request's decode blocks): it takes a place in the cache, pinned; returns
        its hash (to `unpin` when the request ends, then it ages out like any block)."""
        self._occupied += 1
        h = engine_hash(None, (), ("decode", id(self), self._occupied))
        self.pin((h,))
        self.blocks[h] = None
        self._evict([])
        return h

    def clear(self) -> None:
        self.blocks.clear()
        self._publish([kv.AllBlocksCleared()])

    def _publish(self, events: list[kv.KvEvent]) -> None:
        if self._pub is None or not events:
            return
        try:
            self._pub.send_multipart(kv.message(self._seq, kv.EventBatch(ts=time.time(),
                                                                         events=events)),
                                     flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("KV event batch %d dropped (no room)", self._seq)
        self._seq += 1

    def close(self) -> None:
        if self._pub is not None:
            self._pub.close(linger=0)
            self._pub = None
