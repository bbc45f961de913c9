"""A 256-worker simulated fleet: one `python -m rlfleet.mocker --replicas 256` process (the
declared simulator) behind one frontend over file discovery. It is listed by the RL
listener, routed to, refreshed in rolling waves and synchronously (with one worker hung:
named in the result, the others not held up). A 1,024-worker one (its calls through relays)
is recovered after its coordinator is killed mid-refresh (tests/refresh_hooked.py; the
recovery back to the last verified policy: tests/integration/test_refresh_transactions.py).
No timings are asserted."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from rlfleet.mocker.engine import write_mock_checkpoint
from rlfleet.refresh.coordinator import PolicyRefresh
from tests.fleets import RL_MOCK_MODEL as MODEL
from tests.fleets import local_fleet, mock_args, wait_for_workers

N = 256
SEEDS = {"A": 2, "B": 3, "C": 4}
HOOKED = Path(__file__).resolve().parents[1] / "refresh_hooked.py"


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scale")
    root = tmp / "weights"
    ckpts = {name: write_mock_checkpoint(root / name, seed) for name, seed in SEEDS.items()}
    # a long lease: 256 workers on two busy cores must not lapse while they are refreshed
    with local_fleet(tmp / "fleet", [mock_args(root, "--replicas", str(N))], lease_ttl=20.0,
                     enable_rl=True,
                     frontend_env={"DYN_RL_REQUEST_TIMEOUT_SECS": "30"}) as fleet:
        wait_for_workers(fleet.url, MODEL, N, timeout=180)
        fleet.ckpts, fleet.journal = ckpts, str(tmp / "journal.sqlite")
        yield fleet


def listed(f) -> list[dict]:
    return httpx.get(f"{f.rl_url}/v1/rl/workers", timeout=120).json()["workers"]


def policies(f) -> dict[int, tuple]:
    """(version, digest) of every worker, from each worker's own system server."""
    async def ask():
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=32)) as c:
            ws = listed(f)
            rs = await asyncio.gather(*(c.post(f"{w['system_url']}/engine/get_weight_version",
                                               json={}, timeout=60) for w in ws))
            return {w["instance_id"]: (r.json()["version"], r.json()["weight_digest"])
                    for w, r in zip(ws, rs, strict=True)}
    return asyncio.run(ask())


def refresh(f, name: str, **kw):
    r = PolicyRefresh(f.rl_url, model=MODEL, journal=f.journal, timeout=60, **kw)
    try:
        return asyncio.run(r.refresh(f.ckpts[name], name, digest=f"mock:{SEEDS[name]}"))
    finally:
        r.journal.close()


def test_the_fleet_is_listed_with_every_worker_s_own_endpoints(big):
    ws = listed(big)
    assert len(ws) == N
    assert all(w.get("routes") and not w.get("error") for w in ws), \
        [w.get("error") for w in ws if w.get("error")][:3]
    for key in ("instance_id", "system_url"):
        assert len({w[key] for w in ws}) == N


def test_requests_reach_many_distinct_workers(big):
    async def send():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=32)) as c:
            body = {"model": MODEL, "prompt": [1101, 1102], "max_tokens": 1,
                    "nvext": {"extra_fields": ["worker_id"]}}
            rs = await asyncio.gather(*(c.post(f"{big.url}/v1/completions", json=body)
                                        for _ in range(N)))
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200][:2]
        return {r.json()["nvext"]["worker_id"]["decode_worker_id"] for r in rs}
    reached = asyncio.run(send())
    assert len(reached) > N // 2  # round-robin over the whole fleet, not a few workers


