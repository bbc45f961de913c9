"""A pipelined fan-out of a staged version across real `python -m rlfleet.mocker` worker
processes (the mocker is a simulator: staging here is the real staging code and the real
chunk plane of the system server; no engine behaviour is claimed). A chain serves chunks
before it holds the whole version; a worker killed while its downstreams pull from it leaves
every other one READY with the version's digest; a downstream left without holders resumes
from the origin at the chunk it lacks; a chunk corrupted on the wire is refused by its
Adler-32 and fetched again; a binary tree of seven stages a version from S3, or from the
trainer's publisher, each worker pulling from its parent while the parent still receives,
and the origin sends the version about once."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from rlfleet.protocol import fanout as wire
from rlfleet.protocol.admin_vllm import FanoutOrigin
from rlfleet.runtime.server import AppServer, bind_socket
from rlfleet.testing.s3 import BUCKET
from rlfleet.weights.fanout import CHUNK_BYTES, fanout_sources
from rlfleet.weights.publish import Publisher, TrainerServer

TOKEN = "fanout-s3cret"
RATE = 8e6  # bytes/s the first worker reads the 32 MB version at: ~4 s of staging


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("fanout-versions")
    g = torch.Generator().manual_seed(7)
    tensors = {f"layer.{i}.weight": torch.randn(1 << 20, generator=g) for i in range(8)}
    pub = Publisher(f"file://{root / 'versions'}")
    return {"root": root / "versions", "v1": pub.publish(tensors, "v1"), "tensors": tensors}


@pytest.fixture(scope="module")
def s3_v1(s3_server, store) -> str:
    """The same version in S3: its URI."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in s3_server.env.items():
            mp.setenv(k, v)
        pub = Publisher(f"s3://{BUCKET}/fanout-tree", endpoint_url=s3_server.endpoint_url)
        assert pub.publish(store["tensors"], "v1")["digest"] == store["v1"]["digest"]
        pub.close()
    return f"s3://{BUCKET}/fanout-tree/v1"


@pytest.fixture(scope="module")
def fleet(start_module_fleet, store, s3_server):
    args = ("--served-model-name", "mock", "--system-port", "0", "--admin-token", TOKEN,
            "--allowed-weights-root", str(store["root"]))
    fleet = start_module_fleet([args] * 7, frontend=None, worker_env=s3_server.env)
    # A simulated worker imports torch on its first stage call (~2 s of CPU each; seven at
    # once on two cores take several seconds): warm them all together, so that the fan-outs
    # below time chunks between warm workers (a refused call is enough)
    with ThreadPoolExecutor(7) as pool:
        said = list(pool.map(lambda w: httpx.post(
            f"{w.ready['system_url']}/engine/stage_weights", timeout=60,
            json={"version": "warm-up", "source": {"kind": "disk"}},
            headers={"Authorization": f"Bearer {TOKEN}"}), fleet.workers))
    assert all("path" in r.json()["message"] for r in said), [r.text for r in said]
    return fleet


