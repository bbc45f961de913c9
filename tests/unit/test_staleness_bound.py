"""The frontend's staleness bound without processes: nvext.policy parsing, which workers
are within it, and how a final delta that left it is marked or aborted."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rlfleet.frontend.dispatch import Staleness
from rlfleet.frontend.result import merge_deltas
from rlfleet.frontend.router import NoWorker, Worker, within
from rlfleet.protocol.engine import Delta, WeightSpan
from rlfleet.protocol.nvext import NvExt, PolicyBound


def worker(iid: int, step: int | None) -> Worker:
    return Worker(iid, "m", "http://x", "x:1", {"weight_step": step})


def spans(*steps: int) -> list[WeightSpan]:
    return [WeightSpan(version=f"s{s}", digest=None, step=s, start=i, end=i + 1)
            for i, s in enumerate(steps)]


def test_nvext_policy_is_checked():
    assert NvExt.model_validate({"policy": {"max_lag": 1}}).policy == PolicyBound(max_lag=1)
    for bad in ({}, {"min_step": -1}, {"max_lag": 1.0}, {"max_lag": 1, "on_stale": "keep"},
                {"max_lag": 1, "extra": 1}):
        with pytest.raises(ValidationError):
            NvExt.model_validate({"policy": bad})


def test_floor_and_allows():
    b = PolicyBound(min_step=3, max_lag=1)
    assert b.floor(10) == 9 and b.floor(3) == 3 and b.floor(None) == 3
    assert PolicyBound(max_lag=2).floor(None) is None
    assert b.allows([3, 4]) and not b.allows([3, 5]) and not b.allows([2]) \
        and not b.allows([None])


def test_within_counts_max_lag_from_the_newest_serving_step():
    ws = [worker(1, 4), worker(2, 5), worker(3, None)]
    assert [w.instance_id for w in within(PolicyBound(max_lag=0), ws, "m")] == [2]
    assert [w.instance_id for w in within(PolicyBound(max_lag=1), ws, "m")] == [1, 2]
    with pytest.raises(NoWorker) as info:
        within(PolicyBound(min_step=7), ws, "m")
    assert info.value.status == 409
    assert "wanted step >= 7; steps served: none declared, 4, 5" in str(info.value.body)


def test_a_final_delta_outside_the_bound_is_marked_or_aborted():
    w = worker(1, 5)
    d = Delta(index=0, token_ids=[1, 2], finish_reason="length", weight_versions=spans(5, 6))
    keep = Staleness(PolicyBound(max_lag=0, on_stale="finish"), w, 5)
    out = keep.final(d, 5)
    assert out.stale_policy is True and out.finish_reason == "length"
    assert d.stale_policy is not True  # the event itself is never changed
    cut = Staleness(PolicyBound(max_lag=0), w, 5).final(d, 5)
    assert (cut.finish_reason, cut.stale_policy) == ("abort", True)
    fine = Delta(index=0, token_ids=[1], finish_reason="stop", weight_versions=spans(6))
    assert Staleness(PolicyBound(max_lag=1), w, 6).final(fine, 6) is fine
    # below the floor set at routing time (newest 6, max_lag 0)
    assert Staleness(PolicyBound(max_lag=0), w, 6).final(
        Delta(index=0, finish_reason="stop", weight_versions=spans(5)), 5).stale_policy is True
    # an engine without per-token spans: the Head's step stands for the choice
    assert Staleness(PolicyBound(min_step=6), w, 6).final(
        Delta(index=0, finish_reason="stop"), 5).stale_policy is True
    # the worker's step as discovery reports it
    s = Staleness(PolicyBound(max_lag=0), w, 5)
    s.first = 5
    assert not s.left(w)
    w.entry["weight_step"] = 6
    assert s.left(w)


def test_merged_deltas_keep_the_mark():
    a = Delta(index=0, token_ids=[1])
    b = Delta(index=0, token_ids=[2], finish_reason="abort", stale_policy=True)
    [m] = merge_deltas([a, b])
    assert m.token_ids == [1, 2] and m.stale_policy is True
