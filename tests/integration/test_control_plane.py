"""Worker admin routes against real vLLM on the tiny model: pause modes with requests in
flight, weight updates from disk and from a trainer group, version and digest identity."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from rlfleet.refresh.probe import reference_probe
from rlfleet.weights.broadcast import push_weights
from rlfleet.weights.digest import checkpoint_digest, iter_checkpoint_tensors
from tests.fleets import vllm_worker_args

pytestmark = pytest.mark.engine

MODEL = "ctl"
PROMPT = [151644, 8948, 198, 40, 1079]

REFERENCE_SCRIPT = r'''
set -euo pipefail

WORKER_URL=http://10.0.0.12:8081
TARGET_VERSION=step-42
TARGET_PATH=/models/checkpoint-42

curl --fail-with-body "$WORKER_URL/engine/pause_generation" \
  -H 'Content-Type: application/json' \
  -d '{"mode":"wait","clear_cache":false}' | jq -e '.status == "ok"'

curl --fail-with-body "$WORKER_URL/engine/update_weights_from_disk" \
  -H 'Content-Type: application/json' \
  -d "{\"model_path\":\"$TARGET_PATH\",\"weight_version\":\"$TARGET_VERSION\"}" \
  | jq -e --arg version "$TARGET_VERSION" '.status == "ok" and .version == $version'

curl --fail-with-body "$WORKER_URL/engine/get_weight_version" \
  -H 'Content-Type: application/json' \
  -d '{}' | jq -e --arg version "$TARGET_VERSION" '.status == "ok" and .version == $version'

curl --fail-with-body "$WORKER_URL/engine/resume_generation" \
  -H 'Content-Type: application/json' \
  -d '{}' | jq -e '.status == "ok"'
'''


@pytest.fixture(scope="module")
def weights_root(tmp_path_factory, tiny_model, tiny_model_b) -> Path:
    """Checkpoints the worker may read: A, B, and one of another architecture."""
    root = tmp_path_factory.mktemp("weights")
    for name, src in (("A", tiny_model), ("B", tiny_model_b)):
        shutil.copytree(src, root / name)  # a symlink out of the root would be refused
    wrong = root / "wrong-arch"
    wrong.mkdir()
    tensors = dict(iter_checkpoint_tensors(tiny_model))
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(256, 64)
    save_file(tensors, str(wrong / "model.safetensors"))
    (wrong / "config.json").write_text((tiny_model / "config.json").read_text())
    return root


@pytest.fixture(scope="module")
def ctl(start_module_fleet, weights_root):
    """One RL worker serving checkpoint A, with a frontend in front of it."""
    worker = vllm_worker_args(weights_root / "A", MODEL,
                              "--allowed-weights-root", str(weights_root))
    fleet = start_module_fleet([worker], name="ctl-fleet", kind="vllm", model=MODEL,
                               lease_ttl=3)
    fleet.system_url = fleet.workers[0].ready["system_url"]
    return fleet


def admin(fleet, route: str, body: dict | None = None, timeout: float = 60) -> dict:
    r = httpx.post(f"{fleet.system_url}/engine/{route}", json=body or {}, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def greedy(fleet, max_tokens: int = 16) -> tuple[list[int], list[float]]:
    r = httpx.post(f"{fleet.url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
        "logprobs": 0, "ignore_eos": True, "nvext": {"extra_fields": ["completion_token_ids"]}})
    assert r.status_code == 200, r.text
    out = r.json()
    return out["nvext"]["completion_token_ids"], out["choices"][0]["logprobs"]["token_logprobs"]


def transformers_greedy(model_dir: Path, n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and logprobs of a plain transformers forward pass."""
    probe = reference_probe(model_dir, PROMPT, n)
    return probe.token_ids, probe.logprobs


def set_weights(fleet, path: Path, version: str) -> dict:
    admin(fleet, "pause_generation", {"mode": "wait"})
    try:
        return admin(fleet, "update_weights_from_disk",
                     {"model_path": str(path), "weight_version": version})
    finally:
        admin(fleet, "resume_generation")


