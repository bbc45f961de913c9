"""A retry of an X-Request-Id through another frontend that is placed on another worker than
the first attempt (the ID's top-ranked worker gated meanwhile; in --router-mode kv, the
worker holding the prompt gated) asks the workers that may own the run and attaches to it
there: one generation (counted at the workers), the same tokens. On the mocker (the
declared simulator: what is tested is the frontends' placement and the workers' kept
runs); four frontends on one discovery store, two of them in mode kv."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from rlfleet.frontend.router import Worker, rank
from rlfleet.frontend.runs import fingerprint
from rlfleet.runtime.launch import spawn
from tests.fleets import wait_for_workers

MODEL = "mock-owner"
EVENTS = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                     "endpoint": "tcp://127.0.0.1:0"})
WORKER = ("--served-model-name", MODEL, "--system-port", "0", "--token-delay", "0.02",
          "--seed", "1", "--block-size", "16", "--kv-events-config", EVENTS)


@pytest.fixture(scope="module")
def fleet(start_module_fleet):
    f = start_module_fleet([WORKER] * 3, model=MODEL, frontend=())
    f.by_id = {int(p.ready["instance_id"]): p for p in f.workers}
    f.urls = {"a": f.url}
    for name, extra in (("b", ()), ("kv-a", ("--router-mode", "kv")),
                        ("kv-b", ("--router-mode", "kv"))):
        p = spawn(f"frontend-{name}", [*f.frontend.popen.args[:3], "--http-port", "0",
                                       *f._common(), *extra], f.workdir / "logs")
        f.procs.append(p)
        p.wait_ready(60)
        f.urls[name] = p.ready["url"]
    for url in f.urls.values():
        wait_for_workers(url, MODEL, 3)
    return f


def ranked(f, rid: str) -> list[int]:
    """The workers' instance IDs in the order every frontend ranks them for `rid`."""
    return [w.instance_id for w in rank(rid, [Worker(i, MODEL, "", "", {}) for i in f.by_id])]


def worker_count(f, name: str) -> int:
    total = 0.0
    for p in f.workers:
        text = httpx.get(f"{p.ready['url']}/metrics", timeout=10).text
        total += sum(float(v) for v in re.findall(
            rf'^{name}{{model="{MODEL}"[^}}]*}} (\S+)$', text, re.M))
    return int(total)


def counts(f) -> tuple[int, int]:
    """(generations the workers' engines ran, requests that attached to a kept run)."""
    return (worker_count(f, "rlfleet_worker_requests_total"),
            worker_count(f, "rlfleet_worker_request_id_attaches_total"))


def generated_once(f, gens: int, attached: int) -> bool:
    """Since (gens, attached) were counted: one generation, and at least one attach (a
    retry may have reached the run at its worker directly and through another worker that
    relays it)."""
    now = counts(f)
    return now[0] == gens + 1 and now[1] > attached


def asks(url: str, outcome: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return int(sum(float(v) for v in re.findall(
        rf'^rlfleet_frontend_request_id_owner_asks_total{{outcome="{outcome}"}} (\S+)$',
        text, re.M)))


def body(prompt: list[int], max_tokens: int = 60) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 1.0, "nvext": {"extra_fields": ["completion_token_ids", "worker_id"]}}


def post(url: str, rid: str | None, prompt: list[int], max_tokens: int = 60) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body(prompt, max_tokens), timeout=60,
                      headers={"X-Request-Id": rid} if rid else {})


def served(r: httpx.Response) -> tuple[int, list[int]]:
    """(the worker that served it, its tokens)."""
    assert r.status_code == 200, r.text
    nv = r.json()["nvext"]
    return nv["worker_id"]["decode_worker_id"], nv["completion_token_ids"]


def usable(url: str) -> set[int]:
    return {w["instance_id"] for w in httpx.get(f"{url}/health", timeout=5).json()["workers"]
            if w["usable"]}


@contextlib.contextmanager
def gated(f, *iids: int) -> Iterator[None]:
    """These workers closed by their admission (as a refresh closes them) while inside,
    every frontend having seen it; reopened after."""
    try:
        for i in iids:
            r = httpx.post(f"{f.by_id[i].ready['system_url']}/engine/set_admission",
                           json={"open": False, "reason": "test"}, timeout=5)
            assert r.status_code == 200, r.text
        for url in f.urls.values():
            deadline = time.monotonic() + 15
            while usable(url) & set(iids):
                assert time.monotonic() < deadline, f"{url} still routes to {iids}"
                time.sleep(0.05)
        yield
    finally:
        for i in iids:
            httpx.post(f"{f.by_id[i].ready['system_url']}/engine/set_admission",
                       json={"open": True}, timeout=5)
        for url in f.urls.values():
            deadline = time.monotonic() + 15
            while set(iids) - usable(url) and time.monotonic() < deadline:
                time.sleep(0.05)


def cached_blocks(url: str, iid: int) -> int:
    """How many blocks the frontend at `url` knows worker `iid` holds (from its events)."""
    workers = httpx.get(f"{url}/health", timeout=5).json()["workers"]
    return next(w["kv"]["cached_blocks"] for w in workers if w["instance_id"] == iid)


