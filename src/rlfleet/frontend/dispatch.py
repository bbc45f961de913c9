"""Send one request to a worker, retrying elsewhere only while nothing of it reached the
caller (`Dispatch`); its events are folded into a response by rlfleet.frontend.result."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from rlfleet.frontend.kv import Prefix, RouteAttempt
from rlfleet.frontend.router import Worker, WorkerPool, newest_step
from rlfleet.protocol.engine import Delta, Event, GenerateRequest, Head, Step
from rlfleet.protocol.nvext import PolicyBound
from rlfleet.runtime import metrics
from rlfleet.runtime.http import HttpError
from rlfleet.runtime.request_plane import StreamClient, WorkerError, WorkerStream

MAX_ATTEMPTS = 3
log = logging.getLogger("rlfleet.dispatch")
# n x max_tokens x (1 + logprobs) a request may ask for (about 30 bytes of JSON each): one
# request must not make a response of gigabytes (python -m rlfleet.frontend
# --max-response-entries; None: no limit)
MAX_RESPONSE_ENTRIES: int | None = 4_000_000


def check_response_size(req: GenerateRequest, max_model_len: Any) -> None:
    """HttpError 400 when the request could produce more than MAX_RESPONSE_ENTRIES."""
    limit = MAX_RESPONSE_ENTRIES
    if limit is None:
        return
    s = req.sampling
    tokens = s.max_tokens
    if tokens is None:
        tokens = max_model_len if isinstance(max_model_len, int) and max_model_len > 0 else 0
    entries = s.n * tokens * (1 + (s.logprobs or 0))
    if s.prompt_logprobs is not None and isinstance(max_model_len, int):
        entries += max_model_len * (1 + s.prompt_logprobs)
    if entries > limit:
        raise HttpError(400, f"this request could produce {entries} tokens and logprobs (n={s.n}"
                             f" x max_tokens={tokens} x (1 + logprobs={s.logprobs or 0})); this "
                             f"frontend answers at most {limit} per request: lower n, "
                             "max_tokens or logprobs, or split the request")


class Staleness:
    """One run's staleness bound (nvext.policy) after routing: its choices' tokens must all
    come from steps at or above `floor` and at most `max_lag` apart. Watches the worker's
    step as discovery reports it (a keep-pause update moves it mid-generation): with
    on_stale "abort" the run is aborted on the worker as soon as the worker leaves the
    bound; either way each final delta is checked against its spans, and a choice outside
    the bound is marked stale (on_stale "abort": also finished as abort)."""

    __slots__ = ("bound", "floor", "first", "aborted", "model")

    def __init__(self, bound: PolicyBound, w: Worker, newest: int | None,
                 model: str | None = None) -> None:
        self.bound = bound
        self.model = model or w.model  # the model, or the adapter, whose steps count
        self.floor = bound.floor(newest)
        self.first: int | None = w.step_of(self.model)  # the first token's (the Head's)
        self.aborted = False

    def allows(self, steps: list[int | None]) -> bool:
        """Whether tokens from these steps are within the bound (an unknown step is not)."""
        if not self.bound.allows(steps):
            return False
        return self.floor is None or all(s >= self.floor for s in steps)  # type: ignore[operator]

    def left(self, w: Worker) -> bool:
        """Whether the worker's current policy takes the run out of its bound."""
        steps = [s for s in (self.first, w.step_of(self.model)) if s is not None]
        return bool(steps) and not self.allows(steps)

    def final(self, d: Delta, head_step: int | None) -> Delta:
        """`d` (a final delta) as it is sent on: marked, or aborted and marked, when its
        tokens left the bound; never changed in place (events are replayed)."""
        steps = [s.step for s in d.weight_versions] if d.weight_versions else [head_step]
        if self.allows(steps) and not self.aborted:
            return d
        out = msgspec.structs.replace(d, stale_policy=True)
        if self.bound.on_stale == "abort" and out.finish_reason != "abort":
            out.finish_reason, out.stop_reason = "abort", None
        return out


