"""LoRA adapters as policies on a fleet of three mocker workers (the declared simulator:
an adapter's tokens are seeded by its content digest, nothing here is vLLM's behaviour),
driven by the same coordinator path as vLLM workers (PolicyRefresh, path vllm-adapter):
a rolling adapter refresh with base and other-adapter traffic answered throughout, a
coordinator killed in the middle of an adapter refresh and recovered from the journal, and
two runs refreshing two adapters at once without gating each other. One fleet per module."""

from __future__ import annotations

import asyncio
import itertools
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from rlfleet.journal import open_journal
from rlfleet.models import make_adapter
from rlfleet.protocol.admin import STALE_EPOCH
from rlfleet.refresh.coordinator import PolicyRefresh
from rlfleet.refresh.hooks import RefreshHooks
from rlfleet.rl.fleet import Fleet
from rlfleet.rollout.client import RolloutClient
from rlfleet.rollout.retry import RetryPolicy
from rlfleet.rollout.sample import SampleFailed, SampleRequest, SamplingSpec
from rlfleet.runtime.discovery import open_discovery
from rlfleet.weights.digest import checkpoint_digest
from rlfleet.worker.dynamo_lora import lora_name_to_id
from tests.fleets import RL_MOCK_MODEL as MODEL
from tests.fleets import RL_PROBE_ENV, mock_args, routed

LORA_FLAGS = ("--enable-lora", "--max-loras", "8", "--max-lora-rank", "16")
HOOKED = Path(__file__).resolve().parents[1] / "refresh_hooked.py"
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def lf(tmp_path_factory, start_module_fleet):
    """Three mocker workers serving adapters (`other` from the start), a frontend."""
    tmp = tmp_path_factory.mktemp("lora-mock")
    root = tmp / "adapters"
    ads = {n: make_adapter(root / n, rank=4, seed=s) for s, n in enumerate(
        ("other", "v1", "v2", "v3", "a1", "a2", "b1", "b2"))}
    ads["rank32"] = make_adapter(root / "rank32", rank=32, seed=9)
    args = mock_args(root, *LORA_FLAGS, "--lora-modules", f"other={ads['other']}")
    fleet = start_module_fleet([args] * 3, model=MODEL, enable_rl=True,
                               frontend_env=RL_PROBE_ENV)
    fleet.ads, fleet.tmp = ads, tmp
    fleet.digests = {n: checkpoint_digest(p) for n, p in ads.items()}
    return fleet


def complete(f, model: str, max_tokens: int = 8, client: httpx.Client | None = None
             ) -> httpx.Response:
    post = client.post if client is not None else httpx.post
    return post(f"{f.url}/v1/completions", timeout=30, json={
        "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
        "seed": 7, "ignore_eos": True, "nvext": {"extra_fields": ["engine_data"]}})


def listed(f, name: str) -> list[dict | None]:
    """The adapter `name` as each worker lists it (None: not loaded there)."""
    out = []
    for p in f.workers:
        r = httpx.post(f"{p.ready['system_url']}/engine/list_lora_adapters", json={},
                       timeout=10).json()
        out.append(next((a for a in r["adapters"] if a["lora_name"] == name), None))
    return out


async def discovery_entries(f) -> list[dict]:
    d = open_discovery(f.discovery)
    try:
        return list(await d.list(f.namespace))
    finally:
        await d.close()


def coordinator(f, adapter: str, journal: Path, **kw) -> PolicyRefresh:
    return PolicyRefresh(f.rl_url, model=MODEL, path="vllm-adapter", adapter=adapter,
                         journal=journal, timeout=15, **kw)


def sync_load(f, adapter: str, name: str, journal: Path):
    r = coordinator(f, adapter, journal)
    try:
        res = asyncio.run(r.refresh(f.ads[name], f"{adapter}-{name}"))
    finally:
        r.close()
    assert res.decision == "reopened" and res.fleet_moved, res.reason
    return res