def in_background(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=fn()))
    t.start()
    return t, out


PROMPT = [5, 6, 7]


def test_a_retry_placed_elsewhere_because_the_top_worker_is_gated_attaches(fleet):
    f = fleet
    rid = "owner-1"
    top = ranked(f, rid)[0]
    gens, attached = counts(f)
    found = asks(f.urls["b"], "found")
    t, out = in_background(lambda: post(f.urls["a"], rid, PROMPT))
    time.sleep(0.3)  # the first attempt is generating on the ID's top-ranked worker
    with gated(f, top):
        retry = post(f.urls["b"], rid, PROMPT)  # frontend b places it on another worker
    t.join()
    first = served(out["r"])
    assert first[0] == top and len(first[1]) == 60
    assert served(retry) == first  # followed the first attempt where it runs
    assert counts(f) == (gens + 1, attached + 1)
    assert asks(f.urls["b"], "found") == found + 1


def test_a_first_attempt_placed_below_the_top_is_found_by_a_retry_placed_lower_still(fleet):
    f = fleet
    rid = "owner-2"
    o = ranked(f, rid)
    gens, attached = counts(f)
    missed = asks(f.urls["a"], "not_found")
    with gated(f, o[0]):
        # the top-ranked worker owns no run of it (asked: not found): the second generates
        t, out = in_background(lambda: post(f.urls["a"], rid, PROMPT))
        time.sleep(0.3)
        with gated(f, o[1]):
            retry = post(f.urls["b"], rid, PROMPT)  # placed on the third: asks both above
        t.join()
    first = served(out["r"])
    assert first[0] == o[1] and asks(f.urls["a"], "not_found") == missed + 1
    # followed there: straight from the second, or relayed by the top one (it was told
    # where the first attempt went), whichever answered first
    assert served(retry)[1] == first[1] and served(retry)[0] in o[:2]
    assert generated_once(f, gens, attached)
    # after the end, through the other frontend, the top one open again: the kept result
    # (b's own registry answers; a's has it too)
    assert served(post(f.urls["b"], rid, PROMPT))[1] == first[1]
    assert counts(f)[0] == gens + 1
    # the top worker was told where the run is (not where b would have put the retry): a
    # request for the ID sent straight to it follows the run there
    retain = fingerprint("/v1/completions", json.dumps(body(PROMPT)).encode())
    r = httpx.post(f"{f.by_id[o[0]].ready['url']}/generate", timeout=30, json={
        "request_id": rid, "prompt_token_ids": PROMPT, "retain": retain,
        "sampling": {"max_tokens": 60, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    events = [json.loads(line) for line in r.text.splitlines()]
    assert [t for ev in events for c in ev.get("choices", ()) for t in c["token_ids"]] == \
        first[1]
    assert generated_once(f, gens, attached)


def test_requests_without_an_id_or_on_their_top_worker_ask_nobody(fleet):
    f = fleet
    before = [asks(u, o) for u in f.urls.values() for o in ("found", "not_found")]
    for i in range(4):
        served(post(f.urls["b"], None, PROMPT, 2))
        served(post(f.urls["a"], f"top-{i}", PROMPT, 2))  # every worker open: the top one
    assert [asks(u, o) for u in f.urls.values() for o in ("found", "not_found")] == before


def test_in_kv_mode_a_retry_placed_away_from_the_prompt_attaches_where_it_runs(fleet):
    f = fleet
    prompt = [1000 + k for k in range(48)]  # three full blocks
    x, _ = served(post(f.urls["kv-a"], None, prompt, 2))  # now cached on worker x
    deadline = time.monotonic() + 15  # ... as kv-b learns from x's KV events
    while cached_blocks(f.urls["kv-b"], x) < 3:
        assert time.monotonic() < deadline, "kv-b never heard of the cached prompt"
        time.sleep(0.05)
    rid = next(r for r in (f"kv-owner-{i}" for i in range(100)) if ranked(f, r)[0] != x)
    gens, attached = counts(f)
    t, out = in_background(lambda: post(f.urls["kv-a"], rid, prompt))
    time.sleep(0.3)  # placed by its prefix on x, not on its ID's top-ranked worker
    with gated(f, x):
        retry = post(f.urls["kv-b"], rid, prompt)  # kv-b places it elsewhere: asks x
    t.join()
    first = served(out["r"])
    assert first[0] == x and served(retry)[1] == first[1]
    assert generated_once(f, gens, attached)


def test_a_retry_sent_to_the_top_worker_once_it_reopens_follows_the_run_placed_below(fleet):
    f = fleet
    rid = "owner-3"
    o = ranked(f, rid)
    gens, attached = counts(f)
    with gated(f, o[0]):
        # placed on the second worker; the top one, asked first, is told where it went
        t, out = in_background(lambda: post(f.urls["a"], rid, PROMPT))
        time.sleep(0.3)
    retry = post(f.urls["b"], rid, PROMPT)  # the top one is open again: b sends it there
    t.join()
    first = served(out["r"])
    assert first[0] == o[1]
    assert served(retry)[1] == first[1]  # the top worker followed the run where it runs
    assert counts(f) == (gens + 1, attached + 1)
