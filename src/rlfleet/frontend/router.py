"""Which worker serves a request: the live set from discovery (only the workers that serve
their model's committed policy, CommittedPolicy, when a refresh coordinator published one),
and a routing policy."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from rlfleet.frontend.kv import KvRouter, Prefix
from rlfleet.protocol.engine import GenerateRequest
from rlfleet.protocol.identity import PolicyIdentity
from rlfleet.protocol.nvext import PolicyBound
from rlfleet.protocol.rl import CommittedPolicy
from rlfleet.runtime import metrics
from rlfleet.runtime.discovery import Discovery, DiscoveryError, entry_key
from rlfleet.runtime.http import HttpError
from rlfleet.runtime.request_plane import ATTACH_DEADLINE, StreamClient, WorkerError, WorkerStream

log = logging.getLogger("rlfleet.router")

ROUTER_MODES = ("round-robin", "least-loaded", "random", "kv")
#: seconds a worker stays out of routing after a request found it unreachable, broken or
#: stalled (python -m rlfleet.frontend --down-seconds)
DOWN_SECONDS = 30.0
COMMITTED_POLL = 1.0  # seconds between reads of the models' committed policies
RELIST_DEADLINE = 2.0  # seconds for the listing a request for an unknown model makes
# a request with an X-Request-Id placed elsewhere than on the ID's top-ranked worker first
# asks at most this many of the workers ranked above (and, in mode kv, of those holding its
# prefix) whether they own its run, each within ASK_DEADLINE seconds (WorkerPool.owners)
ASK_RANKS = 4
ASK_DEADLINE = ATTACH_DEADLINE


@dataclass
class Worker:
    instance_id: int
    model: str
    url: str  # its HTTP request plane (what discovery's `transport` names)
    address: str  # its stream plane, host:port: what this frontend sends requests over
    entry: dict
    inflight: int = 0
    down_until: float = 0.0  # set when a request found it unreachable or broken
    # why it serves no policy the fleet committed (CommittedPolicy): left out of a refresh
    off_policy: str | None = None
    # `policy`, read from this entry (an entry is never changed in place: a new one is new)
    _policy: tuple[dict, PolicyIdentity] | None = field(default=None, repr=False,
                                                         compare=False)

    @property
    def usable(self) -> bool:
        return time.monotonic() >= self.down_until and not self.entry.get("gated", False) \
            and self.off_policy is None

    @property
    def policy(self) -> PolicyIdentity:
        """The policy it serves, as its discovery entry says."""
        got = self._policy
        if got is None or got[0] is not self.entry:
            got = self._policy = (self.entry, PolicyIdentity.from_stamped(self.entry))
        return got[1]

    @property
    def step(self) -> int | None:
        """The fleet step of the policy it serves, as its discovery entry says."""
        s = self.entry.get("weight_step")
        return s if type(s) is int else None

    @property
    def adapters(self) -> dict[str, dict]:
        """The LoRA adapters it serves beside its model, by name (each a policy of its own:
        {adapter, version, digest, step}), as its discovery entry lists them."""
        listed = self.entry.get("adapters")
        return {a["adapter"]: a for a in listed if isinstance(a, dict)
                and isinstance(a.get("adapter"), str)} if isinstance(listed, list) else {}

    def serves(self, model: str) -> bool:
        """Whether a request for `model` (its model, or an adapter it serves) can go here."""
        return model == self.model or model in self.adapters

    def usable_for(self, model: str) -> bool:
        """Usable, and for an adapter, open to requests (a refresh of it closes it)."""
        return self.usable and (model == self.model
                                or self.adapters.get(model, {}).get("open", True) is not False)

    def gated_for(self, model: str) -> bool:
        """Closed to `model`'s requests by a refresh (the worker's, or the adapter's)."""
        return bool(self.entry.get("gated")) or (
            model != self.model and self.adapters.get(model, {}).get("open") is False)

    def step_of(self, model: str) -> int | None:
        """The fleet step of `model`'s policy here: the model's, or the adapter's own."""
        if model == self.model:
            return self.step
        s = self.adapters.get(model, {}).get("step")
        return s if type(s) is int else None


