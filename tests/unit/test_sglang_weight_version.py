"""SGLang's GET /get_weight_version (and the weight_version of /get_model_info and
/server_info) at the frontend answers from discovery as it is when asked, not from the pool's
watch, which may not have seen yet the entries a worker rewrote before its update returned:
a client that updates the fleet and then asks reads the version it set."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
from starlette.applications import Starlette
from starlette.routing import Mount

from rlfleet.frontend.router import WorkerPool
from rlfleet.frontend.sglang import routes as sglang
from rlfleet.protocol.identity import PolicyIdentity
from rlfleet.runtime.discovery import FileDiscovery

OLD = PolicyIdentity(version="A", digest="d-a", step=0)
NEW = PolicyIdentity(version="B", digest="d-b", step=1)


def entry(iid: int, policy: PolicyIdentity) -> dict:
    return {"namespace": "ns", "component": "backend", "endpoint": "generate",
            "instance_id": iid, "model": "m", "transport": {"http": f"http://w{iid}"},
            "stream_plane": f"127.0.0.1:{iid}", "gated": False, **policy.stamped()}


def client(pool: WorkerPool) -> httpx.AsyncClient:
    app = Starlette(routes=[Mount("/", app=sglang.router)])
    app.state.frontend = SimpleNamespace(pool=pool)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://fe")


async def test_the_version_read_is_the_one_the_workers_just_published(tmp_path):
    async with FileDiscovery(tmp_path) as d:
        regs = [await d.register(entry(i, OLD), ttl=30) for i in (1, 2)]
        pool = WorkerPool(d, "ns")  # not started: its watch never moves past what it saw
        pool.update([entry(1, OLD), entry(2, OLD)])
        for i, reg in zip((1, 2), regs, strict=True):  # the update moved both workers
            await reg.update(entry(i, NEW))
        async with client(pool) as c:
            r = await c.get("/get_weight_version")
            assert r.status_code == 200, r.text
            assert r.json()["weight_version"] == "B" and r.json()["weight_step"] == 1
            assert (await c.get("/get_model_info")).json()["weight_version"] == "B"
            assert (await c.get("/server_info")).json()["weight_version"] == "B"
        assert {w.policy.version for w in pool.workers.values()} == {"B"}


async def test_a_store_that_cannot_be_read_leaves_the_last_view_to_answer(tmp_path):
    async with FileDiscovery(tmp_path) as d:
        pool = WorkerPool(d, "ns")
        pool.update([entry(1, OLD)])

    async def broken(*args, **kwargs):
        raise OSError("store unreachable")
    pool.discovery = SimpleNamespace(list=broken)  # type: ignore[assignment]
    async with client(pool) as c:
        r = await c.get("/get_weight_version")
        assert r.status_code == 200, r.text
        assert r.json()["weight_version"] == "A"
