"""Send one request to a worker (retrying elsewhere only when nothing reached an engine)
and collect its events into per-choice results that the route renderers read."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from rlfleet.frontend.kv import Attempt, Prefix
from rlfleet.frontend.router import Worker, WorkerPool, newest_step
from rlfleet.protocol.engine import (
    Delta,
    Done,
    Event,
    GenerateRequest,
    Head,
    RoutedExperts,
    Step,
)
from rlfleet.protocol.identity import UNKNOWN, PolicyIdentity, WeightSpan
from rlfleet.protocol.nvext import PolicyBound
from rlfleet.protocol.openai import Usage
from rlfleet.runtime import metrics
from rlfleet.runtime.http import HttpError
from rlfleet.runtime.request_plane import WorkerClient, WorkerError, WorkerStream

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


# model -> its series of FRONTEND_GENERATED_TOKENS (labels() on every step takes a lock)
_GENERATED: dict[str, Any] = {}


class Choice:
    """One choice's output so far (with `keep` false, only how many tokens: a stream that
    has rendered each delta needs no copy of them)."""

    __slots__ = ("index", "keep", "count", "token_ids", "_text", "logprobs", "finish_reason",
                 "stop_reason", "weight_versions", "stale_policy", "routed_experts")

    def __init__(self, index: int, keep: bool = True) -> None:
        self.index = index
        self.keep = keep
        self.count = 0
        self.token_ids: list[int] = []
        self._text: list[str] = []
        self.logprobs: list | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.weight_versions: list[WeightSpan] | None = None
        self.stale_policy = False  # it left the request's staleness bound (nvext.policy)
        self.routed_experts: RoutedExperts | None = None  # with the final delta, when asked

    @property
    def text(self) -> str:
        parts = self._text
        if len(parts) > 1:
            parts[:] = ["".join(parts)]
        return parts[0] if parts else ""

    def add(self, d: Delta) -> None:
        self.count += len(d.token_ids)
        if self.keep:
            self.token_ids += d.token_ids
            if d.text:
                self._text.append(d.text)
            if d.logprobs is not None:
                if self.logprobs is None:
                    self.logprobs = []
                self.logprobs += d.logprobs
        carry_marks(self, d)


class Result:
    """Everything a request produced, filled as events arrive."""

    __slots__ = ("request_id", "n", "received", "first_token", "finished", "worker_id",
                 "prompt_token_ids", "prompt_logprobs", "prompt_text", "prompt_token_strs",
                 "policy", "choices", "model")

    def __init__(self, request_id: str, n: int, keep_output: bool = True) -> None:
        self.request_id, self.n = request_id, n
        self.received = time.time()
        self.first_token: float | None = None
        self.finished: float | None = None
        self.worker_id: int | None = None
        self.prompt_token_ids: list[int] = []
        self.prompt_logprobs: list | None = None
        self.prompt_text = ""  # with echo
        self.prompt_token_strs: list[str] | None = None  # with echo
        self.policy: PolicyIdentity = UNKNOWN  # what produced the first token (the Head's)
        self.choices = [Choice(i, keep_output) for i in range(n)]
        self.model = ""  # the model a worker serves it for (metrics label)

    def apply(self, ev: Event | dict) -> list[Delta]:
        """Fold one worker event in (typed, or a plain dict of the same shape); return its
        choice deltas (for streaming)."""
        kind = type(ev)
        if kind is dict:
            ev = _typed(ev)  # type: ignore[arg-type]
            kind = type(ev)
        if kind is Step:
            deltas = ev.choices  # type: ignore[union-attr]
            if self.first_token is None and deltas:
                self.first_token = time.time()
                metrics.FRONTEND_TTFT.labels(self.model).observe(self.first_token - self.received)
            tokens = 0
            for d in deltas:
                self.choices[d.index].add(d)
                tokens += len(d.token_ids)
            if tokens:
                counter = _GENERATED.get(self.model)
                if counter is None:
                    counter = _GENERATED[self.model] = \
                        metrics.FRONTEND_GENERATED_TOKENS.labels(self.model)
                counter.inc(tokens)
            return deltas
        if kind is Head:
            h: Head = ev  # type: ignore[assignment]
            self.prompt_token_ids = h.prompt_token_ids
            self.worker_id = h.worker_id or None
            self.policy = h.policy
            if h.prompt_text:
                self.prompt_text = h.prompt_text
            if h.prompt_token_strs:
                self.prompt_token_strs = h.prompt_token_strs
            if h.prompt_logprobs:
                self.prompt_logprobs = h.prompt_logprobs
        elif kind is Done:
            # an engine that says [] has nothing to add to what the head brought
            if ev.prompt_logprobs:  # type: ignore[union-attr]
                self.prompt_logprobs = ev.prompt_logprobs  # type: ignore[union-attr]
            self.finished = time.time()
        return []

    def spans(self, choice: Choice) -> list[WeightSpan]:
        """The weight-version spans of a finished choice; from an engine that does not
        track versions per token, one span from the weights the worker reported."""
        return choice.weight_versions or [WeightSpan.of(self.policy, 0, choice.count)]

    @property
    def completion_tokens(self) -> int:
        return sum(c.count for c in self.choices)

    def usage(self) -> Usage:
        p = len(self.prompt_token_ids)
        c = self.completion_tokens
        return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)

    def timing(self) -> dict[str, float]:
        end = self.finished or time.time()
        out = {"request_received_ms": round(self.received * 1000, 3),
               "total_time_ms": round((end - self.received) * 1000, 3)}
        if self.first_token is not None:
            out["ttft_ms"] = round((self.first_token - self.received) * 1000, 3)
        return out


def _typed(ev: dict) -> Event:
    """A worker event given as a plain dict (as the HTTP request plane writes it)."""
    if "choices" in ev:
        return msgspec.convert(ev, Step)
    if "prompt_token_ids" in ev:
        head = msgspec.convert({k: v for k, v in ev.items() if k != "_worker"}, Head)
        if ev.get("_worker") is not None:
            head.worker_id = ev["_worker"]
        return head
    if "done" in ev:
        return msgspec.convert(ev, Done)
    raise ValueError(f"not a request-plane event: {sorted(ev)}")


def merge_deltas(deltas: list[Delta]) -> list[Delta]:
    """Deltas of several steps as one delta per choice, in first-seen order (what a
    client that reads slower than the engine writes gets: fewer, larger chunks)."""
    if len(deltas) < 2:
        return deltas
    by: dict[int, Delta] = {}
    copied: set[int] = set()
    for d in deltas:
        i = d.index
        m = by.get(i)
        if m is None:
            by[i] = d
            continue
        if i not in copied:  # never change an event: it may be replayed to another caller
            copied.add(i)
            m = by[i] = Delta(index=i, token_ids=list(m.token_ids), text=m.text,
                              logprobs=None if m.logprobs is None else list(m.logprobs),
                              finish_reason=m.finish_reason, stop_reason=m.stop_reason,
                              weight_versions=m.weight_versions,
                              stale_policy=m.stale_policy, routed_experts=m.routed_experts)
        m.token_ids += d.token_ids
        m.text += d.text
        if d.logprobs is not None:
            if m.logprobs is None:
                m.logprobs = []
            m.logprobs += d.logprobs
        carry_marks(m, d)
    return list(by.values())


def carry_marks(into: Delta | Choice, d: Delta) -> None:
    """What a delta says once per choice (its finish, its spans so far, a staleness mark,
    the routed experts), carried onto what collects the choice's deltas."""
    if d.finish_reason is not None:
        into.finish_reason, into.stop_reason = d.finish_reason, d.stop_reason
    if d.weight_versions is not None:
        into.weight_versions = d.weight_versions
    if d.stale_policy is True:
        into.stale_policy = True
    if d.routed_experts is not None:
        into.routed_experts = d.routed_experts


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


