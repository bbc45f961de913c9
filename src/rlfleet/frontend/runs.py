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

The registry itself (followers, orphan grace, bounds) is rlfleet.runtime.runs, shared with
the worker's. This one answers retries that come back to the same process. Across
processes and frontends, the worker keeps the run too (GenerateRequest.retain,
rlfleet.worker.kept) and every frontend routes the ID to the same worker
(rlfleet.frontend.router.rank), so a retry through any of them attaches to the first
attempt there; one placed elsewhere first asks the workers ranked above
(rlfleet.frontend.router.WorkerPool.owners)."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import AsyncIterator
from typing import Any, Protocol

import msgspec

from rlfleet.runtime import metrics
from rlfleet.runtime.http import HttpError
from rlfleet.runtime.request_plane import WorkerError
from rlfleet.runtime.runs import KEPT_WINDOW, Run, RunRegistry, event_bytes

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


def _worker_failed(error: BaseException | None) -> bool:
    """The run ended because its worker died, stalled or was unreachable, or no worker was
    free: not because of the request itself."""
    if isinstance(error, WorkerError):
        return error.broken
    return isinstance(error, HttpError) and error.status == 503


class RequestIdConflict(Exception):
    """The request ID is already used by a different request body."""


class Source(Protocol):
    """What feeds a run (rlfleet.frontend.dispatch.Dispatch): its events, the worker
    serving it (None before one is picked), and `taken(n)`, told of every `n` events its
    one caller has passed on (a run that nobody else can join moves at its caller's pace)."""

    worker: Any

    def __aiter__(self) -> AsyncIterator[Any]: ...

    def taken(self, n: int) -> None: ...


class GenerationRun(Run):
    """One generation the frontend owns (rlfleet.runtime.runs.Run): what its request ID
    stands for, its owner's cancel token, and its source while it runs (which says the
    worker that took it); an ended run keeps only that worker."""

    __slots__ = ("fingerprint", "cancel_token", "source", "_worker")

    def __init__(self, request_id: str, fingerprint: str, keep: bool, source: Source,
                 cancel_token: bytes | None = None) -> None:
        super().__init__(request_id, keep)
        self.fingerprint = fingerprint
        self.cancel_token = cancel_token  # sha256 of the X-Cancel-Token it was started with
        self.source: Source | None = source
        self._worker: Any = None  # the worker that took it, once it ended

    @property
    def worker(self) -> Any:
        """The worker that took it (rlfleet.frontend.router.Worker), None before one did."""
        return self._worker if self.source is None else self.source.worker

    def let_go(self) -> None:
        """It ended: keep its worker, not its source (the request, its last stream), which
        a run kept for retries would otherwise hold for as long as it is remembered."""
        if self.source is not None:
            self._worker, self.source = self.source.worker, None

    def release(self, upto: int) -> None:
        """Its caller has read the events before number `upto`: a run that nobody else can
        join forgets them, and its worker may send as many more."""
        if not self.keep and upto > self.base:
            n = upto - self.base
            del self.events[:n]
            self.base = upto
            if self.source is not None:
                self.source.taken(n)


def _events(run: GenerationRun) -> AsyncIterator[Any]:
    return aiter(run.source)  # type: ignore[arg-type]  (a run starts with its source)


def _cancelled() -> BaseException:
    return WorkerError("the request was cancelled before it finished", 499)


class GenerationRuns(RunRegistry[GenerationRun]):
    """The runs this frontend drives (see the module docstring)."""

    def __init__(self, orphan_grace: float = 30.0, window: float = KEPT_WINDOW,
                 max_runs: int = 10_000, max_kept_bytes: int = 2 << 30,
                 admin_token: str | None = None) -> None:
        super().__init__(orphan_grace, window, max_runs, max_kept_bytes, event_bytes,
                         _cancelled, "this frontend holds as much of requests with an "
                         "X-Request-Id as it may (runs in flight); retry shortly")
        self.admin_token = admin_token  # may cancel any run

    def start(self, request_id: str, body: bytes, keep: bool,  # type: ignore[override]
              source: Source, route: str = "",
              cancel_token: str | None = None) -> tuple[GenerationRun, bool]:
        """The run for `request_id`: an existing one (replayed, `source` left unread) or a
        new one fed by `source`.
        Returns (run, replayed). Raises RequestIdConflict (the ID names another request) or
        HttpError 429 (kept runs in flight hold all the memory allowed)."""
        fp = fingerprint(route, body) if keep else ""
        run = self.get(request_id)
        if run is not None:
            if run.fingerprint != fp:
                raise RequestIdConflict(
                    f"X-Request-Id {request_id!r} was already used for a different request; "
                    "use a new request ID for a new request")
            if not (run.done and _worker_failed(run.error)):
                REPLAYS.inc()
                return run, True
            RESTARTS.inc()  # its worker failed it: this attempt starts anew (elsewhere)
            self.forget(request_id)
        run = GenerationRun(request_id, fp, keep, source, token_hash(cancel_token))
        return super().start(run, _events), False

    def ended(self, run: GenerationRun) -> None:
        run.let_go()

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