class Traffic:
    """Greedy completions of each model in `models`, one after another per model, while the
    block runs: every status code, and each model's (text, engine_data) seen."""

    def __init__(self, f, models: list[str]) -> None:
        self.f, self.models = f, models
        self.codes: dict[str, list[int]] = {m: [] for m in models}
        self.seen: dict[str, set] = {m: set() for m in models}
        self.stop = threading.Event()

    def _run(self, model: str) -> None:
        with httpx.Client(timeout=30) as c:
            while not self.stop.is_set():
                r = complete(self.f, model, client=c)
                self.codes[model].append(r.status_code)
                if r.status_code == 200:
                    d = r.json()["nvext"]["engine_data"]
                    self.seen[model].add((r.json()["choices"][0]["text"],
                                          d.get("weight_adapter"), d["weight_version"]))

    def __enter__(self) -> Traffic:
        self.threads = [threading.Thread(target=self._run, args=(m,)) for m in self.models]
        for t in self.threads:
            t.start()
        time.sleep(0.3)
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(0.3)
        self.stop.set()
        for t in self.threads:
            t.join(60)


# ------------------------------------------------------------------ the simulated adapters


def test_mocker_adapters_are_policies_as_on_vllm_workers(lf):
    """--lora-modules serves `other` from the start; a request naming it gets other tokens
    than the base, the same on every worker, stamped with its identity in engine_data and
    spans; discovery and get_weight_version list it; bad input is refused by name."""
    f = lf
    base, other = complete(f, MODEL), complete(f, "other")
    assert base.status_code == other.status_code == 200, other.text
    assert base.json()["choices"][0]["text"] != other.json()["choices"][0]["text"]
    data = other.json()["nvext"]["engine_data"]
    assert data["weight_adapter"] == "other"
    assert data["weight_digest"] == f.digests["other"]
    assert "weight_adapter" not in base.json()["nvext"]["engine_data"]
    texts = {complete(f, "other").json()["choices"][0]["text"] for _ in range(6)}
    assert texts == {other.json()["choices"][0]["text"]}  # whichever worker answered
    models = httpx.get(f"{f.url}/v1/models", timeout=10).json()["data"]
    assert {"id": "other", "parent": MODEL} in [
        {"id": m["id"], "parent": m.get("parent")} for m in models]
    for p in f.workers:
        v = httpx.post(f"{p.ready['system_url']}/engine/get_weight_version", json={},
                       timeout=10).json()
        assert [(a["adapter"], a["digest"]) for a in v["adapters"]] == \
            [("other", f.digests["other"])]
    entries = [e for e in asyncio.run(discovery_entries(f)) if e.get("model") == MODEL]
    assert len(entries) >= 3 and all(
        [(a["adapter"], a["digest"], a["rank"], a["open"]) for a in e["adapters"]] ==
        [("other", f.digests["other"], 4, True)] for e in entries), entries
    r = complete(f, "no-such-adapter")
    assert r.status_code == 404 and "no-such-adapter" in r.text
    sys_url = f.workers[0].ready["system_url"]
    said = httpx.post(f"{sys_url}/engine/load_lora_adapter", timeout=10, json={
        "lora_name": "big", "lora_path": str(f.ads["rank32"])}).json()
    assert said["status"] == "error" and "--max-lora-rank 16" in said["message"]
    assert listed(f, "big") == [None] * 3


