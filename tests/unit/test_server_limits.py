"""Server limits (issue 10 finding 5): a body over the limit is refused with 413 in the error
shape (by its length, and while a chunked one streams in), slow heads and idle sockets lose
their connection, and at the cap of connections the one idle longest makes room (a new
connection is served; 503 when none is idle). A real AppServer on
loopback with a tiny Starlette app behind it."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rlfleet.runtime.http import ERROR_HANDLERS, json_response
from rlfleet.runtime.limits import ServerLimits
from rlfleet.runtime.server import AppServer, bind_socket


async def echo_size(request: Request) -> Response:
    return json_response({"bytes": len(await request.body())})


APP = Starlette(routes=[Route("/echo", echo_size, methods=["POST"])],
                exception_handlers=ERROR_HANDLERS)


async def serve(limits: ServerLimits) -> AppServer:
    s = AppServer(APP, bind_socket("127.0.0.1", 0), limits=limits)
    await s.start()
    return s


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    """True when the server closes the connection within `seconds`."""
    try:
        return await asyncio.wait_for(reader.read(), seconds) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


async def test_body_over_the_limit_is_413_in_the_error_shape() -> None:
    s = await serve(ServerLimits(max_body_bytes=1000))
    try:
        async with httpx.AsyncClient(base_url=s.url, timeout=10) as http:
            ok = await http.post("/echo", content=b"x" * 1000)
            assert ok.status_code == 200 and ok.json() == {"bytes": 1000}
            big = await http.post("/echo", content=b"x" * 5000)  # Content-Length
            assert big.status_code == 413, big.text
            err = big.json()["error"]
            assert err["code"] == 413 and "--max-body-bytes" in err["message"]

            async def chunks():
                for _ in range(10):
                    yield b"y" * 400
            chunked = await http.post("/echo", content=chunks())  # no Content-Length
            assert chunked.status_code == 413, chunked.text
            assert (await http.post("/echo", content=b"z")).status_code == 200
    finally:
        await s.stop()


async def test_slow_heads_and_idle_sockets_are_closed_and_the_server_still_answers() -> None:
    s = await serve(ServerLimits(read_timeout=0.5, idle_timeout=0.5))
    try:
        idle_r, _idle_w = await asyncio.open_connection("127.0.0.1", s.port)
        slow_r, slow_w = await asyncio.open_connection("127.0.0.1", s.port)
        slow_w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\n")  # the head never ends
        await slow_w.drain()
        body_r, body_w = await asyncio.open_connection("127.0.0.1", s.port)
        body_w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
        await body_w.drain()
        assert await closed_within(idle_r, 5)
        assert await closed_within(slow_r, 5)
        late = await asyncio.wait_for(body_r.read(), 5)  # the body never completes: 408
        assert late.startswith(b"HTTP/1.1 408"), late[:100]
        async with httpx.AsyncClient(base_url=s.url, timeout=10) as http:
            assert (await http.post("/echo", content=b"ok")).status_code == 200
    finally:
        await s.stop()


async def test_at_the_cap_the_connection_idle_longest_makes_room() -> None:
    """Issue 43: at the cap a new connection is served, and the connection idle longest is
    closed to make room; when every connection has a request under way, the new one is
    answered 503 (never reset unanswered)."""
    s = await serve(ServerLimits(max_connections=4, read_timeout=None))
    held = []
    try:
        for _ in range(4):
            held.append(await asyncio.open_connection("127.0.0.1", s.port))
            await asyncio.sleep(0.02)  # in order: the first is idle longest
        async with httpx.AsyncClient(base_url=s.url, timeout=10) as http:
            assert (await http.post("/echo", content=b"ok")).status_code == 200
        assert await closed_within(held[0][0], 5)  # the one idle longest made room
        for r, _w in held[1:]:
            assert not await closed_within(r, 0.1)
        extra = await asyncio.open_connection("127.0.0.1", s.port)
        for _, w in [*held[1:], extra]:  # every connection busy: a request head under way
            w.write(b"POST /echo HTTP/1.1\r\nhost: x\r\n")
            await w.drain()
        await asyncio.sleep(0.1)
        extra2 = await asyncio.open_connection("127.0.0.1", s.port)  # 5 > 4: no idle one left
        answer = await asyncio.wait_for(extra2[0].read(), 5)
        assert answer.startswith(b"HTTP/1.1 503") and b'"code": 503' in answer, answer
        for _, w in [*held, extra, extra2]:
            w.close()
        await asyncio.sleep(0.2)
        async with httpx.AsyncClient(base_url=s.url, timeout=10) as http:
            assert (await http.post("/echo", content=b"ok")).status_code == 200
    finally:
        await s.stop()


def test_flags_parse_into_limits() -> None:
    import argparse

    p = argparse.ArgumentParser()
    ServerLimits.add_args(p)
    d = ServerLimits.from_args(p.parse_args([]))
    assert d.max_body_bytes == 32 << 20 and d.read_timeout == 30 and d.connections() >= 64
    off = ServerLimits.from_args(p.parse_args(["--max-body-bytes", "0", "--read-timeout", "0"]))
    assert off.max_body_bytes is None and off.read_timeout is None
    with pytest.raises(SystemExit):
        p.parse_args(["--max-body-bytes", "lots"])
