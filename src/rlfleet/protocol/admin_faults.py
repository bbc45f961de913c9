"""TEST ONLY: the fault injection route's schema (`/engine/fault_injection`), fenced here,
out of the wire contract: a worker serves the route only when started with
--enable-fault-injection (rlfleet.worker.system_server), and no client of the contract sends
it. It makes the next calls of a named route fail in a chosen way, so the fault tests can
drive a refresh through each failure."""

from __future__ import annotations

from typing import Any, ClassVar

from msgspec import UNSET, UnsetType

from rlfleet.protocol.admin_base import AdminRequestError, Reply, Request

# error: 200 with status "error"; http500: the contract's 500; hang: sleep hang_seconds first;
# exit: the process dies; respond: answer with the given `body` instead of running the route;
# delay: sleep hang_seconds, then run the route as usual
FAULT_MODES = ("error", "http500", "hang", "exit", "respond", "delay")
_FAULT_ROUTE = "route is required (the name of the route to fail)"


class FaultRequest(Request, kw_only=True, frozen=True):
    """Make a named route fail `times` times (tests only; 0 disarms)."""

    route: str
    mode: str = "error"  # FAULT_MODES
    times: int = 1
    hang_seconds: float = 3600.0
    body: dict[str, Any] | None = None  # what mode respond answers with
    MESSAGES: ClassVar[dict[str, str]] = {
        "route": _FAULT_ROUTE, "times": "times must be a non-negative integer (0 disarms)",
        "hang_seconds": "hang_seconds must be a non-negative number",
        "body": "mode respond needs body (the JSON object to answer with)"}

    def __post_init__(self) -> None:
        if not self.route:
            raise AdminRequestError(_FAULT_ROUTE)
        if self.mode not in FAULT_MODES:
            raise AdminRequestError(f"Invalid mode {self.mode!r}; expected "
                                    f"{'|'.join(FAULT_MODES)}")
        for name in ("times", "hang_seconds"):
            if getattr(self, name) < 0:
                raise AdminRequestError(self.MESSAGES[name])
        if self.mode == "respond" and self.body is None:
            raise AdminRequestError(self.MESSAGES["body"])


class FaultReply(Reply, kw_only=True):
    route: str | UnsetType = UNSET
    mode: str | UnsetType = UNSET
    times: int | UnsetType = UNSET

