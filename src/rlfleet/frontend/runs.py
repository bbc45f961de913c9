"""Generation runs owned by the frontend, so that a retry reusing an `X-Request-Id` gets the
first attempt's result (in flight or completed) instead of generating again.

A run without a request ID belongs to its connection: when the caller leaves, it is
aborted. A run with a request ID outlives its caller for `orphan_grace` seconds, so a
retry can attach to it; its events are kept for `window` seconds after it ends (at most
`max_runs` runs, and about `max_kept_bytes` of their events, are remembered: the oldest
finished runs are forgotten first, and while runs still in flight hold more than that, new
requests with a request ID are refused with 429).

A request ID names a request: the same route with the same JSON body (whatever its
spacing or key order) rejoins the run; anything else under that ID is a 409. A run whose
worker died or stalled before it finished starts anew on a retry (nothing of it was
admitted: it never ended). Only its owner can cancel a run: whoever presents the
`X-Cancel-Token` the request was started with, or the frontend's admin token.

This registry answers retries that come back to the same process. Across processes and
frontends, the worker keeps the run too (GenerateRequest.retain, rlfleet.worker.kept) and
every frontend routes the ID to the same worker (rlfleet.frontend.router.rank), so a
retry through any of them attaches to the first attempt there."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from rlfleet.protocol.engine import Head, Step
from rlfleet.runtime import metrics
from rlfleet.runtime.http import HttpError
from rlfleet.runtime.request_plane import WorkerError

REPLAYS = metrics.FRONTEND_REPLAYS  # on the frontend's /metrics
RESTARTS = metrics.FRONTEND_RESTARTS

CANCEL_TOKEN_HEADER = "x-cancel-token"
_canonical = msgspec.json.Encoder(order="sorted")


def fingerprint(route: str, body: bytes) -> str:
    """What a request ID stands for: the route and the JSON body as data (key order and
    spacing do not count)."""
    try:
        canonical = _canonical.encode(msgspec.json.decode(body))
    except (msgspec.DecodeError, TypeError, ValueError):
        canonical = body  # not JSON: its bytes
    return hashlib.blake2b(route.encode() + b"\0" + canonical, digest_size=16).hexdigest()


def token_hash(token: str | None) -> bytes | None:
    """The SHA-256 of a cancel token (None: none given)."""
    return None if not token else hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def event_bytes(ev: Any) -> int:
    """About how much memory one kept event holds (Python objects: ~40 bytes a token ID,
    ~120 a logprob entry)."""
    kind = type(ev)
    if kind is Step:
        n = 64
        for d in ev.choices:
            n += 64 + 40 * len(d.token_ids) + len(d.text)
            if d.logprobs:
                n += sum(120 + 120 * len(lp.top or ()) for lp in d.logprobs)
        return n
    if kind is Head:
        return 256 + 40 * len(ev.prompt_token_ids)
    prompt_logprobs = getattr(ev, "prompt_logprobs", None)
    return 256 + (200 * sum(len(p or ()) for p in prompt_logprobs) if prompt_logprobs else 0)


def _worker_failed(error: BaseException | None) -> bool:
    """The run ended because its worker died, stalled or was unreachable, or no worker was
    free: not because of the request itself."""
    if isinstance(error, WorkerError):
        return error.broken
    return isinstance(error, HttpError) and error.status == 503


class RequestIdConflict(Exception):
    """The request ID is already used by a different request body."""


@dataclass
class GenerationRun:
    """One generation the frontend owns: its events so far, who follows it, how it ended."""

    request_id: str
    fingerprint: str
    keep: bool  # outlives its callers (it has a caller-chosen request ID)
    # events from number `base` on: a run that nobody else can join drops what its one
    # caller has read (`release`); a kept run keeps them all for retries
    events: list[dict] = field(default_factory=list)
    base: int = 0
    error: BaseException | None = None
    done: bool = False
    ended_at: float | None = None
    followers: int = 0
    cancel_token: bytes | None = None  # sha256 of the X-Cancel-Token it was started with
    bytes: int = 0  # about how much its kept events hold
    worker: Any = None  # the worker that took it (rlfleet.frontend.router.Worker)
    stream: Any = None  # its paced stream, for a run that nobody else can join
    task: asyncio.Task | None = None
    _waiters: list[asyncio.Future] = field(default_factory=list)
    _orphan_timer: asyncio.TimerHandle | None = None

    def _publish(self) -> None:
        """Wake every follower waiting for news (each waits on its own future, so that a
        follower that leaves cancels nobody else's wait)."""
        waiters = self._waiters
        if waiters:
            self._waiters = []
            for w in waiters:
                if not w.done():
                    w.set_result(None)

    @property
    def produced(self) -> int:
        """How many events the run has produced so far."""
        return self.base + len(self.events)

    def since(self, i: int) -> list:
        """The events from number `i` on."""
        return self.events[i - self.base:]

    def release(self, upto: int) -> None:
        """Its caller has read the events before number `upto`: a run that nobody else can
        join forgets them."""
        if not self.keep and upto > self.base:
            n = upto - self.base
            del self.events[:n]
            self.base = upto
            if self.stream is not None:  # the worker may send as many more
                self.stream.taken(n)

    async def wait_past(self, i: int) -> None:
        """Until the run has more than `i` events or has ended."""
        while self.base + len(self.events) <= i and not self.done:
            w = asyncio.get_running_loop().create_future()
            self._waiters.append(w)
            await w

    async def follow(self) -> AsyncIterator[dict]:
        """Every event of the run from the start, then new ones as they come."""
        i = self.base
        while True:
            while i < self.produced:
                yield self.events[i - self.base]
                i += 1
            if self.done:
                if self.error is not None:
                    raise self.error
                return
            await self.wait_past(i)


@dataclass
class RunRegistry:
    orphan_grace: float = 30.0
    window: float = 600.0
    max_runs: int = 10_000
    max_kept_bytes: int = 2 << 30  # about this much of kept runs' events, at most
    admin_token: str | None = None  # may cancel any run
    runs: OrderedDict[str, GenerationRun] = field(default_factory=OrderedDict)
    kept_bytes: int = 0

    def _forget(self, request_id: str) -> None:
        run = self.runs.pop(request_id)
        self.kept_bytes -= run.bytes

    def _expire(self) -> None:
        """Forget runs that ended more than `window` ago, the oldest beyond `max_runs`, and
        the oldest finished ones while all hold more than `max_kept_bytes` (a forgotten run
        still in flight finishes for the callers attached to it)."""
        now = time.monotonic()
        while self.runs:
            rid, run = next(iter(self.runs.items()))
            old = run.done and run.ended_at is not None and now - run.ended_at > self.window
            if not old and len(self.runs) <= self.max_runs:
                break
            self._forget(rid)
        if self.kept_bytes > self.max_kept_bytes:
            for rid in [rid for rid, run in self.runs.items() if run.done]:
                self._forget(rid)
                if self.kept_bytes <= self.max_kept_bytes:
                    break

    def start(self, request_id: str, body: bytes, keep: bool,
              source: Callable[[GenerationRun], AsyncIterator[dict]], route: str = "",
              cancel_token: str | None = None) -> tuple[GenerationRun, bool]:
        """The run for `request_id`: an existing one (replayed) or a new one fed by `source`.
        Returns (run, replayed). Raises RequestIdConflict (the ID names another request) or
        HttpError 429 (kept runs in flight hold all the memory allowed)."""
        fp = fingerprint(route, body) if keep else ""
        self._expire()
        run = self.runs.get(request_id)
        if run is not None:
            if run.fingerprint != fp:
                raise RequestIdConflict(
                    f"X-Request-Id {request_id!r} was already used for a different request; "
                    "use a new request ID for a new request")
            if not (run.done and _worker_failed(run.error)):
                REPLAYS.inc()
                return run, True
            RESTARTS.inc()  # its worker failed it: this attempt starts anew (elsewhere)
            self._forget(request_id)
        if keep and self.kept_bytes > self.max_kept_bytes:
            raise HttpError(429, "this frontend holds as much of requests with an X-Request-Id "
                                 "as it may (runs in flight); retry shortly")
        run = GenerationRun(request_id, fp, keep, cancel_token=token_hash(cancel_token))
        run.task = asyncio.create_task(self._pump(run, source(run)))
        if keep:
            self.runs[request_id] = run
        return run, False

    def is_admin(self, admin_token: str | None) -> bool:
        """Whether `admin_token` is this frontend's admin token."""
        return bool(self.admin_token and admin_token and hmac.compare_digest(
            admin_token.encode("utf-8", "surrogatepass"),
            self.admin_token.encode("utf-8", "surrogatepass")))

    def may_cancel(self, run: GenerationRun, cancel_token: str | None, admin_token: str | None) -> bool:
        """Whether a caller presenting these tokens owns the run (or administers the
        frontend)."""
        if self.is_admin(admin_token):
            return True
        given = token_hash(cancel_token)
        return run.cancel_token is not None and given is not None \
            and hmac.compare_digest(given, run.cancel_token)

    async def _pump(self, run: GenerationRun, events: AsyncIterator[dict]) -> None:
        append = run.events.append
        keep = run.keep
        try:
            async for ev in events:
                append(ev)
                if keep:
                    size = event_bytes(ev)
                    run.bytes += size
                    if self.runs.get(run.request_id) is run:
                        self.kept_bytes += size
                if run._waiters:
                    run._publish()
        except asyncio.CancelledError:
            run.error = WorkerError("the request was cancelled before it finished", 499)
        except BaseException as e:  # noqa: BLE001 - handed to every follower
            run.error = e
        finally:
            with contextlib.suppress(Exception):
                await events.aclose()  # type: ignore[attr-defined]
            run.done = True
            run.ended_at = time.monotonic()
            run._publish()

    def attach(self, run: GenerationRun) -> None:
        run.followers += 1
        if run._orphan_timer is not None:
            run._orphan_timer.cancel()
            run._orphan_timer = None

    def detach(self, run: GenerationRun) -> None:
        """A caller stopped listening: abort the run if nobody can come back for it."""
        run.followers -= 1
        if run.followers > 0 or run.done or run.task is None:
            return
        if not run.keep:
            run.task.cancel()
            return
        run._orphan_timer = asyncio.get_running_loop().call_later(
            self.orphan_grace, lambda: run.followers == 0 and run.task.cancel())

    def running(self, request_id: str) -> GenerationRun | None:
        run = self.runs.get(request_id)
        return None if run is None or run.done else run
