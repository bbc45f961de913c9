"""The one client of the admin routes (`rlfleet.protocol.admin`): a call names a route of
the table and passes its request Struct; the answer carries the HTTP status, the reply as
the route's reply Struct, and the body as it came (plain JSON, for a journal). Every call
has a deadline and carries the admin token, the caller's fleet epoch and its traceparent."""

from __future__ import annotations

import json
import ssl
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import urlsplit

import aiohttp
import httpx
import msgspec

from rlfleet.protocol import admin
from rlfleet.protocol.admin import AdminRoute
from rlfleet.runtime import tracing

R = TypeVar("R")


@dataclass(frozen=True)
class CallResult(Generic[R]):
    """What a call came back with. `reply` is the route's reply Struct when the worker
    answered 200 with a body of that shape; `body` is the JSON as it came (or, when the
    worker could not be reached, `{"error": ...}`)."""

    route: AdminRoute
    http_status: int | None  # None: the worker could not be reached
    body: Any
    reply: R | None = None
    error: str | None = None  # why the call failed before an answer (unreachable)

    @property
    def unreachable(self) -> bool:
        return self.http_status is None

    @property
    def ok(self) -> bool:
        """HTTP 200 with a reply of the route's shape that says so (`status: ok` or SGLang's
        `success: true`)."""
        b = self.body
        return self.http_status == 200 and self.reply is not None and isinstance(b, dict) and (
            b.get("status") == "ok" or b.get("success") is True)

    @property
    def stale_epoch(self) -> bool:
        """Whether the worker refused the caller's fleet epoch (HTTP 409)."""
        return self.http_status == 409 and isinstance(self.body, dict) and \
            self.body.get("error") == admin.STALE_EPOCH

    @property
    def message(self) -> Any:
        """What the worker (or the transport) said."""
        if self.error is not None:
            return self.error
        if isinstance(self.body, dict):
            return self.body.get("message", self.body)
        return self.body


