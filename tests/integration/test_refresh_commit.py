"""A synchronous refresh of workers that serve commit_policy: two admin calls per worker
(the commit, the reopen; the probe is on the request plane), each lifecycle step still
judged and journaled under its own name; a refresh whose steps tests must reach one by one
(rlfleet.refresh.hooks) calls each step instead. The stage-first refresh's choices where no
real engine is needed (the mocker's engine prepares no version while it serves): every worker
falls back to the disk path and the journal says why; `Fleet.refresh` probes after the
reopen, so a worker whose probe fails was reopened and is closed again, left out, while the
other serves. On a two-worker mocker fleet."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rlfleet.refresh.coordinator import PolicyRefresh
from rlfleet.refresh.hooks import RefreshHooks
from rlfleet.rl import Fleet
from tests.fleets import RL_MOCK_MODEL, fault, mock_policies, routed, two_rl_mockers

MODEL = RL_MOCK_MODEL
STEPS = ["resolve", "gate", "pause", "apply", "reset_cache", "verify", "resume", "probe",
         "reopen"]


@pytest.fixture
def ckpts(tmp_path) -> dict[str, Path]:
    return mock_policies(tmp_path / "weights")


@pytest.fixture
def fleet(start_fleet, ckpts):
    return two_rl_mockers(start_fleet, ckpts)


def admin_calls(worker: dict) -> int:
    """The HTTP admin calls the coordinator made to a worker: each call recorded, but the
    steps one commit_policy call ran count once, and the probe is not an admin call."""
    calls = worker["calls"]
    return (sum(1 for c in calls if "via" not in c and c["route"] != "generate")
            + (1 if any("via" in c for c in calls) else 0))


class Watching(RefreshHooks):
    """Wants the "paused" point (and does nothing there)."""

    def __init__(self) -> None:
        self.reached_points: list[str] = []

    def wants(self, point: str) -> bool:
        return point == "paused"

    def reached(self, point: str) -> None:
        self.reached_points.append(point)


def test_a_sync_refresh_takes_two_admin_calls_per_worker(fleet, ckpts, tmp_path):
    events: list[str] = []
    r = PolicyRefresh(fleet.rl_url, model=MODEL, timeout=10, journal=tmp_path / "j.sqlite",
                      on_event=events.append)
    try:
        res = asyncio.run(r.refresh(ckpts["B"], "B", digest="mock:2"))
        assert res.ok and res.fleet_moved, res.reason
        # progress names the phases the commit runs as it starts, then its end
        started = [i for i, e in enumerate(events) if " commit ... " in e]
        assert len(started) == 1, events
        assert "gate, pause, apply, reset_cache, verify, resume" in events[started[0]], events
        assert any(" committed in one call each " in e for e in events[started[0] + 1:]), events
        assert [s["name"] for s in res.steps] == STEPS
        for w in res.workers:
            assert admin_calls(w) == 2, w["calls"]
            steps = [c["step"] for c in w["calls"]]
            assert steps == ["gate", "pause", "apply", "reset_cache", "verify", "verify",
                             "resume", "probe", "reopen"], steps
            assert {c["via"] for c in w["calls"] if c["step"] not in ("probe", "reopen")} \
                == {"commit_policy"}
            assert w["holds"]["digest"] == "mock:2"
        entry = r.journal.get(res.refresh_id)
        assert entry["state"] == "reopened" and entry["served_version"] == "B"
        assert len(routed(fleet, 2)) == 2 and r.rollout_gate.is_open

        hooks = Watching()  # a test that stops the coordinator at a step: one call a step
        hooked = PolicyRefresh(fleet.rl_url, model=MODEL, timeout=10, hooks=hooks,
                               journal=tmp_path / "j.sqlite")
        try:
            res = asyncio.run(hooked.refresh(ckpts["A"], "A", digest="mock:1"))
        finally:
            hooked.close()
        assert res.ok and res.fleet_moved, res.reason
        assert hooks.reached_points == ["paused"]
        for w in res.workers:
            assert not any("via" in c for c in w["calls"])
            assert admin_calls(w) == 8, w["calls"]  # gate, pause, apply, reset, 2x verify, ...
    finally:
        r.close()


def trainer(fleet, tmp_path) -> Fleet:
    return Fleet(fleet.url, RL_MOCK_MODEL, rl_url=fleet.rl_url, timeout=10,
                 journal=tmp_path / "journal.sqlite")


def test_workers_that_cannot_stage_install_from_disk_and_the_journal_says_why(fleet, ckpts,
                                                                              tmp_path):
    with trainer(fleet, tmp_path) as t:
        res = t.refresh(ckpts["B"], "B", digest="mock:2")
        assert res.ok and res.fleet_moved, res.reason
        entry = t.coordinator.journal.get(res.refresh_id)
    assert entry["update_path"] == "vllm-staged"
    for w in entry["workers"].values():
        calls = [(c["step"], c["route"]) for c in w["calls"]]
        assert calls[0] == ("stage", "fallback"), calls
        assert ("apply", "update_weights_from_disk") in calls
        why = next(c["body"] for c in w["calls"] if c["route"] == "fallback")
        assert why["install"] == "update_weights_from_disk"
        assert "does not prepare a staged version while it serves" in why["why"]
        assert w["holds"]["digest"] == "mock:2"


def test_a_worker_failing_its_probe_after_the_reopen_is_closed_again(fleet, ckpts, tmp_path):
    bad, good = fleet.workers[1], fleet.workers[0]
    fault(bad, "generate", "http500")
    with trainer(fleet, tmp_path) as t:
        res = t.refresh(ckpts["B"], "B", digest="mock:2")
        assert res.decision == "reopened", res.reason
        assert t.rollout_gate.is_open
    names = [s["name"] for s in res.steps]
    assert names.index("reopen") < names.index("probe")  # reopened, then probed
    w = next(w for w in res.workers if w["instance_id"] == int(bad.ready["instance_id"]))
    assert w["status"] == "excluded" and "post-update generation failed" in w["reason"]
    gates = [c for c in w["calls"] if c["route"] == "set_admission"]
    assert [c["step"] for c in gates][-2:] == ["reopen", "gate"]  # opened, then closed again
    want = {int(good.ready["instance_id"])}
    assert routed(fleet, want) == want
