"""Frontend routing and failure handling, driven with the mocker (the declared simulator)."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from rlfleet.testing.fleet import LocalFleet
from tests.fleets import wait_for_workers

MODEL = "mock"
SLOW = ("--served-model-name", MODEL, "--token-delay", "0.02")


def complete(url: str, **kw) -> httpx.Response:
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True,
            "nvext": {"extra_fields": ["worker_id", "completion_token_ids"]}, **kw}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def test_least_loaded_routing_and_membership_changes(tmp_path):
    with LocalFleet(tmp_path, lease_ttl=2) as fleet:
        fleet.start_frontend("--router-mode", "least-loaded")
        a = fleet.start_worker(*SLOW, kind="mocker")
        b = fleet.start_worker(*SLOW, kind="mocker")
        wait_for_workers(fleet.url, MODEL, 2)
        # a long request keeps one worker busy: the next ones go to the other
        hold = threading.Thread(target=complete, args=(fleet.url,), kwargs={"max_tokens": 150})
        hold.start()
        time.sleep(0.5)
        ids = {complete(fleet.url).json()["nvext"]["worker_id"]["decode_worker_id"]
               for _ in range(3)}
        assert len(ids) == 1
        hold.join()
        c = fleet.start_worker(*SLOW, kind="mocker")
        wait_for_workers(fleet.url, MODEL, 3)
        seen = set()
        for _ in range(30):
            seen.add(complete(fleet.url).json()["nvext"]["worker_id"]["decode_worker_id"])
        assert seen == {int(p.ready["instance_id"]) for p in (a, b, c)}
        c.stop()  # clean shutdown deregisters at once, no lease wait
        wait_for_workers(fleet.url, MODEL, 2, timeout=3)


def test_worker_failures_become_clear_errors(tmp_path):
    with LocalFleet(tmp_path, lease_ttl=30) as fleet:
        fleet.start_frontend("--request-timeout", "2")
        w = fleet.start_worker(*SLOW, kind="mocker")
        wait_for_workers(fleet.url, MODEL, 1)
        # unary request, worker killed mid-request: a JSON error, not a hang
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(r=complete(fleet.url, max_tokens=500)))
        t.start()
        time.sleep(0.5)
        w.signal(signal.SIGKILL)
        t.join(15)
        assert not t.is_alive()
        r = out["r"]
        assert r.status_code == 502 and "failed mid-request" in r.json()["error"]["message"]
        # the dead worker's lease is still valid (30 s) but the frontend marked it down
        r = complete(fleet.url)
        assert r.status_code == 503 and "no live worker" in r.json()["error"]["message"]

        # a hung worker (stopped process): a timeout error within the request deadline
        h = fleet.start_worker(*SLOW, kind="mocker")
        wait_for_workers(fleet.url, MODEL, 1)
        events: list[str] = []

        def stream() -> None:
            with httpx.stream("POST", f"{fleet.url}/v1/completions", timeout=30, json={
                    "model": MODEL, "prompt": [1], "max_tokens": 500, "stream": True,
                    "ignore_eos": True}) as resp:
                events.extend(line for line in resp.iter_lines() if line.startswith("data: "))

        t = threading.Thread(target=stream)
        t.start()
        time.sleep(0.5)
        h.signal(signal.SIGSTOP)
        t0 = time.monotonic()
        t.join(20)
        h.signal(signal.SIGCONT)
        assert not t.is_alive() and time.monotonic() - t0 < 10
        err = json.loads(events[-1][6:])
        assert "timed out" in err["error"]["message"]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_unknown_model_gets_a_clear_error_without_workers(tmp_path, route):
    with LocalFleet(tmp_path) as fleet:
        fleet.start_frontend()
        body = {"model": MODEL, "prompt": [1], "messages": [{"role": "user", "content": "x"}],
                "input_ids": [1]}
        r = httpx.post(f"{fleet.url}{route}", json=body, timeout=10)
        assert r.status_code in (400, 404) and r.json()["error"]["message"]


def test_requests_are_held_while_every_worker_is_gated(tmp_path):
    with LocalFleet(tmp_path, lease_ttl=5) as fleet:
        fleet.start_frontend("--gated-hold", "3")
        w = fleet.start_worker(*SLOW, "--system-port", "0", "--start-gated", kind="mocker")
        wait_for_workers_listed = time.monotonic() + 10
        while not httpx.get(f"{fleet.url}/health").json()["workers"]:
            assert time.monotonic() < wait_for_workers_listed
            time.sleep(0.1)
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(r=complete(fleet.url)))
        t.start()
        time.sleep(0.5)
        assert t.is_alive()  # held, not refused
        r = httpx.post(f"{w.ready['system_url']}/engine/set_admission", json={"open": True})
        assert r.json()["status"] == "ok"
        t.join(10)
        assert out["r"].status_code == 200, out["r"].text
        httpx.post(f"{w.ready['system_url']}/engine/set_admission",
                   json={"open": False, "reason": "test"})
        time.sleep(0.5)
        t0 = time.monotonic()
        r = complete(fleet.url)  # nobody reopens it: a 503 after the hold
        assert r.status_code == 503 and 2.5 < time.monotonic() - t0 < 10
