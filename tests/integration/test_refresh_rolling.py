"""Rolling refreshes on a mocker fleet of three workers: waves of workers move to the next
policy step while the others serve, rollouts never stop, every admitted sample's tokens
come from policies within the bound (as their per-token spans say), and never fewer than
`min_serving` workers serve."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import httpx
import pytest

from rlfleet.mocker.engine import write_mock_checkpoint
from rlfleet.rl import Fleet as RlFleet
from rlfleet.rl import PolicyRefresh, SampleRequest, SamplingSpec
from tests.fleets import RL_MOCK_MODEL as MODEL
from tests.fleets import RL_PROBE_ENV, mock_args, routed

SEEDS = {"A": 1, "B": 2, "C": 3, "D": 4}
N_SAMPLES = 2000


@pytest.fixture(scope="module")
def rf(tmp_path_factory, start_module_fleet):
    tmp = tmp_path_factory.mktemp("rolling")
    root = tmp / "weights"
    ckpts = {name: write_mock_checkpoint(root / name, seed) for name, seed in SEEDS.items()}
    fleet = start_module_fleet([mock_args(root)] * 3, model=MODEL, enable_rl=True,
                               frontend_env=RL_PROBE_ENV)
    fleet.ckpts, fleet.journal = ckpts, str(tmp / "journal.sqlite")
    return fleet


def policy(f) -> dict[int, tuple]:
    out = {}
    for p in f.workers:
        v = httpx.post(f"{p.ready['system_url']}/engine/get_weight_version", timeout=5).json()
        out[int(p.ready["instance_id"])] = (v["version"], v["weight_digest"], v["step"])
    return out


def answered(f) -> float:
    """Requests the frontend has answered with 200 so far (its own counter)."""
    text = httpx.get(f"{f.url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("rlfleet_frontend_requests_total{") and 'status="200"' in line)


def sync_to(f, name: str) -> int:
    r = PolicyRefresh(f.rl_url, model=MODEL, journal=f.journal, timeout=15)
    try:
        res = asyncio.run(r.refresh(f.ckpts[name], name, digest=f"mock:{SEEDS[name]}"))
    finally:
        r.close()
    assert res.ok and res.fleet_moved, res.reason
    return res.policy.step


def test_a_rolling_refresh_serves_throughout_within_the_bound(rf):
    """2,000 samples while the fleet rolls to the next step with max_lag=1: the frontend
    routes them by their nvext.policy, every one is admitted at its first attempt (none
    inside the bound refused or aborted), and each one's per-token spans (what the workers
    say produced its tokens) are within the bound."""
    f = rf
    start = sync_to(f, "A")
    fleet = RlFleet(f.url, MODEL, rl_url=f.rl_url, journal=f.journal, mode="rolling",
                    max_lag=1, min_serving=2, wave_size=1, pause_mode="keep", timeout=15,
                    allow_mixed_versions=True, concurrency=24)
    try:
        samples = [SampleRequest(f"r-{i}", [1000 + i % 50, 1001, 1002],
                                 SamplingSpec(max_tokens=24, ignore_eos=True))
                   for i in range(N_SAMPLES)]
        outcomes: list = []
        roll = threading.Thread(target=lambda: outcomes.extend(fleet.rollout(samples)))
        before = answered(f)
        roll.start()
        deadline = time.monotonic() + 60  # some samples end before the refresh begins
        while answered(f) < before + 50 and time.monotonic() < deadline:
            time.sleep(0.05)
        result = fleet.refresh(f.ckpts["B"], "B", digest="mock:2")
        roll.join(300)
        assert not roll.is_alive()
    finally:
        fleet.close()
    assert result.ok and result.fleet_moved, result.reason
    assert result.policy.step == start + 1 and "in 3 wave(s)" in result.reason
    assert sorted({s["wave"] for s in result.steps if s.get("wave")}) == [1, 2, 3]
    assert set(policy(f).values()) == {("B", "mock:2", start + 1)}
    assert len(routed(f, 3)) == 3
    # rollouts never stopped and every sample is within the bound, by its own spans
    failed = [o for o in outcomes if not o.admitted]
    assert len(outcomes) == N_SAMPLES and not failed, [o.reason for o in failed[:3]]
    assert [o.sample_id for o in outcomes if o.sample.attempt != 1] == []
    steps = [[s.step for s in o.sample.completion.weight_spans] for o in outcomes]
    assert all(set(s) <= {start, start + 1} and max(s) - min(s) <= 1 for s in steps)
    # the rollout spanned the refresh: samples from the old step only, from the new step
    # only, and (a keep-pause mid-sample) from both
    kinds = {tuple(sorted(set(s))) for s in steps}
    assert {(start,), (start + 1,)} <= kinds, kinds
    # one wave at a time: each worker left routing only after the previous one came back
    windows = sorted((min(c["at"] for c in w["calls"] if c["route"] == "set_admission"),
                      max(c["at"] for c in w["calls"] if c["route"] == "set_admission"))
                     for w in result.workers)
    assert all(later[0] >= earlier[1] for earlier, later in itertools.pairwise(windows))


def test_a_rolling_refresh_refuses_what_it_cannot_do_safely(rf):
    """Before anything changes: a target more than max_lag steps ahead of a serving worker,
    a wave that would leave fewer than min_serving serving; no rollback mode."""
    f = rf
    start = sync_to(f, "A")
    before = policy(f)
    r = PolicyRefresh(f.rl_url, model=MODEL, journal=f.journal, timeout=15, mode="rolling",
                      max_lag=1)
    try:
        res = asyncio.run(r.refresh(f.ckpts["C"], "C", digest="mock:3", step=start + 2))
        assert res.decision == "held" and "2 steps ahead of a serving worker" in res.reason
    finally:
        r.close()
    r = PolicyRefresh(config=r.config.replace(min_serving=3))
    try:
        res = asyncio.run(r.refresh(f.ckpts["C"], "C", digest="mock:3"))
        assert res.decision == "held" and "fewer than min_serving=3" in res.reason
    finally:
        r.close()
    assert policy(f) == before and len(routed(f, 3)) == 3 and r.rollout_gate.is_open
    with pytest.raises(ValueError, match="does not roll back"):
        PolicyRefresh(f.rl_url, mode="rolling", on_failure="rollback")
