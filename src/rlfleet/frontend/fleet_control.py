"""The control routes of vLLM's and SGLang's servers at the frontend's URL, forwarded to the
fleet control service (`rlfleet control`, rlfleet.refresh.fleet_control) when the frontend is
started with `--fleet-control URL`: a client written for one server sends generation and
control to the same address, and each control call becomes a fleet operation there. The
paths are the service's route table (rlfleet.protocol.fleet_control.FORWARDED); every frontend
process forwards to the one service, which owns the fleet's transactions.

The request goes on as it came (method, query, body, the Authorization header the service
checks its admin token against, X-Request-Id, traceparent), with a deadline per route (a
read is quick, an update moves every worker's weights); the answer comes back as the
service gave it. A service that cannot be reached is a 503 that names it.

Who may change the fleet: vLLM serves these routes only in a development mode; a frontend
serves them to anyone who reaches its port. So a route that changes the fleet is forwarded
for a caller on loopback, for one in a network `--fleet-control-from CIDR` names, and for
one that presents the fleet's admin token (when the frontend has one); any other caller
gets 403 naming what to set. `exposure` is the warning a frontend logs at start when it
binds beyond loopback and forwards control without an admin token."""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Sequence

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rlfleet.protocol import smg
from rlfleet.protocol.fleet_control import FORWARDED, ControlRoute

log = logging.getLogger("rlfleet.frontend.fleet_control")

#: the request headers that go on to the service
FORWARDED_HEADERS = ("authorization", "content-type", "x-request-id", "traceparent")
#: seconds to connect to the service
CONNECT_DEADLINE = 5.0


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def networks(cidrs: Sequence[str]) -> list[Network]:
    """The networks `--fleet-control-from` names (ValueError naming a bad one)."""
    out = []
    for c in cidrs:
        try:
            out.append(ipaddress.ip_network(c.strip(), strict=False))
        except ValueError as e:
            raise ValueError(f"--fleet-control-from {c!r} is not a CIDR (e.g. 10.0.0.0/8, "
                             f"192.0.2.7/32): {e}") from None
    return out


def _loopback(host: str) -> bool:
    """Whether a bind address (or a caller's) is loopback only."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host == "localhost"
    return ip.is_loopback or (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


def exposure(host: str, fleet_control: str | None, admin_token: str | None,
             allowed: Sequence[str]) -> str | None:
    """The warning for a frontend that forwards control on `host` beyond loopback without an
    admin token (None when there is nothing to warn of)."""
    if not fleet_control or admin_token or _loopback(host):
        return None
    who = (f"callers in {', '.join(allowed)} (--fleet-control-from) and on loopback"
           if allowed else "callers on loopback only")
    return (f"fleet control is forwarded on {host}, beyond loopback, without an admin token: "
            f"the routes that change the fleet (/pause, /update_weights_from_disk, ...) are "
            f"served to {who}; any other caller gets 403. Set an admin token (--admin-token-"
            "file) for control from elsewhere")


class ControlForward:
    """One frontend process's link to the service (one HTTP client, made on first use, in
    the process's own event loop), and who may send it what changes the fleet."""

    def __init__(self, url: str, *, admin_token: str | None = None,
                 allowed: Sequence[str] = ()) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--fleet-control must be the service's http(s):// URL, not {url!r}")
        self.url = url.rstrip("/")
        self.admin_token = admin_token
        self.allowed = networks(allowed)
        self._http: httpx.AsyncClient | None = None

    def may_change(self, request: Request) -> bool:
        """Whether the caller may send a route that changes the fleet (the module doc)."""
        host = request.client.host if request.client else ""
        if _loopback(host):
            return True
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            ip = None
        if ip is not None:
            ip = getattr(ip, "ipv4_mapped", None) or ip
            if any(ip in net for net in self.allowed):
                return True
        if self.admin_token:
            sent = request.headers.get("authorization", "")
            return hmac.compare_digest(sent.encode(), f"Bearer {self.admin_token}".encode())
        return False

    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=8))
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def forward(self, request: Request, route: ControlRoute) -> Response:
        if route.mutating and not self.may_change(request):
            caller = request.client.host if request.client else "an unknown address"
            return self._failed(route, 403, (
                f"{route.path} changes the fleet and is not served to {caller}: send the "
                "fleet's admin token (Authorization: Bearer <token>)" if self.admin_token else
                f"{route.path} changes the fleet and is not served to {caller}: this frontend "
                "has no admin token, so only loopback callers and the networks "
                "--fleet-control-from names may send it"))
        headers = {k: v for k in FORWARDED_HEADERS if (v := request.headers.get(k)) is not None}
        try:
            r = await self.http().request(
                request.method, f"{self.url}{request.url.path}", params=request.query_params,
                content=await request.body(), headers=headers,
                timeout=httpx.Timeout(route.deadline, connect=CONNECT_DEADLINE))
        except httpx.TimeoutException as e:
            return self._failed(route, 504, f"the fleet control service at {self.url} did not "
                                f"answer {route.path} within {route.deadline:g} s ({e!r}); "
                                "its journal says how the operation ended (`rlfleet journal`)")
        except httpx.HTTPError as e:
            return self._failed(route, 503, f"the fleet control service at {self.url} cannot be "
                                f"reached ({e!r}): start it (`rlfleet control`) or fix "
                                "--fleet-control")
        keep = {k: v for k, v in r.headers.items()
                if k.lower() in ("content-type", "x-request-id")}
        return Response(r.content, status_code=r.status_code, headers=keep)

    @staticmethod
    def _failed(route: ControlRoute, status: int, message: str) -> Response:
        log.warning("%s", message)
        if route.dialect == "smg":
            code = smg.UPSTREAM_TIMEOUT if status == 504 else smg.UPSTREAM_UNREACHABLE
            return JSONResponse(smg.error(code, message), status_code=status)
        if route.dialect in ("sglang", "areal"):  # AReaL's server answers as SGLang's
            return JSONResponse({"success": False, "message": message}, status_code=status)
        return JSONResponse({"error": message}, status_code=status)


def control_routes(service: str | ControlForward) -> list[Route]:
    """The Starlette routes that forward every control route to the service (its URL, or
    a link to it that says who may call)."""
    link = service if isinstance(service, ControlForward) else ControlForward(service)

    def endpoint(route: ControlRoute):
        async def forward(request: Request) -> Response:
            return await link.forward(request, route)
        return forward
    return [Route(r.path, endpoint(r), methods=list(r.methods)) for r in FORWARDED]
