"""The relay route (an rlfleet extension) on a worker's system server: `POST /engine/relay`
runs one admin call on a list of other workers (its subtree) on its caller's behalf and
answers every worker's result, so that a coordinator of a large fleet makes K calls a phase
instead of N (rlfleet.refresh.relay lays the tree out; rlfleet.worker.relay serves it).

The relay forwards its caller's fleet epoch (`X-Fleet-Epoch`) on every call it makes, and
the admin token it serves with: each target fences the call as it fences a direct one (a
stale epoch is its 409, in that target's result), and the relay route is itself fenced. It
forwards only the fenced routes of the admin table (not itself, not fault injection).

Request: `{"route", "request", "targets": [{"instance_id", "system_url"}], "timeout",
"concurrency"}`; reply: `{"status": "ok", "results": [{"instance_id", "http_status",
"body", "error"}]}`, one result per target, in the order given. A target that could not be
reached, or did not answer within `timeout`, has `http_status` null and `error` says why;
otherwise `body` is what it answered, as it answered it."""

from __future__ import annotations

from typing import Any, ClassVar
from urllib.parse import urlsplit

import msgspec

from rlfleet.protocol.admin import ROUTES, AdminRoute
from rlfleet.protocol.admin_base import AdminRequestError, Reply, Request

#: a relay call names at most this many targets
MAX_TARGETS = 4096
#: calls a relay has in flight at once, at most (a request may ask for fewer)
MAX_CONCURRENCY = 256
#: the longest per-call deadline a relay accepts (seconds)
MAX_TIMEOUT = 3600.0

_TARGETS = ("targets is required: a non-empty list of {instance_id (int), system_url "
            "(http(s)://host:port)}")


class RelayTarget(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """One worker of the subtree."""

    instance_id: int
    system_url: str  # its system server, http(s)://host:port


class RelayRequest(Request, kw_only=True, frozen=True):
    route: str  # a fenced route of the admin table (rlfleet.protocol.admin.ROUTES)
    request: dict[str, Any] = {}  # that route's body, sent to every target as it is
    targets: list[RelayTarget]
    timeout: float  # seconds: each target's call, and the relay's whole work, end by then
    concurrency: int = 64  # calls in flight at once (at most MAX_CONCURRENCY)
    MESSAGES: ClassVar[dict[str, str]] = {
        "route": "route is required (the name of the admin route to run on every target)",
        "request": "request must be an object (the route's body)",
        "targets": _TARGETS,
        "timeout": f"timeout is required: seconds per call, above 0 and at most {MAX_TIMEOUT:g}",
        "concurrency": f"concurrency must be an integer from 1 to {MAX_CONCURRENCY}"}
    NON_EMPTY: ClassVar[tuple[str, ...]] = ("route", "targets")

    def __post_init__(self) -> None:
        super().__post_init__()
        spec = ROUTES.get(self.route)
        if spec is None or not relayable(spec):
            raise AdminRequestError(f"route {self.route!r} is not relayed: a relay runs the "
                                    "fenced routes of the admin table (not relay itself, not "
                                    "fault_injection)")
        if len(self.targets) > MAX_TARGETS:
            raise AdminRequestError(f"a relay call names at most {MAX_TARGETS} targets, not "
                                    f"{len(self.targets)}: split the subtree")
        for t in self.targets:
            parts = urlsplit(t.system_url)
            if parts.scheme not in ("http", "https") or not parts.hostname or \
                    parts.path.strip("/") or parts.query or parts.fragment:
                raise AdminRequestError(f"target {t.instance_id}: system_url must be "
                                        f"http(s)://host:port, not {t.system_url!r}")
        if isinstance(self.timeout, bool) or not 0 < self.timeout <= MAX_TIMEOUT:
            raise AdminRequestError(self.MESSAGES["timeout"])
        if isinstance(self.concurrency, bool) or not 1 <= self.concurrency <= MAX_CONCURRENCY:
            raise AdminRequestError(self.MESSAGES["concurrency"])


class RelayResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One target's answer to the relayed call."""

    instance_id: int
    http_status: int | None = None  # None: not reached, or no answer within the deadline
    body: Any = None  # what it answered (JSON), as it answered it
    error: str | None = None  # why there is no answer


class RelayReply(Reply, kw_only=True):
    results: list[RelayResult] = msgspec.field(default_factory=list)


#: not serialized (it runs beside the worker's own control calls, and calls this worker
#: too when it is in its own subtree); mutating: it needs the admin token, and its epoch
#: advances this worker's as any control call's does
RELAY = AdminRoute("relay", RelayRequest, RelayReply, serialized=False)


def relayable(route: AdminRoute) -> bool:
    """Whether a relay forwards `route`: the fenced routes, but the relay itself."""
    return route.fenced and not route.native and route.name != RELAY.name
