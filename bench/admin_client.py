"""CPU per admin call on the coordinator's side, for the HTTP clients it could use, against a
worker's real system server (the mocker's route table, served by uvicorn in a process of its
own, so that only the client's CPU is in this process's time).

Each client keeps one connection alive per simulated worker (--workers of them, all calls
in flight at once, --calls each, one after the other), sends the coordinator's headers (the
fleet epoch), a JSON body, and gives every call a deadline; the reply is decoded as
rlfleet's admin client decodes it. Clients:

- httpx: a bare httpx.AsyncClient.post per call, one client per worker (as rlfleet's
  AdminConnections kept them before this bench): the baseline
- httpx-admin: rlfleet's AdminClient over a client per worker as it called before (httpx,
  the reply read into the route's Struct)
- rlfleet-admin: rlfleet's AdminClient as it is now (AdminConnections: one aiohttp session,
  the reply read into the route's Struct)
- aiohttp: one aiohttp.ClientSession per worker (`pip install aiohttp`: the bench extra)
- httpcore: one httpcore.AsyncConnectionPool per worker
- h11: a small client over asyncio streams with h11 framing and msgspec bodies (deadline:
  asyncio.timeout; TLS: the stream's ssl context)

    python bench/admin_client.py [--workers 64] [--calls 200] [--rounds 3]

Prints CPU microseconds per call for each, and the ratio to httpx (lower is cheaper),
side by side; the last line is one JSON object {"cpu_us_per_call": {...}, "ratio": {...}}."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import msgspec

from rlfleet.protocol import admin
from rlfleet.runtime.admin_client import AdminClient, AdminConnections

SERVER = """
import sys, uvicorn
from rlfleet.mocker.admin import MockAdmin
from rlfleet.mocker.engine import MockEngine
from rlfleet.worker.system_server import system_app
mock = MockAdmin(MockEngine(seed=1))
uvicorn.run(system_app(mock.routes(), fence=mock.fence), host="127.0.0.1",
            port=int(sys.argv[1]), log_level="warning", access_log=False)
