"""The post-update probe of a synchronous refresh runs inside each worker's commit_policy
call (on the worker's own request plane, after the resume) and is judged as a direct probe
is: the same journal row (step "probe", route "generate", marked `via` commit_policy) and,
when it fails, the same exclusion. On a two-worker mocker fleet."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rlfleet.mocker.engine import write_mock_checkpoint
from rlfleet.refresh.coordinator import PolicyRefresh
from tests.fleets import RL_MOCK_MODEL, RL_PROBE_ENV, fault, mock_args, routed

MODEL = RL_MOCK_MODEL


@pytest.fixture
def ckpts(tmp_path) -> dict[str, Path]:
    root = tmp_path / "weights"
    return {"root": root, "B": write_mock_checkpoint(root / "B", 2)}


@pytest.fixture
def fleet(start_fleet, ckpts):
    return start_fleet([mock_args(ckpts["root"])] * 2, model=MODEL, enable_rl=True,
                       frontend_env=RL_PROBE_ENV)


def refresh(fleet, ckpts, tmp_path):
    r = PolicyRefresh(fleet.rl_url, model=MODEL, timeout=10, journal=tmp_path / "j.sqlite")
    return r, asyncio.run(r.refresh(ckpts["B"], "B", digest="mock:2"))


def test_the_probe_runs_inside_the_commit(fleet, ckpts, tmp_path):
    r, res = refresh(fleet, ckpts, tmp_path)
    assert res.ok and res.fleet_moved, res.reason
    for w in res.workers:
        assert w["status"] == "verified", w
        probes = [c for c in w["calls"] if c["step"] == "probe"]
        assert len(probes) == 1, w["calls"]
        p = probes[0]
        assert p["route"] == "generate" and p["http_status"] == 200, p
        assert p["via"] == "commit_policy", p
        assert p["body"]["done"] is True, p  # the stream's last event, as a direct probe's
    journaled = r.journal.get(res.refresh_id)
    assert journaled["state"] == "reopened"
    assert len(routed(fleet, 2)) == 2


def test_a_failing_probe_in_the_commit_keeps_the_worker_out(fleet, ckpts, tmp_path):
    bad = fleet.workers[1]
    fault(bad, "generate", "http500")
    _, res = refresh(fleet, ckpts, tmp_path)
    assert res.decision == "reopened", res.reason
    w = next(w for w in res.workers if w["instance_id"] == int(bad.ready["instance_id"]))
    assert w["status"] == "excluded", w
    assert w["reason"].startswith("post-update generation failed: HTTP 500"), w["reason"]
    probe = [c for c in w["calls"] if c["step"] == "probe"]
    assert [(c["route"], c["http_status"], c["via"]) for c in probe] == \
        [("generate", 500, "commit_policy")], probe
    assert probe[0]["body"]["error"]["message"], probe  # the refusal's body is journaled
    want = {int(fleet.workers[0].ready["instance_id"])}
    assert routed(fleet, want) == want
