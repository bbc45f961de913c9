"""RL-aware routing (--router-mode kv) end to end with mocker workers (the declared
simulator: what is tested is the frontend's placement): a replayable RL trace routes the
same way every time it is replayed, an episode's requests stay on one worker (X-Session-ID)
until `POST /finish_session` releases it, an overloaded worker sheds a session, and a flush
forgets the sessions with the prefix views."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import pytest

from rlfleet.testing import traces
from tests.fleets import wait_for_workers

MODEL = "mock-rl-routing"
WORKER = ("--served-model-name", MODEL, "--token-delay", "0.002", "--block-size", "16",
          "--system-port", "0", "--kv-events-config",
          '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:0"}')


@pytest.fixture(scope="module")
def fleet(start_module_fleet):
    return start_module_fleet([WORKER] * 2, model=MODEL, frontend=("--router-mode", "kv"))


def health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=10).json()


def sessions_of(url: str) -> dict[int, int]:
    return {w["instance_id"]: w["kv"]["sessions"] for w in health(url)["workers"]}


def flush(fleet) -> None:
    for p in fleet.workers:
        httpx.post(f"{p.ready['system_url']}/engine/flush_cache", json={},
                   timeout=60).raise_for_status()


def _trace() -> traces.Trace:
    """Two episodes, turn by turn, and two GRPO groups between their turns."""
    ag = traces.agent(7, episodes=2, turns=3, system=64, task=48, tool=32, max_tokens=8)
    gr = traces.grpo(8, prompts=2, n=3, families=1, preamble=64, question=40, max_tokens=8)
    turns = sorted(ag.requests, key=lambda r: r.id.split("-")[1])  # t0 of both, then t1, ...
    return traces.Trace("mix", 0, {}, [*turns[:2], *gr.requests[:3], *turns[2:4],
                                       *gr.requests[3:], *turns[4:]])


def test_a_trace_replayed_twice_routes_identically(fleet, tmp_path) -> None:
    trace = _trace()
    trace.check()
    saved = traces.Trace.load(trace.dump(tmp_path / "trace.jsonl"))
    assert saved == trace
    routes = []
    main = fleet.frontend
    # each replay starts cold: the module's frontend (this test runs first), then a new one
    for fe in (main, None):
        flush(fleet)
        if fe is None:
            fe = fleet.start_frontend("--router-mode", "kv")
            fleet.frontend = main
        try:
            wait_for_workers(fe.ready["url"], MODEL, 2)
            client = traces.OpenAIClient(fe.ready["url"], MODEL, "X-Session-ID",
                                         finish_sessions=True)
            outs = asyncio.run(traces.replay(saved, client, sequential=True))
            assert not any(sessions_of(fe.ready["url"]).values())  # every episode finished
        finally:
            if fe is not main:
                fe.stop()
                fleet.procs.remove(fe)
        routes.append([o.worker for o in outs])
    assert routes[0] == routes[1]
    by = dict(zip([r.id for r in saved.requests], routes[0], strict=True))
    for key in ("e0", "e1", "g0", "g1"):  # an episode, a group: each on one worker
        assert len({w for rid, w in by.items() if rid.startswith(key + "-")}) == 1, by
    assert len(set(by.values())) == 2  # and the work spread over both


def chat(url: str, session: str | None, text: str = "hello", max_tokens: int = 4,
         stream: bool = False) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": stream,
            "nvext": {"extra_fields": ["worker_id"]}}
    headers = {"X-Session-ID": session} if session else {}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    if stream:
        return -1
    return r.json()["nvext"]["worker_id"]["decode_worker_id"]


def test_session_affinity_holds_and_is_released_by_finish_session(fleet) -> None:
    url = fleet.url
    placed = {s: chat(url, s) for s in ("s0", "s1", "s2", "s3")}
    assert len(set(placed.values())) == 2  # new sessions spread over the workers
    for _ in range(3):  # chat prompts (no token IDs to match): the session alone places them
        for s, w in placed.items():
            assert chat(url, s, text=f"turn of {s}") == w
    assert sum(sessions_of(url).values()) == 4
    r = httpx.post(f"{url}/finish_session", params={"session_id": "s0"}, timeout=10)
    assert r.status_code == 200 and r.json() == {"session_id": "s0", "released": True}
    assert sum(sessions_of(url).values()) == 3
    again = httpx.post(f"{url}/finish_session", params={"session_id": "s0"}, timeout=10)
    assert again.json()["released"] is False  # unknown: nothing to release, no error
    bad = httpx.post(f"{url}/finish_session", timeout=10)
    assert bad.status_code == 400 and "session_id" in bad.json()["error"]["message"]
    flush(fleet)  # a reset (every refresh) clears the views and their sessions
    deadline = time.monotonic() + 10
    while sum(sessions_of(url).values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sum(sessions_of(url).values()) == 0


def test_an_overloaded_worker_sheds_a_session(fleet) -> None:
    url = fleet.url
    home = chat(url, "busy-ep")
    shed0 = health(url)["kv_router"]["sessions_shed"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "long"}],
            "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, contextlib.ExitStack() as held:
        # the session's own long requests pile up on its worker (held open here, closed at
        # the end: the frontend aborts them): the 4th finds it overloaded
        # ((3 + 1) > 1.5 x (1.5 + 1)) and moves the session to the other one
        for n in range(1, 4):
            r = held.enter_context(http.stream("POST", f"{url}/v1/chat/completions", json=body,
                                               headers={"X-Session-ID": "busy-ep"}))
            assert r.status_code == 200
            deadline = time.monotonic() + 10
            while {w["instance_id"]: w["inflight"] for w in health(url)["workers"]}[home] < n:
                assert time.monotonic() < deadline, "the long requests did not start"
                time.sleep(0.05)
        moved = chat(url, "busy-ep")
        assert moved != home
        assert health(url)["kv_router"]["sessions_shed"] == shed0 + 1
        assert chat(url, "busy-ep") == moved  # the session stays where it went