def test_a_rolling_refresh_moves_the_fleet_in_waves(big):
    first = refresh(big, "B")  # a rolling refresh starts from a fleet on one fleet step
    assert first.ok, first.reason
    res = refresh(big, "C", mode="rolling", wave_size=N // 2, concurrency=32)
    assert res.ok, (res.reason, [w["reason"] for w in res.workers][:3])
    waves = {s.get("wave") for s in res.steps if s["name"] == "apply"}
    assert len(waves) >= 2
    assert sum(w["status"] == "verified" for w in res.workers) == N
    assert set(policies(big).values()) == {("C", "mock:4")}


def test_a_sync_refresh_names_a_hung_worker_and_moves_the_others(big):
    """One worker's pause hangs past the phase deadline: it is left out as missing and
    named in the result; the other 255 are verified on the target and reopened."""
    hung = listed(big)[17]
    r = httpx.post(f"{hung['system_url']}/engine/fault_injection", timeout=10,
                   json={"route": "pause_generation", "mode": "hang", "hang_seconds": 90})
    assert r.json()["status"] == "ok", r.text
    res = refresh(big, "A", phase_timeout=30)
    assert res.ok, res.reason
    by_id = {w["instance_id"]: w for w in res.workers}
    assert by_id[hung["instance_id"]]["status"] == "missing"
    assert "phase deadline" in by_id[hung["instance_id"]]["reason"]
    assert sum(w["status"] == "verified" for w in res.workers) == N - 1
    held = policies(big)
    assert sum(v == ("A", "mock:2") for v in held.values()) == N - 1


N_RECOVER = 1024


@pytest.fixture
def huge(tmp_path_factory):
    """1,024 simulated workers in one mocker process (relayed: above the default relay
    threshold of 256)."""
    tmp = tmp_path_factory.mktemp("scale1024")
    root = tmp / "weights"
    ckpts = {name: write_mock_checkpoint(root / name, seed) for name, seed in SEEDS.items()}
    with local_fleet(tmp / "fleet", [], lease_ttl=60.0, enable_rl=True,
                     frontend_env={"DYN_RL_REQUEST_TIMEOUT_SECS": "60"}) as fleet:
        # registering 1,024 workers takes a while on two busy cores
        fleet.start_worker(*mock_args(root, "--replicas", str(N_RECOVER)), kind="mocker",
                           timeout=600)
        wait_for_workers(fleet.url, MODEL, N_RECOVER, timeout=600)
        fleet.ckpts, fleet.journal = ckpts, str(tmp / "journal.sqlite")
        yield fleet


def test_a_killed_coordinator_is_recovered_at_1024_workers(huge):
    """A coordinator SIGKILLed once 1,024 workers are paused (its calls through relays)
    leaves them gated; the next one recovers the whole fleet onto one verified policy from
    the journal (forward to the interrupted target: there is no earlier verified one) and
    reopens it."""
    argv = [sys.executable, str(HOOKED), "paused=kill", "--checkpoint", str(huge.ckpts["B"]),
            "--version", "B", "--digest", "mock:3", "--rl-url", huge.rl_url, "--model", MODEL,
            "--journal", huge.journal]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert p.returncode == -signal.SIGKILL, p.stdout + p.stderr
    assert not usable_workers(huge)  # gated: the coordinator died with the fleet closed
    r = PolicyRefresh(huge.rl_url, model=MODEL, journal=huge.journal, timeout=120)
    try:
        res = asyncio.run(r.recover())
    finally:
        r.journal.close()
    assert res is not None and res.ok and res.kind == "recovery", res and res.reason
    assert sum(w["status"] == "verified" for w in res.workers) == N_RECOVER
    relayed = {c.get("relay") for w in res.workers for c in w["calls"] if c["step"] == "pause"}
    assert None not in relayed and len(relayed) > 1  # the recovery's pause went through relays
    # what each worker publishes of itself (its discovery entry, as the RL listener lists it)
    ws = listed(huge)
    assert len(ws) == N_RECOVER
    assert {(w["weight_version"], w["weight_digest"]) for w in ws} == {("B", "mock:3")}
    wait_for_workers(huge.url, MODEL, N_RECOVER, timeout=300)  # all reopened


def usable_workers(f) -> list[dict]:
    return [w for w in httpx.get(f"{f.url}/health", timeout=60).json()["workers"]
            if w["model"] == MODEL and w["usable"]]
