"""PolicyRefresh failure handling, driven with mocker workers and their fault injection.
(The real-engine refresh is in test_refresh_vllm.py.)"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import httpx
import pytest

from rlfleet.journal import SqliteJournal
from rlfleet.protocol.identity import PolicyIdentity
from rlfleet.refresh.control import SglangWorker
from rlfleet.refresh.coordinator import PolicyRefresh
from rlfleet.refresh.transaction import (
    TRANSITIONS,
    IllegalRefreshTransition,
    RefreshState,
    check_transition,
)
from rlfleet.runtime.launch import spawn
from tests.fleets import (
    RL_MOCK_MODEL,
    fault,
    mock_args,
    mock_policies,
    routed,
    two_rl_mockers,
    wait_for_workers,
)

MODEL = RL_MOCK_MODEL


@pytest.fixture
def ckpts(tmp_path) -> dict[str, Path]:
    return mock_policies(tmp_path / "weights")


@pytest.fixture
def fleet(start_fleet, ckpts):
    return two_rl_mockers(start_fleet, ckpts)


def coordinator(fleet, tmp_path, **kw) -> PolicyRefresh:
    kw.setdefault("journal", tmp_path / "journal.sqlite")
    return PolicyRefresh(fleet.rl_url, model=MODEL, timeout=10, **kw)


def to(refresh: PolicyRefresh, ckpts, name: str, seed: int):
    return asyncio.run(refresh.refresh(ckpts[name], name, digest=f"mock:{seed}"))


def versions(fleet) -> dict[int, tuple]:
    out = {}
    for p in fleet.workers:
        if p.popen.poll() is None:
            v = httpx.post(f"{p.ready['system_url']}/engine/get_weight_version", json={}).json()
            out[int(p.ready["instance_id"])] = (v["version"], v["weight_digest"])
    return out


def test_transition_table():
    for old, allowed in TRANSITIONS.items():
        for new in RefreshState:
            if new in allowed:
                assert check_transition(old, new) is new
            else:
                with pytest.raises(IllegalRefreshTransition):
                    check_transition(old, new)


def test_clean_refresh_and_journal(fleet, ckpts, tmp_path):
    r = coordinator(fleet, tmp_path)
    res = to(r, ckpts, "B", 2)
    assert res.decision == "reopened" and res.ok, res.reason
    assert set(versions(fleet).values()) == {("B", "mock:2")}
    names = [s["name"] for s in res.steps]
    assert names == ["resolve", "gate", "pause", "apply", "reset_cache", "verify", "resume",
                     "probe", "reopen"]
    entry = SqliteJournal(tmp_path / "journal.sqlite").get(res.refresh_id)
    assert entry["target_version"] == "B" and entry["target_digest"] == "mock:2"
    assert entry["decision"] == "reopened" and len(entry["intended_workers"]) == 2
    assert all(w["status"] == "verified" for w in entry["workers"].values())
    routes = {c["route"] for w in entry["workers"].values() for c in w["calls"]}
    assert {"pause_generation", "update_weights_from_disk", "get_weight_version"} <= routes
    assert len(routed(fleet, 2)) == 2


def test_pause_failure_excludes_that_worker(fleet, ckpts, tmp_path):
    bad = fleet.workers[0]
    fault(bad, "pause_generation")
    res = to(coordinator(fleet, tmp_path), ckpts, "B", 2)
    assert res.decision == "reopened"
    by = {w["instance_id"]: w for w in res.workers}
    assert by[int(bad.ready["instance_id"])]["status"] == "excluded"
    assert "pause failed" in by[int(bad.ready["instance_id"])]["reason"]
    v = versions(fleet)
    assert v[int(bad.ready["instance_id"])] == (None, "mock:1")  # no transfer to it
    want = {int(fleet.workers[1].ready["instance_id"])}
    assert routed(fleet, want) == want  # not admitted


def test_transfer_failure_after_a_peer_succeeded_holds(fleet, ckpts, tmp_path):
    fault(fleet.workers[1], "update_weights_from_disk", "http500")
    r = coordinator(fleet, tmp_path, on_failure="hold")
    res = to(r, ckpts, "B", 2)
    assert res.decision == "held" and "transfer failed on 1 of 2" in res.reason
    assert routed(fleet, 0) == set() and not r.rollout_gate.is_open
    entry = r.journal.get(res.refresh_id)
    calls = [c for w in entry["workers"].values() for c in w["calls"]
             if c["route"] == "update_weights_from_disk"]
    assert sorted(c["http_status"] for c in calls) == [200, 500]


def test_transfer_failure_retry(fleet, ckpts, tmp_path):
    fault(fleet.workers[1], "update_weights_from_disk", "error", times=1)
    res = to(coordinator(fleet, tmp_path, on_failure="retry", retries=2), ckpts, "B", 2)
    assert res.decision == "reopened", res.reason
    assert set(versions(fleet).values()) == {("B", "mock:2")}


def test_transfer_failure_rollback_returns_to_a_verified(fleet, ckpts, tmp_path):
    r = coordinator(fleet, tmp_path, on_failure="rollback")
    assert to(r, ckpts, "A", 1).ok
    fault(fleet.workers[0], "update_weights_from_disk", "error", times=1)
    res = to(r, ckpts, "B", 2)
    assert res.decision == "rolled_back", res.reason
    assert set(versions(fleet).values()) == {("A", "mock:1")}
    assert res.policy.version == "A" and r.current.version == "A"
    assert len(routed(fleet, 2)) == 2 and r.rollout_gate.is_open
    assert any(s["name"] == "rollback" for s in res.steps)


def test_a_coordinator_on_an_existing_journal_rolls_back(fleet, ckpts, tmp_path):
    """A new PolicyRefresh on the journal of a held refresh knows the last verified policy
    (and what each worker holds) and rolls the mixed fleet back to it."""
    first = coordinator(fleet, tmp_path, on_failure="hold")
    assert to(first, ckpts, "A", 1).ok
    fault(fleet.workers[1], "update_weights_from_disk", "error")
    assert to(first, ckpts, "B", 2).decision == "held"
    ids = [int(p.ready["instance_id"]) for p in fleet.workers]
    assert versions(fleet) == {ids[0]: ("B", "mock:2"), ids[1]: ("A", "mock:1")}

    second = coordinator(fleet, tmp_path, on_failure="rollback")
    assert (second.current.version, second.current.digest) == ("A", "mock:1")
    assert second.current.path == str(ckpts["A"].resolve()) and second.verified == set(ids)
    assert second.holdings == {ids[0]: PolicyIdentity(version="B", digest="mock:2", step=1),
                               ids[1]: PolicyIdentity(version="A", digest="mock:1", step=0)}
    fault(fleet.workers[1], "update_weights_from_disk", "error")
    res = to(second, ckpts, "B", 2)
    assert res.decision == "rolled_back" and "rolled back to A" in res.reason, res.reason
    assert set(versions(fleet).values()) == {("A", "mock:1")}
    assert len(routed(fleet, 2)) == 2 and second.rollout_gate.is_open
    assert coordinator(fleet, tmp_path).current.version == "A"  # and the next one knows


def test_probe_uses_the_models_own_tokenizer_and_workers_must_agree(fleet, ckpts, tmp_path):
    """A fleet whose vocabulary is not Qwen's (4,096 tokens) refreshes with the defaults: the
    probe prompt is text the workers tokenise. A worker that generates differently from the
    others (a misconfigured vocabulary: the simulated model is another) keeps the fleet held,
    and the reason names it and the token."""
    small = ("--served-model-name", "mock-4k", "--vocab-size", "4096")
    for _ in range(2):
        fleet.start_worker(*mock_args(ckpts["root"]), *small, kind="mocker")
    wait_for_workers(fleet.url, "mock-4k", 2)
    r = PolicyRefresh(fleet.rl_url, model="mock-4k", timeout=10,
                      journal=tmp_path / "journal.sqlite")
    res = asyncio.run(r.refresh(ckpts["B"], "B", digest="mock:2"))
    assert res.ok and res.fleet_moved, res.reason

    odd = fleet.start_worker(*mock_args(ckpts["root"]), "--served-model-name", "mock-4k",
                             "--vocab-size", "4097", kind="mocker")
    # it joins a coordinator-controlled fleet, so it starts gated (finding 8): known, not usable
    deadline = time.monotonic() + 30
    while len([w for w in httpx.get(f"{fleet.url}/health", timeout=5).json()["workers"]
               if w["model"] == "mock-4k"]) < 3:
        assert time.monotonic() < deadline, "the third worker never joined"
        time.sleep(0.2)
    res = asyncio.run(r.refresh(ckpts["A"], "A", digest="mock:1"))
    assert res.decision == "held" and not res.fleet_moved, res.reason
    assert res.reason.startswith("workers disagree on the post-update probe: worker "
                                 f"{odd.ready['instance_id']} puts token "), res.reason
    assert " first at position " in res.reason and " where worker " in res.reason
    assert not r.rollout_gate.is_open
    deadline = time.monotonic() + 10  # the frontend sees the gated entries on its next poll
    while True:
        usable = {w["instance_id"] for w in httpx.get(f"{fleet.url}/health").json()["workers"]
                  if w["usable"] and w["model"] == "mock-4k"}
        if not usable or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert usable == set()  # none of the three admitted


def test_cache_reset_failure_excludes(fleet, ckpts, tmp_path):
    fault(fleet.workers[0], "flush_cache")
    res = to(coordinator(fleet, tmp_path), ckpts, "B", 2)
    assert res.decision == "reopened"
    out = [w for w in res.workers if w["status"] != "verified"]
    assert len(out) == 1 and "cache reset failed" in out[0]["reason"]
    want = {int(fleet.workers[1].ready["instance_id"])}
    assert routed(fleet, want) == want


def test_version_mismatch_keeps_the_fleet_closed(fleet, ckpts, tmp_path):
    fault(fleet.workers[0], "get_weight_version", "respond",
          body={"status": "ok", "version": "B", "version_declared": True,
                "weight_digest": "mock:999"})
    r = coordinator(fleet, tmp_path)
    res = to(r, ckpts, "B", 2)
    assert res.decision == "held" and "version check differs" in res.reason
    assert routed(fleet, 0) == set() and not r.rollout_gate.is_open


def test_post_update_generation_failure_keeps_worker_out(fleet, ckpts, tmp_path):
    bad = fleet.workers[1]
    fault(bad, "generate", "http500")
    res = to(coordinator(fleet, tmp_path), ckpts, "B", 2)
    assert res.decision == "reopened"
    w = next(w for w in res.workers if w["instance_id"] == int(bad.ready["instance_id"]))
    assert w["status"] == "excluded" and "post-update generation failed" in w["reason"]
    assert any(c["route"] == "generate" for c in w["calls"])  # diagnostics kept
    want = {int(fleet.workers[0].ready["instance_id"])}
    assert routed(fleet, want) == want


def test_worker_missing_at_transfer_time(fleet, ckpts, tmp_path):
    victim = fleet.workers[0]
    fault(victim, "pause_generation", "respond",
          body={"status": "ok", "message": "Engine paused", "mode": "wait", "clear_cache": False})
    fault(victim, "update_weights_from_disk", "exit")
    res = to(coordinator(fleet, tmp_path), ckpts, "B", 2)
    assert res.decision == "reopened", res.reason
    w = next(w for w in res.workers if w["instance_id"] == int(victim.ready["instance_id"]))
    assert w["status"] == "missing"
    assert set(versions(fleet).values()) == {("B", "mock:2")}


def test_worker_killed_mid_refresh(fleet, ckpts, tmp_path):
    victim = fleet.workers[1]
    fault(victim, "update_weights_from_disk", "hang", hang_seconds=3)
    r = coordinator(fleet, tmp_path)

    async def run():
        task = asyncio.create_task(r.refresh(ckpts["B"], "B", digest="mock:2"))
        await asyncio.sleep(1.0)
        victim.signal(signal.SIGKILL)
        return await task

    res = asyncio.run(run())
    assert res.decision == "reopened", res.reason
    w = next(w for w in res.workers if w["instance_id"] == int(victim.ready["instance_id"]))
    assert w["status"] == "missing"
    want = {int(fleet.workers[0].ready["instance_id"])}
    assert routed(fleet, want) == want


def test_replacement_worker_is_admitted_only_when_verified(fleet, ckpts, tmp_path):
    r = coordinator(fleet, tmp_path)
    assert to(r, ckpts, "B", 2).ok
    new = fleet.start_worker(*mock_args(ckpts["root"], "--start-gated"), kind="mocker")
    iid = int(new.ready["instance_id"])
    wait_for_workers(fleet.url, MODEL, 2)  # it joined discovery but is not routed to
    assert iid not in routed(fleet)
    res = asyncio.run(r.admit_new_workers())
    assert res.ok and [w["instance_id"] for w in res.workers] == [iid]
    assert versions(fleet)[iid] == ("B", "mock:2")
    assert iid in routed(fleet, 3) and len(routed(fleet)) == 3


def test_sglang_path(tmp_path, ckpts):
    env = {"DYN_SGLANG_ENGINE_ROUTES": "pause_generation:tm continue_generation:tm"}
    import os
    import sys
    procs = []
    try:
        for i in range(2):
            p = spawn(f"sglang-{i}", [sys.executable, "-m", "rlfleet.mocker",
                                      *mock_args(ckpts["root"]), "--admin-schema", "sglang",
                                      "--discovery", f"file://{tmp_path / 'disc'}"],
                      tmp_path / "logs", env={**os.environ, **env})
            procs.append(p)
        for p in procs:
            p.wait_ready(60)
        workers = [SglangWorker(p.ready["system_url"], p.ready["url"], f"sglang-{i}")
                   for i, p in enumerate(procs)]
        r = PolicyRefresh(path="sglang-disk", sglang_workers=workers, timeout=10)
        res = asyncio.run(r.refresh(ckpts["B"], "B", digest="mock:2"))
        assert res.ok, res.reason
        assert all(w["status"] == "verified" for w in res.workers)
        routes = {c["route"] for w in res.workers for c in w["calls"]}
        assert {"pause_generation", "control/update_weights_from_disk",
                "continue_generation", "generate"} <= routes
        # a post-update digest that is not the target's keeps the worker out
        res = asyncio.run(r.refresh(ckpts["A"], "A", digest="mock:999"))
        assert res.decision == "held"
    finally:
        for p in procs:
            p.stop()


def test_cli_refresh_and_journal(fleet, ckpts, tmp_path):
    import subprocess
    import sys

    journal = tmp_path / "cli-journal.sqlite"
    run = subprocess.run(
        [sys.executable, "-m", "rlfleet.cli", "refresh", "--checkpoint", str(ckpts["B"]),
         "--version", "B", "--digest", "mock:2", "--rl-url", fleet.rl_url, "--model", MODEL,
         "--journal", str(journal), "--step", "7"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "decision: reopened" in run.stdout and "probe" in run.stdout  # progress + steps
    shown = subprocess.run([sys.executable, "-m", "rlfleet.cli", "journal", "--journal",
                            str(journal)], capture_output=True, text=True, timeout=60).stdout
    assert "step=7" in shown and "-> B [reopened]" in shown
    fault(fleet.workers[0], "get_weight_version", "respond",
          body={"status": "ok", "version": "C", "weight_digest": "mock:3"})
    held = subprocess.run(
        [sys.executable, "-m", "rlfleet.cli", "refresh", "--checkpoint", str(ckpts["A"]),
         "--version", "A", "--digest", "mock:1", "--rl-url", fleet.rl_url, "--journal",
         str(journal)], capture_output=True, text=True, timeout=120)
    assert held.returncode == 1 and "decision: held" in held.stdout


def test_a_restarted_worker_stays_out_until_verified_without_start_gated(fleet, ckpts, tmp_path):
    """A coordinator moved the fleet to B; a worker restarts on its command line (A), with
    no --start-gated, under continuous load: it reads from its peers' entries that a
    coordinator controls the fleet and joins gated, so no request is served from A; the
    coordinator then admits it on B (issue 10 finding 8)."""
    import threading

    r = coordinator(fleet, tmp_path)
    assert to(r, ckpts, "B", 2).ok
    served: list[str | None] = []
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(timeout=30) as http:
            while not stop.is_set():
                out = http.post(f"{fleet.url}/v1/completions", json={
                    "model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4,
                    "nvext": {"extra_fields": ["weight_versions"]}})
                if out.status_code == 200:
                    served.extend(s["digest"] for s in out.json()["nvext"]["weight_versions"])

    loaders = [threading.Thread(target=load) for _ in range(4)]
    for t in loaders:
        t.start()
    try:
        time.sleep(0.5)
        fleet.workers[1].stop()
        new = fleet.start_worker(*mock_args(ckpts["root"]), kind="mocker")  # seed 1: A
        time.sleep(3)  # well past the frontend noticing the new entry
    finally:
        stop.set()
        for t in loaders:
            t.join()
    iid = int(new.ready["instance_id"])
    assert served and set(served) == {"mock:2"}, {d: served.count(d) for d in set(served)}
    assert iid not in routed(fleet)
    health = httpx.get(f"{new.ready['system_url']}/health", timeout=5).json()
    assert health["gated"] and "coordinator" in health["gate_reason"], health
    res = asyncio.run(r.admit_new_workers())
    assert res.ok and [w["instance_id"] for w in res.workers] == [iid], res.reason
    assert versions(fleet)[iid] == ("B", "mock:2")
    assert iid in routed(fleet, 2)
