"""Adapter versions through the weight plane on real vLLM workers (CPU build, float32): a
refresh stages the version from S3 (full, then an XOR delta on the version served) while
the base model and the adapter keep answering, loads it beside the serving version and
probes it there before its gate, and switches the adapter's name in the gated window; a
worker stages a version from a peer that serves it; a wrong digest or a wrong base is
refused by name before anything is gated, and so is a version whose probe fails, the old
version serving on both workers; a version published to a trainer's publisher and the
workers' catalog is staged from the trainer by a refresh, and from a holder the catalog
lists by a worker that names no peer.
Two workers for the module (vLLM starts are slow)."""

from __future__ import annotations

import asyncio
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from rlfleet.models import make_adapter
from rlfleet.refresh.coordinator import PolicyRefresh
from rlfleet.refresh.probe import Probe
from rlfleet.testing.s3 import BUCKET
from rlfleet.weights.adapters import publish_adapter
from rlfleet.weights.catalog import Catalog
from rlfleet.weights.digest import checkpoint_digest
from rlfleet.weights.publish import TrainerServer
from rlfleet.worker.lora_admin import LORA_TMP_PREFIX
from tests.fleets import MODEL_NAME, vllm_worker_args

pytestmark = pytest.mark.engine

LORA_FLAGS = ("--enable-lora", "--max-loras", "6", "--max-lora-rank", "16")
PROMPT = "The quick brown fox"
PREFIX = f"s3://{BUCKET}/lora-staging"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("staged-adapters")
    return {"a1": make_adapter(root / "a1", rank=8, seed=11),
            "a2": make_adapter(root / "a2", rank=8, seed=12),
            "a3": make_adapter(root / "a3", rank=8, seed=13)}


@pytest.fixture(scope="module")
def published(adapters, s3_server) -> dict[str, str]:
    """s-v1 (full), s-v2 (a delta on s-v1), s-v3 (full), s-v4 (a delta on s-v1) in S3."""
    if s3_server.proc is None:
        s3_server.start()
    ep = s3_server.endpoint_url
    with pytest.MonkeyPatch.context() as mp:  # the S3 server's credentials
        for k, v in s3_server.env.items():
            mp.setenv(k, v)
        publish_adapter(adapters["a1"], PREFIX, "s-v1", endpoint_url=ep)
        publish_adapter(adapters["a2"], PREFIX, "s-v2", base=("s-v1", adapters["a1"]),
                        endpoint_url=ep)
        publish_adapter(adapters["a3"], PREFIX, "s-v3", endpoint_url=ep)
        publish_adapter(adapters["a3"], PREFIX, "s-v4", base=("s-v1", adapters["a1"]),
                        endpoint_url=ep)
    return {v: f"{PREFIX}/{v}" for v in ("s-v1", "s-v2", "s-v3", "s-v4")}


@pytest.fixture(scope="module")
def worker_pids():
    """The fleet's worker pids; once the workers have stopped (this is set up before the
    fleet, so torn down after it), none left a directory of adapters behind."""
    pids: list[int] = []
    yield pids
    left = [p for pid in pids for p in Path(tempfile.gettempdir()).glob(
        f"{LORA_TMP_PREFIX}{pid}-*")]
    assert pids and not left, f"left behind by the stopped workers: {left}"


@pytest.fixture(scope="module")
def fleet(worker_pids, start_module_fleet, tiny_model, adapters, s3_server, tmp_path_factory):
    catalog = f"sqlite://{tmp_path_factory.mktemp('lora-catalog') / 'catalog.sqlite'}"
    args = vllm_worker_args(tiny_model, MODEL_NAME, *LORA_FLAGS, "--allowed-weights-root",
                            str(adapters["a1"].parent), "--weights-catalog", catalog)
    f = start_module_fleet([args] * 2, name="lora-staging", kind="vllm", model=MODEL_NAME,
                           lease_ttl=3.0, enable_rl=True, worker_env=s3_server.env)
    f.catalog = catalog
    worker_pids.extend(w.pid for w in f.workers)
    return f


