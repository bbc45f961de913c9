"""The worker system server's shared HTTP behaviour (docs/contract.md, "Worker system server"),
driven in-process: body parsing, errors, the route listing, the admin token, fault
injection and per-worker serialisation. The `exit` fault is tested on a real process in
tests/integration/test_mocker_admin.py."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from rlfleet.protocol.admin import AdminRoute
from rlfleet.protocol.admin_base import Reply
from rlfleet.worker.system_server import FaultInjector, FleetFence, system_app
from rlfleet.worker.system_server import Route as ServedRoute

TOKEN = "s3cret"


def Route(name: str, handler, **flags: Any) -> ServedRoute:  # noqa: N802
    """A test route: its body is any JSON object, handed to the handler as it is."""
    return ServedRoute(AdminRoute(name, dict[str, Any], Reply, **flags), handler)


def ok(**fields: Any) -> dict[str, Any]:
    return {"status": "ok", **fields}


async def echo(body: dict[str, Any]) -> dict[str, Any]:
    return ok(body=body)


async def boom(body: dict[str, Any]) -> dict[str, Any]:
    raise RuntimeError("kaputt")


async def expected_failure(body: dict[str, Any]) -> Reply:
    return Reply.failed("not now")


def client_for(routes: list[ServedRoute], **kw: Any) -> httpx.AsyncClient:
    app = system_app(routes, **kw)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://system")


@pytest.fixture
async def client():
    routes = [Route("echo", echo), Route("boom", boom), Route("nope", expected_failure),
              Route("zeta", echo, mutating=False), Route("alpha/nested", echo)]
    async with client_for(routes, faults=FaultInjector()) as c:
        yield c


# ---------------------------------------------------------------- bodies and errors


async def test_empty_body_is_an_empty_object_and_get_is_accepted(client) -> None:
    for resp in (await client.post("/engine/echo"), await client.post("/engine/echo", content=b"  "),
                 await client.get("/engine/echo")):
        assert resp.status_code == 200
        assert resp.json() == {"status": "ok", "body": {}}
    resp = await client.post("/engine/echo", json={"a": [1, 2]})
    assert resp.json() == {"status": "ok", "body": {"a": [1, 2]}}


async def test_invalid_json_is_400(client) -> None:
    resp = await client.post("/engine/echo", content=b"{not json",
                             headers={"content-type": "application/json"})
    assert resp.status_code == 400
    body = resp.json()
    assert body["error"] == "Invalid JSON" and isinstance(body["message"], str) and body["message"]


@pytest.mark.parametrize("raw", [b"[1, 2]", b"\"text\"", b"42", b"null", b"true"])
async def test_json_that_is_not_an_object_is_a_200_error(client, raw: bytes) -> None:
    resp = await client.post("/engine/echo", content=raw)
    assert resp.status_code == 200
    assert resp.json() == {"status": "error", "message": "request body must be a JSON object"}


@pytest.mark.parametrize("name", ["x", "nested/route", "fault_injection_x"])
async def test_unknown_route_is_404(client, name: str) -> None:
    for resp in (await client.post(f"/engine/{name}", json={}), await client.get(f"/engine/{name}")):
        assert resp.status_code == 404
        assert resp.json() == {"error": "Route not found",
                               "message": f"Route /engine/{name} not found"}


async def test_a_handler_that_raises_is_500_and_an_expected_failure_is_200(client) -> None:
    resp = await client.post("/engine/boom", json={})
    assert resp.status_code == 500
    body = resp.json()
    assert body["error"] == "Handler error" and "kaputt" in body["message"]
    resp = await client.post("/engine/nope", json={})
    assert resp.status_code == 200 and resp.json() == {"status": "error", "message": "not now"}
    # the server keeps serving
    assert (await client.post("/engine/echo")).status_code == 200


async def test_nested_route_names(client) -> None:
    resp = await client.post("/engine/alpha/nested", json={"k": 1})
    assert resp.status_code == 200 and resp.json()["body"] == {"k": 1}


async def test_route_listing_is_sorted_and_hides_fault_injection(client) -> None:
    resp = await client.get("/engine")
    assert resp.status_code == 200
    assert resp.json() == {"routes": ["alpha/nested", "boom", "echo", "nope", "zeta"]}


async def test_fault_injection_is_404_when_disabled() -> None:
    async with client_for([Route("echo", echo)]) as c:
        resp = await c.post("/engine/fault_injection", json={"route": "echo"})
        assert resp.status_code == 404
        assert resp.json() == {"error": "Route not found",
                               "message": "Route /engine/fault_injection not found"}


async def test_health_is_ready_once_the_worker_serves() -> None:
    """As Dynamo's workers answer (its RL end-to-end test waits for "ready"): 503 notready
    until the worker serves, then 200 ready; /live says the same; the worker's own fields
    stay."""
    serving = False
    async with client_for([], health=lambda: {"model": "m"}, ready=lambda: serving) as c:
        for path in ("/health", "/live"):
            resp = await c.get(path)
            assert resp.status_code == 503
            body = resp.json()
            assert body["status"] == "notready" and body["model"] == "m"
            assert set(body["uptime"]) == {"secs", "nanos"}
        serving = True
        for path in ("/health", "/live"):
            resp = await c.get(path)
            assert resp.status_code == 200
            assert resp.json()["status"] == "ready" and resp.json()["model"] == "m"


# ---------------------------------------------------------------- admin token


async def test_admin_token_guards_mutating_routes_only() -> None:
    routes = [Route("mutate", echo), Route("read", echo, mutating=False)]
    async with client_for(routes, admin_token=TOKEN, faults=FaultInjector()) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                        {"Authorization": f"Basic {TOKEN}"}):
            resp = await c.post("/engine/mutate", json={}, headers=headers)
            assert resp.status_code == 401, headers
            assert resp.json()["error"] == "Unauthorized"
        resp = await c.post("/engine/mutate", json={"x": 1},
                            headers={"Authorization": f"Bearer {TOKEN}"})
        assert resp.status_code == 200 and resp.json() == {"status": "ok", "body": {"x": 1}}
        # non-mutating routes and the listing need no token
        assert (await c.post("/engine/read", json={})).status_code == 200
        assert (await c.get("/engine")).status_code == 200
        # arming a fault is mutating too
        resp = await c.post("/engine/fault_injection", json={"route": "read"})
        assert resp.status_code == 401
        # the token is checked before the body is parsed
        resp = await c.post("/engine/mutate", content=b"{bad")
        assert resp.status_code == 401


# ---------------------------------------------------------------- fault injection


async def arm(c: httpx.AsyncClient, **body: Any) -> dict:
    resp = await c.post("/engine/fault_injection", json=body)
    assert resp.status_code == 200
    return resp.json()


async def test_fault_error_mode_and_times(client) -> None:
    assert await arm(client, route="echo", mode="error", times=2) == \
        {"status": "ok", "route": "echo", "mode": "error", "times": 2}
    for _ in range(2):
        resp = await client.post("/engine/echo", json={})
        assert resp.status_code == 200
        assert resp.json() == {"status": "error", "message": "injected failure of echo"}
    assert (await client.post("/engine/echo", json={})).json()["status"] == "ok"


async def test_fault_default_is_one_error(client) -> None:
    await arm(client, route="zeta")
    assert (await client.post("/engine/zeta")).json()["status"] == "error"
    assert (await client.post("/engine/zeta")).json()["status"] == "ok"


async def test_fault_http500_mode(client) -> None:
    await arm(client, route="echo", mode="http500")
    resp = await client.post("/engine/echo", json={})
    assert resp.status_code == 500
    assert resp.json()["error"] == "Handler error"
    assert "injected failure of echo" in resp.json()["message"]
    assert (await client.post("/engine/echo", json={})).status_code == 200


async def test_fault_hang_mode(client) -> None:
    await arm(client, route="echo", mode="hang", hang_seconds=0.3)
    t0 = time.monotonic()
    resp = await client.post("/engine/echo", json={})
    assert time.monotonic() - t0 >= 0.3
    assert resp.status_code == 200 and resp.json()["status"] == "error"
    t0 = time.monotonic()
    assert (await client.post("/engine/echo", json={})).json()["status"] == "ok"
    assert time.monotonic() - t0 < 0.3


async def test_fault_zero_times_disarms(client) -> None:
    await arm(client, route="echo", times=5)
    assert await arm(client, route="echo", times=0) == \
        {"status": "ok", "route": "echo", "mode": "error", "times": 0}
    assert (await client.post("/engine/echo", json={})).json()["status"] == "ok"


async def test_fault_delay_runs_the_route_after_the_delay(client) -> None:
    await arm(client, route="echo", mode="delay", hang_seconds=0.05)
    assert (await client.post("/engine/echo", json={"a": 1})).json() == \
        {"status": "ok", "body": {"a": 1}}


@pytest.mark.parametrize(("body", "words"), [
    ({}, "route is required"),
    ({"route": ""}, "route is required"),
    ({"route": "echo", "mode": "explode"}, "Invalid mode 'explode'; expected error|http500|hang|exit"),
    ({"route": "echo", "times": -1}, "times must be a non-negative integer"),
    ({"route": "echo", "times": "2"}, "times must be a non-negative integer"),
])
async def test_fault_injection_validates(client, body: dict, words: str) -> None:
    out = await arm(client, **body)
    assert out["status"] == "error" and words in out["message"]
    assert (await client.post("/engine/echo", json={})).json()["status"] == "ok"


# ---------------------------------------------------------------- serialisation


async def test_serialized_routes_run_one_after_the_other() -> None:
    log: list[tuple[str, str]] = []

    def slow(name: str, seconds: float):
        async def handler(body: dict) -> dict:
            log.append((name, "start"))
            await asyncio.sleep(seconds)
            log.append((name, "end"))
            return ok()
        return handler

    routes = [Route("a", slow("a", 0.2)), Route("b", slow("b", 0.2)),
              Route("free", slow("free", 0.0), serialized=False)]
    async with client_for(routes) as c:

        async def free_later() -> httpx.Response:
            await asyncio.sleep(0.05)  # while `a` or `b` holds the lock
            return await c.post("/engine/free")

        responses = await asyncio.gather(c.post("/engine/a"), c.post("/engine/b"), free_later())
    assert [r.status_code for r in responses] == [200, 200, 200]
    serialized = [e for e in log if e[0] != "free"]
    first, second = serialized[0][0], serialized[2][0]
    assert {first, second} == {"a", "b"}
    # one after the other: start, end, start, end
    assert serialized == [(first, "start"), (first, "end"), (second, "start"), (second, "end")]
    # the non-serialized route ran while the first one held the lock
    assert log.index((first, "start")) < log.index(("free", "start")) \
        < log.index(("free", "end")) < log.index((first, "end"))


# ---------------------------------------------------------------- fleet-epoch fencing


def epoch(n: int | str) -> dict[str, str]:
    return {"X-Fleet-Epoch": str(n)}


async def test_a_call_from_an_older_epoch_is_refused_naming_both() -> None:
    fence = FleetFence()
    changes: list[int] = []

    async def changed() -> None:
        changes.append(fence.newest)

    routes = [Route("echo", echo), Route("read", echo, mutating=False, serialized=False)]
    async with client_for(routes, fence=fence, changed=changed) as c:
        assert (await c.post("/engine/echo", headers=epoch(5))).status_code == 200
        assert fence.newest == 5 and changes == [5]
        for route in ("echo", "read"):
            resp = await c.post(f"/engine/{route}", headers=epoch(4))
            assert resp.status_code == 409
            body = resp.json()
            assert body["error"] == "Stale fleet epoch"
            assert (body["fleet_epoch"], body["newest_fleet_epoch"]) == (4, 5)
            assert "epoch 4 is older than epoch 5" in body["message"]
        # the same epoch and calls without one pass; a read never advances the epoch
        assert (await c.post("/engine/echo", headers=epoch(5))).status_code == 200
        assert (await c.post("/engine/echo")).status_code == 200
        assert (await c.post("/engine/read", headers=epoch(9))).status_code == 200
        assert fence.newest == 5
        assert (await c.post("/engine/echo", headers=epoch(6))).status_code == 200
        assert fence.newest == 6 and changes[-1] == 6
        for bad in ("-1", "x", "1.5", "9" * 25):
            resp = await c.post("/engine/echo", headers=epoch(bad))
            assert resp.status_code == 400 and resp.json()["error"] == "Invalid fleet epoch"
        assert fence.newest == 6


async def test_a_queued_call_is_refused_once_a_newer_epoch_arrived() -> None:
    """A call from epoch 1 waiting for the control lock behind a slow one does not run
    after a call from epoch 2 arrived meanwhile: nothing older runs once a newer epoch is
    seen."""
    ran: list[str] = []

    async def slow(body: dict) -> dict:
        ran.append(body["who"])
        await asyncio.sleep(0.3)
        return ok()

    async with client_for([Route("slow", slow)]) as c:
        first = asyncio.create_task(c.post("/engine/slow", json={"who": "a1"}, headers=epoch(1)))
        await asyncio.sleep(0.05)
        queued = asyncio.create_task(c.post("/engine/slow", json={"who": "a2"},
                                            headers=epoch(1)))
        await asyncio.sleep(0.05)
        newer = await c.post("/engine/slow", json={"who": "b"}, headers=epoch(2))
        assert (await first).status_code == 200 and newer.status_code == 200
        assert (await queued).status_code == 409
    assert ran == ["a1", "b"]