def test_the_rollout_client_admits_a_sample_only_from_the_adapter_it_named(lf):
    """Through the workers' own stamps (engine data and spans): a client of adapter `other`
    admits its samples, every span naming it; a client of the base model admits the
    base's; a client told that the base model's name is an adapter refuses the base's
    samples by name, though the frontend echoes the `model` it was sent."""
    f = lf
    once = RetryPolicy(max_attempts=1)
    spec = SamplingSpec(max_tokens=6, ignore_eos=True)

    async def run() -> None:
        async with RolloutClient(f.url, "other", adapter=True, retry=once) as c:
            s = await c.generate("o-1", PROMPT, spec)
        assert (s.policy.adapter, s.policy.digest) == ("other", f.digests["other"])
        assert {sp.adapter for sp in s.completion.weight_spans} == {"other"}
        async with RolloutClient(f.url, MODEL, adapter=False, retry=once) as c:
            base = await c.generate("b-1", PROMPT, spec)
        assert base.policy.adapter_name is None and base.model == MODEL
        async with RolloutClient(f.url, MODEL, adapter=True, retry=once) as c:
            with pytest.raises(SampleFailed) as info:
                await c.generate("b-2", PROMPT, spec)
            assert c.ledger.admitted() == {}
        assert info.value.reason == (f"adapter: the worker's engine data names no adapter (the "
                                     f"base model); the request named adapter {MODEL!r}")

    asyncio.run(run())


def test_a_stale_epoch_on_an_adapter_route_is_refused_and_each_adapter_fences_alone(lf):
    """An adapter route called with an older epoch than its adapter's newest is refused as
    the base routes refuse one (409, the contract's stale-epoch body naming both epochs)
    and changes nothing: the adapter stays loaded, open and answered. Each adapter fences
    alone: adapter A at epoch 5 does not fence B at epoch 1, nor the base model's fence."""
    f = lf
    sys_url = f.workers[0].ready["system_url"]

    def call(route: str, **body) -> httpx.Response:
        return httpx.post(f"{sys_url}/engine/{route}", json=body, timeout=30)

    base_epoch = call("get_weight_version").json()["fleet_epoch"]
    for name, ad in (("fence-a", "v1"), ("fence-b", "v2")):
        assert call("load_lora_adapter", lora_name=name, lora_path=str(f.ads[ad]),
                    weight_version=f"{name}-{ad}").json()["status"] == "ok"
    try:
        got = call("set_lora_admission", lora_name="fence-a", open=True, fleet_epoch=5).json()
        assert got["status"] == "ok" and got["fleet_epoch"] == 5, got
        stale = [call("set_lora_admission", lora_name="fence-a", open=False, fleet_epoch=4),
                 call("load_lora_adapter", lora_name="fence-a", lora_path=str(f.ads["v3"]),
                      weight_version="fence-a-v3", fleet_epoch=4),
                 call("unload_lora_adapter", lora_name="fence-a", fleet_epoch=4)]
        for r in stale:
            assert r.status_code == 409, r.text
            assert (r.json()["error"], r.json()["fleet_epoch"],
                    r.json()["newest_fleet_epoch"]) == (STALE_EPOCH, 4, 5)
        a = next(x for x in listed(f, "fence-a") if x is not None)
        assert (a["version"], a["open"], a["fleet_epoch"]) == ("fence-a-v1", True, 5)
        deadline = time.monotonic() + 15
        while (r := complete(f, "fence-a")).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)  # until discovery brings the adapter to the frontend
        assert r.status_code == 200, r.text
        data = r.json()["nvext"]["engine_data"]
        assert (data["weight_adapter"], data["weight_digest"]) == ("fence-a", f.digests["v1"])
        got = call("set_lora_admission", lora_name="fence-b", open=True, fleet_epoch=1).json()
        assert got["status"] == "ok" and got["fleet_epoch"] == 1, got  # A's 5 fences not B
        assert call("get_weight_version").json()["fleet_epoch"] == base_epoch
    finally:
        for name in ("fence-a", "fence-b"):
            call("unload_lora_adapter", lora_name=name)


# ------------------------------------------------------------------ rolling


