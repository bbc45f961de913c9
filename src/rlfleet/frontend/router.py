"""Which worker serves a request: the live set from discovery, and a routing policy."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from dataclasses import dataclass, field

from rlfleet.protocol.nvext import PolicyBound
from rlfleet.runtime.discovery import Discovery
from rlfleet.runtime.http import HttpError

log = logging.getLogger("rlfleet.router")

ROUTER_MODES = ("round-robin", "least-loaded", "random")


@dataclass
class Worker:
    instance_id: int
    model: str
    url: str  # its HTTP request plane (what discovery's `transport` names)
    address: str  # its stream plane, host:port: what this frontend sends requests over
    entry: dict
    inflight: int = 0
    down_until: float = 0.0  # set when a request found it unreachable or broken

    @property
    def usable(self) -> bool:
        return time.monotonic() >= self.down_until and not self.entry.get("gated", False)

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


@dataclass
class WorkerPool:
    discovery: Discovery
    namespace: str
    mode: str = "round-robin"
    down_seconds: float = 30.0
    # how long a request waits for a worker while its model's workers are gated (a policy
    # refresh in progress): held, not refused
    gated_hold: float = 60.0
    workers: dict[int, Worker] = field(default_factory=dict)
    _rr: itertools.count = field(default_factory=itertools.count)
    _task: asyncio.Task | None = None
    _ready: asyncio.Event = field(default_factory=asyncio.Event)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        if self.mode not in ROUTER_MODES:
            raise ValueError(f"unknown router mode {self.mode!r}; use one of {ROUTER_MODES}")

    async def start(self) -> None:
        self._task = asyncio.create_task(self._follow())
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._ready.wait(), 5)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _follow(self) -> None:
        """Follow discovery for the life of the pool: neither a bad entry nor a failing
        watch ends it (it logs and carries on with the last good set)."""
        while True:
            try:
                async for entries in self.discovery.watch(self.namespace):
                    try:
                        self.update([e for e in entries if e.get("endpoint") == "generate"])
                    except Exception:  # a malformed entry must not freeze membership
                        log.exception("discovery update not applied; keeping the last set")
                    self._ready.set()
                return  # the discovery object was closed
            except Exception:
                log.exception("discovery watch failed; restarting it in 1 s")
                await asyncio.sleep(1.0)

    def update(self, entries: list[dict]) -> None:
        """Replace the live set, keeping the load and health state of workers that stay."""
        fresh: dict[int, Worker] = {}
        for e in entries:
            transport = e.get("transport")
            url = transport.get("http") if isinstance(transport, dict) else None
            address = e.get("stream_plane")
            if not isinstance(url, str) or not isinstance(address, str) \
                    or not isinstance(e.get("model"), str):
                continue
            iid = int(e["instance_id"])
            w = self.workers.get(iid)
            if w is None or w.address != address:
                w = Worker(iid, e["model"], url, address, e)
                log.info("worker %s joined: %s at %s (stream plane %s)", iid, w.model, url,
                         address)
            else:
                w.entry = e
            fresh[iid] = w
        for iid in self.workers.keys() - fresh.keys():
            log.info("worker %s left", iid)
        self.workers = fresh
        self._changed.set()  # wake requests held for a worker
        self._changed = asyncio.Event()

    def models(self) -> list[str]:
        return sorted({w.model for w in self.workers.values()})

    def adapters(self) -> dict[str, str]:
        """The LoRA adapters served, each with the model it adapts (its parent)."""
        return {a: w.model for w in self.workers.values() for a in w.adapters}

    def for_model(self, model: str) -> list[Worker]:
        """The workers that serve `model`, or serve the adapter it names."""
        return [w for w in self.workers.values() if w.serves(model)]

    def pick(self, model: str, exclude: set[int] = frozenset(),
             bound: PolicyBound | None = None) -> Worker:
        all_ = self.for_model(model)
        if not all_:
            known = ", ".join(self.models()) or "none"
            adapters = ", ".join(sorted(self.adapters()))
            raise NoWorker(f"model {model!r} is not served here (models: {known}"
                           + (f"; LoRA adapters: {adapters}" if adapters else "") + ")", 404)
        serving = [w for w in all_ if w.usable_for(model)]
        ok = [w for w in serving if w.instance_id not in exclude]
        if not ok:
            raise NoWorker(f"no live worker can serve {model!r} right now "
                           f"({len(all_)} known, none usable); retry shortly", 503)
        if bound is not None:  # the newest step counts over every serving worker
            inside = {w.instance_id for w in within(bound, serving, model)}
            ok = [w for w in ok if w.instance_id in inside]
            if not ok:
                raise NoWorker(f"no live worker of {model!r} within nvext.policy "
                               f"({bound.describe()}) is left to try", 503)
        if self.mode == "least-loaded":
            low = min(w.inflight for w in ok)
            ok = [w for w in ok if w.inflight == low]
        elif self.mode == "random":
            return random.choice(ok)
        ok.sort(key=lambda w: w.instance_id)
        return ok[next(self._rr) % len(ok)]

    async def acquire(self, model: str, exclude: set[int] = frozenset(),
                      bound: PolicyBound | None = None) -> Worker:
        """pick(), but while the model's only candidates are gated (a policy refresh is
        under way), or while none serves a policy within `bound`, wait for one, up to
        `gated_hold` seconds."""
        deadline = time.monotonic() + self.gated_hold
        while True:
            try:
                return self.pick(model, exclude, bound)
            except NoWorker as e:
                gated = any(w.gated_for(model) for w in self.for_model(model)
                            if w.instance_id not in exclude)
                left = deadline - time.monotonic()
                if not (e.status == 409 or (e.status == 503 and gated)) or left <= 0:
                    raise
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), min(left, 1.0))

    def mark_down(self, w: Worker, why: str) -> None:
        log.warning("worker %s marked down for %.0fs: %s", w.instance_id, self.down_seconds, why)
        w.down_until = time.monotonic() + self.down_seconds
