"""The stage-first refresh's choices where no real engine is needed, on two mocker workers
(whose engine prepares no version while it serves): every worker falls back to the disk path
and the journal says why; `Fleet.refresh` probes after the reopen, so a worker whose probe
fails was reopened and is closed again, left out, while the other serves."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfleet.rl import Fleet
from tests.fleets import RL_MOCK_MODEL, fault, mock_policies, routed, two_rl_mockers


@pytest.fixture
def setup(start_fleet, tmp_path) -> tuple[object, dict[str, Path]]:
    """Two RL mockers and their checkpoints (A, B)."""
    ckpts = mock_policies(tmp_path / "weights")
    return two_rl_mockers(start_fleet, ckpts), ckpts


def trainer(fleet, tmp_path) -> Fleet:
    return Fleet(fleet.url, RL_MOCK_MODEL, rl_url=fleet.rl_url, timeout=10,
                 journal=tmp_path / "journal.sqlite")


def test_workers_that_cannot_stage_install_from_disk_and_the_journal_says_why(setup, tmp_path):
    fleet, ckpts = setup
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


def test_a_worker_failing_its_probe_after_the_reopen_is_closed_again(setup, tmp_path):
    fleet, ckpts = setup
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