@pytest.fixture(autouse=True)
def s3_env(monkeypatch, s3_server):
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)


def s3(uri: str, s3_server) -> dict:
    return {"kind": "s3", "uri": uri, "endpoint_url": s3_server.endpoint_url}


def engine(url: str, route: str, **body) -> dict:
    r = httpx.post(f"{url}/engine/{route}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def generate(url: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": model, "prompt": PROMPT, "max_tokens": 10, "temperature": 0,
        "ignore_eos": True, "nvext": {"extra_fields": ["engine_data"]}})


def served(fleet, model: str) -> tuple[list[int], str | None]:
    """(greedy tokens, the version that generated them) of `model` through the frontend."""
    r = generate(fleet.url, model)
    assert r.status_code == 200, r.text
    data = r.json()["nvext"]["engine_data"]
    return data["completion_token_ids"], data.get("weight_version")


def reference(fleet, adapters, name: str) -> list[int]:
    """The greedy tokens of adapter directory `name`, loaded as `ref-<name>` on every
    worker (then unloaded)."""
    systems = [w.ready["system_url"] for w in fleet.workers]
    for s in systems:
        got = engine(s, "load_lora_adapter", lora_name=f"ref-{name}",
                     lora_path=str(adapters[name]), weight_version=name)
        assert got["status"] == "ok", got
    deadline = time.monotonic() + 15
    while True:  # until the frontend routes the name (discovery lists it)
        r = generate(fleet.url, f"ref-{name}")
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert r.status_code == 200, r.text
    out = r.json()["nvext"]["engine_data"]["completion_token_ids"]
    for s in systems:
        engine(s, "unload_lora_adapter", lora_name=f"ref-{name}")
    return out


class Traffic:
    """Greedy completions of each model in turn, one after another, while the block runs."""

    def __init__(self, fleet, models: list[str]) -> None:
        self.fleet, self.models = fleet, models
        self.codes: dict[str, list[int]] = {m: [] for m in models}
        self.stop = threading.Event()

    def _run(self) -> None:
        with httpx.Client(timeout=60) as c:
            k = 0
            while not self.stop.is_set():
                m = self.models[k % len(self.models)]
                k += 1
                r = c.post(f"{self.fleet.url}/v1/completions", json={
                    "model": m, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                    "ignore_eos": True})
                self.codes[m].append(r.status_code)

    def __enter__(self) -> Traffic:
        self.thread = threading.Thread(target=self._run)
        self.thread.start()
        time.sleep(0.5)
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(0.5)
        self.stop.set()
        self.thread.join()

    def all_answered(self) -> None:
        for m, codes in self.codes.items():
            assert codes and set(codes) == {200}, (m, codes)


@pytest.fixture(scope="module")
def coordinator(fleet, tmp_path_factory):
    refresh = PolicyRefresh(fleet.rl_url, model=MODEL_NAME, path="vllm-adapter", adapter="s",
                            journal=tmp_path_factory.mktemp("lora-journal") / "j.sqlite",
                            timeout=120)
    yield refresh
    refresh.close()


def routes_called(result) -> list[str]:
    return [c["route"] for w in result.workers for c in w["calls"]]


