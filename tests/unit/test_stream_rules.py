"""The asynchronous loop's settings and what it counts per sample (rlfleet.rl.stream)."""

from __future__ import annotations

import pytest

from rlfleet.protocol.identity import PolicyIdentity, WeightSpan
from rlfleet.rl.stream import StreamConfig, StreamStats, sample_steps
from rlfleet.rollout.sample import AdmittedSample, Completion


def test_stream_config_refuses_bad_settings():
    with pytest.raises(ValueError, match="batch_size"):
        StreamConfig(0)
    with pytest.raises(ValueError, match="max_staleness"):
        StreamConfig(4, -1)
    with pytest.raises(ValueError, match="on_stale"):
        StreamConfig(4, on_stale="keep")
    with pytest.raises(ValueError, match="max_ahead"):
        StreamConfig(4, max_ahead=0)
    assert StreamConfig(4, 2).max_ahead == 8 and StreamConfig(4, 0).max_ahead == 4


def span(step: int, start: int, end: int) -> WeightSpan:
    return WeightSpan.of(PolicyIdentity(version=f"s{step}", digest="d", step=step), start, end)


def test_sample_steps_count_every_span_of_every_completion():
    c1 = Completion([1, 2, 3], [-1.0] * 3, "length", [1] * 3, [span(4, 0, 2), span(5, 2, 3)])
    c2 = Completion([4, 5], [-1.0] * 2, "length", [1] * 2, None)  # no spans: the sample's
    s = AdmittedSample("x", 1, "r", [9], [c1, c2], "m", PolicyIdentity(step=5))
    assert sample_steps(s) == [(4, 2), (5, 1), (5, 2)]


def test_stats_summary_counts_tokens_by_staleness():
    st = StreamStats()
    st.tokens_by_staleness.update({0: 30, 1: 10})
    assert st.max_staleness_seen == 1 and st.mean_staleness == pytest.approx(0.25)
    summary = st.summary()
    assert summary["tokens_by_staleness"] == {"0": 30, "1": 10}
    assert 0 <= summary["fleet_idle_fraction"] <= 1
