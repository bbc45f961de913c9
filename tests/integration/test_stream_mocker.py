"""The asynchronous loop (Fleet.stream_rollouts) on a mocker fleet of two workers (a declared
simulator: the point is the loop, not the engine): rollouts go on while the trainer
"trains", rolling refreshes move the fleet after every step, no handed token is beyond
the bound (counted from the spans), every sample is admitted once, the producer never runs
more than max_ahead ahead, and a fleet shrunk to one worker is refreshed synchronously."""

from __future__ import annotations

import asyncio
import time

import pytest

from rlfleet.mocker.engine import write_mock_checkpoint
from rlfleet.rl import Fleet, PolicyRefresh, RetryPolicy, SampleRequest, SamplingSpec
from rlfleet.rl.stream import numbered
from tests.fleets import RL_MOCK_MODEL as MODEL
from tests.fleets import RL_PROBE_ENV, mock_args

SEEDS = {"s1": 100, "s0": 200}
SPEC = SamplingSpec(max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def mf(tmp_path_factory, start_module_fleet):
    tmp = tmp_path_factory.mktemp("stream")
    root = tmp / "weights"
    fleet = start_module_fleet([mock_args(root, "--token-delay", "0.01")] * 2, model=MODEL,
                               enable_rl=True, frontend_env=RL_PROBE_ENV)
    fleet.root, fleet.tmp = root, tmp
    return fleet


def requests(tag: str):
    return numbered(lambda i: SampleRequest(f"{tag}-{i}", [1000 + i % 50, 1001], SPEC))


def run_loop(f, tag: str, steps: int, max_staleness: int, train_seconds: float,
             per_batch: int = 1, **cfg):
    journal = str(f.tmp / f"{tag}.sqlite")
    seed0 = SEEDS[tag]
    sync = PolicyRefresh(f.rl_url, model=MODEL, journal=journal, timeout=20)
    try:  # a rolling refresh starts from a fleet whose workers declare a step
        first = asyncio.run(sync.refresh(write_mock_checkpoint(f.root / f"{tag}-0", seed0),
                                         f"{tag}-0", digest=f"mock:{seed0}"))
    finally:
        sync.close()
    assert first.fleet_moved, first.reason
    fleet = Fleet(f.url, MODEL, rl_url=f.rl_url, journal=journal, mode="rolling",
                  max_lag=max_staleness + 1, min_serving=1, timeout=20, pause_mode="keep",
                  retry=RetryPolicy(4, backoff_initial=0.1, attempt_timeout=60))
    batches = []
    try:
        with fleet.stream_rollouts(requests(tag), 4, max_staleness=max_staleness,
                                   start_step=first.policy.step, **cfg) as stream:
            for k in range(1, steps * per_batch + 1):
                if (k - 1) % per_batch == 0:
                    batches.append(stream.next_batch(timeout=120))
                time.sleep(train_seconds)  # the trainer's step
                seed = seed0 + k
                stream.publish(write_mock_checkpoint(f.root / f"{tag}-{k}", seed), f"{tag}-{k}",
                               digest=f"mock:{seed}", step=first.policy.step + k)
            stream.wait_refreshed(120)
        stats = stream.stats
        admitted = fleet.ledger.admitted()
    finally:
        fleet.close()
    return first.policy.step, batches, stats, admitted


def test_async_loop_stays_within_the_bound_and_admits_each_sample_once(mf):
    start, batches, stats, admitted = run_loop(mf, "s1", 5, 1, 0.3)
    handed = [s for b in batches for s in b]
    assert [len(b) for b in batches] == [4] * 5
    ids = [s.sample.sample_id for s in handed]
    assert len(set(ids)) == len(ids) and set(ids) <= set(admitted)
    for s in handed:  # every token within the bound, as its own spans say
        spans = [sp for c in s.sample.completions for sp in c.weight_spans]
        assert all(s.trainer_step - sp.step <= 1 for sp in spans), (s.trainer_step, spans)
        assert sum(sp.end - sp.start for sp in spans) == 16
    assert stats.max_staleness_seen is not None and stats.max_staleness_seen <= 1
    assert sum(stats.tokens_by_staleness.values()) == 16 * len(handed)
    assert stats.max_in_flight_ahead <= 4  # max_ahead = max_staleness x batch_size
    # every step's refresh reopened the fleet on it (rolling), trainer steps 1..5 in order
    moved = [r for r in stats.refreshes if r["decision"] == "reopened"]
    assert [r["step"] for r in moved] == [start + k for k in range(1, 6)]
    assert all(r["mode"] == "rolling" for r in moved)
    # samples handed at a step come from it or the one before: the loop overlapped
    assert any(s.staleness == 1 for s in handed[4:]), [s.staleness for s in handed]


def test_a_stale_sample_is_regenerated_and_never_handed(mf):
    """max_staleness 0 and two optimizer steps per batch: the samples generated for the next
    batch (at the step after this one) are one step stale when it is taken; they are
    dropped and their requests sent again under new IDs."""
    start, batches, stats, admitted = run_loop(mf, "s0", 3, 0, 0.3, per_batch=2)
    handed = [s for b in batches for s in b]
    assert all(s.staleness == 0 for s in handed)
    assert set(stats.tokens_by_staleness) == {0}
    assert stats.dropped_stale >= 1 and stats.regenerated >= stats.dropped_stale
    assert any("~r" in s.sample.sample_id for s in handed)
    ids = [s.sample.sample_id for s in handed]
    assert len(set(ids)) == len(ids)