def test_adapter_versions_staged_from_s3_full_then_delta_while_base_and_adapter_serve(
        fleet, adapters, published, coordinator, s3_server):
    want = {n: reference(fleet, adapters, n) for n in ("a1", "a2")}
    base = served(fleet, MODEL_NAME)[0]
    first = asyncio.run(coordinator.refresh(
        None, "s-v1", source=s3(published["s-v1"], s3_server),
        digest=checkpoint_digest(adapters["a1"])))
    assert first.decision == "reopened", first.reason
    assert served(fleet, "s") == (want["a1"], "s-v1")

    with Traffic(fleet, [MODEL_NAME, "s"]) as traffic:
        second = asyncio.run(coordinator.refresh(
            None, "s-v2", source=s3(published["s-v2"], s3_server),
            digest=checkpoint_digest(adapters["a2"])))
    assert second.decision == "reopened", second.reason
    traffic.all_answered()  # the base and the adapter answered throughout
    assert served(fleet, "s") == (want["a2"], "s-v2")
    assert served(fleet, MODEL_NAME)[0] == base
    steps = [s["name"] for s in second.steps]
    # staged and probed beside the serving version before the gate; the window switches
    assert steps.index("stage") < steps.index("probe_beside") < steps.index("gate")
    calls = routes_called(second)
    assert calls.count("stage_lora_adapter") == 2 and calls.count("activate_lora_adapter") == 2
    assert "pause_generation" not in calls and "flush_cache" not in calls
    for w in fleet.workers:  # the delta was applied on each worker's resident s-v1
        staged = engine(w.ready["system_url"], "get_staged_lora_adapter", lora_name="s")
        assert staged["resident"]["version"] == "s-v2", staged
        delta = [h for h in staged["staged"] if h["version"] == "s-v2"]
        assert delta and delta[-1]["format"] == "xor-delta" and delta[-1]["applied"], staged


def test_a_worker_stages_an_adapter_version_from_a_peer_while_serving(fleet, adapters,
                                                                      coordinator):
    """Worker 1 pulls s-v2 from worker 0's /weights route (its resident staged copy) as a
    new adapter `p`, with the base model and `s` answering meanwhile."""
    assert served(fleet, "s")[1] == "s-v2"  # after the refresh test
    want = reference(fleet, adapters, "a2")
    peer, target = (w.ready["system_url"] for w in fleet.workers)
    with Traffic(fleet, [MODEL_NAME, "s"]) as traffic:
        started = engine(target, "stage_lora_adapter", lora_name="p", version="s-v2",
                         source={"kind": "peer", "url": peer},
                         digest=checkpoint_digest(adapters["a2"]))
        assert started["status"] == "ok", started
        summary = wait_staged(target, "p", started["handle"])
    traffic.all_answered()
    assert summary["state"] == "READY", summary
    assert summary["source"]["kind"] == "peer" and summary["source"]["url"] == peer
    got = engine(target, "load_lora_adapter", lora_name="p", handle=started["handle"],
                 weight_version="s-v2")
    assert got["status"] == "ok" and got["weight_digest"] == checkpoint_digest(adapters["a2"])
    deadline = time.monotonic() + 15
    while (r := generate(fleet.url, "p")).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert r.json()["nvext"]["engine_data"]["completion_token_ids"] == want
    assert engine(target, "unload_lora_adapter", lora_name="p")["status"] == "ok"