def test_a_rolling_adapter_refresh_moves_it_worker_by_worker(lf):
    """Mode rolling, path vllm-adapter: one worker per wave; base-model and `other` traffic
    answered (200) throughout with unchanged tokens; every sample of the refreshed adapter
    the rollout client admits came from its old or its new version (its identity, never the
    base's), and both versions answered during the roll."""
    f = lf
    journal = f.tmp / "rolling.sqlite"
    sync_load(f, "roll", "v1", journal)
    old = ("roll-v1", f.digests["v1"])
    fl = Fleet(f.url, "roll", rl_url=f.rl_url, journal=journal, path="vllm-adapter",
               adapter="roll", mode="rolling", wave_size=1, min_serving=2, max_lag=1,
               allow_mixed_versions=True, concurrency=8, timeout=15)
    outcomes: list = []
    try:
        samples = [SampleRequest(f"roll-{i}", PROMPT, SamplingSpec(max_tokens=12, seed=i,
                                                                   ignore_eos=True))
                   for i in range(600)]
        with Traffic(f, [MODEL, "other"]) as traffic:
            roll = threading.Thread(target=lambda: outcomes.extend(fl.rollout(samples)))
            roll.start()
            time.sleep(0.5)
            result = fl.refresh(f.ads["v2"], "roll-v2")
            roll.join(300)
            assert not roll.is_alive()
    finally:
        fl.close()
    assert result.decision == "reopened" and result.fleet_moved, result.reason
    assert "in 3 wave(s)" in result.reason, result.reason
    assert sorted({s["wave"] for s in result.steps if s.get("wave")}) == [1, 2, 3]
    new = ("roll-v2", f.digests["v2"])
    assert [(a["version"], a["weight_digest"]) for a in listed(f, "roll")] == [new] * 3
    calls = {c["route"] for w in result.workers for c in w["calls"]}
    assert calls.isdisjoint({"set_admission", "pause_generation", "flush_cache"}), calls
    # one worker at a time: each closed the adapter only after the one before reopened it
    windows = sorted((min(c["at"] for c in w["calls"] if c["route"] == "set_lora_admission"),
                      max(c["at"] for c in w["calls"] if c["route"] == "set_lora_admission"))
                     for w in result.workers)
    assert len(windows) == 3
    assert all(later[0] >= earlier[1] for earlier, later in itertools.pairwise(windows))
    for model in (MODEL, "other"):
        assert traffic.codes[model] and set(traffic.codes[model]) == {200}, traffic.codes
        assert len(traffic.seen[model]) == 1, traffic.seen[model]  # never moved
    failed = [o for o in outcomes if not o.admitted]
    assert len(outcomes) == 600 and not failed, [o.reason for o in failed[:3]]
    got = set()
    for o in outcomes:
        p = o.sample.policy
        assert p.adapter == "roll" and (p.version, p.digest) in (old, new), p
        spans = o.sample.completion.weight_spans or []
        assert spans and {(s.adapter, s.version, s.digest) for s in spans} <= {
            ("roll", *old), ("roll", *new)}, spans
        got.add((p.version, p.digest))
    assert got == {old, new}, got  # the roll happened while samples were admitted


# ------------------------------------------------------------------ recovery


def cli_refresh(f, adapter: str, name: str, journal: Path, hook: str) -> tuple[int, str]:
    """`rlfleet refresh --path vllm-adapter` that kills itself at the hook's point."""
    argv = [sys.executable, str(HOOKED), hook, "--checkpoint", str(f.ads[name]), "--version",
            f"{adapter}-{name}", "--rl-url", f.rl_url, "--model", MODEL, "--journal",
            str(journal), "--path", "vllm-adapter", "--adapter", adapter]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                       start_new_session=True)
    return p.returncode, p.stdout + p.stderr


