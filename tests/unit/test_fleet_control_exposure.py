"""Who may change the fleet through a frontend that forwards fleet control (issue 43): on a
frontend without an admin token only loopback callers and the networks --fleet-control-from
names; with one, whoever presents it; reads are for everyone. And the warning a frontend
logs when it binds beyond loopback with control forwarding and no token."""

from __future__ import annotations

import httpx
import pytest
from starlette.applications import Starlette

from rlfleet.frontend.__main__ import parse_args
from rlfleet.frontend.fleet_control import ControlForward, control_routes, exposure

UNREACHABLE = "http://127.0.0.1:9"  # a forwarded call answers 503 (the service is not there)


async def _call(link: ControlForward, caller: str, path: str = "/pause", method: str = "POST",
                headers: dict | None = None) -> httpx.Response:
    app = Starlette(routes=control_routes(link))
    transport = httpx.ASGITransport(app=app, client=(caller, 40000))
    async with httpx.AsyncClient(transport=transport, base_url="http://frontend") as http:
        return await http.request(method, path, headers=headers or {})


async def test_without_a_token_only_loopback_and_named_networks_may_change_the_fleet():
    link = ControlForward(UNREACHABLE, allowed=["10.1.0.0/16"])
    for caller in ("127.0.0.1", "::1", "10.1.2.3"):
        r = await _call(link, caller)
        assert r.status_code == 503 and "cannot be reached" in r.json()["error"], (caller, r.text)
    for caller in ("192.0.2.2", "10.2.0.1", "::ffff:192.0.2.9"):
        r = await _call(link, caller)
        assert r.status_code == 403, (caller, r.text)
        assert "no admin token" in r.json()["error"] and "--fleet-control-from" in r.json()["error"]
    r = await _call(link, "192.0.2.2", "/pause_generation")  # SGLang's shape
    assert r.status_code == 403 and r.json()["success"] is False
    r = await _call(link, "192.0.2.2", "/is_paused", "GET")  # a read: forwarded
    assert r.status_code == 503


async def test_with_a_token_a_caller_elsewhere_presents_it():
    link = ControlForward(UNREACHABLE, admin_token="s3cret")
    r = await _call(link, "192.0.2.2")
    assert r.status_code == 403 and "admin token" in r.json()["error"]
    r = await _call(link, "192.0.2.2", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 403
    r = await _call(link, "192.0.2.2", headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 503  # forwarded


def test_a_frontend_beyond_loopback_without_a_token_warns():
    assert exposure("127.0.0.1", UNREACHABLE, None, []) is None
    assert exposure("0.0.0.0", None, None, []) is None  # nothing forwarded
    assert exposure("0.0.0.0", UNREACHABLE, "tok", []) is None
    said = exposure("0.0.0.0", UNREACHABLE, None, [])
    assert "beyond loopback, without an admin token" in said and "loopback only" in said
    said = exposure("192.0.2.2", UNREACHABLE, None, ["10.0.0.0/8"])
    assert "10.0.0.0/8 (--fleet-control-from)" in said


def test_the_flag_is_checked_at_start():
    args = parse_args(["--fleet-control", UNREACHABLE, "--fleet-control-from", "10.0.0.0/8",
                       "--fleet-control-from", "192.0.2.7"])
    assert args.fleet_control_from == ["10.0.0.0/8", "192.0.2.7"]
    with pytest.raises(SystemExit):
        parse_args(["--fleet-control", UNREACHABLE, "--fleet-control-from", "ten"])
    with pytest.raises(SystemExit):
        parse_args(["--fleet-control-from", "10.0.0.0/8"])  # nothing to forward