def wait_staged(system: str, name: str, handle: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = engine(system, "get_staged_lora_adapter", lora_name=name, handle=handle)
        if got["staged"][0]["state"] != "STAGING":
            return got["staged"][0]
        time.sleep(0.1)
    raise AssertionError(f"{handle} still STAGING after {timeout} s")


def test_a_wrong_digest_base_or_probe_is_refused_before_the_gate_the_old_version_serving(
        fleet, adapters, published, coordinator, s3_server):
    assert served(fleet, "s")[1] == "s-v2"
    before = served(fleet, "s")
    wrong_digest = "blake3:" + "0" * 64
    held = asyncio.run(coordinator.refresh(None, "s-v3", source=s3(published["s-v3"],
                                                                    s3_server),
                                           digest=wrong_digest))
    assert held.decision == "held", held.reason
    assert "digest" in held.reason and wrong_digest in held.reason, held.reason
    assert "nothing was gated" in held.reason
    assert "gate" not in [s["name"] for s in held.steps]
    assert served(fleet, "s") == before

    # s-v4 is a delta against s-v1; the workers serve s-v2
    held = asyncio.run(coordinator.refresh(None, "s-v4", source=s3(published["s-v4"],
                                                                    s3_server),
                                           digest=checkpoint_digest(adapters["a3"])))
    assert held.decision == "held", held.reason
    assert "needs base s-v1" in held.reason and "nothing was gated" in held.reason, held.reason
    assert served(fleet, "s") == before

    # staged and loaded beside, but its probe fails: discarded, never gated
    wrong_probe = Probe(prompt=[1, 2, 3], token_ids=[5, 5, 5, 5], logprobs=[-0.1] * 4)
    held = asyncio.run(coordinator.refresh(None, "s-v3", source=s3(published["s-v3"],
                                                                    s3_server),
                                           digest=checkpoint_digest(adapters["a3"]),
                                           probe=wrong_probe))
    assert held.decision == "held", held.reason
    assert "probe through s-v3 loaded beside the serving version failed" in held.reason
    assert "nothing was gated" in held.reason
    assert "gate" not in [s["name"] for s in held.steps]
    assert served(fleet, "s") == before
    for w in fleet.workers:  # nothing was left loaded beside
        listed = engine(w.ready["system_url"], "list_lora_adapters")
        assert [(a["lora_name"], a["version"]) for a in listed["adapters"]] == [("s", "s-v2")]
    r = httpx.post(f"{fleet.workers[0].ready['system_url']}/engine/activate_lora_adapter",
                   json={"lora_name": "s", "weight_version": "s-v4"}, timeout=30)
    assert r.json()["status"] == "error" and "no version 's-v4' loaded beside" in \
        r.json()["message"]


async def holders(catalog: str, version: str) -> set[str]:
    async with Catalog(catalog) as c:
        return {d["system_url"] for d in (await c.get(version)).holders.values()}


def test_an_adapter_version_from_the_trainers_publisher_then_from_a_holder_in_the_catalog(
        fleet, adapters, tmp_path):
    """bench/lora.py's --source trainer as a test: a version published to the trainer's
    publisher (TrainerServer) and registered in the workers' catalog is staged from the
    trainer on both workers by a refresh of adapter `t`, the base model answering, and
    serves; both workers are then its holders in the catalog. With the trainer gone, a
    worker that stages it naming no peer gets it from the other; unloaded, a worker is no
    longer a holder."""
    want = reference(fleet, adapters, "a3")
    systems = [w.ready["system_url"] for w in fleet.workers]
    refresh = PolicyRefresh(fleet.rl_url, model=MODEL_NAME, path="vllm-adapter", adapter="t",
                            journal=tmp_path / "journal.sqlite", timeout=120)
    try:
        with TrainerServer(tmp_path / "published") as trainer:
            publish_adapter(adapters["a3"], trainer.dir, "t-v1", catalog=fleet.catalog,
                            model="t")
            with Traffic(fleet, [MODEL_NAME]) as traffic:
                res = asyncio.run(refresh.refresh(
                    None, "t-v1", digest=checkpoint_digest(adapters["a3"]),
                    source={"kind": "trainer", "url": trainer.url}))
    finally:
        refresh.close()
    assert res.decision == "reopened" and res.fleet_moved, res.reason
    traffic.all_answered()
    assert served(fleet, "t") == (want, "t-v1")
    assert routes_called(res).count("stage_lora_adapter") == 2
    for s in systems:
        staged = engine(s, "get_staged_lora_adapter", lora_name="t")
        assert staged["resident"]["version"] == "t-v1", staged
        assert [h["source"]["kind"] for h in staged["staged"]] == ["trainer"], staged
    assert asyncio.run(holders(fleet.catalog, "t-v1")) == set(systems)

    started = engine(systems[1], "stage_lora_adapter", lora_name="q", version="t-v1",
                     source={"kind": "peer"})
    assert started["status"] == "ok", started
    summary = wait_staged(systems[1], "q", started["handle"])
    assert summary["state"] == "READY", summary
    assert summary["source"] == {**summary["source"], "kind": "peer", "url": systems[0]}
    assert summary["digest"] == checkpoint_digest(adapters["a3"])
    for s in systems:
        assert engine(s, "unload_lora_adapter", lora_name="t")["status"] == "ok"
    assert asyncio.run(holders(fleet.catalog, "t-v1")) == set()