def test_reference_script_updates_the_worker(ctl, weights_root, tiny_model_b):
    before = greedy(ctl)
    script = REFERENCE_SCRIPT.replace("http://10.0.0.12:8081", ctl.system_url) \
        .replace("/models/checkpoint-42", str(weights_root / "B"))
    run = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    try:
        after = greedy(ctl)
        assert after[0] != before[0]
        ref_ids, ref_lps = transformers_greedy(tiny_model_b, 16)
        assert after[0] == ref_ids
        assert max(abs(a - b) for a, b in zip(after[1], ref_lps, strict=True)) < 1e-4
        v = admin(ctl, "get_weight_version")
        cli = subprocess.run([sys.executable, "-m", "rlfleet.cli", "digest", str(tiny_model_b)],
                             capture_output=True, text=True, check=True).stdout.strip()
        assert v["version"] == "step-42" and v["version_declared"] is True
        assert v["weight_digest"] == cli == checkpoint_digest(tiny_model_b)
    finally:
        set_weights(ctl, weights_root / "A", "A")
    assert greedy(ctl) == before  # and back: the prefix cache did not keep B's KV


@pytest.mark.parametrize("body,words", [
    ({"model_path": "A"}, "not paused"),
])
def test_update_requires_pause(ctl, weights_root, body, words):
    r = admin(ctl, "update_weights_from_disk", {"model_path": str(weights_root / "B")})
    assert r["status"] == "error" and "pause" in r["message"]


def test_bad_updates_keep_the_old_weights(ctl, weights_root, tmp_path):
    before = greedy(ctl)
    digest = admin(ctl, "get_weight_version")["weight_digest"]
    admin(ctl, "pause_generation", {"mode": "wait"})
    try:
        cases = [
            ({"model_path": str(weights_root / "missing")}, "does not exist"),
            ({"model_path": str(tmp_path)}, "outside the allowed"),
            ({"model_path": str(weights_root / "B" / ".." / ".." / "x")}, "outside the allowed"),
            ({"model_path": str(weights_root / "wrong-arch")}, "architecture"),
            ({}, "model_path is required"),
            ({"model_path": str(weights_root / "B"), "weight_version": 3}, "weight_version"),
        ]
        for body, words in cases:
            r = admin(ctl, "update_weights_from_disk", body)
            assert r["status"] == "error" and words in r["message"], (body, r)
    finally:
        admin(ctl, "resume_generation")
    assert admin(ctl, "get_weight_version")["weight_digest"] == digest
    assert greedy(ctl) == before


def test_version_routes(ctl):
    tagged = admin(ctl, "set_weight_version", {"weight_version": "tagged"})
    assert (tagged["status"], tagged["version"]) == ("ok", "tagged")
    v = admin(ctl, "get_weight_version")
    assert v["version"] == "tagged" and v["version_declared"] is True
    assert admin(ctl, "set_weight_version", {"weight_version": None})["version"] is None
    v = admin(ctl, "get_weight_version")
    assert v["version"] is None and v["version_declared"] is True
    assert admin(ctl, "set_weight_version", {})["status"] == "error"
    live = admin(ctl, "liveness_probe")
    assert (live["status"], live["alive"]) == ("ok", True)
    assert admin(ctl, "flush_cache") == {"status": "ok", "message": "Cache flushed"}


def test_system_health_answers_ready_as_dynamo_workers_do(ctl):
    """Dynamo's RL end-to-end harness waits for the worker's /health to say "ready"."""
    r = httpx.get(f"{ctl.system_url}/health", timeout=10)
    answered = time.monotonic_ns()
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ready" and body["endpoints"] == {"generate": "ready", "rl": "ready"}
    assert body["model"] == MODEL and body["weight_digest"].startswith("blake3:")
    assert int(body["instance_id"]) == int(ctl.workers[0].ready["instance_id"])
    assert body["gated"] is False  # open to rollouts
    # uptime is Dynamo's {secs, nanos} and counts from the worker's start, not per request:
    # between two reads it grows by at least the time between the first answer and the
    # second ask (one monotonic clock on this host; no bound on how long anything takes)
    time.sleep(0.2)
    asked = time.monotonic_ns()
    again = httpx.get(f"{ctl.system_url}/health", timeout=10).json()["uptime"]

    def ns(uptime: dict) -> int:
        secs, nanos = uptime["secs"], uptime["nanos"]
        assert type(secs) is int and type(nanos) is int and 0 <= nanos < 10**9, uptime
        return secs * 10**9 + nanos

    assert ns(again) - ns(body["uptime"]) >= asked - answered, (body["uptime"], again)


