"""LoRA adapters as policies on a real vLLM worker (CPU build, float32): loaded at run time,
named by a request's `model`, replaced by a new version while the base model serves, and
refused clearly when they do not fit. One fleet for the module (vLLM starts are slow)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest

from rlfleet.models import make_adapter
from rlfleet.refresh.coordinator import PolicyRefresh
from rlfleet.rl.fleet import Fleet
from rlfleet.rollout.sample import SampleRequest, SamplingSpec
from rlfleet.weights.adapters import publish_adapter
from tests.fleets import MODEL_NAME, local_fleet, vllm_worker_args

pytestmark = pytest.mark.engine

LORA_FLAGS = ("--enable-lora", "--max-loras", "6", "--max-lora-rank", "16")
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {"a1": make_adapter(root / "a1", rank=8, seed=1),
            "a2": make_adapter(root / "a2", rank=8, seed=2),
            "b1": make_adapter(root / "b1", rank=4, seed=3),
            "rank32": make_adapter(root / "rank32", rank=32, seed=4),
            "other_base": make_adapter(root / "other", size="small", rank=4, seed=5)}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_model, adapters):
    args = vllm_worker_args(tiny_model, MODEL_NAME, *LORA_FLAGS, "--allowed-weights-root",
                            str(adapters["a1"].parent))
    with local_fleet(tmp_path_factory.mktemp("lora-fleet"), [args], kind="vllm",
                     model=MODEL_NAME, lease_ttl=3.0, enable_rl=True) as f:
        yield f


def system(fleet) -> str:
    return fleet.workers[0].ready["system_url"]


def engine(fleet, route: str, **body) -> dict:
    r = httpx.post(f"{system(fleet)}/engine/{route}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def complete(fleet, model: str, max_tokens: int = 12, **kw) -> httpx.Response:
    return httpx.post(f"{fleet.url}/v1/completions", timeout=60, json={
        "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "nvext": {"extra_fields": ["engine_data"]}, **kw})


def tokens(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return r.json()["nvext"]["engine_data"]["completion_token_ids"]


def listed(fleet, name: str, timeout: float = 15) -> dict:
    """The adapter once the frontend's /v1/models lists it (discovery carries it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        cards = {c["id"]: c for c in httpx.get(f"{fleet.url}/v1/models").json()["data"]}
        if name in cards:
            return cards[name]
        time.sleep(0.2)
    raise AssertionError(f"{name} never listed in /v1/models")


