"""The rollout client's transport: httpx's own in pools of a few connections
(rlfleet.rollout.transport), against an in-process HTTP/1.1 server on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx
import pytest

from rlfleet.rollout.client import RolloutClient
from rlfleet.rollout.transport import ShardedTransport


def _against_server(delay: float, transport: ShardedTransport,
                    body: Callable[[httpx.AsyncClient, str, list[int]], Awaitable[None]]) -> None:
    """`body(client, url, accepted)` with a client on `transport`, against a keep-alive
    HTTP/1.1 server on loopback that answers every request with its path after `delay`
    seconds (`accepted` counts the connections it took)."""
    accepted = [0]

    async def conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted[0] += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1]
                await asyncio.sleep(delay)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(path), path))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def go() -> None:
        server = await asyncio.start_server(conn, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with server, httpx.AsyncClient(transport=transport) as http:
            await body(http, url, accepted)
    asyncio.run(go())


def test_requests_at_once_spread_over_pools_of_at_most_per_pool():
    t = ShardedTransport(max_connections=64, per_pool=4)

    async def body(http: httpx.AsyncClient, url: str, accepted: list[int]) -> None:
        for _ in range(2):  # the second wave reuses the first one's connections
            got = await asyncio.gather(*(http.get(f"{url}/r{i}") for i in range(20)))
            assert [r.text for r in got] == [f"/r{i}" for i in range(20)]
        assert len(t.pools) == 5
        assert all(len(p.transport._pool.connections) <= 4 for p in t.pools)
        assert all(p.active == 0 for p in t.pools)
        assert accepted[0] == 20  # kept alive: no new connection for the second wave
    _against_server(0.05, t, body)


def test_a_streamed_body_holds_its_pool_until_closed_and_a_failure_releases_it():
    t = ShardedTransport(max_connections=8, per_pool=2)

    async def body(http: httpx.AsyncClient, url: str, accepted: list[int]) -> None:
        async with http.stream("GET", f"{url}/s") as r:
            assert t.pools[0].active == 1
            assert await r.aread() == b"/s"
        assert t.pools[0].active == 0
        with pytest.raises(httpx.ConnectError):
            await http.get("http://127.0.0.1:1/")  # nothing listens there
        assert sum(p.active for p in t.pools) == 0
    _against_server(0.0, t, body)


def test_no_more_pools_than_max_connections_allow():
    t = ShardedTransport(max_connections=4, per_pool=2)

    async def body(http: httpx.AsyncClient, url: str, accepted: list[int]) -> None:
        got = await asyncio.gather(*(http.get(f"{url}/{i}") for i in range(12)))
        assert all(r.status_code == 200 for r in got)
        assert len(t.pools) == 2 and accepted[0] <= 4  # the rest waited in the pools
    _against_server(0.05, t, body)


def test_the_client_keeps_httpx_default_transport_under_an_environment_proxy(monkeypatch):
    async def transports() -> list[type]:
        out = []
        for proxy in (None, "http://proxy.invalid:3128"):
            if proxy:
                monkeypatch.setenv("HTTP_PROXY", proxy)
            async with RolloutClient("http://127.0.0.1:9", "m") as c:
                out.append(type(c._http._transport))
        return out
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    assert asyncio.run(transports()) == [ShardedTransport, httpx.AsyncHTTPTransport]


def test_a_request_cancelled_before_its_response_retires_its_pool():
    """httpcore may keep, unusable, the connection it was opening for a request cancelled
    before its response: that pool takes no new request, the requests under way on it end
    as usual, and its transport (every connection) is closed after the last of them."""
    t = ShardedTransport(max_connections=8, per_pool=2)

    async def body(http: httpx.AsyncClient, url: str, accepted: list[int]) -> None:
        dropped = asyncio.ensure_future(http.get(f"{url}/dropped"))
        await asyncio.sleep(0.05)
        first = t.pools[0]
        under_way = asyncio.ensure_future(http.get(f"{url}/under-way"))  # the same pool
        await asyncio.sleep(0.05)
        assert first.active == 2
        dropped.cancel()
        with pytest.raises(asyncio.CancelledError):
            await dropped
        assert first.retired and first not in t.pools
        assert (await under_way).text == "/under-way"
        assert first.active == 0 and not first.transport._pool.connections  # closed
        assert first not in t.retired
        after = await http.get(f"{url}/after")
        assert after.text == "/after" and t.pools[0] is not first
    _against_server(0.3, t, body)
