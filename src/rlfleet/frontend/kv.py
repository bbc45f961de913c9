"""KV-aware routing (`--router-mode kv`): send a request where it costs least: where its
prompt's prefix is cached, weighed against the load there; keep a session (an agent
episode) on its worker and a GRPO group's samples together, unless load demands.

What the frontend knows of each worker's prefix cache (its `PrefixView`):
- from the engine's own KV events (vLLM's `--kv-events-config` ZMQ publisher, or the
  mocker's), where the worker's discovery entry names a publisher (`kv_events`): blocks
  stored, removed, all cleared;
- from its own record of what it routed where: the prompt blocks of every request it sent
  there (at once, so that the G samples of a group sent together follow the first), and
  the prompt + completion blocks of every finished choice (what a multi-turn
  continuation starts with). For a worker with events this record only bridges the time
  until the engine's events arrive (RECORD_TTL seconds); for a worker without events it
  is all there is (the most recent MAX_RECORD_BLOCKS blocks: the frontend sees no
  evictions).

Block keys: the frontend does not compute vLLM's block hashes (their seed is per process
unless PYTHONHASHSEED is shared). It chains its own key over each full block of token
IDs (`block_keys`), from the request's token IDs and from the token IDs that every
`BlockStored` event carries, and maps the engine's hashes to its keys for removals. A
request's cache salt is part of its first block's key, and a LoRA adapter's name part of
every block's key, as in vLLM (whose events publish both in `extra_keys`).

A view is cleared when the engine says so (`AllBlocksCleared`, which vLLM publishes when
its prefix cache is reset: every policy refresh), when the worker's policy changes in
discovery (weights, version or step: the refresh flushed the cache), when an event
stream skips a sequence number, and when the worker leaves or comes back elsewhere; the
first two, and leaving, also release the worker's sessions.

The choice (`KvRouter.choose`), among the candidates the pool allows (usable, not excluded,
within the staleness bound): a worker is overloaded when (its load - the requests in flight
there with the very same prompt + 1) > threshold x (mean load + 1), where the load is its
requests in flight (for a request of a session: or its sessions, whichever is more);
among those that are not, the lowest `cost` wins (seconds once the rates are measured,
rlfleet.frontend.rates: the prefill queued there, the request's own uncached prompt, the
stall its prefill puts on the requests running there, the decode time it adds), then the
least load, then round-robin. A session (rlfleet.frontend.sessions) goes back to its
worker unless another costs less, its sessions counted as load (without token IDs: unless
it is overloaded). docs/routing.md has the formula.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import zmq
import zmq.asyncio

from rlfleet.frontend.rates import Rates
from rlfleet.frontend.sessions import DEFAULT_TTL, SessionTable
from rlfleet.protocol import kv_events as kv

log = logging.getLogger("rlfleet.router.kv")

DEFAULT_BLOCK_SIZE = 16  # vLLM's default; a worker's entry (kv_block_size) or events win
DEFAULT_OVERLOAD = 1.5
DEFAULT_OVERLAP_WEIGHT = 2.0  # bench/prefix_routing.py: 1.0 split GRPO groups across workers
RECORD_TTL = 30.0  # seconds a routed-record block counts on a worker that sends events
DECODE_SAMPLE = 8  # tokens between two samples of a request's decode rate
MAX_RECORD_BLOCKS = 200_000  # per worker without events


def block_keys(tokens: Sequence[int], block_size: int, first_extra: Any = None,
               parent: int | None = None, every: tuple = ()) -> list[int]:
    """The chained key of each full block of `tokens` (a partial last block has none):
    key_i = hash(key_{i-1}, tokens of block i, what else went into it: `every` (a LoRA
    adapter's name) then, for the first block of a prompt, `first_extra`'s items (its cache
    salt)), as vLLM keys blocks and publishes their extra keys."""
    keys = []
    first = tuple(first_extra) if first_extra else ()
    rest = every or None
    for i in range(len(tokens) // block_size):
        extra = (every + first or None) if i == 0 and parent is None else rest
        parent = hash((parent, tuple(tokens[i * block_size:(i + 1) * block_size]), extra))
        keys.append(parent)
    return keys


def _extra(keys: list[Any] | None) -> Any:
    """A BlockStored extra_keys entry as part of a key (the request side: (adapter, salt))."""
    return tuple(keys) if keys else None


@dataclass
class Prefix:
    """What the router scores a request by: its prompt token IDs, cache salt, and the LoRA
    adapter it runs on (its blocks are the adapter's own)."""

    tokens: list[int]
    salt: str | None = None
    adapter: str | None = None
    _whole: int | None = field(default=None, repr=False, compare=False)
    _keys: dict[tuple, list[int]] = field(default_factory=dict, repr=False, compare=False)

    def keys(self, block_size: int) -> list[int]:
        """The key of each full block (computed once per block size and adapter)."""
        got = self._keys.get((block_size, self.adapter))
        if got is None:
            got = self._keys[(block_size, self.adapter)] = block_keys(
                self.tokens, block_size, (self.salt,) if self.salt else None,
                every=(self.adapter,) if self.adapter else ())
        return got

    def continued(self, more: Sequence[int], block_size: int) -> list[int]:
        """The keys of this prompt followed by `more` tokens (a completion), from its own."""
        own = self.keys(block_size)
        start = len(own) * block_size
        tail = list(self.tokens[start:]) + list(more)
        every = (self.adapter,) if self.adapter else ()
        if not own:
            return block_keys(tail, block_size, (self.salt,) if self.salt else None,
                              every=every)
        return own + block_keys(tail, block_size, parent=own[-1], every=every)

    @property
    def whole(self) -> int:
        """A key of the whole prompt: the requests that share it are siblings (the samples
        of one GRPO group)."""
        if self._whole is None:
            self._whole = hash((tuple(self.tokens), self.salt, self.adapter))
        return self._whole


@dataclass
class PrefixView:
    """One worker's prefix cache as the frontend knows it (see the module doc)."""

    block_size: int = DEFAULT_BLOCK_SIZE
    has_events: bool = False
    cached: set[int] = field(default_factory=set)  # from the engine's events
    engine_keys: dict[kv.BlockHash, int] = field(default_factory=dict)  # its hash -> our key
    record: OrderedDict[int, float] = field(default_factory=OrderedDict)  # key -> when
    last_seq: int | None = None

    def clear(self) -> None:
        self.cached.clear()
        self.engine_keys.clear()
        self.record.clear()

    def overlap(self, keys: list[int]) -> int:
        """How many leading blocks of `keys` this worker holds."""
        if not keys:
            return 0
        oldest = time.monotonic() - RECORD_TTL if self.has_events else None
        n = 0
        for k in keys:
            if k in self.cached:
                n += 1
                continue
            at = self.record.get(k)
            if at is None or (oldest is not None and at < oldest):
                break
            n += 1
        return n

    def note(self, keys: list[int]) -> None:
        """The frontend's record: these blocks were sent (or generated) here."""
        now = time.monotonic()
        rec = self.record
        for k in keys:
            rec[k] = now
            rec.move_to_end(k)
        limit = MAX_RECORD_BLOCKS
        if self.has_events:  # only a bridge until the events arrive
            while rec and next(iter(rec.values())) < now - RECORD_TTL:
                rec.popitem(last=False)
        while len(rec) > limit:
            rec.popitem(last=False)

    def apply(self, ev: kv.KvEvent) -> None:
        """One engine event."""
        if type(ev) is kv.AllBlocksCleared:
            self.clear()
        elif type(ev) is kv.BlockStored:
            if ev.medium in kv.OFFLOADED_MEDIA or not ev.block_hashes:
                return
            size = ev.block_size if len(ev.token_ids) == ev.block_size * len(ev.block_hashes) \
                else len(ev.token_ids) // len(ev.block_hashes)
            if size <= 0:
                return
            self.block_size = size
            parent = None if ev.parent_block_hash is None \
                else self.engine_keys.get(ev.parent_block_hash)
            if ev.parent_block_hash is not None and parent is None:
                return  # its parent was never seen (evicted, or before we subscribed)
            extras = ev.extra_keys or []
            for i, h in enumerate(ev.block_hashes):
                block = ev.token_ids[i * size:(i + 1) * size]
                extra = _extra(extras[i]) if i < len(extras) else None
                parent = hash((parent, tuple(block), extra))
                self.engine_keys[h] = parent
                self.cached.add(parent)
        elif type(ev) is kv.BlockRemoved:
            if ev.medium in kv.OFFLOADED_MEDIA:
                return
            for h in ev.block_hashes:
                k = self.engine_keys.pop(h, None)
                if k is not None:
                    self.cached.discard(k)


class RouteAttempt:
    """One request sent to one worker, as the router books it: routed (its prompt is
    there, its uncached part is that worker's prefill backlog), first token (the backlog
    is done), end (its completions are there too). Its timing teaches the router's rates
    (rlfleet.frontend.rates): the time to its first token against the prompt tokens its
    worker computed meanwhile, the gaps between its tokens against the worker's load."""

    __slots__ = ("router", "iid", "prefix", "load", "made", "ahead", "since", "first",
                 "tokens")

    def __init__(self, router: KvRouter, iid: int, prefix: Prefix | None) -> None:
        self.router, self.iid, self.prefix = router, iid, prefix
        self.ahead = router.active.get(iid, 0)  # prompt tokens its worker computes first
        self.load = router.routed(iid, prefix)
        self.made: dict[int, list[int]] = {}  # each choice's tokens
        self.since = time.monotonic()
        self.first = True
        self.tokens = 0  # tokens since the last decode sample

    def head(self, prompt_token_ids: list[int], salt: str | None,
             adapter: str | None = None) -> None:
        """The worker's report of the prompt: a text or chat prompt is booked now."""
        if self.prefix is None:
            self.prefix = Prefix(prompt_token_ids, salt, adapter)
            self.load = self.router.routed(self.iid, self.prefix, counted=True)

    def step(self, deltas: Sequence[Any]) -> None:
        tokens = 0
        for d in deltas:
            self.made.setdefault(d.index, []).extend(d.token_ids)
            tokens = max(tokens, len(d.token_ids))
        if tokens:  # the decode rate is sampled every DECODE_SAMPLE tokens (cheaper)
            self.tokens += tokens
            if self.first or self.tokens >= DECODE_SAMPLE:
                self._sample(time.monotonic())
        if self.load:
            self.router.prefilled(self.iid, self.load)
            self.load = 0

    def _sample(self, now: float) -> None:
        rates = self.router.rates
        if self.first:
            rates.prefilled(self.ahead + self.load, now - self.since)
        else:
            rates.decoded(self.router.running.get(self.iid, 1), (now - self.since) / self.tokens)
        self.first, self.since, self.tokens = False, now, 0

    def end(self) -> None:
        made = list(self.made.values())
        if made:
            self.router.rates.generated(max(len(m) for m in made))
        self.router.finished(self.iid, self.prefix, self.load, made)
        self.load = 0


class Candidate(Protocol):
    instance_id: int
    inflight: int


class KvRouter:
    """The views of every worker, their event subscriptions, and the choice."""

    def __init__(self, overload: float = DEFAULT_OVERLOAD,
                 overlap_weight: float = DEFAULT_OVERLAP_WEIGHT,
                 session_ttl: float = DEFAULT_TTL) -> None:
        if not overload > 1.0:
            raise ValueError(f"--kv-overload-threshold must be greater than 1, got {overload}")
        if not overlap_weight >= 0:
            raise ValueError(f"--kv-overlap-weight must be at least 0, got {overlap_weight}")
        self.overload, self.overlap_weight = overload, overlap_weight
        # prompt tokens to compute (not cached when routed) of the requests sent there that
        # have no first token yet: its prefill backlog
        self.active: dict[int, int] = {}
        self.running: dict[int, int] = {}  # requests this router has in flight there
        # whole-prompt key -> worker -> requests in flight there with that very prompt
        self.siblings: dict[int, dict[int, int]] = {}
        self.sessions = SessionTable(session_ttl)
        self.rates = Rates()
        self.views: dict[int, PrefixView] = {}
        self._subs: dict[int, tuple[str, asyncio.Task]] = {}
        self._policies: dict[int, tuple] = {}
        self._rr = itertools.count()
        self._ctx: zmq.asyncio.Context | None = None

    # ------------------------------------------------------------------ the choice

    def view(self, iid: int) -> PrefixView:
        v = self.views.get(iid)
        if v is None:
            v = self.views[iid] = PrefixView()
        return v

    def choose(self, candidates: Sequence[Candidate], prefix: Prefix | None,
               session: str | None = None) -> Candidate:
        """The worker for a request (see the module doc); `prefix` None: least loaded, or
        its session's worker while that is not overloaded. A request of a session counts as
        a worker's load its requests in flight or its sessions bound, whichever is more: an
        episode between turns (its tool running) comes back soon, and a worker is not
        overloaded by a passing burst. A session with token IDs stays on its worker unless
        another costs less counted that way, its turns to come too (`_session_cost`): its
        worker holds its conversation, so it moves only when the sessions and the prefill
        queued there outweigh recomputing it."""
        def load(w: Candidate) -> int:
            return max(w.inflight, self.sessions.count(w.instance_id)) if session \
                else w.inflight
        mean = sum(load(w) for w in candidates) / len(candidates)
        group = self.siblings.get(prefix.whole) if prefix is not None else None

        def fits(w: Candidate) -> bool:  # its siblings (the same prompt) do not count
            own = group.get(w.instance_id, 0) if group else 0
            return load(w) - own + 1 <= self.overload * (mean + 1)
        fit = [w for w in candidates if fits(w)]
        keys: dict[int, list[int]] = {}
        bound = self.sessions.get(session) if session else None
        held = next((w for w in candidates if w.instance_id == bound), None) \
            if bound is not None else None
        if session and prefix is not None:  # its turns to come counted
            cost = self._session_cost(held, candidates, prefix, keys, load, session)
        else:
            def cost(w: Candidate) -> float:
                return self.cost(w, prefix, keys, load(w))
        if held is not None and prefix is not None:
            # the first of the cheapest: it stays unless moving costs less
            chosen = min([held, *(w for w in fit or candidates if w is not held)], key=cost)
        else:
            chosen = self._cheapest(fit or candidates, cost, load)
            if held is not None and held is not chosen and fits(held):
                chosen = held  # no prefix: it stays while its worker is not overloaded
        if session:
            if bound is not None and bound != chosen.instance_id:
                self.sessions.shed += 1
                log.info("session %s moves from worker %s to %s (%s)", session, bound,
                         chosen.instance_id, "not usable" if held is None else
                         "cheaper there" if prefix is not None else "overloaded")
            self.sessions.bind(session, chosen.instance_id)
        return chosen

    def _session_cost(self, held: Candidate | None, candidates: Sequence[Candidate],
                      prefix: Prefix, keys: dict[int, list[int]],
                      load: Callable[[Candidate], int], session: str
                      ) -> Callable[[Candidate], float]:
        """What a request of a session bound to `held` (None: its first) costs on a worker
        (`cost`), its turns to come counted: each of them stalls, for its new tokens (this
        request's uncached tokens on `held`, or the fewest any candidate leaves), the other
        sessions bound where it runs, and waits about as long for theirs. So a session moves
        off a worker crowded with sessions once recomputing its conversation elsewhere pays,
        and a first turn weighs the sessions bound where its prefix is cached."""
        per_token = self.rates.prefill if self.rates.known else 1.0
        memo: dict[int, int] = {}  # each worker's prefix matched once a request

        def uncached(w: Candidate) -> int:
            n = memo.get(w.instance_id)
            if n is None:
                n = memo[w.instance_id] = self._uncached(w, prefix, keys)
            return n
        turn = min(uncached(w) for w in ([held] if held is not None else candidates))
        later = per_token * self.sessions.turns_to_come(session) * turn

        def cost(w: Candidate) -> float:  # with the sessions bound to `w` but this one
            others = self.sessions.count(w.instance_id) - (w is held)
            return self.cost(w, prefix, keys, load(w), uncached(w)) + 2 * later * others
        return cost

    def _cheapest(self, candidates: Sequence[Candidate], cost: Callable[[Candidate], float],
                  load: Callable[[Candidate], int]) -> Candidate:
        """The candidate of the lowest `cost`, then the least `load`, then round-robin."""
        scored = [((cost(w), load(w)), w) for w in candidates]
        best = min(c for c, _ in scored)
        tied = sorted((w for c, w in scored if c == best), key=lambda w: w.instance_id)
        return tied[next(self._rr) % len(tied)] if len(tied) > 1 else tied[0]

    def cost(self, w: Candidate, prefix: Prefix | None,
             keys: dict[int, list[int]] | None = None, running: int | None = None,
             uncached: int | None = None) -> float:
        """What sending the request to `w` costs the fleet, in seconds once the rates are
        known (in tokens until then): the prefill queued there before it and its own
        uncached tokens (weighed by the overlap weight; `uncached` when the caller has
        matched the prefix already), the stall its prefill puts on the requests running
        there (`running`, default its requests in flight), and the decode time it adds to
        them and they to it."""
        if prefix is None:
            return 0.0
        if uncached is None:
            uncached = self._uncached(w, prefix, {} if keys is None else keys)
        running = w.inflight if running is None else running
        r = self.rates
        per_token = r.prefill if r.known else 1.0
        _, per_seq = r.step()
        prefill = self.active.get(w.instance_id, 0) + self.overlap_weight * uncached \
            + uncached * running
        return per_token * prefill + r.output * per_seq * (2 * running + 1)

    def _uncached(self, w: Candidate, prefix: Prefix, keys: dict[int, list[int]]) -> int:
        """The tokens of `prefix` that `w` does not hold (`keys`: its block keys by block
        size, filled as computed)."""
        v = self.view(w.instance_id)
        ks = keys.get(v.block_size)
        if ks is None:
            ks = keys[v.block_size] = prefix.keys(v.block_size)
        return len(prefix.tokens) - v.overlap(ks) * v.block_size

    def holders(self, candidates: Sequence[Candidate], prefix: Prefix, than: Candidate,
                n: int) -> list[Candidate]:
        """At most `n` of `candidates` other than `than` that hold at least as many blocks
        of `prefix` as it does (and some), the most first: where a request with this
        prefix was likely placed before, when `than` is where it goes now."""
        keys: dict[int, list[int]] = {}

        def held(w: Candidate) -> int:
            v = self.view(w.instance_id)
            ks = keys.get(v.block_size)
            if ks is None:
                ks = keys[v.block_size] = prefix.keys(v.block_size)
            return v.overlap(ks)
        floor = max(held(than), 1)
        scored = [(h, w) for w in candidates if w is not than and (h := held(w)) >= floor]
        scored.sort(key=lambda hw: -hw[0])
        return [w for _, w in scored[:n]]

    def describe(self, iid: int) -> dict[str, Any]:
        """What the frontend knows of a worker's cache (its /health): where from, and how
        many blocks (from events; and recorded)."""
        v = self.view(iid)
        return {"source": "events" if v.has_events else "record", "block_size": v.block_size,
                "cached_blocks": len(v.cached), "recorded_blocks": len(v.record),
                "sessions": self.sessions.count(iid)}

    def routed(self, iid: int, prefix: Prefix | None, counted: bool = False) -> int:
        """Record that `prefix` was sent to worker `iid` (`counted`: the request was
        recorded already, without its prompt); returns the tokens it adds to the worker's
        load until `finished` (the prompt tokens it does not hold yet)."""
        if not counted:
            self.running[iid] = self.running.get(iid, 0) + 1
        if prefix is None:
            return 0
        group = self.siblings.setdefault(prefix.whole, {})
        group[iid] = group.get(iid, 0) + 1
        v = self.view(iid)
        keys = prefix.keys(v.block_size)
        load = len(prefix.tokens) - v.overlap(keys) * v.block_size  # what it must compute
        v.note(keys)
        self.active[iid] = self.active.get(iid, 0) + load
        return load

    def prefilled(self, iid: int, load: int) -> None:
        """A request `routed` there has its first token: its prompt is computed."""
        if iid in self.active:
            self.active[iid] = max(0, self.active[iid] - load)

    def finished(self, iid: int, prefix: Prefix | None, load: int,
                 completions: Sequence[Sequence[int]] = ()) -> None:
        """The request `routed` sent there ended (`load`: what of it `prefilled` has not
        taken off; with these completions: what a continuation of it starts with is
        there now)."""
        self.prefilled(iid, load)
        if iid in self.running:
            self.running[iid] = max(0, self.running[iid] - 1)
        if prefix is not None:
            group = self.siblings.get(prefix.whole)
            if group is not None and iid in group:
                group[iid] -= 1
                if group[iid] <= 0:
                    del group[iid]
                if not group:
                    del self.siblings[prefix.whole]
        v = self.views.get(iid)
        if prefix is None or v is None:
            return
        for c in completions:
            v.note(prefix.continued(c, v.block_size))

    def finish_session(self, session: str) -> bool:
        """POST /finish_session: the session is over; whether it was bound."""
        return self.sessions.finish(session)

    def summary(self) -> dict[str, Any]:
        """The router's own state for /health: sessions bound, moved, and the rates."""
        return {"sessions": len(self.sessions), "sessions_shed": self.sessions.shed,
                **self.rates.describe()}

    # ------------------------------------------------------------------ membership

    def sync(self, entries: dict[int, dict]) -> None:
        """Follow the pool's live set: forget workers that left, clear the view of a
        worker whose policy changed, (re)subscribe to each worker's KV events (when
        called on an event loop)."""
        for iid in list(self.views.keys() - entries.keys()):
            self.forget(iid)
        self.follow(entries)

    def follow(self, entries: dict[int, dict]) -> None:
        """Take these workers' entries as they are now (each joined, or changed), as
        `sync` does, leaving the other workers as they are: the pool's work per discovery
        change does not grow with the fleet (`forget` the workers that left). A worker
        whose KV event stream broke is subscribed again at the next change of its entry."""
        try:
            start_events = asyncio.get_running_loop() is not None
        except RuntimeError:
            start_events = False
        for iid, e in entries.items():
            policy = (e.get("weight_digest"), e.get("weight_version"), e.get("weight_step"),
                      e.get("stream_plane"))
            if self._policies.get(iid, policy) != policy:
                log.info("worker %s: policy or address changed; forgetting its prefix cache",
                         iid)
                self.view(iid).clear()
                self.sessions.drop_worker(iid)
            self._policies[iid] = policy
            v = self.view(iid)
            size = e.get("kv_block_size")
            if type(size) is int and size > 0:
                v.block_size = size
            endpoint = e.get("kv_events")
            sub = self._subs.get(iid)
            if sub is not None and (sub[0] != endpoint or sub[1].done()):
                sub[1].cancel()
                del self._subs[iid]
                sub = None
            if sub is None:
                v.has_events = isinstance(endpoint, str) and start_events
            if v.has_events and sub is None:
                self._subs[iid] = (endpoint, asyncio.create_task(self._follow(iid, endpoint)))

    def forget(self, iid: int) -> None:
        self.views.pop(iid, None)
        self.active.pop(iid, None)
        self.running.pop(iid, None)
        self.sessions.drop_worker(iid)
        self._policies.pop(iid, None)
        sub = self._subs.pop(iid, None)
        if sub is not None:
            sub[1].cancel()

    async def close(self) -> None:
        tasks = [t for _, t in self._subs.values()]
        self._subs.clear()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # ------------------------------------------------------------------ events

    def on_message(self, iid: int, seq_bytes: bytes, body: bytes) -> None:
        """One published batch of worker `iid`'s events."""
        v = self.views.get(iid)
        if v is None:
            return
        seq = int.from_bytes(seq_bytes, "big")
        if v.last_seq is not None and seq != v.last_seq + 1:
            log.warning("worker %s: KV events %s..%s lost; forgetting its prefix cache",
                        iid, v.last_seq + 1, seq - 1)
            v.clear()
        v.last_seq = seq
        try:
            batch = kv.decode_batch(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("worker %s: not a KV event batch (%s); forgetting its prefix cache",
                        iid, e)
            v.clear()
            return
        for ev in batch.events:
            v.apply(ev)
            if type(ev) is kv.AllBlocksCleared:  # a reset: its sessions' prefixes are gone
                self.sessions.drop_worker(iid)

    async def _follow(self, iid: int, endpoint: str) -> None:
        """Read worker `iid`'s event publisher for as long as it is in the pool."""
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            sock.connect(endpoint)
            log.info("worker %s: following its KV events at %s", iid, endpoint)
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 3:
                    log.warning("worker %s: a KV event message of %d frames ignored", iid,
                                len(frames))
                    continue
                self.on_message(iid, frames[1], frames[2])
        except zmq.ZMQError as e:
            log.warning("worker %s: KV events at %s unreadable (%s); routing it by the "
                        "frontend's own record", iid, endpoint, e)
            v = self.views.get(iid)
            if v is not None:
                v.has_events = False
        finally:
            sock.close(linger=0)
