"""`rlfleet up --ray` on a real local Ray cluster: every member a Ray actor in its own
placement group; a worker actor killed by Ray comes back, gated, and is re-admitted only once
verified; `rlfleet down` leaves no process and no actor. Mocker workers (the declared
simulator) for the restart under load, one real vLLM worker for the engine."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from rlfleet.mocker.engine import write_mock_checkpoint
from rlfleet.rl import PolicyRefresh, RetryPolicy, RolloutClient, SampleLedger, SamplingSpec
from rlfleet.rollout.sample import SampleRequest
from tests.fleets import VLLM_FLAGS

pytestmark = pytest.mark.engine

MODEL = "mock-rl"


def rlfleet(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlfleet.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)
    return got


@pytest.fixture
def ray_driver(ray_head):
    import ray

    ray.init(address=ray_head, namespace="rlfleet-test", log_to_driver=False,
             logging_level="ERROR")
    try:
        yield ray
    finally:
        ray.shutdown()


def up(tmp_path: Path, ray_head: str, config: dict, namespace: str) -> tuple[Path, dict]:
    cfg = tmp_path / "fleet.yaml"
    cfg.write_text(yaml.safe_dump(config))
    state = tmp_path / "state"
    r = rlfleet("up", "--ray", ray_head, "--ray-namespace", namespace, "--config", str(cfg),
                "--state", str(state), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return state, json.loads((state / "fleet.json").read_text())


def down_leaves_nothing(state_dir: Path, ray, namespace: str, pids: set[int]) -> None:
    r = rlfleet("down", "--state", str(state_dir))
    assert r.returncode == 0, r.stdout + r.stderr
    assert not (state_dir / "fleet.json").exists()
    left = [a for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == namespace]
    assert left == []
    wait_for(lambda: not any(alive(p) for p in pids), 20, f"processes {pids} to end")


def test_ray_fleet_restarts_a_killed_worker_gated_and_readmits_it(tmp_path, ray_head,
                                                                   ray_driver):
    ray = ray_driver
    root = tmp_path / "weights"
    ckpt = write_mock_checkpoint(root / "B", 2)
    worker = {"served-model-name": MODEL, "enable-rl": True, "system-port": 0,
              "allowed-weights-root": [str(root)], "token-delay": 0.002, "seed": 1,
              "lease-ttl": 2}
    config = {"discovery": (tmp_path / "discovery").as_uri(),
              "frontend": {"http-port": 0, "enable-rl": True, "rl-port": 0},
              "workers": [{"kind": "mocker", "count": 2, "args": worker}]}
    state_dir, state = up(tmp_path, ray_head, config, "rlf-mock")
    front = state["members"][0]["ready"]
    pids = {m["pid"] for m in state["members"]}
    try:
        listed = httpx.get(f"{front['rl_url']}/v1/rl/workers", timeout=30).json()["workers"]
        assert len(listed) == 2 and all(w["model"] == MODEL for w in listed)
        # each worker is an actor in a placement group of its own
        groups = ray.util.placement_group_table()
        names = {g["name"] for g in groups.values() if g["state"] == "CREATED"}
        assert {"rlf-mock-worker-0", "rlf-mock-worker-1", "rlf-mock-frontend"} <= names

        coordinator = PolicyRefresh(front["rl_url"], model=MODEL, timeout=20)
        assert asyncio.run(coordinator.refresh(ckpt, "B", digest="mock:2")).ok

        victim = ray.get_actor("worker-1", namespace="rlf-mock")
        old = ray.get(victim.info.remote())
        outcomes: list = []

        async def load() -> None:
            retry = RetryPolicy(max_attempts=8, backoff_initial=0.05, backoff_max=1.0,
                                attempt_timeout=30)
            async with RolloutClient(front["url"], MODEL, ledger=SampleLedger(tmp_path / "l.db"),
                                     retry=retry) as client:
                samples = [SampleRequest(f"s{i}", [1, 2, 3, i % 50 + 4],
                                         SamplingSpec(max_tokens=64, seed=i))
                           for i in range(300)]
                outcomes.extend(await client.rollout(samples, concurrency=16))

        t = threading.Thread(target=lambda: asyncio.run(load()))
        t.start()
        time.sleep(1.0)
        ray.kill(victim, no_restart=False)  # Ray kills the actor: it restarts it
        back = wait_for(lambda: _restarted(ray, "rlf-mock"), 90, "the actor's restart")
        assert back["pid"] != old["pid"] and not alive(old["pid"])
        pids.add(back["pid"])
        new_iid = int(back["ready"]["instance_id"])
        def listed_new() -> dict | None:  # the frontend finds it on its next discovery poll
            return next((w for w in httpx.get(f"{front['url']}/health", timeout=10)
                         .json()["workers"] if w["instance_id"] == new_iid), None)
        assert not wait_for(listed_new, 30, "the frontend to list the restarted worker")[
            "usable"]  # gated
        admitted = asyncio.run(coordinator.admit_new_workers())
        assert admitted.ok and [w["instance_id"] for w in admitted.workers] == [new_iid]
        t.join(timeout=120)
        assert not t.is_alive()
        failed = [(o.sample_id, repr(o.error)) for o in outcomes if not o.admitted]
        assert len(outcomes) == 300 and failed == [], failed[:5]
        wait_for(lambda: len(httpx.get(f"{front['rl_url']}/v1/rl/workers", timeout=30)
                             .json()["workers"]) == 2, 30, "the dead entry to expire")
        def usable() -> set[int] | None:  # the frontend sees the reopened worker on its next poll
            ids = {w["instance_id"] for w in httpx.get(f"{front['url']}/health", timeout=10)
                   .json()["workers"] if w["usable"]}
            return ids if new_iid in ids and len(ids) == 2 else None
        wait_for(usable, 30, "the re-admitted worker to be routed")
        st = rlfleet("status", "--state", str(state_dir), "--json")
        assert st.returncode == 0, st.stdout + st.stderr
        assert any(m.get("restarted") for m in json.loads(st.stdout)["members"])
    finally:
        down_leaves_nothing(state_dir, ray, "rlf-mock", pids)


def _restarted(ray, namespace: str) -> dict | None:
    try:
        info = ray.get(ray.get_actor("worker-1", namespace=namespace).info.remote(), timeout=5)
    except Exception:  # restarting
        return None
    return info if info["restarted"] and info["ready"].get("instance_id") else None


def test_ray_fleet_with_a_vllm_worker(tmp_path, ray_head, ray_driver, tiny_model):
    config = {"discovery": (tmp_path / "discovery").as_uri(),
              "frontend": {"http-port": 0, "enable-rl": True, "rl-port": 0},
              "workers": [{"kind": "vllm", "args": [
                  "--model", str(tiny_model), "--served-model-name", "tiny", "--enable-rl",
                  "--system-port", "0", *VLLM_FLAGS]}]}
    state_dir, state = up(tmp_path, ray_head, config, "rlf-vllm")
    front = state["members"][0]["ready"]
    try:
        listed = httpx.get(f"{front['rl_url']}/v1/rl/workers", timeout=30).json()["workers"]
        assert [w["model"] for w in listed] == ["tiny"] and "update_weights_from_disk" in \
            listed[0]["routes"]
        r = httpx.post(f"{front['url']}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4, "logprobs": 1})
        assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["tokens"]) == 4
    finally:
        down_leaves_nothing(state_dir, ray_driver, "rlf-vllm",
                            {m["pid"] for m in state["members"]})