class NoWorker(HttpError):
    """No live worker serves the model (HTTP 503, or 404 for an unknown model; 409: none
    serves a policy within the request's staleness bound)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(status, message, "model_not_found" if status == 404 else None)


def newest_step(workers: list[Worker], model: str | None = None) -> int | None:
    """The newest fleet step these workers serve for `model` (None: their own models; an
    adapter's name: its own steps) (None: none declares one)."""
    steps = [w.step if model is None else w.step_of(model) for w in workers]
    return max((s for s in steps if s is not None), default=None)


def within(bound: PolicyBound, workers: list[Worker], model: str) -> list[Worker]:
    """The serving workers whose policy of `model` (the model's, or an adapter's own) is
    within `bound` (max_lag counts from the newest step any of them serves); NoWorker 409
    naming the steps wanted and served if none."""
    floor = bound.floor(newest_step(workers, model))
    ok = [w for w in workers if (s := w.step_of(model)) is not None and floor is not None
          and s >= floor]
    if not ok:
        served = sorted({w.step_of(model) for w in workers},
                        key=lambda s: -1 if s is None else s)
        names = ", ".join("none declared" if s is None else str(s) for s in served)
        wanted = f"step >= {floor}" if floor is not None else "a declared step"
        raise NoWorker(f"no worker of {model!r} serves a policy within nvext.policy "
                       f"({bound.describe()}): wanted {wanted}; steps served: {names}", 409)
    return ok


def _scorer(key: str) -> Callable[[Worker], bytes]:
    k = key.encode("utf-8", "surrogatepass") + b"\0"

    def score(w: Worker) -> bytes:
        return hashlib.blake2b(k + str(w.instance_id).encode(), digest_size=8).digest()
    return score


def rank(key: str, workers: list[Worker]) -> list[Worker]:
    """`workers` in the order every frontend gives them for `key` (rendezvous hashing: the
    highest digest of key and instance ID first), whatever order it learnt them in: a
    request ID's retries go to the same worker through any frontend, and when a worker
    leaves, only the IDs it ranked first move."""
    return sorted(workers, key=_scorer(key), reverse=True)


async def ask_owners(client: StreamClient, asked: list[Worker], req: GenerateRequest,
                     placed_at: str, paced: bool = False) -> tuple[Worker, WorkerStream] | None:
    """Ask `asked` at once whether one keeps the run of `req`'s ID (an attach-only
    request, ASK_DEADLINE seconds each: an unreachable or silent worker keeps none): the
    one that does and its stream of the run, or None. Those that do not remember that it
    goes to `placed_at` (a stream-plane address), or, when one does, are told it is there,
    so that a later attempt sent to one of them follows it. Raises WorkerError 409 when one
    keeps the ID for another request (and none for this one)."""
    probe = msgspec.structs.replace(req, attach_only=True, placed_at=placed_at)
    tasks = {asyncio.ensure_future(client.attach(w.address, probe, ASK_DEADLINE, paced)): w
             for w in asked}
    found: tuple[Worker, WorkerStream] | None = None
    conflict: WorkerError | None = None
    pending = set(tasks)
    try:
        while pending and found is None:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                try:
                    stream = t.result()
                except WorkerError as e:
                    conflict = e
                    continue
                if stream is not None and found is None:
                    found = tasks[t], stream
                elif stream is not None:  # two owners of one ID cannot be; follow one
                    await stream.aclose()
    finally:
        for t in pending:
            t.cancel()
    metrics.FRONTEND_OWNER_ASKS.labels("found" if found else "not_found").inc()
    if found is None and conflict is not None:
        raise conflict
    others = [] if found is None else [w for w in asked if w is not found[0]]
    if others:  # they were told it goes to `placed_at`: tell them where it is instead
        _tell(client, others, msgspec.structs.replace(probe, placed_at=found[0].address))
    return found


_telling: set[asyncio.Task] = set()  # the tasks of `_tell` (kept until they end)


def _tell(client: StreamClient, workers: list[Worker], probe: GenerateRequest) -> None:
    """Send `probe` (attach-only) to `workers` in the background: each remembers that the
    ID's run is at `probe.placed_at`."""
    async def tell() -> None:
        got = await asyncio.gather(*(client.attach(w.address, probe, ASK_DEADLINE)
                                     for w in workers), return_exceptions=True)
        for stream in got:
            if isinstance(stream, WorkerStream):
                await stream.aclose()
    task = asyncio.ensure_future(tell())
    _telling.add(task)
    task.add_done_callback(_telling.discard)


def _key(e: dict) -> str:
    """An entry's discovery key (what `Discovery.follow` names its changes by)."""
    try:
        return entry_key(e)
    except (TypeError, ValueError):  # not from a store (a hand-made entry): its ID alone
        return f"instance/{e.get('instance_id')}"


@dataclass
class WorkerPool:
    discovery: Discovery
    namespace: str
    mode: str = "round-robin"
    down_seconds: float = DOWN_SECONDS
    # how long a request waits for a worker while its model's workers are gated (a policy
    # refresh in progress): held, not refused
    gated_hold: float = 60.0
    # how often the models' committed policies (CommittedPolicy records) are read again;
    # they are also read before every change of the live set is applied
    committed_poll: float = COMMITTED_POLL
    workers: dict[int, Worker] = field(default_factory=dict)
    committed: dict[str, CommittedPolicy] = field(default_factory=dict)
    _rr: itertools.count = field(default_factory=itertools.count)
    _task: asyncio.Task | None = None
    _poller: asyncio.Task | None = None
    _relisting: asyncio.Future | None = None
    _keys: dict[str, int] = field(default_factory=dict)  # discovery key -> its worker's ID
    _refs: dict[int, int] = field(default_factory=dict)  # worker ID -> keys naming it
    _unreadable: set[str] = field(default_factory=set)  # records whose failure was logged
    _ready: asyncio.Event = field(default_factory=asyncio.Event)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    kv: KvRouter | None = None  # mode "kv": the workers' prefix caches (frontend/kv.py)

    def __post_init__(self) -> None:
        if self.mode not in ROUTER_MODES:
            raise ValueError(f"unknown router mode {self.mode!r}; use one of {ROUTER_MODES}")
        if self.mode == "kv" and self.kv is None:
            self.kv = KvRouter()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._follow())
        self._poller = asyncio.create_task(self._poll_committed())
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._ready.wait(), 5)

    async def stop(self) -> None:
        for task in (self._task, self._poller):
            # cancelled again until it ends: a cancel swallowed by a library's wait_for
            # (Python 3.11) would leave a loop running, and this waiting for it forever
            while task is not None and not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=1.0)
            if task is not None and not task.cancelled():
                task.result()  # what ended it, raised as before
        if self.kv is not None:
            await self.kv.close()

    async def _follow(self) -> None:
        """Follow discovery for the life of the pool, one change at a time (the work per
        change does not grow with the fleet): neither a bad entry nor a failing watch ends
        it (it logs and carries on with the last good set)."""
        while True:
            try:
                # the generate entries alone: the other endpoints' files are never read
                follow = self.discovery.follow(self.namespace, endpoint="generate")
                async with contextlib.aclosing(follow) as changes:
                    async for change in changes:
                        # what changed, read now: the watch's view moves on at its next step
                        changed = {k: change.entries.get(k) for k in change.changed}
                        try:
                            await self._apply_changes(changed)
                        except Exception:  # a malformed entry must not freeze membership
                            log.exception("discovery update not applied; keeping the last set")
                        self._ready.set()
                return  # the discovery object was closed
            except Exception:
                log.exception("discovery watch failed; restarting it in 1 s")
                await asyncio.sleep(1.0)

    async def _apply_changes(self, changed: dict[str, dict | None]) -> None:
        # the records first, as in _apply; a record read here that changed re-judges every
        # worker of its model, not only the changed ones (a worker left out of the commit
        # has an unchanged entry, and the poller will not see this change again)
        moved = await self.read_committed({e.get("model") for e in changed.values()
                                           if e is not None and e.get("endpoint") == "generate"})
        self.apply(changed, rejudge=moved)

    async def _apply(self, entries: list[dict]) -> None:
        generate = [e for e in entries if e.get("endpoint") == "generate"]
        # the records first: a worker that changes after its coordinator committed (a
        # reopen) is judged against what was committed
        await self.read_committed({e.get("model") for e in generate})
        self.update(generate)

    async def _relist(self) -> None:
        """Read discovery once now: a request named a model (or LoRA adapter) the pool does
        not know, which may have registered since the watch's last change (an adapter a
        refresh just loaded). Concurrent misses share one listing."""
        if self._relisting is None or self._relisting.done():
            self._relisting = asyncio.ensure_future(self._list_now())
        await asyncio.shield(self._relisting)

    async def _list_now(self) -> None:
        try:
            async with asyncio.timeout(RELIST_DEADLINE):
                await self._apply(await self.discovery.list(self.namespace))
        except Exception as e:  # the watch carries on; the request gets its 404
            log.warning("listing discovery for an unknown model failed: %r", e)

    def _worker_of(self, e: dict) -> Worker | None:
        """The worker an entry describes (the one known, its state kept, while its stream
        plane stays), or None: not a routable generate entry."""
        transport = e.get("transport")
        url = transport.get("http") if isinstance(transport, dict) else None
        address = e.get("stream_plane")
        if not isinstance(url, str) or not isinstance(address, str) \
                or not isinstance(e.get("model"), str):
            return None
        iid = int(e["instance_id"])
        w = self.workers.get(iid)
        if w is None or w.address != address:
            w = Worker(iid, e["model"], url, address, e)
            log.info("worker %s joined: %s at %s (stream plane %s)", iid, w.model, url,
                     address)
        else:
            w.entry = e
        return w

    def update(self, entries: list[dict]) -> None:
        """Replace the live set, keeping the load and health state of workers that stay."""
        fresh: dict[int, Worker] = {}
        keys: dict[str, int] = {}
        for e in entries:
            w = self._worker_of(e)
            if w is not None:
                fresh[w.instance_id] = w
                keys[_key(e)] = w.instance_id
        for iid in self.workers.keys() - fresh.keys():
            log.info("worker %s left", iid)
        self.workers, self._keys = fresh, keys
        self._refs = {}
        for iid in keys.values():
            self._refs[iid] = self._refs.get(iid, 0) + 1
        if self.kv is not None:
            self.kv.sync({iid: w.entry for iid, w in fresh.items()})
        self._judge()
        self._wake()

    def apply(self, changed: dict[str, dict | None], rejudge: set[str] = frozenset()) -> None:
        """Apply what changed in discovery (key -> its entry now, None: removed), touching
        only those workers; the others keep their state untouched, except that every worker
        of a model in `rejudge` (its committed policy just changed) is judged again."""
        touched: list[Worker] = []
        left: list[int] = []
        for key, e in changed.items():
            gone = self._keys.pop(key, None)
            if gone is not None:
                self._refs[gone] -= 1
            w = self._worker_of(e) if e is not None and e.get("endpoint") == "generate" \
                else None
            if w is not None:
                self._keys[key] = w.instance_id
                self._refs[w.instance_id] = self._refs.get(w.instance_id, 0) + 1
                self.workers[w.instance_id] = w
                touched.append(w)
            if gone is not None and not self._refs[gone]:  # no other key names it
                del self._refs[gone]
                if self.workers.pop(gone, None) is not None:
                    log.info("worker %s left", gone)
                    left.append(gone)
        if not changed and not rejudge:
            return
        if changed and self.kv is not None:  # the workers that changed, not the pool
            for iid in left:
                if iid not in self.workers:  # (not back under another key)
                    self.kv.forget(iid)
            self.kv.follow({w.instance_id: w.entry for w in touched})
        self._judge(touched)
        self._rejudge(rejudge)
        self._wake()

    def _wake(self) -> None:
        self._changed.set()  # wake requests held for a worker
        self._changed = asyncio.Event()

    # ---------------------------------------------------------------- committed policies

    async def _poll_committed(self) -> None:
        """Read the models' committed policies every `committed_poll` seconds: a commit
        changes no worker's entry when a worker was left out of it."""
        while True:
            await asyncio.sleep(self.committed_poll)
            try:
                moved = await self.read_committed({w.model for w in self.workers.values()})
            except Exception:  # a bug; the last records stand
                log.exception("reading the committed policies failed")
                continue
            if moved:
                self._rejudge(moved)
                self._wake()

    async def read_committed(self, models: set) -> set[str]:
        """Read the committed-policy record of each model (a store that cannot be read, or a
        record that is not one, leaves the last one read in place, and says so once).
        Returns the models whose record this read changed: the caller re-judges all their
        workers (`_rejudge`), since whoever changed the record is the one that knows."""
        moved: set[str] = set()
        for model in sorted(m for m in models if isinstance(m, str)):
            name = CommittedPolicy.record_name(self.namespace, model)
            try:
                raw = await self.discovery.get_record(name)
                rec = None if raw is None else CommittedPolicy.from_record(raw)
            except (DiscoveryError, msgspec.ValidationError) as e:
                if name not in self._unreadable:
                    self._unreadable.add(name)
                    log.warning("cannot read the committed policy of %s (%s); routing by the "
                                "last one read: %s", model, name, e)
                continue
            self._unreadable.discard(name)
            if rec is None:
                if self.committed.pop(model, None) is not None:
                    moved.add(model)
            elif rec != self.committed.get(model):
                log.info("committed policy of %s: %s", model, rec.describe())
                self.committed[model] = rec
                moved.add(model)
        return moved

    def _rejudge(self, models: set[str]) -> None:
        """Judge again every worker of these models (their committed policy changed: a
        commit is rare, so this walk of the pool is paid per commit, not per entry change)."""
        if models:
            self._judge([w for w in self.workers.values() if w.model in models])

    def _judge(self, workers: list[Worker] | None = None) -> None:
        """Take out of routing every worker (of `workers`, default all) that serves no
        committed policy of its model (left out of a refresh: whatever its lease says, its
        weights are not the fleet's), and back in those that do."""
        for w in self.workers.values() if workers is None else workers:
            rec = self.committed.get(w.model)
            policy = w.policy
            why = None if rec is None or rec.serves(policy) else (
                f"serves {policy.version} ({policy.digest}, step {policy.step}), not the "
                f"committed policy {rec.describe()}")
            if why != w.off_policy:
                if why:
                    log.warning("worker %s out of routing: %s", w.instance_id, why)
                else:
                    log.info("worker %s serves the committed policy again", w.instance_id)
                w.off_policy = why

    def models(self) -> list[str]:
        return sorted({w.model for w in self.workers.values()})

    def adapters(self) -> dict[str, str]:
        """The LoRA adapters served, each with the model it adapts (its parent)."""
        return {a: w.model for w in self.workers.values() for a in w.adapters}

    def for_model(self, model: str) -> list[Worker]:
        """The workers that serve `model`, or serve the adapter it names."""
        return [w for w in self.workers.values() if w.serves(model)]

    def pick(self, model: str, exclude: set[int] = frozenset(),
             bound: PolicyBound | None = None, prefix: Prefix | None = None,
             key: str | None = None, session: str | None = None) -> Worker:
        """A worker for a request of `model` by the routing mode; with a `key` (the
        X-Request-Id of a request the workers keep), the first usable one in `rank` order
        over all the model's workers, so that every frontend picks the same one. In mode
        "kv" a request with a `prefix` goes where its prefix is cached instead: a retry of
        it through another frontend usually finds the same worker (the one holding its
        prefix), but only `rank` guarantees it."""
        all_ = self.for_model(model)
        if not all_:
            known = ", ".join(self.models()) or "none"
            adapters = ", ".join(sorted(self.adapters()))
            raise NoWorker(f"model {model!r} is not served here (models: {known}"
                           + (f"; LoRA adapters: {adapters}" if adapters else "") + ")", 404)
        serving = [w for w in all_ if w.usable_for(model)]
        ok = [w for w in serving if w.instance_id not in exclude]
        if not ok:
            off = [w for w in all_ if w.off_policy]
            why = (f"; {len(off)} serve a policy other than the committed one "
                   f"({self.committed[model].describe()})" if off else "")
            raise NoWorker(f"no live worker can serve {model!r} right now "
                           f"({len(all_)} known, none usable{why}); retry shortly", 503)
        if bound is not None:  # the newest step counts over every serving worker
            inside = {w.instance_id for w in within(bound, serving, model)}
            ok = [w for w in ok if w.instance_id in inside]
            if not ok:
                raise NoWorker(f"no live worker of {model!r} within nvext.policy "
                               f"({bound.describe()}) is left to try", 503)
        if self.kv is not None and (prefix is not None or session is not None):
            if prefix is not None and model != ok[0].model:  # a LoRA adapter's request:
                prefix.adapter = model  # its blocks are the adapter's
            return self.kv.choose(ok, prefix, session)  # type: ignore[return-value]
        if key is not None:
            usable = {w.instance_id for w in ok}
            return next(w for w in rank(key, all_) if w.instance_id in usable)
        if self.kv is not None:
            return self.kv.choose(ok, None)  # type: ignore[return-value]
        if self.mode == "least-loaded":
            low = min(w.inflight for w in ok)
            ok = [w for w in ok if w.inflight == low]
        elif self.mode == "random":
            return random.choice(ok)
        ok.sort(key=lambda w: w.instance_id)
        return ok[next(self._rr) % len(ok)]

    async def acquire(self, model: str, exclude: set[int] = frozenset(),
                      bound: PolicyBound | None = None, prefix: Prefix | None = None,
                      key: str | None = None, session: str | None = None) -> Worker:
        """pick(), but while the model's only candidates are gated (a policy refresh is
        under way) or off the committed policy (a refresh just ended: the commit and the
        workers' new entries reach this frontend one after the other), or while none serves
        a policy within `bound`, wait for one, up to `gated_hold` seconds."""
        deadline = time.monotonic() + self.gated_hold
        relisted = False
        while True:
            try:
                return self.pick(model, exclude, bound, prefix, key, session)
            except NoWorker as e:
                if e.status == 404 and not relisted:
                    relisted = True
                    await self._relist()
                    continue
                gated = any(w.gated_for(model) or w.off_policy is not None
                            for w in self.for_model(model) if w.instance_id not in exclude)
                left = deadline - time.monotonic()
                if not (e.status == 409 or (e.status == 503 and gated)) or left <= 0:
                    raise
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(left, 1.0)):
                        await self._changed.wait()

    def owners(self, model: str, key: str, chosen: Worker, prefix: Prefix | None = None,
               exclude: set[int] = frozenset()) -> list[Worker]:
        """The workers to ask whether they own the run of request ID `key` before it is
        placed on `chosen`: those ranked above it (where an earlier attempt went while
        `chosen` was not the first usable: it was gated, outside a staleness bound), at
        most ASK_RANKS, so none (at no cost beyond one score per worker) when `chosen` is
        the ID's top-ranked worker; and in mode kv, for a request placed by its prefix,
        at most ASK_RANKS of those holding at least as much of it as `chosen` (where the
        KV router placed an earlier attempt before that worker was gated or overloaded);
        never one marked down or in `exclude` (tried by this request already)."""
        all_ = self.for_model(model)
        by_prefix = self.kv is not None and prefix is not None
        top = max(all_, key=_scorer(key)) is chosen
        if top and not by_prefix:
            return []
        now = time.monotonic()
        out: list[Worker] = []
        for w in () if top else rank(key, all_):
            if w is chosen or len(out) == ASK_RANKS:
                break
            if w.instance_id not in exclude and w.down_until <= now:
                out.append(w)
        if by_prefix:
            live = [w for w in all_ if w.instance_id not in exclude and w.down_until <= now]
            for w in self.kv.holders(live, prefix, chosen, ASK_RANKS):
                if w not in out:
                    out.append(w)  # type: ignore[arg-type]
        return out

    async def owner(self, client: StreamClient, model: str, key: str, chosen: Worker,
                    req: GenerateRequest, prefix: Prefix | None = None,
                    exclude: set[int] = frozenset(), paced: bool = False
                    ) -> tuple[Worker, WorkerStream | None]:
        """Where request ID `key` goes, placed on `chosen`: (chosen, None), or the worker
        that `owners` names and that keeps its run, with its stream of the run (see
        ask_owners; WorkerError 409 when the ID names another request there)."""
        asked = self.owners(model, key, chosen, prefix, exclude)
        found = await ask_owners(client, asked, req, chosen.address, paced) if asked else None
        return found if found is not None else (chosen, None)

    def mark_down(self, w: Worker, why: str) -> None:
        log.warning("worker %s marked down for %.0fs: %s", w.instance_id, self.down_seconds, why)
        w.down_until = time.monotonic() + self.down_seconds