@pytest.mark.parametrize("point", ["apply_half", "verified"])
def test_a_coordinator_killed_mid_adapter_refresh_is_recovered(lf, point):
    """SIGKILL in the middle of an adapter refresh (half the workers loaded, or all verified
    and the adapter still gated): the adapter stays closed, the base model and `other` are
    served throughout; a new coordinator recovers from the adapter's journal to one version
    fleet-wide (back to the old one from a mixed fleet, forward once all hold the new;
    `rlfleet recover --path vllm-adapter --adapter` for the latter), reopens it, and never
    gates the base model."""
    f = lf
    adapter, journal = f"rec-{point}", f.tmp / f"recovery-{point}.sqlite"
    sync_load(f, adapter, "v1", journal)
    with Traffic(f, [MODEL, "other"]) as traffic:
        code, out = cli_refresh(f, adapter, "v2", journal, f"{point}=kill")
        assert code == -signal.SIGKILL, out
        assert f"RLFLEET_TEST_HOOK {point} kill" in out
        held = listed(f, adapter)
        assert [a["open"] for a in held] == [False] * 3  # nobody reopened it
        versions = sorted(a["version"] for a in held)
        if point == "apply_half":
            assert versions in ([f"{adapter}-v1"] * 2 + [f"{adapter}-v2"],
                                [f"{adapter}-v1"] + [f"{adapter}-v2"] * 2), versions
        assert len(routed(f, 3)) == 3  # the base model was never gated
        rec_id = recover(f, adapter, journal, cli=point == "verified")
    name = "v2" if point == "verified" else "v1"
    want = (f"{adapter}-{name}", f.digests[name], True)
    assert [(a["version"], a["weight_digest"], a["open"]) for a in listed(f, adapter)] == \
        [want] * 3
    r = complete(f, adapter)
    assert r.status_code == 200 and r.json()["nvext"]["engine_data"]["weight_version"] == \
        want[0]
    for model in (MODEL, "other"):
        assert traffic.codes[model] and set(traffic.codes[model]) == {200}, traffic.codes
        assert len(traffic.seen[model]) == 1, traffic.seen[model]
    with open_journal(str(journal)) as j:
        old = [row for row in j.recent(10) if row["kind"] == "refresh"][0]
        assert old["decision"] == "recovered" and old["fleet"].endswith(f"#lora={adapter}")
        rec = j.get(rec_id)
        assert rec["kind"] == "recovery" and rec["recovery_of"] == old["id"]
        assert rec["decision"] == "reopened" and rec["served_version"] == want[0]
        calls = {c["route"] for w in rec["workers"].values() for c in w["calls"]}
    assert "set_lora_admission" in calls, calls
    assert calls.isdisjoint({"set_admission", "pause_generation", "flush_cache"}), calls


def recover(f, adapter: str, journal: Path, cli: bool) -> int:
    """Recover the adapter's interrupted refresh (with `rlfleet recover --path vllm-adapter`,
    or PolicyRefresh.recover in this process); the recovery's journal id."""
    if not cli:
        r = coordinator(f, adapter, journal)
        try:
            res = asyncio.run(r.recover())
            assert asyncio.run(r.recover()) is None  # nothing left to recover
        finally:
            r.close()
        assert res is not None and res.ok and res.kind == "recovery", res and res.reason
        return res.refresh_id
    argv = [sys.executable, "-m", "rlfleet.cli", "recover", "--rl-url", f.rl_url, "--model",
            MODEL, "--journal", str(journal), "--path", "vllm-adapter", "--adapter", adapter]
    first = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0 and "decision: reopened" in first.stdout, \
        first.stdout + first.stderr
    again = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "nothing to recover" in again.stdout, again.stdout
    with open_journal(str(journal)) as j:
        return next(row["id"] for row in j.recent(10) if row["kind"] == "recovery")


# ------------------------------------------------------------------ two runs


class CheckOtherRun(RefreshHooks):
    """At the verified point of run `mine`'s refresh (its adapter still closed on every
    worker): with `other` set, the other run's adapter, when loaded and not in a refresh of
    its own (its lock held here keeps it out of one), is open everywhere and answered from;
    the base model is answered either way."""

    def __init__(self, f, mine: str, other: tuple[str, threading.Lock] | None) -> None:
        self.f, self.mine, self.other = f, mine, other
        self.seen: list[tuple] = []

    def wants(self, point: str) -> bool:
        return point == "verified"

    def reached(self, point: str) -> None:
        f = self.f
        mine = [a["open"] for a in listed(f, self.mine)]
        theirs, answered = None, None
        if self.other is not None:
            name, lock = self.other
            with lock:
                theirs = [a and a["open"] for a in listed(f, name)]
                if theirs != [None] * 3:
                    r = complete(f, name)
                    answered = (r.status_code, r.json()["nvext"]["engine_data"][
                        "weight_adapter"] if r.status_code == 200 else r.text)
        self.seen.append((mine, theirs, answered, complete(f, MODEL).status_code))