# ------------------------------------------------------------------ pause modes in flight

class Stream:
    """A streamed completion read in a thread: tokens as they arrive, and the end."""

    def __init__(self, fleet, max_tokens: int) -> None:
        self.ids: list[int] = []
        self.finish: str | None = None
        self.detailed: str | None = None
        self.error: str | None = None
        self.spans: list[dict] = []
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True,
                "nvext": {"extra_fields": ["completion_token_ids", "detailed_finish_reason",
                                           "weight_versions"]}}
        self.thread = threading.Thread(target=self._run, args=(fleet.url, body), daemon=True)
        self.thread.start()

    def _run(self, url: str, body: dict) -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    self.error = ev["error"]["message"]
                    return
                nv = ev.get("nvext", {})
                self.ids += nv.get("completion_token_ids", [])
                self.detailed = nv.get("detailed_finish_reason", self.detailed)
                self.spans = nv.get("weight_versions", self.spans)
                for c in ev["choices"]:
                    self.finish = c.get("finish_reason") or self.finish

    def wait_tokens(self, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(self.ids) < n:
            assert time.monotonic() < deadline, f"only {len(self.ids)} tokens arrived"
            time.sleep(0.01)

    def join(self, timeout: float = 120) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the request did not finish"


LONG = 600  # long enough that a pause always lands mid-request (~6 s of decoding alone)


def generated_tokens(fleet) -> float:
    """The worker engine's own count of generated tokens (the client may lag behind it)."""
    text = httpx.get(f"{fleet.system_url}/metrics", timeout=10).text
    return float(re.search(r"^rlfleet_worker_generated_tokens_total(?:{[^}]*})? ([0-9.e+]+)$", text,
                           re.M).group(1))


def test_pause_keep_freezes_and_resume_continues(ctl):
    uninterrupted = greedy(ctl, LONG)[0]
    before = generated_tokens(ctl)
    s = Stream(ctl, LONG)
    s.wait_tokens(20)
    admin(ctl, "pause_generation", {"mode": "keep"})
    try:
        time.sleep(0.2)
        frozen = generated_tokens(ctl)
        time.sleep(1.0)
        assert generated_tokens(ctl) == frozen  # nothing generated while paused
        assert frozen - before < LONG  # and the request is not finished
    finally:
        admin(ctl, "resume_generation")
    s.join()
    assert s.error is None and s.finish == "length"
    assert s.ids == uninterrupted


def test_pause_wait_drains_and_holds_new_requests(ctl):
    s = Stream(ctl, 300)
    s.wait_tokens(10)
    admin(ctl, "pause_generation", {"mode": "wait"}, timeout=120)  # returns once it finished
    try:
        s.join()
        assert len(s.ids) == 300 and s.finish == "length"
        held = Stream(ctl, 5)
        time.sleep(1.0)
        assert held.ids == [] and held.thread.is_alive()  # waiting, not lost
    finally:
        admin(ctl, "resume_generation")
    held.join()
    assert len(held.ids) == 5 and held.finish == "length"


def test_pause_abort_ends_requests_with_partial_output(ctl):
    s = Stream(ctl, LONG)
    s.wait_tokens(10)
    admin(ctl, "pause_generation", {"mode": "abort"})
    try:
        s.join(30)
    finally:
        admin(ctl, "resume_generation")
    assert s.error is None
    assert s.finish == "abort" and s.detailed == "cancelled"
    assert 10 <= len(s.ids) < LONG
    assert greedy(ctl, 4)[0]  # the worker serves new requests after resume


# ------------------------------------------------------------------ trainer → worker

def test_trainer_pushes_weights_over_gloo(ctl, tiny_model_b, weights_root):
    tensors = list(iter_checkpoint_tensors(tiny_model_b))
    admin(ctl, "pause_generation", {"mode": "keep"})
    try:
        results = asyncio.run(push_weights([ctl.system_url], tensors, "B-dist", timeout=30))
    finally:
        admin(ctl, "resume_generation")
    try:
        assert results[0].body["status"] == "ok", results
        assert results[0].body["weight_digest"] == checkpoint_digest(tiny_model_b)
        assert greedy(ctl)[0] == transformers_greedy(tiny_model_b, 16)[0]
    finally:
        set_weights(ctl, weights_root / "A", "A")


TRAINER = textwrap.dedent("""
    import asyncio, sys, time, httpx
    # imported before the rendezvous: on a loaded machine the import alone can outlast the
    # group's 5 s deadline, and the worker would give up before this side listens
    import vllm.distributed.utils
    from rlfleet.weights.broadcast import TrainerGroup, dtype_name, free_port
    from rlfleet.weights.digest import iter_checkpoint_tensors

    url, ckpt = sys.argv[1], sys.argv[2]
    tensors = list(iter_checkpoint_tensors(ckpt))
    port = free_port()
    group = TrainerGroup("127.0.0.1", port, 2, "gloo", timeout=5)

    async def main():
        async with httpx.AsyncClient(timeout=60) as http:
            init = http.post(url + "/engine/init_weights_update_group", json={
                "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                "world_size": 2, "backend": "gloo", "timeout": 5})
            await asyncio.gather(asyncio.to_thread(group.connect), init)
            meta = {"names": [n for n, _ in tensors], "dtypes": [dtype_name(t) for _, t in tensors],
                    "shapes": [list(t.shape) for _, t in tensors], "weight_version": "never"}
            asyncio.create_task(http.post(url + "/engine/update_weights_from_distributed", json=meta))
            await asyncio.sleep(0.5)
            await asyncio.to_thread(group.send, tensors[: len(tensors) // 2])
            print("HALF_SENT", flush=True)
            await asyncio.sleep(3600)

    asyncio.run(main())
""")


def test_trainer_killed_mid_transfer_leaves_old_weights(ctl, tiny_model_b, tmp_path):
    before = greedy(ctl)
    digest = admin(ctl, "get_weight_version")["weight_digest"]
    admin(ctl, "pause_generation", {"mode": "keep"})
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    trainer = subprocess.Popen([sys.executable, str(script), ctl.system_url, str(tiny_model_b)],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout.readline().strip() == "HALF_SENT"
        trainer.kill()
        trainer.wait(10)
        t0 = time.monotonic()
        # control calls are serialised: this returns once the update gave up (deadline 5 s)
        r = httpx.post(f"{ctl.system_url}/engine/destroy_weights_update_group", json={},
                       timeout=60)
        assert r.status_code == 200 and time.monotonic() - t0 < 30
    finally:
        trainer.kill()
        admin(ctl, "resume_generation")
    assert admin(ctl, "liveness_probe")["alive"] is True
    assert admin(ctl, "get_weight_version")["weight_digest"] == digest
    assert greedy(ctl) == before


def test_group_init_times_out_instead_of_hanging(ctl):
    from rlfleet.weights.broadcast import free_port

    t0 = time.monotonic()
    r = admin(ctl, "init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1,
        "world_size": 2, "timeout": 3}, timeout=60)
    assert r["status"] == "error" and "initialisation failed" in r["message"]
    assert time.monotonic() - t0 < 30
    assert greedy(ctl, 4)[0]


def test_weight_versions_span_an_update_under_keep_pause(ctl, weights_root, tiny_model_b):
    """A request frozen by a keep-pause across an update reports two spans; afterwards a
    request reports one span on the new version and digest."""
    s = Stream(ctl, LONG)
    s.wait_tokens(20)
    admin(ctl, "pause_generation", {"mode": "keep"})
    try:
        r = admin(ctl, "update_weights_from_disk",
                  {"model_path": str(weights_root / "B"), "weight_version": "B", "step": 11})
        assert r["status"] == "ok" and r["step"] == 11
    finally:
        admin(ctl, "resume_generation")
    s.join()
    try:
        spans = s.spans
        assert [sp["version"] for sp in spans] == [spans[0]["version"], "B"]
        assert spans[1]["digest"] == checkpoint_digest(tiny_model_b) and spans[1]["step"] == 11
        assert spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == LONG
        out = httpx.post(f"{ctl.url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True,
            "nvext": {"extra_fields": ["weight_versions"]}}).json()
        assert out["nvext"]["weight_versions"] == [
            {"version": "B", "digest": checkpoint_digest(tiny_model_b), "step": 11, "start": 0,
             "end": 5}]
        gen = httpx.post(f"{ctl.url}/generate", timeout=60, json={
            "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}}).json()
        assert gen["meta_info"]["weight_versions"][0]["version"] == "B"
    finally:
        set_weights(ctl, weights_root / "A", "A")


# ------------------------------------------------------------------ refusals (issue 10)

def test_bad_checkpoints_are_refused_with_a_reason(ctl, weights_root, tiny_model_b):
    """A symlinked file out of the allowed root, a null byte, a truncated file: each a
    200 `status: error` that says what is wrong; the weights stay."""
    linked = weights_root / "linked"
    linked.mkdir(exist_ok=True)
    for f in (weights_root / "A").iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, linked / f.name)
    target = tiny_model_b / "model.safetensors"  # outside the allowed root
    (linked / "model.safetensors").unlink(missing_ok=True)
    (linked / "model.safetensors").symlink_to(target)
    truncated = weights_root / "truncated"
    shutil.copytree(weights_root / "A", truncated, dirs_exist_ok=True)
    data = (weights_root / "A" / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    digest = admin(ctl, "get_weight_version")["weight_digest"]
    admin(ctl, "pause_generation", {"mode": "wait"})
    try:
        for path, words in ((linked, "symlinks that lead outside"),
                            (f"{weights_root}/A\0/../B", "null byte"),
                            (truncated, "not readable safetensors")):
            r = httpx.post(f"{ctl.system_url}/engine/update_weights_from_disk", timeout=60,
                           json={"model_path": str(path)})
            assert r.status_code == 200, r.text
            assert r.json()["status"] == "error" and words in r.json()["message"], r.json()
    finally:
        admin(ctl, "resume_generation")
    assert admin(ctl, "get_weight_version")["weight_digest"] == digest


def test_a_trainer_broadcast_of_non_finite_weights_is_refused(ctl, tiny_model_b):
    tensors = [(n, t.clone()) for n, t in iter_checkpoint_tensors(tiny_model_b)]
    tensors[-1][1].view(-1)[0] = float("nan")
    digest = admin(ctl, "get_weight_version")["weight_digest"]
    admin(ctl, "pause_generation", {"mode": "keep"})
    try:
        results = asyncio.run(push_weights([ctl.system_url], tensors, "nan", timeout=30))
    finally:
        admin(ctl, "resume_generation")
    assert results[0].body["status"] == "error" and "non-finite" in results[0].message, results
    assert admin(ctl, "get_weight_version")["weight_digest"] == digest
    live = admin(ctl, "liveness_probe")
    assert (live["status"], live["alive"]) == ("ok", True)


def test_a_long_control_call_keeps_its_deadline_and_blocks_no_reader(ctl):
    """A trainer group to a port nobody listens on, with an 8 s deadline, while the liveness
    probe, the version and the admission answer at once (issue 10 finding 11)."""
    from concurrent.futures import ThreadPoolExecutor

    from rlfleet.weights.broadcast import free_port

    def timed(route: str, body: dict | None = None) -> tuple[float, float, dict]:
        t0 = time.monotonic()
        out = admin(ctl, route, body, timeout=60)
        return t0, time.monotonic(), out

    with ThreadPoolExecutor(1) as pool:
        init = pool.submit(timed, "init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1,
            "world_size": 2, "timeout": 8})
        time.sleep(2)  # the engine is running the call now
        readers = [timed("liveness_probe"), timed("get_weight_version"),
                   timed("set_admission", {"open": True})]
        began, ended, out = init.result()
    assert out["status"] == "error" and "initialisation failed" in out["message"], out
    assert ended - began < 8 + 6, f"the 8 s deadline took {ended - began:.1f}s"
    # each reader answered while the group call still ran (a blocked one answers after it)
    for _, done, body in readers:
        assert body["status"] == "ok" and done < ended, (ended - done, body)
