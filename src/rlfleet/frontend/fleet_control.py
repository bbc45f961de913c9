"""The control routes of vLLM's and SGLang's servers at the frontend's URL, forwarded to the
fleet control service (`rlfleet control`, rlfleet.refresh.fleet_control) when the frontend is
started with `--fleet-control URL`: a client written for one server sends generation and
control to the same address, and each control call becomes a fleet operation there. The
paths are the service's route table (rlfleet.protocol.fleet_control.FORWARDED); every frontend
process forwards to the one service, which owns the fleet's transactions.

The request goes on as it came (method, query, body, the Authorization header the service
checks its admin token against, X-Request-Id, traceparent), with a deadline per route (a
read is quick, an update moves every worker's weights); the answer comes back as the
service gave it. A service that cannot be reached is a 503 that names it."""

from __future__ import annotations

import logging

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


class ControlForward:
    """One frontend process's link to the service (one HTTP client, made on first use, in
    the process's own event loop)."""

    def __init__(self, url: str) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--fleet-control must be the service's http(s):// URL, not {url!r}")
        self.url = url.rstrip("/")
        self._http: httpx.AsyncClient | None = None

    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=8))
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def forward(self, request: Request, route: ControlRoute) -> Response:
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


def control_routes(url: str) -> list[Route]:
    """The Starlette routes that forward every control route to the service at `url`."""
    link = ControlForward(url)

    def endpoint(route: ControlRoute):
        async def forward(request: Request) -> Response:
            return await link.forward(request, route)
        return forward
    return [Route(r.path, endpoint(r), methods=list(r.methods)) for r in FORWARDED]