def test_two_runs_refresh_two_adapters_without_gating_each_other(lf):
    """Two runs, each its adapter, ledger and journal, refreshing at the same time on the
    same workers: each admits its samples once and only from its own adapter's version;
    while run-a's adapter is gated for its refresh, run-b's (once loaded, outside its own
    refreshes) stays open and answered, and the base model is answered during both."""
    f = lf
    locks = {"run-a": threading.Lock(), "run-b": threading.Lock()}
    hooks = {"run-a": CheckOtherRun(f, "run-a", ("run-b", locks["run-b"])),
             "run-b": CheckOtherRun(f, "run-b", None)}
    out: dict = {}

    def run(name: str, versions: list[str]) -> None:
        fl = Fleet(f.url, name, rl_url=f.rl_url, ledger=f.tmp / f"{name}.sqlite",
                   journal=f.tmp / f"{name}-journal.sqlite", path="vllm-adapter",
                   adapter=name, timeout=15, hooks=hooks[name])
        try:
            for i, v in enumerate(versions):
                with locks[name]:
                    result = fl.refresh(f.ads[v], f"{name}-v{i}")
                assert result.decision == "reopened", result.reason
                batch = [SampleRequest(f"{name}-{i}-{k}", PROMPT, SamplingSpec(
                    max_tokens=8, temperature=1.0, seed=k)) for k in range(6)]
                for o in fl.rollout(batch):
                    assert o.admitted, o.reason
                    p = o.sample.policy
                    out.setdefault(name, []).append((o.sample_id, p.adapter, p.version,
                                                     p.digest))
            out[f"{name}-ledger"] = fl.ledger.admitted()
        finally:
            fl.close()

    plan = {"run-a": ["a1", "a2", "a1", "a2"], "run-b": ["b1", "b2", "b1", "b2"]}
    threads = [threading.Thread(target=run, args=item) for item in plan.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for name, versions in plan.items():
        got = out[name]
        assert len(got) == 24 and len({s for s, *_ in got}) == 24, got
        assert {a for _, a, _, _ in got} == {name}
        for sample_id, _, version, digest in got:
            i = int(sample_id.split("-")[2])
            assert (version, digest) == (f"{name}-v{i}", f.digests[versions[i]])
        assert set(out[f"{name}-ledger"]) == {s for s, *_ in got}
    for hook in hooks.values():
        assert len(hook.seen) == 4, hook.seen
        for i, (mine, theirs, answered, base) in enumerate(hook.seen):
            # its own adapter gated (a first load too: it opens when its refresh reopens)
            assert mine == [False] * 3 and base == 200, (i, hook.seen)
            assert theirs in (None, [None] * 3, [True] * 3), theirs
            assert answered in (None, (200, "run-b")), answered
    # run-b was loaded (and so checked) by the time run-a's later refreshes verified
    assert any(a == (200, "run-b") for *_, a, _ in hooks["run-a"].seen), hooks["run-a"].seen


# ------------------------------------------------------------------ Dynamo's /v1/loras


def test_dynamos_lora_routes_load_list_and_unload(lf):
    """Dynamo's worker routes (POST/GET /v1/loras, DELETE /v1/loras/{name}) with its bodies
    and replies, over the same handlers: a loaded adapter is routable by name; loading it
    again leaves it as it is (no DYN_LORA_HOTSWAP_ENABLED); bad input is refused by name;
    the RL route list still has no load_lora / unload_lora."""
    f = lf
    dyn_id = lora_name_to_id("dyn")
    for p in f.workers:
        r = httpx.post(f"{p.ready['system_url']}/v1/loras", timeout=30, json={
            "lora_name": "dyn", "source": {"uri": f"file://{f.ads['v3']}"}})
        assert r.status_code == 200 and r.json() == {
            "status": "success", "message": "LoRA adapter 'dyn' loaded successfully",
            "lora_name": "dyn", "lora_id": dyn_id}, r.text
    r = complete(f, "dyn")
    assert r.status_code == 200, r.text
    assert r.json()["nvext"]["engine_data"]["weight_digest"] == f.digests["v3"]
    sys_url = f.workers[0].ready["system_url"]
    again = httpx.post(f"{sys_url}/v1/loras", timeout=30, json={
        "lora_name": "dyn", "source": {"uri": f"file://{f.ads['v1']}"}}).json()
    assert again["status"] == "success" and "already loaded" in again["message"]
    assert {a["weight_digest"] for a in listed(f, "dyn")} == {f.digests["v3"]}
    listing = httpx.get(f"{sys_url}/v1/loras", timeout=10).json()
    assert listing["status"] == "success" and listing["loras"]["dyn"] == dyn_id
    assert listing["loras"]["other"] == lora_name_to_id("other")
    assert listing["count"] == len(listing["loras"])
    s3 = httpx.post(f"{sys_url}/v1/loras", timeout=10, json={
        "lora_name": "s3", "source": {"uri": "s3://bucket/x"}}).json()
    assert s3["status"] == "error" and "file://" in s3["message"]
    missing = httpx.post(f"{sys_url}/v1/loras", timeout=10, json={
        "lora_name": "m", "source": {"uri": f"file://{f.ads['v1'].parent}/nowhere"}}).json()
    assert missing["status"] == "error" and "does not exist" in missing["message"]
    bad = httpx.post(f"{sys_url}/v1/loras", timeout=10, json={"lora_name": "x"})
    assert bad.status_code == 422 and "source" in bad.text
    assert httpx.post(f"{sys_url}/v1/loras", timeout=10, content=b"{nope").status_code == 400
    for p in f.workers:
        r = httpx.delete(f"{p.ready['system_url']}/v1/loras/dyn", timeout=30)
        assert r.json() == {"status": "success", "lora_name": "dyn", "lora_id": dyn_id,
                            "message": "LoRA adapter 'dyn' unloaded successfully"}, r.text
    gone = httpx.delete(f"{sys_url}/v1/loras/dyn", timeout=10).json()
    assert gone["status"] == "error" and "LoRA adapter 'dyn' not found" in gone["message"]
    assert listed(f, "dyn") == [None] * 3
    rl = httpx.get(f"{f.rl_url}/v1/rl/workers", timeout=10).json()["workers"][0]
    assert "load_lora" not in rl["routes"] and "unload_lora" not in rl["routes"]


def test_dynamos_hot_swap_replaces_a_loaded_adapter(lf):
    """With DYN_LORA_HOTSWAP_ENABLED=true (a worker of its own, outside the fleet's pool),
    loading a name already loaded replaces it with the new version, as Dynamo's does."""
    f = lf
    args = (*mock_args(f.ads["v1"].parent, *LORA_FLAGS), "--served-model-name", "mock-hot")
    p = f.start_worker(*args, kind="mocker", env={"DYN_LORA_HOTSWAP_ENABLED": "true"},
                       name="hot-swap-worker", timeout=120)
    try:
        url = p.ready["system_url"]
        for name, how in (("v1", "loaded"), ("v2", "hot-swapped")):
            r = httpx.post(f"{url}/v1/loras", timeout=30, json={
                "lora_name": "h", "source": {"uri": f"file://{f.ads[name]}"}}).json()
            assert r == {"status": "success", "message": f"LoRA adapter 'h' {how} successfully",
                         "lora_name": "h", "lora_id": lora_name_to_id("h")}, r
            got = httpx.post(f"{url}/engine/list_lora_adapters", json={}, timeout=10).json()
            assert [a["weight_digest"] for a in got["adapters"]] == [f.digests[name]]
    finally:
        f.workers.remove(p)
        f.procs.remove(p)
        p.stop()