async def _within_bound(stale: Staleness, w: Worker, model: str, ev: Step,
                        client: WorkerClient, req: GenerateRequest, head_step: int | None
                        ) -> Step:
    """A step of a request under nvext.policy: the request aborted once its worker leaves
    the bound (on_stale "abort"), and its final deltas saying whether it stayed within."""
    if not stale.aborted and stale.bound.on_stale == "abort" and stale.left(w):
        stale.aborted = True  # ends with the partial output, then checked
        log.info("request %s: worker %s moved to step %s, out of nvext.policy (%s) from step "
                 "%s; aborting it", req.request_id, w.instance_id, w.step_of(model),
                 stale.bound.describe(), stale.first)
        if not await client.cancel(w.address, req.request_id):
            log.warning("request %s: the abort did not reach worker %s", req.request_id,
                        w.instance_id)
    if any(d.finish_reason is not None for d in ev.choices):
        ev = Step(choices=[stale.final(d, head_step) if d.finish_reason is not None else d
                           for d in ev.choices])
    return ev


async def dispatch(pool: WorkerPool, client: WorkerClient, model: str, req: GenerateRequest,
                   on_pick: Callable[[Worker], None] | None = None,
                   on_stream: Callable[[WorkerStream], None] | None = None,
                   paced: bool = False, bound: PolicyBound | None = None
                   ) -> AsyncIterator[Event]:
    """Yield the events of `req` served by one worker of `model`. The Head carries the
    instance ID of the worker (`worker_id`); `on_pick` hears of each worker tried and
    `on_stream` of each stream opened (paced: its caller moves the worker's window, see
    WorkerStream.taken). With a staleness `bound` (nvext.policy) only a worker within it
    serves it (held while none is, see WorkerPool.acquire) and its final deltas say whether
    it stayed within (see Staleness). Raises NoWorker or WorkerError."""
    tried: set[int] = set()
    if bound is not None and bound.on_stale == "abort" and not req.stream:
        # step by step from the worker, so that a worker leaving the bound is seen mid-run
        req = msgspec.structs.replace(req, stream=True)
    kv = pool.kv
    prefix = Prefix(req.prompt_token_ids, req.cache_salt) \
        if kv is not None and req.prompt_token_ids is not None else None
    for attempt in range(MAX_ATTEMPTS):
        # a request its worker keeps (retain) goes where every frontend sends its ID, unless
        # the KV router places it by its prefix (WorkerPool.pick)
        key = req.request_id if req.retain is not None else None
        w = await pool.acquire(model, tried, bound, prefix, key)
        if model != w.model:  # it names a LoRA adapter the worker serves beside its model
            req = msgspec.structs.replace(req, adapter=model)
        # placed elsewhere than on its ID's first worker: the run there if one owns it
        w, stream = (w, None) if key is None else \
            await pool.owner(client, model, key, w, req, prefix, tried, paced)
        if attempt == 0:
            check_response_size(req, w.entry.get("max_model_len"))
        tried.add(w.instance_id)
        stale = None if bound is None else \
            Staleness(bound, w, newest_step([v for v in pool.for_model(model) if v.usable_for(model)],
                                            model), model)
        if on_pick is not None:
            on_pick(w)
        w.inflight += 1
        booked = Attempt(kv, w.instance_id, prefix) if kv is not None else None
        started = False
        try:
            if stream is None:
                stream = await client.generate(w.address, req, paced)
            if on_stream is not None:
                on_stream(stream)
            head_step = None
            async for ev in stream:
                if not started:
                    started = True
                    if type(ev) is Head:
                        ev.worker_id = w.instance_id
                        head_step = ev.weight_step
                        if stale is not None:
                            stale.first = head_step
                        if booked is not None:
                            booked.head(ev.prompt_token_ids, req.cache_salt)
                if booked is not None and type(ev) is Step:
                    booked.step(ev.choices)
                if stale is not None and type(ev) is Step:
                    ev = await _within_bound(stale, w, model, ev, client, req, head_step)
                yield ev
            return
        except WorkerError as e:
            kind = "unreachable" if e.retryable else "broken" if e.broken else "refused"
            metrics.FRONTEND_WORKER_ERRORS.labels(model, kind).inc()
            if e.broken:
                pool.mark_down(w, str(e))
            # nothing of it reached the caller: an unreachable or stalled worker's request
            # starts again on another one (a stalled worker that wakes up finds its link
            # gone and aborts it)
            if (e.retryable or e.stalled) and not started and attempt + 1 < MAX_ATTEMPTS:
                continue
            raise
        finally:
            w.inflight -= 1
            if booked is not None:  # what a continuation of it will start with is there
                booked.end()
            if stream is not None:
                await stream.aclose()
