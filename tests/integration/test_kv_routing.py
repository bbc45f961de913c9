"""KV-aware routing (--router-mode kv) with mocker workers (the declared simulator: its
prefix cache and KV events are simulated; what is tested is the frontend's routing), and
vLLM's own KV event classes read by the frontend's view."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
import pytest

from rlfleet.frontend.kv import KvRouter, Prefix
from tests.fleets import wait_for_workers

MODEL = "mock-kv"
EVENTS = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                     "endpoint": "tcp://127.0.0.1:0"})
WORKER = ("--served-model-name", MODEL, "--token-delay", "0.01", "--block-size", "16",
          "--system-port", "0")


@pytest.fixture(scope="module")
def fleet(start_module_fleet):
    # two workers publish KV events, the third has none (the frontend's own record);
    # a high overload threshold: a whole group fits on one idle worker
    return start_module_fleet([WORKER + ("--kv-events-config", EVENTS)] * 2 + [WORKER],
                              model=MODEL, frontend=("--router-mode", "kv",
                                                     "--kv-overload-threshold", "8"))


def complete(url: str, prompt: list[int], **kw) -> tuple[int, list[int]]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "ignore_eos": True,
            "nvext": {"extra_fields": ["worker_id", "completion_token_ids"]}, **kw}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    nv = r.json()["nvext"]
    return nv["worker_id"]["decode_worker_id"], nv["completion_token_ids"]


def health(url: str) -> dict[int, dict]:
    return {w["instance_id"]: w for w in httpx.get(f"{url}/health", timeout=5).json()["workers"]}


def rollout(url: str, prompt: list[int], turns: int = 3) -> list[int]:
    """A multi-turn rollout: each turn re-sends the whole conversation (prompt, completion,
    new user tokens); the workers that served each turn."""
    served = []
    for t in range(turns):
        w, out = complete(url, prompt)
        served.append(w)
        prompt = prompt + out + [5000 + t] * 20
    return served


def _system(i: int) -> list[int]:
    return [10_000 + 97 * i + k for k in range(80)]


def test_groups_and_continuations_go_where_their_prefix_is(fleet):
    url = fleet.url
    with ThreadPoolExecutor(4) as pool:  # a GRPO group: 4 samples, separate requests
        group = list(pool.map(lambda s: complete(url, _system(0), seed=s)[0], range(4)))
    assert len(set(group)) == 1, group
    homes = []
    for i in range(1, 7):
        served = rollout(url, _system(i))
        assert len(set(served)) == 1, f"rollout {i} moved between workers: {served}"
        homes.append(served[0])
    assert len(set(homes)) >= 2, f"every rollout went to one worker: {homes}"
    view = health(url)
    sources = sorted(w["kv"]["source"] for w in view.values())
    assert sources == ["events", "events", "record"]
    # the event workers' views come from their events (the frontend's record expires)
    assert all(w["kv"]["cached_blocks"] > 0 for w in view.values()
               if w["kv"]["source"] == "events" and w["instance_id"] in homes + group)


def _holder(fleet, prompt):
    w, out = complete(fleet.url, prompt)
    return w, prompt + out + [7] * 16, {int(p.ready["instance_id"]): p for p in fleet.workers}


def test_a_gated_holder_is_passed_over(fleet):
    w, nxt, procs = _holder(fleet, _system(20))
    assert complete(fleet.url, nxt)[0] == w
    sysurl = procs[w].ready["system_url"]
    httpx.post(f"{sysurl}/engine/set_admission", json={"open": False, "reason": "test"},
               timeout=10).raise_for_status()
    try:
        wait = time.monotonic() + 10
        while health(fleet.url)[w]["usable"] and time.monotonic() < wait:
            time.sleep(0.1)
        assert complete(fleet.url, nxt + [1] * 16)[0] != w
    finally:
        httpx.post(f"{sysurl}/engine/set_admission", json={"open": True}, timeout=10)
        wait_for_workers(fleet.url, MODEL, 3)


def test_a_flushed_cache_is_forgotten(fleet):
    event_workers = [iid for iid, h in health(fleet.url).items() if h["kv"]["source"] == "events"]
    for i in range(30, 40):  # until an event worker holds one
        w, nxt, procs = _holder(fleet, _system(i))
        if w in event_workers:
            break
    assert health(fleet.url)[w]["kv"]["cached_blocks"] > 0
    httpx.post(f"{procs[w].ready['system_url']}/engine/flush_cache", json={},
               timeout=10).raise_for_status()
    wait = time.monotonic() + 10
    while health(fleet.url)[w]["kv"]["cached_blocks"] and time.monotonic() < wait:
        time.sleep(0.1)
    kv = health(fleet.url)[w]["kv"]
    assert kv["cached_blocks"] == 0 and kv["recorded_blocks"] == 0


def test_a_holder_that_leaves_is_forgotten(fleet):
    w, nxt, procs = _holder(fleet, _system(50))
    procs[w].stop()
    fleet.workers.remove(procs[w])
    wait_for_workers(fleet.url, MODEL, 2, timeout=10)
    assert complete(fleet.url, nxt)[0] != w
    assert w not in health(fleet.url)


def test_the_view_reads_vllm_event_batches():
    """Events made with vLLM's own classes and encoder, as its ZMQ publisher sends them."""
    ve = pytest.importorskip("vllm.distributed.kv_events")
    toks = list(range(100, 132))
    stored = ve.BlockStored(block_hashes=[b"h1", b"h2"], parent_block_hash=None,
                            token_ids=toks, block_size=16, lora_id=None, medium="GPU",
                            lora_name=None, extra_keys=[["salt"], None])
    r = KvRouter()
    r.sync({1: {}})

    def send(seq: int, *events) -> None:
        batch = ve.KVEventBatch(ts=float(seq), events=list(events), data_parallel_rank=0)
        r.on_message(1, seq.to_bytes(8, "big"), msgspec.msgpack.encode(batch))

    send(0, stored)
    assert r.views[1].overlap(Prefix(toks + [5], "salt").keys(16)) == 2
    assert r.views[1].overlap(Prefix(toks).keys(16)) == 0  # no salt: other keys
    more = list(range(500, 516))
    send(1, ve.BlockStored(block_hashes=[b"h3"], parent_block_hash=b"h2", token_ids=more,
                           block_size=16, lora_id=None, medium="GPU", lora_name=None))
    assert r.views[1].overlap(Prefix(toks + more, "salt").keys(16)) == 3
    send(2, ve.BlockRemoved(block_hashes=[b"h2"], medium="GPU"))
    assert r.views[1].overlap(Prefix(toks + more, "salt").keys(16)) == 1
    send(4)  # batch 3 was lost: the view is forgotten rather than trusted
    assert not r.views[1].cached
    send(5, stored, ve.AllBlocksCleared())
    assert not r.views[1].cached
