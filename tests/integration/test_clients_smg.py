"""SMG's RL surface (rlfleet.protocol.smg) against two mocker workers behind the one URL (the
declared simulator: versions and routing, not an engine's numbers), driven by SMG's own
client where it has one (smg 1.13.0's `smg.rl`: `RL.fanout`, `paused`, `FanoutError`,
installed by scripts/setup.sh, loaded by tests/clients.py):

- `/v1/rl/engine/{path}?selector=` calls one engine route on every worker the selector
  matches: `paused(rl, selector)` (pause_generation ... continue_generation) around an update
  from disk on every worker, then on one; a call every worker refuses answers 207 with
  `failed[]` (the client raises FanoutError unless allow_partial); selector errors in SMG's
  codes;
- `x-smg-version-policy` narrows the workers a request may be routed to (latest-only,
  max-staleness:k, min-version:v against the fleet steps the workers serve), a bad value is
  SMG's 400 `invalid_version_policy`;
- `x-smg-weight-version` names the version that served an answer, and a whole answer whose
  tokens came from two versions (an update under a keep-pause while it ran) carries
  `x-smg-mixed-version: true`."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from rlfleet.mocker.engine import write_mock_checkpoint
from tests import clients
from tests.clients import mock_one_url, wait_in_flight
from tests.fleets import RL_MOCK_MODEL as MODEL
from tests.fleets import mock_args

EVERY = "engine=vllm"  # what every rlfleet worker is to a selector


@pytest.fixture(scope="module")
def one(start_module_fleet, tmp_path_factory):
    root = tmp_path_factory.mktemp("smg")
    for u in mock_one_url(start_module_fleet, tmp_path_factory, "smg", MODEL,
                          mock_args(root, "--token-delay", "0.01")):
        u.root, u.ids = root, sorted(w.ready["instance_id"] for w in u.fleet.workers)
        yield u


@pytest.fixture(scope="module")
def smg():
    return clients.smg_rl()


def generate(one, max_new_tokens: int = 8, **headers: str) -> httpx.Response:
    return httpx.post(f"{one.url}/generate", timeout=120, headers=headers, json={
        "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": max_new_tokens,
                                                    "ignore_eos": True}})


def update(smg, one, selector: str, seed: int, step: int) -> None:
    """SMG's refit: pause the matching workers, load a checkpoint on them, always resume."""
    rl = smg.RL(one.url, timeout=120)
    ckpt = write_mock_checkpoint(one.root / f"seed-{seed}", seed)
    with smg.paused(rl, selector) as paused:
        assert paused.total == paused.succeeded
        said = rl.fanout("update_weights_from_disk", {"model_path": str(ckpt),
                                                      "weight_version": str(step), "step": step},
                         selector=selector)
        assert said.succeeded == said.total and not said.failed
        assert all(r.body["version"] == str(step) for r in said.results.values())


def test_an_answer_spanning_an_update_is_marked_mixed(smg, one) -> None:
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", generate(one, 400)))
    t.start()
    wait_in_flight(one.url)
    time.sleep(0.3)  # some tokens under the first weights
    update(smg, one, EVERY, seed=2, step=2)  # keep-paused: the request goes on after
    t.join(120)
    r = out["r"]
    spans = r.json()["meta_info"]["weight_versions"]
    assert len({s["version"] for s in spans}) == 2, spans
    assert r.headers["x-smg-mixed-version"] == "true"
    assert r.headers.get("x-smg-weight-version") == r.json()["meta_info"]["weight_version"]
    after = generate(one)
    assert after.headers["x-smg-weight-version"] == "2"
    assert "x-smg-mixed-version" not in after.headers


def served_by(one, n: int, policy: str) -> set[str]:
    seen = set()
    for _ in range(n):
        r = generate(one, 2, **{"x-smg-version-policy": policy})
        assert r.status_code == 200, r.text
        seen.add(r.headers["x-smg-weight-version"])
    return seen


def test_the_version_policy_narrows_the_workers(smg, one) -> None:
    newer = one.ids[0]
    update(smg, one, f"id={newer}", seed=3, step=3)  # one worker on step 3, the other on 2
    assert served_by(one, 8, "any") == {"2", "3"}
    assert served_by(one, 8, "max-staleness:1") == {"2", "3"}
    assert served_by(one, 6, "latest-only") == {"3"}
    assert served_by(one, 6, "min-version:3") == {"3"}
    assert served_by(one, 6, "max-staleness:0") == {"3"}
    for bad in ("freshest", "max-staleness:x", "min-version:", "min-version:step-3"):
        r = generate(one, 2, **{"x-smg-version-policy": bad})
        assert r.status_code == 400 and r.json()["error"] == "invalid_version_policy", bad
    both = httpx.post(f"{one.url}/v1/completions", timeout=60,
                      headers={"x-smg-version-policy": "latest-only"},
                      json={"model": MODEL, "prompt": [1, 2], "max_tokens": 2,
                            "nvext": {"policy": {"max_lag": 1}}})
    assert both.status_code == 400 and "one staleness bound" in both.text
    update(smg, one, f"id={one.ids[1]}", seed=3, step=3)  # the fleet on one policy again


def test_a_fanout_every_worker_refuses_is_a_207_with_failed(smg, one) -> None:
    rl = smg.RL(one.url, timeout=60)
    with pytest.raises(smg.FanoutError) as e:  # not paused: every worker refuses the load
        rl.fanout("update_weights_from_disk", {"model_path": str(one.root)}, selector=EVERY)
    assert e.value.status == 207
    assert {f.worker_id for f in e.value.result.failed} == {str(i) for i in one.ids}
    assert all(f.error == "upstream_error" for f in e.value.result.failed)
    info = rl.fanout("server_info", method="GET", selector=f"model={MODEL}")
    assert info.total == info.succeeded == 2
    assert {r.body["served_model_name"] for r in info.results.values()} == {MODEL}
    native = rl.fanout("weight_info", method="GET", selector=f"id={one.ids[0]}")
    assert list(native.results) == [str(one.ids[0])]  # a native route of the worker
    for selector, code in [("", "selector_required"), ("color=red", "invalid_selector"),
                           ("model=nope", "no_workers_match")]:
        with pytest.raises(smg.RlError) as e:
            rl.fanout("server_info", method="GET", selector=selector)
        assert (e.value.status, e.value.code) == (400, code), selector
