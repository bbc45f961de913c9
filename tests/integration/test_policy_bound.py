"""The staleness bound the frontend enforces (nvext.policy), on a mocker fleet of two
workers whose fleet steps the test sets: routing only to workers within the bound, holding
while none is (bounded by --gated-hold), 409 naming the steps wanted and served, and
on_stale abort / finish when a worker's step moves mid-generation."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from rlfleet.rl import PolicyBound, RetryPolicy, RolloutClient, SampleFailed, SamplingSpec
from tests.fleets import GENERATED, fleet_metric, wait_generated
from tests.fleets import RL_MOCK_MODEL as MODEL

HOLD = 1.5  # the frontend's --gated-hold


@pytest.fixture(scope="module")
def bf(start_module_fleet):
    f = start_module_fleet([("--served-model-name", MODEL, "--system-port", "0",
                             "--token-delay", "0.01", "--seed", "1")] * 2,
                           model=MODEL, frontend=("--gated-hold", str(HOLD)))
    f.ids = [int(p.ready["instance_id"]) for p in f.workers]
    return f


def set_step(f, i: int, step: int) -> None:
    """Relabel worker i's policy with fleet step `step` (its weights stay)."""
    r = httpx.post(f"{f.workers[i].ready['system_url']}/engine/set_weight_version",
                   json={"weight_version": f"s{step}", "step": step}, timeout=5)
    assert r.status_code == 200, r.text


def steps_seen(f, want: dict[int, int], timeout: float = 10.0) -> None:
    """Wait until the frontend's discovery view shows these steps (worker index: step)."""
    deadline = time.monotonic() + timeout
    while True:
        by = {w["instance_id"]: w.get("step")
              for w in httpx.get(f"{f.url}/health", timeout=5).json()["workers"]}
        if all(by.get(f.ids[i]) == s for i, s in want.items()):
            return
        assert time.monotonic() < deadline, f"frontend sees steps {by}, want {want}"
        time.sleep(0.05)


def complete(f, policy, max_tokens: int = 4, stream: bool = False, **kw) -> httpx.Response:
    body = {"model": MODEL, "prompt": [11, 12, 13], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": stream, "return_tokens_as_token_ids": True,
            "nvext": {"extra_fields": ["engine_data", "worker_id", "weight_versions",
                                       "detailed_finish_reason"], "policy": policy}, **kw}
    return httpx.post(f"{f.url}/v1/completions", json=body, timeout=120)


def served(r: httpx.Response) -> tuple[int, int]:
    assert r.status_code == 200, r.text
    nv = r.json()["nvext"]
    return nv["worker_id"]["decode_worker_id"], nv["engine_data"]["weight_step"]


def test_routes_only_within_the_bound(bf):
    f = bf
    set_step(f, 0, 5)
    set_step(f, 1, 6)
    steps_seen(f, {0: 5, 1: 6})
    for policy in ({"min_step": 6}, {"max_lag": 0}, {"min_step": 2, "max_lag": 0}):
        got = {served(complete(f, policy)) for _ in range(6)}
        assert got == {(f.ids[1], 6)}, (policy, got)
    # max_lag 1 from the newest (6): both serve, round robin
    got = {served(complete(f, {"max_lag": 1})) for _ in range(6)}
    assert got == {(f.ids[0], 5), (f.ids[1], 6)}
    # the SGLang route takes the same bound
    r = httpx.post(f"{f.url}/generate", json={"model": MODEL, "input_ids": [11, 12],
                                              "sampling_params": {"max_new_tokens": 3},
                                              "policy": {"min_step": 6}}, timeout=30)
    assert r.status_code == 200 and r.json()["meta_info"]["weight_step"] == 6, r.text
    spans = r.json()["meta_info"]["weight_versions"]
    assert [s["step"] for s in spans] == [6]