"""
PATH = f"{admin.ROUTE_PREFIX}/{admin.GET_WEIGHT_VERSION.name}"
HEADERS = {admin.EPOCH_HEADER: "1", "content-type": "application/json"}
DEADLINE = 10.0

Call = Callable[[], Awaitable[dict]]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_up(url: str, server: subprocess.Popen) -> None:
    async with httpx.AsyncClient() as c:
        for _ in range(1200):
            if server.poll() is not None:
                raise RuntimeError(f"the system server exited with {server.returncode}")
            try:
                if (await c.get(f"{url}/health", timeout=1)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.05)
    raise TimeoutError("the system server did not start")


# ---------------------------------------------------------------- the clients, per worker


async def rlfleet_admin(url: str, n: int):
    clients = AdminConnections()
    ac = AdminClient(httpx.AsyncClient(), DEADLINE, epoch=1, workers=clients)

    def one(_: int) -> Call:
        async def call() -> dict:
            res = await ac.call(url, admin.GET_WEIGHT_VERSION)
            assert res.ok, res.body
            return res.body
        return call

    async def close() -> None:
        await clients.aclose()
        await ac.http.aclose()
    return [one(i) for i in range(n)], close


async def httpx_admin(url: str, n: int):
    # without AdminConnections, AdminClient calls through its httpx client: one per worker here
    acs = [AdminClient(httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=2)),
                       DEADLINE, epoch=1) for _ in range(n)]

    def one(ac: AdminClient) -> Call:
        async def call() -> dict:
            res = await ac.call(url, admin.GET_WEIGHT_VERSION)
            assert res.ok, res.body
            return res.body
        return call

    async def close() -> None:
        for ac in acs:
            await ac.http.aclose()
    return [one(ac) for ac in acs], close


async def httpx_bare(url: str, n: int):
    # one client per worker, as AdminConnections keeps them (every worker is its own origin)
    clients = [httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=2))
               for _ in range(n)]

    def one(c: httpx.AsyncClient) -> Call:
        async def call() -> dict:
            r = await c.post(url + PATH, content=b"{}", headers=HEADERS, timeout=DEADLINE)
            return msgspec.json.decode(r.content)
        return call

    async def close() -> None:
        for c in clients:
            await c.aclose()
    return [one(c) for c in clients], close


async def aiohttp_client(url: str, n: int):
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=DEADLINE)
    sessions = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=2),
                                      timeout=timeout) for _ in range(n)]

    def one(s) -> Call:
        async def call() -> dict:
            async with s.post(url + PATH, data=b"{}", headers=HEADERS) as r:
                return msgspec.json.decode(await r.read())
        return call

    async def close() -> None:
        for s in sessions:
            await s.close()
    return [one(s) for s in sessions], close


async def httpcore_client(url: str, n: int):
    import httpcore

    pools = [httpcore.AsyncConnectionPool(max_keepalive_connections=2) for _ in range(n)]
    ext = {"timeout": {"connect": DEADLINE, "read": DEADLINE, "write": DEADLINE,
                       "pool": DEADLINE}}
    hdrs = list(HEADERS.items())

    def one(p) -> Call:
        async def call() -> dict:
            r = await p.request("POST", url + PATH, headers=hdrs, content=b"{}",
                                extensions=ext)
            return msgspec.json.decode(r.content)
        return call

    async def close() -> None:
        for p in pools:
            await p.aclose()
    return [one(p) for p in pools], close


class H11Connection:
    """One kept-alive HTTP/1.1 connection: h11 framing over asyncio streams."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes, headers: dict[str, str],
                   deadline: float) -> tuple[int, bytes]:
        import h11

        async with asyncio.timeout(deadline):
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
                self.conn = h11.Connection(h11.CLIENT)
            conn = self.conn
            hs = [("host", f"{self.host}:{self.port}"), ("content-length", str(len(body))),
                  *headers.items()]
            self.writer.write(conn.send(h11.Request(method="POST", target=path, headers=hs))
                              + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
            status, chunks = 0, []
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await self.reader.read(65536))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    chunks.append(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    conn.start_next_cycle()
                    return status, b"".join(chunks)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def h11_client(url: str, n: int):
    from urllib.parse import urlsplit

    u = urlsplit(url)
    conns = [H11Connection(u.hostname, u.port) for _ in range(n)]

    def one(c: H11Connection) -> Call:
        async def call() -> dict:
            _, body = await c.post(PATH, b"{}", HEADERS, DEADLINE)
            return msgspec.json.decode(body)
        return call

    async def close() -> None:
        for c in conns:
            await c.close()
    return [one(c) for c in conns], close


CLIENTS = {"httpx": httpx_bare, "httpx-admin": httpx_admin, "rlfleet-admin": rlfleet_admin,
           "aiohttp": aiohttp_client, "httpcore": httpcore_client, "h11": h11_client}


async def measure(make, url: str, workers: int, calls: int) -> float:
    """CPU microseconds per call: every worker's calls one after the other, all at once."""
    per_worker, close = await make(url, workers)
    try:
        await asyncio.gather(*(c() for c in per_worker))  # connections open, warm
        c0 = time.process_time()

        async def run(call: Call) -> None:
            for _ in range(calls):
                body = await call()
                assert body.get("status") == "ok", body
        await asyncio.gather(*(run(c) for c in per_worker))
        return (time.process_time() - c0) / (workers * calls) * 1e6
    finally:
        await close()


async def main_async(a: argparse.Namespace) -> dict[str, float]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)],
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] /
                                                                   "src")})
    try:
        await wait_up(url, server)
        out: dict[str, list[float]] = {}
        for _ in range(a.rounds):  # interleaved: a busy box slows every client alike
            for name in a.clients.split(","):
                out.setdefault(name, []).append(
                    await measure(CLIENTS[name], url, a.workers, a.calls))
        return {k: round(min(v), 1) for k, v in out.items()}
    finally:
        server.terminate()
        server.wait(10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", default=",".join(CLIENTS))
    a = p.parse_args()
    cpu = asyncio.run(main_async(a))
    base = cpu.get("httpx") or next(iter(cpu.values()))
    print(f"{'client':>14} {'CPU us/call':>12} {'x httpx':>8}")
    for k, v in cpu.items():
        print(f"{k:>14} {v:>12} {v / base:>8.2f}")
    print(json.dumps({"cpu_us_per_call": cpu, "ratio": {k: round(v / base, 3)
                                                        for k, v in cpu.items()},
                      "workers": a.workers, "calls": a.calls}))


if __name__ == "__main__":
    main()