def served(fleet, name: str, version: str, timeout: float = 15) -> None:
    """Until the frontend routes `name` to a worker that lists it at `version`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = complete(fleet, name, max_tokens=1)
        if r.status_code == 200 and r.json()["nvext"]["engine_data"].get(
                "weight_version") == version:
            return
        time.sleep(0.2)
    raise AssertionError(f"{name} never served at {version}")


def test_an_adapter_changes_the_tokens_of_the_requests_naming_it_and_only_those(fleet,
                                                                               adapters):
    base = tokens(complete(fleet, MODEL_NAME))
    loaded = engine(fleet, "load_lora_adapter", lora_name="a1",
                    lora_path=str(adapters["a1"]), weight_version="a1-v1", step=1)
    assert loaded["status"] == "ok", loaded
    assert loaded["adapter"] == "a1" and loaded["version"] == "a1-v1" and loaded["step"] == 1
    assert loaded["weight_digest"].startswith("blake3:") and loaded["rank"] == 8
    card = listed(fleet, "a1")
    assert card["parent"] == MODEL_NAME

    r = complete(fleet, "a1")
    on_adapter = tokens(r)
    assert on_adapter != base
    data = r.json()["nvext"]["engine_data"]
    assert data["weight_adapter"] == "a1" and data["weight_version"] == "a1-v1"
    assert data["weight_step"] == 1 and data["weight_digest"] == loaded["weight_digest"]
    assert tokens(complete(fleet, MODEL_NAME)) == base  # the base model is untouched
    base_data = complete(fleet, MODEL_NAME).json()["nvext"]["engine_data"]
    assert "weight_adapter" not in base_data

    version = engine(fleet, "get_weight_version")
    assert {"adapter": "a1", "version": "a1-v1", "digest": loaded["weight_digest"],
            "step": 1} in version["adapters"]
    rl = httpx.get(f"{fleet.rl_url}/v1/rl/workers").json()["workers"][0]
    assert "load_lora" not in rl["routes"] and "unload_lora" not in rl["routes"]


def test_bad_adapters_are_refused_by_name_and_nothing_else_changes(fleet, adapters):
    engine(fleet, "load_lora_adapter", lora_name="a1", lora_path=str(adapters["a1"]),
           weight_version="a1-v1", step=1)
    before = tokens(complete(fleet, "a1"))
    cases = {
        "rank32": ("--max-lora-rank 16", dict(lora_path=str(adapters["rank32"]))),
        "other_base": ("another base model", dict(lora_path=str(adapters["other_base"]))),
        "missing": ("does not exist", dict(lora_path=str(adapters["a1"].parent / "nope"))),
    }
    for name, (says, body) in cases.items():
        got = engine(fleet, "load_lora_adapter", lora_name="a1", weight_version="bad", **body)
        assert got["status"] == "error" and says in got["message"], (name, got)
    assert tokens(complete(fleet, "a1")) == before  # the old version still serves
    assert engine(fleet, "get_weight_version")["adapters"][0]["version"] == "a1-v1"

    r = complete(fleet, "no-such-adapter")
    assert r.status_code == 404 and "no-such-adapter" in r.text
    r = httpx.post(f"{system(fleet)}/engine/unload_lora_adapter", json={"lora_name": "zz"})
    assert r.json()["status"] == "error" and "zz" in r.json()["message"]
    r = httpx.post(f"{system(fleet)}/engine/load_lora_adapter", json={"lora_name": "a1"})
    assert r.json()["status"] == "error" and "lora_path is required" in r.json()["message"]
    # vLLM's own runtime-LoRA route: 4xx with vLLM's error shape
    r = httpx.post(f"{system(fleet)}/v1/load_lora_adapter",
                   json={"lora_name": "a1", "lora_path": str(adapters["rank32"])})
    assert r.status_code == 400 and "--max-lora-rank" in r.text
    r = httpx.post(f"{system(fleet)}/v1/unload_lora_adapter", json={"lora_name": "zz"})
    assert r.status_code == 404 and "zz" in r.text
    assert tokens(complete(fleet, "a1")) == before


def test_a_new_version_serves_while_the_base_model_streams_unpaused(fleet, adapters):
    engine(fleet, "load_lora_adapter", lora_name="a1", lora_path=str(adapters["a1"]),
           weight_version="a1-v1", step=1)
    old = tokens(complete(fleet, "a1"))
    base = tokens(complete(fleet, MODEL_NAME))
    with BaseTraffic(fleet) as traffic:
        got = engine(fleet, "load_lora_adapter", lora_name="a1", lora_path=str(adapters["a2"]),
                     weight_version="a1-v2", step=2)
    assert got["status"] == "ok" and got["replaced"] == "a1-v1", got
    new = complete(fleet, "a1")
    assert tokens(new) != old
    assert new.json()["nvext"]["engine_data"]["weight_version"] == "a1-v2"
    assert traffic.codes and set(traffic.codes) == {200}, traffic.codes
    assert traffic.texts == {traffic.base_text}  # the base never changed
    assert tokens(complete(fleet, MODEL_NAME)) == base


# ------------------------------------------------------------------ refreshes of adapters


def test_an_adapter_refresh_moves_one_adapter_while_the_base_streams(fleet, adapters,
                                                                    tmp_path):
    """PolicyRefresh on path vllm-adapter: the gate, the load, the verify and the probe touch
    the adapter only; base requests are never refused or paused; a wrong-base version is
    refused before the gate (loaded beside the serving version), the old version serving."""
    refresh = PolicyRefresh(fleet.rl_url, model=MODEL_NAME, path="vllm-adapter",
                            adapter="r1", journal=tmp_path / "journal.sqlite",
                            on_failure="rollback")
    try:
        first = asyncio.run(refresh.refresh(adapters["a1"], "r1-v1"))
        assert first.decision == "reopened", first.reason
        v1 = tokens(complete(fleet, "r1"))
        base = tokens(complete(fleet, MODEL_NAME))
        with BaseTraffic(fleet) as traffic:
            second = asyncio.run(refresh.refresh(adapters["a2"], "r1-v2"))
        assert second.decision == "reopened", second.reason
        assert traffic.codes and set(traffic.codes) == {200}, traffic.codes
        assert traffic.texts == {traffic.base_text}
        r = complete(fleet, "r1")
        assert tokens(r) != v1
        data = r.json()["nvext"]["engine_data"]
        assert (data["weight_adapter"], data["weight_version"], data["weight_step"]) == \
            ("r1", "r1-v2", 1)
        steps = {s["name"] for s in second.steps}
        assert {"gate", "apply", "verify", "probe", "reopen"} <= steps
        calls = [c["route"] for w in second.workers for c in w["calls"]]
        assert "pause_generation" not in calls and "flush_cache" not in calls
        assert tokens(complete(fleet, MODEL_NAME)) == base

        # refused while loading it beside the serving version: held before any gate
        wrong = asyncio.run(refresh.refresh(adapters["other_base"], "r1-wrong"))
        assert wrong.decision == "held", wrong.reason
        assert "another base model" in wrong.reason and "nothing was gated" in wrong.reason
        assert "gate" not in {s["name"] for s in wrong.steps}
        r = complete(fleet, "r1")
        assert r.json()["nvext"]["engine_data"]["weight_version"] == "r1-v2"
        record = refresh.journal.get(second.refresh_id)
        assert record.target.adapter == "r1" and record.served.version == "r1-v2"
        assert record["fleet"].endswith("#lora=r1")
    finally:
        refresh.close()


def test_two_runs_refresh_their_adapters_concurrently_with_exactly_once_admission(
        fleet, adapters, tmp_path):
    """Two trainers on one fleet, each its adapter, ledger and journal: they refresh at the
    same time (neither fences nor gates the other) and each admits its samples once, only
    from its own adapter's current version."""
    def run(name: str, versions: list[str], out: dict) -> None:
        fl = Fleet(fleet.url, name, rl_url=fleet.rl_url, ledger=tmp_path / f"{name}.sqlite",
                   journal=tmp_path / f"{name}-journal.sqlite", path="vllm-adapter",
                   adapter=name)
        try:
            for i, path in enumerate(versions):
                result = fl.refresh(path, f"{name}-v{i}")
                assert result.decision == "reopened", result.reason
                batch = [SampleRequest(f"{name}-{i}-{k}", PROMPT, SamplingSpec(
                    max_tokens=8, temperature=1.0, seed=k)) for k in range(4)]
                for o in fl.rollout(batch):
                    assert o.admitted, o.reason
                    p = o.sample.policy
                    out.setdefault(name, []).append((o.sample_id, p.adapter, p.version))
            out[f"{name}-ledger"] = fl.ledger.admitted()
        finally:
            fl.close()

    out: dict = {}
    threads = [threading.Thread(target=run, args=(n, vs, out)) for n, vs in (
        ("run-a", [str(adapters["a1"]), str(adapters["a2"])]),
        ("run-b", [str(adapters["b1"]), str(adapters["a1"])]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    for name in ("run-a", "run-b"):
        got = out[name]
        assert len(got) == 8 and len({s for s, _, _ in got}) == 8, got
        assert {a for _, a, _ in got} == {name}
        assert [v for s, _, v in got] == [f"{name}-v{int(s.split('-')[2])}" for s, _, _ in got]
        assert set(out[f"{name}-ledger"]) == {s for s, _, _ in got}


class BaseTraffic:
    """Greedy base-model completions, one after another, while the block runs."""

    def __init__(self, fleet) -> None:
        self.fleet, self.codes, self.texts = fleet, [], set()
        self.stop = threading.Event()
        self.base_text = complete(fleet, MODEL_NAME).json()["choices"][0]["text"]

    def _run(self) -> None:
        with httpx.Client(timeout=60) as c:
            while not self.stop.is_set():
                r = c.post(f"{self.fleet.url}/v1/completions", json={
                    "model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                    "ignore_eos": True})
                self.codes.append(r.status_code)
                if r.status_code == 200:
                    self.texts.add(r.json()["choices"][0]["text"])

    def __enter__(self) -> BaseTraffic:
        self.thread = threading.Thread(target=self._run)
        self.thread.start()
        time.sleep(0.5)
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(0.5)
        self.stop.set()
        self.thread.join()


def test_adapter_versions_through_the_weight_plane_and_a_wrong_base_delta_refused(
        fleet, adapters):
    root = adapters["a1"].parent / "artifacts"
    publish_adapter(adapters["a1"], root, "w-v1")
    publish_adapter(adapters["a2"], root, "w-v2", base=("w-v1", adapters["a1"]))
    third = make_adapter(root.parent / "c1", rank=8, seed=6)
    publish_adapter(third, root, "w-v3", base=("w-v1", adapters["a1"]))
    direct = {}
    for name in ("a1", "a2"):  # the tokens of each version, loaded from its directory
        got = engine(fleet, "load_lora_adapter", lora_name="direct",
                     lora_path=str(adapters[name]), weight_version=name)
        assert got["status"] == "ok", got
        served(fleet, "direct", name)
        direct[name] = tokens(complete(fleet, "direct"))
    got = engine(fleet, "load_lora_adapter", lora_name="w", lora_path=str(root / "w-v1"),
                 weight_version="w-v1")
    assert got["status"] == "ok", got
    served(fleet, "w", "w-v1")
    assert tokens(complete(fleet, "w")) == direct["a1"]
    got = engine(fleet, "load_lora_adapter", lora_name="w", lora_path=str(root / "w-v2"),
                 weight_version="w-v2")
    assert got["status"] == "ok" and got["replaced"] == "w-v1", got
    served(fleet, "w", "w-v2")
    assert tokens(complete(fleet, "w")) == direct["a2"]
    # w-v3 is a delta against w-v1; the worker serves w-v2: refused, w-v2 serving on
    got = engine(fleet, "load_lora_adapter", lora_name="w", lora_path=str(root / "w-v3"),
                 weight_version="w-v3")
    assert got["status"] == "error" and "delta against adapter version 'w-v1'" in \
        got["message"] and "serves 'w-v2'" in got["message"], got
    assert tokens(complete(fleet, "w")) == direct["a2"]
    for name in ("w", "direct"):
        assert engine(fleet, "unload_lora_adapter", lora_name=name)["status"] == "ok"