def _post(url: str, route: str, body: dict) -> dict:
    r = httpx.post(f"{url}/engine/{route}", json=body, timeout=30,
                   headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200, r.text
    return r.json()


def _summary(url: str, handle: str) -> dict:
    [h] = _post(url, "get_staged_weights", {"handle": handle})["staged"]
    return h


def _final(url: str, handle: str, timeout: float = 90) -> dict:
    deadline = time.monotonic() + timeout
    while (h := _summary(url, handle))["state"] == "STAGING":
        assert time.monotonic() < deadline, h
        time.sleep(0.1)
    return h


def _stage_all(urls: list[str], sources: list[dict], store) -> list[str]:
    handles = []
    for url, source in zip(urls, sources, strict=True):
        r = _post(url, "stage_weights", {"version": "v1", "source": source,
                                         "digest": store["v1"]["digest"]})
        assert r["status"] == "ok", r
        handles.append(r["handle"])
    return handles


def _release(urls: list[str], handles: list[str]) -> None:
    for url, handle in zip(urls, handles, strict=True):
        _post(url, "release_staged_weights", {"handle": handle})


def test_a_chain_serves_chunks_before_it_holds_the_version(fleet, store):
    urls = [w.ready["system_url"] for w in fleet.workers[:3]]
    origin = FanoutOrigin(uri=f"file://{store['root'] / 'v1'}")
    sources = fanout_sources(urls, "v1", origin)
    sources[0]["max_bytes_per_s"] = RATE
    handles = _stage_all(urls, sources, store)
    for u, h in zip(urls, handles, strict=True):
        _final(u, h)
    done = [_summary(u, h) for u, h in zip(urls, handles, strict=True)]  # all of them ended
    try:
        for h in done:
            assert h["state"] == "READY" and h["digest"] == store["v1"]["digest"], h
        head, middle, tail = (h["fanout"] for h in done)
        total = head["chunks_total"]
        assert total == store["v1"]["bytes_full"] // CHUNK_BYTES
        assert all(f["chunks_ready"] == total for f in (head, middle, tail))
        # the middle worker got chunks from the head while the head still staged, and the
        # tail from the middle one while it was itself still receiving: a pipelined chain
        assert middle["chunks_from_staging"] > 0 and tail["chunks_from_staging"] > 0
        assert head["chunks_served"] >= total and middle["chunks_served"] >= total
        assert middle["failovers"] == tail["failovers"] == 0
        assert done[1]["source"]["fanout"]["holders"] == []
        assert done[2]["source"]["fanout"]["holders"] == [urls[0]]
    finally:
        _release(urls, handles)


def test_bad_fanout_sources_are_refused_by_name(fleet):
    url = fleet.workers[0].ready["system_url"]
    for source, message in (
            ({"kind": "peer", "fanout": {}}, "source.url is required with source.fanout"),
            ({"kind": "peer", "url": url, "fanout": {"holders": ["ftp://x"]}},
             "is not a system URL"),
            ({"kind": "peer", "url": url, "fanout": {"stall": 0}}, "stall must be a positive"),
            ({"kind": "peer", "url": url, "fanout": {"origin": {"uri": "s3://b/v1", "x": 1}}},
             "source.fanout:.*unknown field")):
        r = _post(url, "stage_weights", {"version": "v1", "source": source})
        assert r["status"] == "error", r
        assert re.search(message, r["message"]), r["message"]


class _CorruptingProxy:
    """An HTTP proxy in front of a worker's system server that flips one byte of chunk
    `index` in the fan-out stream the first time it passes (the frame's Adler-32 is the
    holder's), from a thread of the test process."""

    def __init__(self, upstream: str, index: int) -> None:
        self.upstream, self.index, self.seen = upstream.rstrip("/"), index, 0
        app = FastAPI()
        app.add_api_route("/{path:path}", self._forward, methods=["GET"])
        self.server = AppServer(app, bind_socket("127.0.0.1", 0))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(30)
        self.url = self.server.url

    async def _forward(self, path: str, request: Request) -> Response:
        client = httpx.AsyncClient(timeout=30)
        r = await client.send(client.build_request(
            "GET", f"{self.upstream}/{path}", params=request.query_params,
            headers={"Authorization": request.headers["authorization"]}), stream=True)
        if r.status_code != 200 or not path.endswith("/stream"):
            body = await r.aread()
            await r.aclose()
            await client.aclose()
            return Response(body, status_code=r.status_code,
                            media_type=r.headers.get("content-type"))

        async def frames():
            buf, frame = bytearray(), wire.FRAME
            try:
                async for piece in r.aiter_raw():
                    buf += piece
                    while len(buf) >= frame.size:
                        index, length, _, _ = frame.unpack_from(buf)
                        if len(buf) < frame.size + length:
                            break
                        out = bytes(buf[:frame.size + length])
                        del buf[:frame.size + length]
                        if index == self.index:
                            self.seen += 1
                            if self.seen == 1:
                                out = out[:frame.size] + bytes([out[frame.size] ^ 0xFF]) + \
                                    out[frame.size + 1:]
                        yield out
            finally:
                await r.aclose()
                await client.aclose()
        return StreamingResponse(frames(), media_type="application/octet-stream")

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_a_corrupt_chunk_is_refused_by_its_adler32_and_fetched_again(fleet, store):
    a, b = (w.ready["system_url"] for w in fleet.workers[:2])
    proxy = _CorruptingProxy(a, index=5)
    try:
        sources = fanout_sources([a, b], "v1", FanoutOrigin(uri=f"file://{store['root'] / 'v1'}"))
        sources[1]["url"] = proxy.url  # the second pulls from the first through the proxy
        handles = _stage_all([a, b], sources, store)
        head, down = _final(a, handles[0]), _final(b, handles[1])
        try:
            assert head["state"] == "READY", head
            assert down["state"] == "READY" and down["digest"] == store["v1"]["digest"], down
            assert down["fanout"]["corrupt_chunks"] == 1
            assert down["fanout"]["failovers"] == 0  # fetched again from the same holder
            assert proxy.seen == 2  # chunk 5 passed twice: corrupt, then whole
        finally:
            _release([a, b], handles)
    finally:
        proxy.close()


def test_a_downstream_resumes_from_the_origin_when_no_holder_is_left(fleet, store):
    """The upstream's staging is released mid-transfer and the downstream names no other
    holder: it reads the chunks it still lacks from the origin artifact, not the whole
    version again."""
    a, b = (w.ready["system_url"] for w in fleet.workers[:2])
    sources = fanout_sources([a, b], "v1", FanoutOrigin(uri=f"file://{store['root'] / 'v1'}"))
    sources[0]["max_bytes_per_s"] = RATE
    handles = _stage_all([a, b], sources, store)
    deadline = time.monotonic() + 60
    while (_summary(b, handles[1]).get("fanout") or {}).get("chunks_ready", 0) == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert _summary(a, handles[0])["state"] == "STAGING"
    _post(a, "release_staged_weights", {"handle": handles[0]})
    down = _final(b, handles[1])
    try:
        assert down["state"] == "READY" and down["digest"] == store["v1"]["digest"], down
        f = down["fanout"]
        assert f["failovers"] == 1 and f["holder"] == "origin"
        assert 0 < f["origin_chunks"] < f["chunks_total"]  # resumed, not started over
        assert f["chunks_from_staging"] + f["origin_chunks"] == f["chunks_total"]
    finally:
        _post(b, "release_staged_weights", {"handle": handles[1]})


class _CountingRelay:
    """A TCP relay in front of a server (S3, a trainer's publisher), from a thread of the
    test process: `sent` counts the bytes the server sent through it (HTTP headers too)."""

    def __init__(self, url: str) -> None:
        parts = urllib.parse.urlsplit(url)
        self.target, self.sent = (parts.hostname, parts.port), 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._relay, "127.0.0.1", 0), self.loop).result(10)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, count: bool):
            with contextlib.suppress(OSError):
                while data := await src.read(1 << 16):
                    if count:
                        self.sent += len(data)
                    dst.write(data)
                    await dst.drain()
            dst.close()
        await asyncio.gather(pipe(reader, up_writer, False), pipe(up_reader, writer, True))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _stage_tree(fleet, store, origin: FanoutOrigin) -> list[dict]:
    """Seven workers stage v1 over a binary tree from `origin` (the root reads it slowly, so
    that every level still receives while it serves the next); their final summaries,
    checked: READY with the digest, each one from its parent and never from the origin."""
    urls = [w.ready["system_url"] for w in fleet.workers[:7]]
    sources = fanout_sources(urls, "v1", origin, degree=2, stall=5.0)
    sources[0]["max_bytes_per_s"] = RATE
    handles = _stage_all(urls, sources, store)
    try:
        done = [_final(u, h) for u, h in zip(urls, handles, strict=True)]
        done = [_summary(u, h) for u, h in zip(urls, handles, strict=True)]
    finally:
        _release(urls, handles)
    total = done[0]["fanout"]["chunks_total"]
    for i, h in enumerate(done):
        assert h["state"] == "READY" and h["digest"] == store["v1"]["digest"], (i, h)
        assert h["fanout"]["chunks_ready"] == total, (i, h["fanout"])
    for i in range(1, 7):
        f = done[i]["fanout"]
        assert done[i]["source"]["url"] == urls[(i - 1) // 2]  # its parent
        # pulled while its parent was still receiving, never from the origin, no failover
        assert f["chunks_from_staging"] > 0 and f["origin_chunks"] == 0, (i, f)
        assert f["failovers"] == 0, (i, f)
    for i in range(3):  # every inner node fed both its children
        assert done[i]["fanout"]["chunks_served"] >= 2 * total, (i, done[i]["fanout"])
    return done


def test_a_binary_tree_stages_a_version_from_s3_once(fleet, store, s3_v1, s3_server):
    relay = _CountingRelay(s3_server.endpoint_url)
    try:
        done = _stage_tree(fleet, store, FanoutOrigin(uri=s3_v1, endpoint_url=relay.url))
        assert done[0]["source"]["kind"] == "s3"
        ratio = relay.sent / store["v1"]["bytes_full"]
        print(f"S3 sent {relay.sent} bytes for 7 workers: {ratio:.3f} x the version")
        assert 1.0 <= ratio <= 1.2, ratio
    finally:
        relay.close()


def test_a_binary_tree_stages_a_trainer_version_from_the_trainer_once(fleet, store, tmp_path):
    """A version the trainer publishes (its TrainerServer): the root stages it from the
    trainer, the six others from their peers; the trainer sends it about once."""
    with TrainerServer(tmp_path / "trainer") as trainer:
        pub = Publisher(trainer.uri)
        assert pub.publish(store["tensors"], "v1")["digest"] == store["v1"]["digest"]
        relay = _CountingRelay(trainer.url)
        try:
            done = _stage_tree(fleet, store, FanoutOrigin(uri=f"{relay.url}/v1"))
            assert done[0]["source"]["kind"] == "trainer"
            ratio = relay.sent / store["v1"]["bytes_full"]
            print(f"the trainer sent {relay.sent} bytes for 7 workers: {ratio:.3f} x the "
                  "version")
            assert 1.0 <= ratio <= 1.2, ratio
        finally:
            relay.close()


def test_a_worker_killed_mid_fanout_leaves_the_others_ready(fleet, store):
    """A chain of four; the second is SIGKILLed while the third and fourth pull from the
    chain: the third fails over to the head and resumes from the chunk it has, the fourth
    goes on from the third, and every survivor ends READY with the version's digest. (Last
    in the module: the killed worker stays dead.)"""
    procs = fleet.workers[:4]
    urls = [p.ready["system_url"] for p in procs]
    sources = fanout_sources(urls, "v1", FanoutOrigin(uri=f"file://{store['root'] / 'v1'}"),
                             stall=3.0)
    sources[0]["max_bytes_per_s"] = RATE
    handles = _stage_all(urls, sources, store)
    deadline = time.monotonic() + 60
    while True:  # the fourth already holds chunks that came through the second
        third, fourth = _summary(urls[2], handles[2]), _summary(urls[3], handles[3])
        if (third.get("fanout") or {}).get("chunks_ready", 0) > 0 and \
                (fourth.get("fanout") or {}).get("chunks_ready", 0) > 0:
            break
        assert time.monotonic() < deadline, (third, fourth)
        time.sleep(0.02)
    head = _summary(urls[0], handles[0])
    assert head["state"] == "STAGING" and third["state"] == "STAGING", (head, third)
    assert third["fanout"]["chunks_ready"] < third["fanout"]["chunks_total"]
    procs[1].signal(signal.SIGKILL)
    procs[1].popen.wait(10)
    survivors = [0, 2, 3]
    done = {i: _final(urls[i], handles[i]) for i in survivors}
    for i, h in done.items():
        assert h["state"] == "READY" and h["digest"] == store["v1"]["digest"], (i, h)
        assert h["fanout"]["chunks_ready"] == h["fanout"]["chunks_total"]
    assert done[2]["fanout"]["failovers"] >= 1 and done[2]["fanout"]["holder"] == urls[0]
    assert done[2]["fanout"]["origin_chunks"] == 0  # the head served what the dead one did not
    _release([urls[i] for i in survivors], [handles[i] for i in survivors])
