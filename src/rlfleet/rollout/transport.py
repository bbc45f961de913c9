"""The rollout client's HTTP transport: httpx's own, split into pools of a few connections.

httpcore (httpx's connection pool, 1.0.x) looks at every connection of a pool each time a
request is queued and each time a response is closed: whether it has expired (for an idle
one, a poll of its socket), and, for each idle connection, how many of all are idle. With
one HTTP/1.1 connection per request in flight, a trainer running 64 samples at once paid
for thousands of such checks per request, about a third of its process's CPU per sample.
`ShardedTransport` keeps the same connections in pools of at most `per_pool`, each an
`httpx.AsyncHTTPTransport`; a request goes to the pool with the fewest requests in flight
(a new pool while every pool is full, up to `max_connections` in all), so each request's
checks see a few connections, not all of them. What a request sends and gets is httpx's.

A request cancelled before its response began (the trainer dropped it, an attempt timed
out) can leave httpcore 1.0 holding the connection it was opening for it, CONNECTING or
NEW, never released: a pool of a few connections is then full for good and the requests
sent to it wait forever (seen under load: samples failing on three 10 s timeouts in a row
while the frontend stood idle). Such a pool is retired: no request goes to it any more, and
its transport (every connection, the stuck ones too) is closed once its last response is."""

from __future__ import annotations

import asyncio
import math
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import httpx


def env_proxies() -> bool:
    """Whether the environment names an HTTP proxy (HTTP_PROXY, HTTPS_PROXY, ALL_PROXY),
    which httpx's default transport honours and a transport given to it does not: a
    client then keeps httpx's default."""
    proxies = urllib.request.getproxies()
    return any(proxies.get(k) for k in ("http", "https", "all"))


class _Pool:
    __slots__ = ("transport", "active", "retired_in")

    def __init__(self, transport: httpx.AsyncHTTPTransport) -> None:
        self.transport = transport
        self.active = 0  # requests whose response is not closed yet
        # retired: its transport's set of retired pools; it takes no request and is closed
        # (and leaves that set) once `active` is 0
        self.retired_in: set[_Pool] | None = None

    @property
    def retired(self) -> bool:
        return self.retired_in is not None

    async def release(self) -> None:
        """A request's response is closed (or it never got one)."""
        self.active -= 1
        if self.retired and not self.active:
            self.retired_in.discard(self)
            await self.transport.aclose()


class _Counted(httpx.AsyncByteStream):
    """A response's body: its pool's request is over once the body is closed."""

    __slots__ = ("stream", "pool")

    def __init__(self, stream: httpx.AsyncByteStream, pool: _Pool) -> None:
        self.stream: httpx.AsyncByteStream | None = stream
        self.pool = pool

    async def __aiter__(self) -> AsyncIterator[bytes]:
        assert self.stream is not None, "the response body was closed"
        async for chunk in self.stream:
            yield chunk

    async def aclose(self) -> None:
        stream, self.stream = self.stream, None
        if stream is not None:
            try:
                await stream.aclose()
            finally:
                await self.pool.release()


class ShardedTransport(httpx.AsyncBaseTransport):
    """httpx's transport for many requests at once (see the module docstring): at most
    `max_connections` connections, kept alive, in pools of at most `per_pool`; `options`
    go to each pool's `httpx.AsyncHTTPTransport`."""

    def __init__(self, max_connections: int, per_pool: int = 4, **options: Any) -> None:
        if max_connections < 1 or per_pool < 1:
            raise ValueError("max_connections and per_pool must be at least 1")
        self.per_pool = min(per_pool, max_connections)
        self.max_pools = math.ceil(max_connections / self.per_pool)
        self.options = options
        self.pools: list[_Pool] = []
        self.retired: set[_Pool] = set()  # retired pools not closed yet
        self._closing: set[asyncio.Task] = set()  # retired pools being closed

    def _pool(self) -> _Pool:
        pools = self.pools
        best = min(pools, key=lambda p: p.active) if pools else None
        if best is not None and (best.active < self.per_pool or len(pools) >= self.max_pools):
            return best
        limits = httpx.Limits(max_connections=self.per_pool,
                              max_keepalive_connections=self.per_pool)
        pool = _Pool(httpx.AsyncHTTPTransport(limits=limits, **self.options))
        pools.append(pool)
        return pool

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        pool = self._pool()
        pool.active += 1
        try:
            response = await pool.transport.handle_async_request(request)
        except asyncio.CancelledError:
            # httpcore may keep the connection it was opening for this request, unusable
            self._retire(pool)
            raise
        except BaseException:
            pool.active -= 1
            raise
        response.stream = _Counted(response.stream, pool)  # type: ignore[arg-type]
        return response

    def _retire(self, pool: _Pool) -> None:
        """`pool` (one of its requests was cancelled) takes no new request; its transport is
        closed once its last response is (here, in the background, if that was the one)."""
        if not pool.retired:
            pool.retired_in = self.retired
            self.pools.remove(pool)
            self.retired.add(pool)
        task = asyncio.ensure_future(pool.release())  # not awaited: the caller is cancelled
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def aclose(self) -> None:
        if self._closing:
            await asyncio.wait(self._closing)
        pools, self.pools = [*self.pools, *self.retired], []
        self.retired.clear()
        for p in pools:
            await p.transport.aclose()
