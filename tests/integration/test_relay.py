"""The relay tree (rlfleet.refresh.relay over the workers' POST /engine/relay): a refresh of a
simulated fleet (the mocker, the declared simulator) through relays moves and journals
every worker; a relay SIGKILLed mid-phase has its subtree called directly; a relay forwards
the coordinator's fleet epoch, so a worker that has seen a newer one refuses a relayed
call (409) as it refuses a direct one; a bad relay request says what to fix. No timings
are asserted."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import httpx
import pytest

from rlfleet.journal import open_journal
from rlfleet.mocker.engine import write_mock_checkpoint
from rlfleet.refresh.coordinator import PolicyRefresh
from tests.fleets import RL_MOCK_MODEL as MODEL
from tests.fleets import local_fleet, mock_args, wait_for_workers

SEEDS = {"A": 2, "B": 3}


def listed(f) -> list[dict]:
    return httpx.get(f"{f.rl_url}/v1/rl/workers", timeout=120).json()["workers"]


def policies(f) -> dict[int, tuple]:
    """(version, digest) of every listed worker that can be reached, from its own system
    server (a killed one stays listed until its lease lapses)."""
    async def ask():
        slots = asyncio.Semaphore(16)
        async with httpx.AsyncClient(timeout=httpx.Timeout(120, pool=None)) as c:
            async def one(w):
                async with slots:
                    try:
                        r = await c.post(f"{w['system_url']}/engine/get_weight_version",
                                         json={})
                    except httpx.ConnectError:
                        return None
                return w["instance_id"], (r.json()["version"], r.json()["weight_digest"])
            return dict(x for x in await asyncio.gather(*map(one, listed(f))) if x)
    return asyncio.run(ask())


def refresh(f, name: str, on_event=None, **kw):
    r = PolicyRefresh(f.rl_url, model=MODEL, journal=f.journal, timeout=60,
                      on_event=on_event, **kw)
    try:
        return asyncio.run(r.refresh(f.ckpts[name], name, digest=f"mock:{SEEDS[name]}"))
    finally:
        r.journal.close()


def journaled(f, refresh_id: int) -> dict[str, dict]:
    with open_journal(f.journal) as j:
        return j.get(refresh_id)["workers"]


def relay(url: str, body: dict, epoch: int | None = None) -> httpx.Response:
    headers = {} if epoch is None else {"X-Fleet-Epoch": str(epoch)}
    return httpx.post(f"{url}/engine/relay", json=body, headers=headers, timeout=60)


# ---------------------------------------------------------------- a small fleet

N_SMALL = 12


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("relay")
    root = tmp / "weights"
    ckpts = {name: write_mock_checkpoint(root / name, seed) for name, seed in SEEDS.items()}
    with local_fleet(tmp / "fleet", [mock_args(root, "--replicas", str(N_SMALL))],
                     lease_ttl=20.0, enable_rl=True,
                     frontend_env={"DYN_RL_REQUEST_TIMEOUT_SECS": "30"}) as fleet:
        wait_for_workers(fleet.url, MODEL, N_SMALL, timeout=120)
        fleet.ckpts, fleet.journal = ckpts, str(tmp / "journal.sqlite")
        yield fleet


def test_every_worker_serves_the_relay_route(small):
    assert all("relay" in w["routes"] for w in listed(small))


def test_a_refresh_through_relays_moves_and_journals_every_worker(small):
    events: list[str] = []
    res = refresh(small, "A", on_event=events.append, relay_threshold=4, relay_fanout=3)
    assert res.ok and sum(w["status"] == "verified" for w in res.workers) == N_SMALL, res.reason
    assert set(policies(small).values()) == {("A", "mock:2")}
    record = journaled(small, res.refresh_id)
    assert len(record) == N_SMALL
    relays = set()
    for w in record.values():
        assert {"gate", "pause", "apply", "verify", "resume", "reopen"} <= \
            {c["step"] for c in w["calls"]}, w["calls"]
        relays |= {c["relay"] for c in w["calls"] if "relay" in c}
        # every admin call the worker answered through a relay is its own answer
        assert all(c["http_status"] == 200 for c in w["calls"]), w["calls"]
    assert len(relays) == 3, relays  # three relays carried the phases
    assert not any("failed" in e for e in events if e.startswith("relay")), events


def test_below_the_threshold_the_coordinator_calls_each_worker(small):
    res = refresh(small, "B", relay_threshold=N_SMALL)
    assert res.ok, res.reason
    for w in journaled(small, res.refresh_id).values():
        assert not any("relay" in c for c in w["calls"])


def test_a_relay_forwards_the_epoch_and_a_worker_fences_it(small):
    a, b = listed(small)[:2]
    target = [{"instance_id": b["instance_id"], "system_url": b["system_url"]}]
    # b sees a newer epoch than the relay's caller will bring
    newest = max(w.get("fleet_epoch") or 0 for w in listed(small)) + 100
    r = httpx.post(f"{b['system_url']}/engine/set_admission", json={"open": True},
                   headers={"X-Fleet-Epoch": str(newest)}, timeout=30)
    assert r.status_code == 200, r.text
    body = {"route": "get_weight_version", "targets": target, "timeout": 30}
    stale = relay(a["system_url"], body, epoch=newest - 1)
    assert stale.status_code == 200, stale.text  # the relay itself has not seen `newest`
    (res,) = stale.json()["results"]
    assert res["instance_id"] == b["instance_id"] and res["http_status"] == 409
    assert res["body"]["error"] == "Stale fleet epoch" and res["body"]["newest_fleet_epoch"] == newest
    fresh = relay(a["system_url"], body, epoch=newest)
    (res,) = fresh.json()["results"]
    assert res["http_status"] == 200 and res["body"]["status"] == "ok"
    # a relay call is a control call to the relay too: it now refuses the older epoch itself
    refused = relay(a["system_url"], body, epoch=newest - 1)
    assert refused.status_code == 409 and refused.json()["error"] == "Stale fleet epoch"


@pytest.mark.parametrize("body, says", [
    ({"route": "relay", "targets": [{"instance_id": 1, "system_url": "http://127.0.0.1:9"}],
      "timeout": 5}, "not relayed"),
    ({"route": "fault_injection", "targets": [{"instance_id": 1,
                                               "system_url": "http://127.0.0.1:9"}],
      "timeout": 5}, "not relayed"),
    ({"route": "pause_generation", "targets": [], "timeout": 5}, "targets is required"),
    ({"route": "pause_generation", "targets": [{"instance_id": 1,
                                                "system_url": "http://127.0.0.1:9/x"}],
      "timeout": 5}, "http(s)://host:port"),
    ({"route": "pause_generation", "targets": [{"instance_id": 1,
                                                "system_url": "http://127.0.0.1:9"}],
      "timeout": 0}, "timeout"),
    ({"route": "pause_generation", "timeout": 5}, "targets is required"),
])
def test_a_bad_relay_request_says_what_to_fix(small, body, says):
    r = relay(listed(small)[0]["system_url"], body)
    assert r.status_code == 200 and r.json()["status"] == "error", r.text
    assert says in r.json()["message"], r.json()


def test_an_unreachable_target_is_reported_by_the_relay(small):
    a = listed(small)[0]
    r = relay(a["system_url"], {"route": "liveness_probe", "timeout": 5, "targets": [
        {"instance_id": 7, "system_url": "http://127.0.0.1:9"},
        {"instance_id": a["instance_id"], "system_url": a["system_url"]}]})
    dead, alive = r.json()["results"]
    assert dead["instance_id"] == 7 and dead.get("http_status") is None and dead["error"]
    assert alive["http_status"] == 200 and alive["body"]["alive"] is True


# ---------------------------------------------------------------- 256 workers, a relay killed

N = 256
RELAYS = 4  # single-worker processes, the only workers that relay (the others: --no-relay)


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("relay256")
    root = tmp / "weights"
    ckpts = {name: write_mock_checkpoint(root / name, seed) for name, seed in SEEDS.items()}
    workers = [mock_args(root, "--replicas", str(N - RELAYS), "--no-relay")] + \
        [mock_args(root)] * RELAYS
    with local_fleet(tmp / "fleet", workers, lease_ttl=30.0, enable_rl=True,
                     frontend_env={"DYN_RL_REQUEST_TIMEOUT_SECS": "30"}) as fleet:
        wait_for_workers(fleet.url, MODEL, N, timeout=180)
        fleet.ckpts, fleet.journal = ckpts, str(tmp / "journal.sqlite")
        yield fleet


def kill_when_logged(proc, line: str, timeout: float = 600.0) -> threading.Thread:
    """SIGKILL `proc` as soon as its log shows `line` (a thread)."""
    def watch() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.popen.poll() is None:
            if line in proc.log_path.read_text(errors="replace"):
                os.kill(proc.popen.pid, signal.SIGKILL)
                return
            time.sleep(0.05)
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def test_a_relay_killed_mid_phase_has_its_subtree_called_directly(big):
    """The four single-worker processes are the relays (K = 4). One is SIGKILLed while it
    holds the first relayed call of the refresh (its relay route is delayed, and the kill
    comes once its log says the call arrived): the coordinator calls that relay's subtree
    directly and relays the later calls through the other three. Every other worker is
    verified on the target, and every worker is journaled with each call."""
    relays = big.workers[1:]
    assert {int(p.ready["instance_id"]) for p in relays} == \
        {w["instance_id"] for w in listed(big) if "relay" in w["routes"]}
    victim = relays[0]
    vid = int(victim.ready["instance_id"])
    r = httpx.post(f"{victim.ready['system_url']}/engine/fault_injection", timeout=10,
                   json={"route": "relay", "mode": "delay", "hang_seconds": 120})
    assert r.json()["status"] == "ok", r.text
    watcher = kill_when_logged(victim, "injecting fault delay into relay")
    events: list[str] = []
    res = refresh(big, "A", on_event=events.append, relay_threshold=64, relay_fanout=RELAYS)
    watcher.join(5)
    assert victim.popen.poll() == -signal.SIGKILL
    assert res.ok, res.reason
    by_id = {w["instance_id"]: w for w in res.workers}
    assert len(by_id) == N
    assert by_id[vid]["status"] == "missing", by_id[vid]
    assert sum(w["status"] == "verified" for w in res.workers) == N - 1
    assert any(f"relay {vid} failed" in e for e in events), [e for e in events if "relay" in e]
    held = policies(big)
    assert vid not in held
    assert set(held.values()) == {("A", "mock:2")} and len(held) == N - 1
    # every worker journaled with each call it answered; the killed relay's subtree was
    # called directly in that phase, then through the other relays
    record = journaled(big, res.refresh_id)
    assert len(record) == N
    direct = [w for iid, w in record.items() if int(iid) != vid and
              "relay" not in w["calls"][0]]
    assert direct, "no worker of the killed relay's subtree was called directly"
    for w in direct:
        later = {c.get("relay") for c in w["calls"] if c["step"] == "reopen"}
        assert later and None not in later and vid not in later, w["calls"]
    for iid, w in record.items():
        if int(iid) != vid:
            assert w["status"] == "verified" and w["calls"], w
            assert all(c["http_status"] == 200 for c in w["calls"]), w["calls"]
