"""The pieces a thousand-worker fleet leans on, without starting a process: the
coordinator's bounded fan-out and phase deadline (rlfleet.refresh.control), the file store's
change detection (a watch lists only when the directory changed or a lease ran out), and
one HTTP server answering several apps on their own sockets."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path

import httpx
import pytest

from rlfleet.protocol.admin import GET_WEIGHT_VERSION
from rlfleet.refresh.control import Channel, FleetWorker, for_each
from rlfleet.refresh.coordinator import PolicyRefresh
from rlfleet.runtime.discovery import FileDiscovery
from rlfleet.runtime.server import AppServer, bind_socket


def _workers(n: int) -> list[FleetWorker]:
    return [FleetWorker(i, f"http://w{i}", None) for i in range(n)]


async def test_the_channel_bounds_the_calls_in_flight() -> None:
    """However many workers a phase moves, at most `concurrency` admin calls are in flight."""
    in_flight = peak = 0

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"status": "ok"})

    async def slow_send(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return handler(request)

    class Slow(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request):
            return await slow_send(request)

    async with httpx.AsyncClient(transport=Slow()) as http:
        ch = Channel(http, 5.0, concurrency=8)
        ws = _workers(100)
        await for_each(ws, lambda w: ch.on(w, "verify", GET_WEIGHT_VERSION), ch.phase_deadline)
    assert peak == 8
    assert all(len(w.calls) == 1 and w.calls[0]["http_status"] == 200 for w in ws)


def test_the_call_concurrency_must_be_positive() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        Channel(httpx.AsyncClient(), 5.0, concurrency=0)
    with pytest.raises(ValueError, match="concurrency"):
        PolicyRefresh("http://127.0.0.1:1", concurrency=-3)
    with pytest.raises(ValueError, match="phase_timeout"):
        PolicyRefresh("http://127.0.0.1:1", phase_timeout=0)


async def test_a_late_worker_is_named_and_does_not_hold_up_the_others() -> None:
    """A worker still busy at the phase deadline is excluded as missing; the phase ends at
    the deadline with the others done."""
    ws = _workers(20)
    done: list[int] = []

    async def step(w: FleetWorker) -> int:
        await asyncio.sleep(30 if w.instance_id == 7 else 0.01)
        done.append(w.instance_id)
        return w.instance_id

    t0 = time.monotonic()
    results = await for_each(ws, step, 0.5)
    assert time.monotonic() - t0 < 5
    assert results[7] is None and sorted(done) == [i for i in range(20) if i != 7]
    assert ws[7].status == "missing" and "phase deadline" in ws[7].reason
    assert all(w.active for w in ws if w.instance_id != 7)


async def test_the_first_failure_cancels_the_phase() -> None:
    ws = _workers(5)
    cancelled = []

    async def step(w: FleetWorker) -> None:
        if w.instance_id == 2:
            raise RuntimeError("fenced")
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(w.instance_id)
            raise

    with pytest.raises(RuntimeError, match="fenced"):
        await for_each(ws, step, 10)
    assert sorted(cancelled) == [0, 1, 3, 4]


# ---------------------------------------------------------------- file discovery

def _entry(i: int, **kw) -> dict:
    return {"namespace": "ns", "component": "c", "endpoint": "e", "instance_id": i, **kw}


async def _next(gen, timeout: float = 5.0):
    return await asyncio.wait_for(anext(gen), timeout)


async def test_a_file_watch_lists_only_when_something_changed(tmp_path: Path,
                                                              monkeypatch) -> None:
    """Between changes a watch stats the directory (no listing), keep-alives touch files
    without changing the directory, and a join, an update and a leave each reach it."""
    d = FileDiscovery(tmp_path / "disc")
    monkeypatch.setattr(FileDiscovery, "HOT", 0.05)
    regs = [await d.register(_entry(i), ttl=0.9) for i in range(3)]
    scans = 0
    real = d._scan

    def counting():
        nonlocal scans
        scans += 1
        return real()
    monkeypatch.setattr(d, "_scan", counting)
    reader = FileDiscovery(tmp_path / "disc")
    reader_scans = 0
    real_reader = reader._scan

    def reader_counting():
        nonlocal reader_scans
        reader_scans += 1
        return real_reader()
    monkeypatch.setattr(reader, "_scan", reader_counting)
    async with contextlib.aclosing(reader.watch("ns", interval=0.05)) as gen:
        assert [e["instance_id"] for e in await _next(gen)] == [0, 1, 2]
        await asyncio.sleep(0.3)  # let the directory cool down
        before = reader_scans
        await asyncio.sleep(1.5)  # several keep-alives (ttl/3) and ~30 ticks
        assert reader_scans == before, "a quiet directory was listed again"
        assert os.stat(d._path(regs[0].key)).st_mtime > time.time() - 0.6  # touched
        await regs[1].update(_entry(1, gated=True))
        assert [e.get("gated") for e in await _next(gen)] == [None, True, None]
        new = await d.register(_entry(9), ttl=0.9)
        assert [e["instance_id"] for e in await _next(gen)] == [0, 1, 2, 9]
        await new.close()
        assert [e["instance_id"] for e in await _next(gen)] == [0, 1, 2]
    await d.close()
    await reader.close()


async def test_a_file_watch_notices_a_lapsed_lease_within_its_ttl(tmp_path: Path) -> None:
    """A registration that stops renewing (its owner stopped) drops out of the watch once
    its lease has run out, without any change to the directory."""
    d = FileDiscovery(tmp_path / "disc")
    keep = await d.register(_entry(1), ttl=1.0)
    stuck = await d.register(_entry(2), ttl=1.0)
    reader = FileDiscovery(tmp_path / "disc")
    async with contextlib.aclosing(reader.watch("ns", interval=0.05)) as gen:
        assert len(await _next(gen)) == 2
        stuck._task.cancel()  # its keep-alive stops, as in a stopped process
        t0 = time.monotonic()
        assert [e["instance_id"] for e in await _next(gen, 5)] == [1]
        assert time.monotonic() - t0 < 1.0 + 0.5
    await keep.close()
    await d.close()
    await reader.close()


async def test_one_server_answers_each_app_on_its_own_socket() -> None:
    async def app_for(name: str):
        async def app(scope, receive, send):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": name.encode()})
        return app

    pairs = [(await app_for(f"app{i}"), bind_socket("127.0.0.1", 0)) for i in range(5)]
    server = AppServer.shared(pairs)
    await server.start()
    try:
        async with httpx.AsyncClient() as c:
            for i, (_, sock) in enumerate(pairs):
                r = await c.get(f"http://127.0.0.1:{sock.getsockname()[1]}/")
                assert r.text == f"app{i}"
    finally:
        await server.stop()