def test_holds_while_none_is_within_then_409_naming_steps(bf):
    f = bf
    set_step(f, 0, 5)
    set_step(f, 1, 6)
    steps_seen(f, {0: 5, 1: 6})
    t0 = time.monotonic()
    r = complete(f, {"min_step": 9})
    waited = time.monotonic() - t0
    assert r.status_code == 409, r.text
    msg = r.json()["error"]["message"]
    assert "min_step 9" in msg and "wanted step >= 9" in msg and "steps served: 5, 6" in msg
    assert waited >= HOLD * 0.9  # held first, not refused at once
    # held, then served once a worker reaches the bound
    out: list = []
    t = threading.Thread(target=lambda: out.append(complete(f, {"min_step": 7})))
    t.start()
    time.sleep(0.3)
    assert not out  # still held
    set_step(f, 0, 7)
    t.join(10)
    assert served(out[0]) == (f.ids[0], 7)


@pytest.mark.parametrize("policy,why", [
    ({}, "min_step and/or max_lag"),
    ({"max_lag": -1}, "max_lag"),
    ({"min_step": "3"}, "min_step"),
    ({"max_lag": 1, "on_stale": "ignore"}, "on_stale"),
    ({"max_lag": 1, "lag": 2}, "lag"),
])
def test_bad_bounds_are_400(bf, policy, why):
    r = complete(bf, policy)
    assert r.status_code == 400 and why in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("on_stale", ["abort", "finish"])
def test_a_worker_leaving_the_bound_mid_generation(bf, on_stale):
    """Both workers move to the next step while the request runs: with max_lag 0 its tokens
    then span two steps. abort: finish reason abort, detailed stale_policy, fewer tokens;
    finish: all tokens, marked stale_policy."""
    f = bf
    base = 20 if on_stale == "abort" else 30
    set_step(f, 0, base)
    set_step(f, 1, base)
    steps_seen(f, {0: base, 1: base})
    out: list = []
    before = fleet_metric(f, GENERATED)
    t = threading.Thread(target=lambda: out.append(
        complete(f, {"max_lag": 0, "on_stale": on_stale}, max_tokens=300)))
    t.start()
    wait_generated(f, 20, before)  # under way at step `base`
    set_step(f, 0, base + 1)
    set_step(f, 1, base + 1)
    t.join(120)  # a bound for a loaded machine, not a timing
    assert out, "the request did not end"
    r = out[0]
    assert r.status_code == 200, r.text
    body = r.json()
    choice, nv = body["choices"][0], body["nvext"]
    assert nv["stale_policy"] is True
    assert [s["step"] for s in nv["weight_versions"]][0] == base
    n = nv["weight_versions"][-1]["end"]
    if on_stale == "abort":
        assert choice["finish_reason"] == "abort"
        assert nv["detailed_finish_reason"] == "stale_policy"
        assert n < 300
    else:
        assert choice["finish_reason"] == "length" and n == 300
        assert {s["step"] for s in nv["weight_versions"]} == {base, base + 1}
    # a request inside the bound throughout is not marked
    r = complete(f, {"max_lag": 0, "on_stale": on_stale})
    assert r.status_code == 200 and "stale_policy" not in r.json()["nvext"], r.text


@pytest.mark.parametrize("on_stale,reason", [("abort", "stale_policy"),
                                             ("finish", "policy_bound")])
def test_the_rollout_client_maps_stale_samples_to_outcomes(bf, on_stale, reason):
    """The same move mid-generation seen through RolloutClient: the attempt is not
    admitted, and its ledger entry says why (aborted as stale / marked stale)."""
    f = bf
    base = 40 if on_stale == "abort" else 50
    set_step(f, 0, base)
    set_step(f, 1, base)
    steps_seen(f, {0: base, 1: base})

    async def sample():
        async with RolloutClient(f.url, MODEL, retry=RetryPolicy(max_attempts=1),
                                 policy=PolicyBound(max_lag=0, on_stale=on_stale),
                                 allow_mixed_versions=True) as c:
            with pytest.raises(SampleFailed):
                await c.generate("x", [11, 12, 13], SamplingSpec(max_tokens=300,
                                                                 ignore_eos=True))
            return c.ledger.attempt("x", 1).reason

    out: list = []
    before = fleet_metric(f, GENERATED)
    t = threading.Thread(target=lambda: out.append(asyncio.run(sample())))
    t.start()
    wait_generated(f, 20, before)  # under way at step `base`
    set_step(f, 0, base + 1)
    set_step(f, 1, base + 1)
    t.join(120)  # a bound for a loaded machine, not a timing
    assert out == [reason]