class AdminConnections:
    """The connections to workers' system servers (admin HTTP) that a coordinator keeps:
    one small HTTP client per worker (per scheme://host:port), for one that calls a
    thousand of them. One shared client would hold their connections in one pool,
    and httpcore scans every connection of its pool (and, per idle one, every connection
    again) on each request it starts or ends: a phase over N workers costs N² there. Each
    worker's own pool keeps its one connection alive from phase to phase, at O(1) a call;
    the coordinator holds at most two descriptors per worker (see
    `rlfleet.runtime.limits.raise_fd_limit`). The clients share one TLS context.

    Admin calls and a refresh's probes go through one aiohttp session instead (`session`):
    the same keep-alive, deadlines and TLS at a fraction of httpx's CPU per call (bench/
    admin_client.py), which was most of a coordinator's CPU in a refresh of many workers;
    `get` (httpx) stays for callers that need an httpx client."""

    def __init__(self, keepalive: int = 2, tls: ssl.SSLContext | None = None) -> None:
        """`tls`: the TLS context its clients share (default: ssl.create_default_context(),
        made on first use; a caller that opens many of these passes one it keeps)."""
        self._keepalive = keepalive
        self._limits = httpx.Limits(max_connections=None, max_keepalive_connections=keepalive)
        self._clients: dict[str, httpx.AsyncClient] = {}
        self._sessions: dict[str, aiohttp.ClientSession] = {}
        self._tls = tls

    def session(self, url: str) -> aiohttp.ClientSession:
        """The aiohttp session for `url` (made on first use): one for every worker, since
        aiohttp's connector finds an origin's kept-alive connections by key (O(1) a call,
        unlike httpcore's pool scan), with no bound on connections (the channel bounds the
        calls in flight)."""
        session = self._sessions.get("")
        if session is None:
            if self._tls is None:
                self._tls = ssl.create_default_context()
            session = self._sessions[""] = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, ssl=self._tls),
                skip_auto_headers=("User-Agent",))
        return session

    def get(self, url: str) -> httpx.AsyncClient:
        """The client for `url`'s origin (made on first use)."""
        parts = urlsplit(url)
        origin = f"{parts.scheme}://{parts.netloc}"
        client = self._clients.get(origin)
        if client is None:
            if self._tls is None:
                self._tls = ssl.create_default_context()
            client = self._clients[origin] = httpx.AsyncClient(limits=self._limits,
                                                               verify=self._tls)
        return client

    async def aclose(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        sessions, self._sessions = list(self._sessions.values()), {}
        for c in clients:
            await c.aclose()
        for s in sessions:
            await s.close()

    async def __aenter__(self) -> AdminConnections:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


@dataclass
class AdminClient:
    """Calls to workers' system servers with one token, deadline and fleet epoch."""

    http: httpx.AsyncClient
    timeout: float
    admin_token: str | None = None
    epoch: int | None = None
    workers: AdminConnections | None = None  # one client per worker (else `http` for all)
    #: False: `epoch` is not the workers' fleet epoch but one that fences in request bodies
    #: (a LoRA adapter's own, rlfleet.refresh.adapter), so no call carries it in the header
    epoch_header: bool = True

    @property
    def headers(self) -> dict[str, str]:
        out = {admin.AUTH_HEADER: admin.bearer(self.admin_token)} if self.admin_token else {}
        if self.epoch is not None and self.epoch_header:
            out[admin.EPOCH_HEADER] = str(self.epoch)
        tp = tracing.outgoing()  # the worker's span joins the caller's
        if tp:
            out["traceparent"] = tp
        return out

    async def call(self, system_url: str, route: AdminRoute, request: Any = None,
                   timeout: float | None = None) -> CallResult[Any]:
        """POST {system_url}/engine/<route> with `request` (the route's request Struct;
        None: no fields)."""
        content = msgspec.json.encode(request) if request is not None else b"{}"
        if self.workers is not None:
            return await self._call_aio(system_url, route, content, timeout or self.timeout)
        try:
            http = self.workers.get(system_url) if self.workers is not None else self.http
            r = await http.post(f"{system_url}{admin.ROUTE_PREFIX}/{route.name}",
                                     content=content, timeout=timeout or self.timeout,
                                     headers={**self.headers,
                                              "content-type": "application/json"})
        except httpx.HTTPError as e:
            return CallResult(route, None, {"error": repr(e)}, error=repr(e))
        try:
            body = r.json()
        except ValueError:
            body = {"raw": r.text[:500]}
        return answered(route, r.status_code, body)


    async def _call_aio(self, system_url: str, route: AdminRoute, content: bytes,
                        timeout: float) -> CallResult[Any]:
        """The call through the worker's aiohttp session (see AdminConnections)."""
        session = self.workers.session(system_url)
        try:
            async with session.post(f"{system_url}{admin.ROUTE_PREFIX}/{route.name}",
                                    data=content, timeout=aiohttp.ClientTimeout(total=timeout),
                                    headers={**self.headers,
                                             "content-type": "application/json"}) as r:
                status, raw = r.status, await r.read()
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            return CallResult(route, None, {"error": repr(e)}, error=repr(e))
        try:
            body = msgspec.json.decode(raw)
        except ValueError:
            try:  # what msgspec refuses but Python's json reads (NaN, Infinity)
                body = json.loads(raw)
            except ValueError:
                body = {"raw": raw[:500].decode(errors="replace")}
        return answered(route, status, body)


def answered(route: AdminRoute, status: int, body: Any) -> CallResult[Any]:
    """The result of a call of `route` that answered `status` with `body` (also a step a
    worker ran for the caller inside one call: commit_policy)."""
    return CallResult(route, status, body, _reply(route, status, body))


def _reply(route: AdminRoute, status: int, body: Any) -> Any:
    if status != 200 or not isinstance(body, dict):
        return None
    try:
        return msgspec.convert(body, route.reply)
    except msgspec.ValidationError:
        return None