class Dispatch:
    """One request sent to one worker of `model` at a time: iterate it for the request's
    events (Head, Step..., Done), from one worker; a worker that was unreachable or
    stalled before anything of the request reached the caller is left for another, up to
    MAX_ATTEMPTS. The Head carries the instance ID of the worker (`worker_id`). With a
    staleness `bound` (nvext.policy) only a worker within it serves it (held while none
    is, see WorkerPool.acquire) and its final deltas say whether it stayed within (see
    Staleness). `session` (X-Session-ID): the session the KV router keeps on one worker.
    Raises NoWorker or WorkerError.

    The attempt under way is its state: `worker` (the worker trying it now; None before
    the first), `stream` (its stream from that worker), its staleness watch and its KV
    booking. With `paced`, the caller reports what it has passed on (`taken`), which moves
    the worker's window (WorkerStream.taken)."""

    __slots__ = ("pool", "client", "model", "req", "paced", "bound", "prefix", "tried",
                 "worker", "stream", "stale", "booked", "head_step", "started", "session")

    def __init__(self, pool: WorkerPool, client: StreamClient, model: str,
                 req: GenerateRequest, paced: bool = False,
                 bound: PolicyBound | None = None, session: str | None = None) -> None:
        if bound is not None and bound.on_stale == "abort" and not req.stream:
            # step by step from the worker, so that a worker leaving the bound is seen mid-run
            req = msgspec.structs.replace(req, stream=True)
        self.pool, self.client, self.model, self.req = pool, client, model, req
        self.paced, self.bound = paced, bound
        self.prefix = Prefix(req.prompt_token_ids, req.cache_salt) \
            if pool.kv is not None and req.prompt_token_ids is not None else None
        self.session = session or req.session_id  # what the KV router keeps together
        self.tried: set[int] = set()
        self.worker: Worker | None = None
        self.stream: WorkerStream | None = None
        self.stale: Staleness | None = None
        self.booked: RouteAttempt | None = None
        self.head_step: int | None = None  # the step of the attempt's Head
        self.started = False  # an event of the attempt under way reached the caller

    def __aiter__(self) -> AsyncIterator[Event]:
        return self.events()

    def taken(self, n: int) -> None:
        """The caller has passed on `n` more events (paced): the worker may send as many
        more."""
        if self.paced and self.stream is not None:
            self.stream.taken(n)

    async def events(self) -> AsyncIterator[Event]:
        """The request's events from the worker that serves it (see the class)."""
        for attempt in range(MAX_ATTEMPTS):
            w = await self._place(attempt)
            w.inflight += 1
            try:
                if self.stream is None:
                    self.stream = await self.client.generate(w.address, self.req, self.paced)
                booked, stale = self.booked, self.stale
                async for ev in self.stream:
                    kind = type(ev)
                    if kind is Step:
                        if booked is not None:
                            booked.step(ev.choices)
                        if stale is not None:
                            ev = await self._within_bound(stale, ev)
                    elif kind is Head and not self.started:
                        self._head(ev)
                    self.started = True
                    yield ev
                return
            except WorkerError as e:
                if not self._retry(e, attempt):
                    raise
            finally:
                await self._leave(w)

    async def _place(self, attempt: int) -> Worker:
        """The worker for attempt number `attempt` (one not tried yet), and the attempt's
        state: its stream when the run is already kept there, its staleness watch, its
        booking with the KV router."""
        pool, model, req = self.pool, self.model, self.req
        # a request its worker keeps (retain) goes where every frontend sends its ID, unless
        # the KV router places it by its prefix (WorkerPool.pick)
        key = req.request_id if req.retain is not None else None
        w = await pool.acquire(model, self.tried, self.bound, self.prefix, key, self.session)
        if model != w.model:  # it names a LoRA adapter the worker serves beside its model
            req = self.req = msgspec.structs.replace(req, adapter=model)
        self.stream = None
        if key is not None:  # placed elsewhere than on its ID's first worker: the run there
            w, self.stream = await pool.owner(self.client, model, key, w, req, self.prefix,
                                              self.tried, self.paced)
        if attempt == 0:
            check_response_size(req, w.entry.get("max_model_len"))
        self.tried.add(w.instance_id)
        self.worker = w
        if self.bound is not None:
            usable = [v for v in pool.for_model(model) if v.usable_for(model)]
            self.stale = Staleness(self.bound, w, newest_step(usable, model), model)
        kv = pool.kv
        self.booked = RouteAttempt(kv, w.instance_id, self.prefix) if kv is not None else None
        self.head_step = None
        self.started = False
        return w

    def _head(self, head: Head) -> None:
        """The attempt's Head: stamped with its worker; the step of its first token."""
        head.worker_id = self.worker.instance_id  # type: ignore[union-attr]
        self.head_step = head.weight_step
        if self.stale is not None:
            self.stale.first = head.weight_step
        if self.booked is not None:
            self.booked.head(head.prompt_token_ids, self.req.cache_salt, self.req.adapter)

    def _retry(self, e: WorkerError, attempt: int) -> bool:
        """Count the worker's failure; whether the request starts again on another."""
        kind = "unreachable" if e.retryable else "broken" if e.broken else "refused"
        metrics.FRONTEND_WORKER_ERRORS.labels(self.model, kind).inc()
        if e.broken:
            self.pool.mark_down(self.worker, str(e))  # type: ignore[arg-type]
        # nothing of it reached the caller: an unreachable or stalled worker's request
        # starts again on another one (a stalled worker that wakes up finds its link gone
        # and aborts it)
        return (e.retryable or e.stalled) and not self.started and attempt + 1 < MAX_ATTEMPTS

    async def _leave(self, w: Worker) -> None:
        """The attempt on `w` is over: unbooked, its stream closed."""
        w.inflight -= 1
        if self.booked is not None:  # what a continuation of it will start with is there
            self.booked.end()
        if self.stream is not None:
            await self.stream.aclose()

    async def _within_bound(self, stale: Staleness, ev: Step) -> Step:
        """A step of a request under nvext.policy: the request aborted once its worker
        leaves the bound (on_stale "abort"), and its final deltas saying whether it stayed
        within."""
        w, req = self.worker, self.req
        if not stale.aborted and stale.bound.on_stale == "abort" and stale.left(w):
            stale.aborted = True  # ends with the partial output, then checked
            log.info("request %s: worker %s moved to step %s, out of nvext.policy (%s) from "
                     "step %s; aborting it", req.request_id, w.instance_id,
                     w.step_of(self.model), stale.bound.describe(), stale.first)
            if not await self.client.cancel(w.address, req.request_id):
                log.warning("request %s: the abort did not reach worker %s", req.request_id,
                            w.instance_id)
        if any(d.finish_reason is not None for d in ev.choices):
            ev = Step(choices=[stale.final(d, self.head_step) if d.finish_reason is not None
                               else d for d in ev.choices])
        return ev
