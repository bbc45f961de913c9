"""A policy refresh of a two-worker vLLM fleet (the session's, tests/conftest.py) from
checkpoint A to B under continuous rollout load: both workers end on B (version and
digest), post-update generation matches a transformers forward pass of B, no admitted sample
mixes A and B tokens, and the journal holds the whole story. The fleet is left on A (the
session's model) for the next modules."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time

import httpx
import pytest

from rlfleet.journal import SqliteJournal
from rlfleet.refresh.coordinator import PolicyRefresh
from rlfleet.refresh.probe import reference_probe
from rlfleet.rl import RolloutClient, SamplingSpec
from rlfleet.rollout.gate import RolloutGate
from rlfleet.weights.digest import checkpoint_digest
from tests.fleets import MODEL_NAME as MODEL
from tests.fleets import refresh_back, weight_versions

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def setup(vllm_fleet, tmp_path_factory, tiny_model, tiny_model_b):
    root = tmp_path_factory.mktemp("refresh-weights")
    shutil.copytree(tiny_model, root / "A")  # the session's model: the digest it serves
    shutil.copytree(tiny_model_b, root / "B")
    yield vllm_fleet, root
    if weight_versions(vllm_fleet) != [("A", checkpoint_digest(tiny_model))] * 2 \
            or routed(vllm_fleet, 2) != 2:
        refresh_back(vllm_fleet, root / "A", tmp_path_factory.mktemp("back") / "j.sqlite")


def test_refresh_a_to_b_under_load(setup, tmp_path):
    fleet, root = setup
    digest = {name: checkpoint_digest(root / name) for name in ("A", "B")}
    gate = RolloutGate()
    journal = SqliteJournal(tmp_path / "journal.sqlite")
    coordinator = PolicyRefresh(fleet.rl_url, model=MODEL, journal=journal, rollout_gate=gate,
                                probe_tolerance=1e-4)
    admitted = []
    spec = SamplingSpec(max_tokens=24, temperature=1.0, ignore_eos=True)

    async def run():
        first = await coordinator.refresh(root / "A", "A", step=0)
        assert first.ok, first.reason
        stop = asyncio.Event()
        async with RolloutClient(fleet.url, MODEL, allow_mixed_versions=True,
                                 gate=gate) as client:
            async def load(worker: int) -> None:
                i = 0
                while not stop.is_set():
                    i += 1
                    admitted.append(await client.generate(f"w{worker}-{i}", [151644, 8948, 198],
                                                          spec))

            async def admitted_past(n: int) -> None:
                """1.5 s of load, and until a sample past the first `n` is admitted (a
                loaded box may admit none in 1.5 s; 120 s at most)."""
                await asyncio.sleep(1.5)
                for _ in range(1200):
                    if len(admitted) > n:
                        return
                    await asyncio.sleep(0.1)

            loaders = [asyncio.create_task(load(k)) for k in range(6)]
            await admitted_past(0)
            before = len(admitted)
            result = await coordinator.refresh(root / "B", "B", step=1)
            await admitted_past(before)
            stop.set()
            await asyncio.gather(*loaders)
        return before, result

    before, result = asyncio.run(run())
    assert result.ok and result.decision == "reopened", result.reason
    assert [w["status"] for w in result.workers] == ["verified", "verified"]
    for p in fleet.workers:
        v = httpx.post(f"{p.ready['system_url']}/engine/get_weight_version", json={}).json()
        assert (v["version"], v["weight_digest"]) == ("B", digest["B"])

    # post-update generation through the frontend matches transformers on B
    probe = reference_probe(root / "B", [151644, 8948, 198, 40], 8)
    out = httpx.post(f"{fleet.url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": probe.prompt, "max_tokens": 8, "temperature": 0,
        "logprobs": 0, "ignore_eos": True,
        "nvext": {"extra_fields": ["completion_token_ids"]}}).json()
    assert out["nvext"]["completion_token_ids"] == probe.token_ids
    got = out["choices"][0]["logprobs"]["token_logprobs"]
    assert max(abs(a - b) for a, b in zip(got, probe.logprobs, strict=True)) < 1e-4

    # load ran on both sides of the refresh, and no admitted sample mixes A and B
    assert 0 < before < len(admitted)
    versions = set()
    for s in admitted:
        spans = s.completion.weight_spans
        assert spans and len({(sp.version, sp.digest) for sp in spans}) == 1, spans
        versions.add((spans[0].version, spans[0].digest))
    assert versions == {("A", digest["A"]), ("B", digest["B"])}

    entry = journal.get(result.refresh_id)
    assert (entry["target_version"], entry["target_digest"]) == ("B", digest["B"])
    assert (entry["previous_version"], entry["previous_digest"]) == ("A", digest["A"])
    assert entry["target_path"] == str((root / "B").resolve()) and entry["framework_step"] == 1
    assert sorted(entry["intended_workers"]) == sorted(
        int(p.ready["instance_id"]) for p in fleet.workers)
    assert entry["decision"] == "reopened" and entry["reason"]
    assert [s["name"] for s in entry["steps"]] == [
        "resolve", "gate", "pause", "apply", "reset_cache", "verify", "resume", "probe", "reopen"]
    # every step was timed, and the journal keeps the times the caller was given
    assert all(type(s["seconds"]) is float and s["seconds"] > 0 for s in entry["steps"]), \
        entry["steps"]
    assert [(s["name"], s["seconds"]) for s in entry["steps"]] == \
        [(s["name"], s["seconds"]) for s in result.steps]
    assert result.seconds == sum(s["seconds"] for s in entry["steps"])
    # a step a worker ran inside its one commit_policy call lies inside that call
    committed = [s for s in entry["steps"] if s.get("via") == "commit_policy"]
    assert [s["name"] for s in committed] == [
        "gate", "pause", "apply", "reset_cache", "verify", "resume"], entry["steps"]
    assert all(s["seconds"] <= committed[0]["commit_seconds"] for s in committed), committed
    for w in entry["workers"].values():
        assert w["status"] == "verified"
        calls = {c["route"]: c for c in w["calls"]}
        assert calls["update_weights_from_disk"]["http_status"] == 200
        assert calls["update_weights_from_disk"]["body"]["weight_digest"] == digest["B"]


def test_probe_that_does_not_match_the_target_keeps_workers_out(setup, tmp_path):
    """The post-update generation must reproduce what the trainer expects: expecting A's
    greedy tokens from checkpoint B holds the fleet (no worker verified)."""
    fleet, root = setup
    coordinator = PolicyRefresh(fleet.rl_url, model=MODEL, journal=tmp_path / "j.sqlite")
    wrong = reference_probe(root / "A", [151644, 8948, 198], 8)

    async def run():
        return await coordinator.refresh(root / "B", "B-probe", probe=wrong)

    result = asyncio.run(run())
    assert result.decision == "held" and "verified" not in {w["status"] for w in result.workers}
    assert all("does not reproduce" in w["reason"] or "does not match" in w["reason"]
               for w in result.workers)
    ok = asyncio.run(coordinator.refresh(root / "B", "B"))  # the right probe reopens it
    assert ok.ok, ok.reason


def test_distributed_path_broadcasts_from_the_trainer(setup, tmp_path):
    """The vLLM distributed path: the coordinator (trainer) broadcasts the checkpoint's
    tensors over gloo to both workers, then verifies and reopens as for the disk path."""
    fleet, root = setup
    coordinator = PolicyRefresh(fleet.rl_url, model=MODEL, path="vllm-distributed",
                                journal=tmp_path / "j.sqlite", timeout=60)
    result = asyncio.run(coordinator.refresh(root / "A", "A-dist"))
    assert result.ok, result.reason
    assert [w["status"] for w in result.workers] == ["verified", "verified"]
    for w in result.workers:
        call = next(c for c in w["calls"] if c["route"] == "update_weights_from_distributed")
        assert call["body"]["weight_digest"] == checkpoint_digest(root / "A")


def routed(fleet, expected: int, timeout: float = 10.0) -> int:
    """How many workers of MODEL the frontend routes to, once it is `expected` (or the
    timeout passed: discovery reaches the frontend within its poll interval)."""
    deadline = time.monotonic() + timeout
    while True:
        n = sum(1 for w in httpx.get(f"{fleet.url}/health", timeout=5).json()["workers"]
                if w["model"] == MODEL and w["usable"])
        if n == expected or time.monotonic() > deadline:
            return n
        time.sleep(0.2)


def test_a_new_coordinator_rolls_a_held_mixed_fleet_back(setup, tmp_path):
    """Issue 9, finding 6: every refresh below is a new `rlfleet refresh` process on the same
    journal. A held refresh leaves the fleet gated on mixed weights; the next coordinator
    knows from the journal that B was the last verified policy and rolls back to it."""
    fleet, root = setup
    journal = tmp_path / "journal.sqlite"
    digest = {name: checkpoint_digest(root / name) for name in ("A", "B")}
    w0, w1 = fleet.workers

    def refresh(name: str, *flags: str) -> subprocess.CompletedProcess:
        # the disk path (`rlfleet refresh` stages first by default): the faults below are
        # armed on update_weights_from_disk
        return subprocess.run(
            [sys.executable, "-m", "rlfleet.cli", "refresh", "--checkpoint", str(root / name),
             "--version", name, "--rl-url", fleet.rl_url, "--model", MODEL, "--journal",
             str(journal), "--path", "vllm-disk", *flags], capture_output=True, text=True,
            timeout=600)

    def holds() -> list[tuple[str, str]]:
        return [tuple(httpx.post(f"{p.ready['system_url']}/engine/get_weight_version",
                                 json={}, timeout=30).json()[k]
                      for k in ("version", "weight_digest")) for p in (w0, w1)]

    def fail_transfer(proc) -> None:
        r = httpx.post(f"{proc.ready['system_url']}/engine/fault_injection", timeout=5,
                       json={"route": "update_weights_from_disk", "mode": "error"})
        assert r.json()["status"] == "ok", r.text

    for name in ("A", "B"):
        run = refresh(name)
        assert run.returncode == 0 and "decision: reopened" in run.stdout, run.stdout + run.stderr
    fail_transfer(w1)
    held = refresh("A", "--on-failure", "hold")
    assert held.returncode == 1 and "decision: held" in held.stdout, held.stdout + held.stderr
    assert holds() == [("A", digest["A"]), ("B", digest["B"])]  # mixed
    assert routed(fleet, 0) == 0  # and gated

    fail_transfer(w1)  # the next coordinator's transfer fails on the same worker again
    back = refresh("A", "--on-failure", "rollback")
    assert "decision: rolled_back" in back.stdout and "rolled back to B" in back.stdout, \
        back.stdout + back.stderr
    assert holds() == [("B", digest["B"])] * 2
    assert routed(fleet, 2) == 2
    last = SqliteJournal(journal).recent(1)[0]
    assert last["decision"] == "rolled_back" and last["previous_version"] == "B"
    assert all(w["status"] == "verified" for w in last["workers"].values())
