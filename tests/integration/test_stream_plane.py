"""The frontend over the stream plane, with a mocker fleet (the declared simulator: load
and fault behaviour, not real-engine claims): callers that leave mid-stream abort their
requests in the engines, every one; a slow reader gets every token while other requests
run; errors keep the OpenAI shape."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

MODEL = "mock-s"


@pytest.fixture(scope="module")
def fleet(start_module_fleet):
    return start_module_fleet([("--served-model-name", MODEL, "--token-delay", "0.01",
                                "--max-model-len", "8192")] * 2, model=MODEL, lease_ttl=5)


def worker_metric(fleet, name: str, **labels: str) -> float:
    total = 0.0
    want = "".join(f'{k}="{v}"' for k, v in labels.items())
    for p in fleet.workers:
        text = httpx.get(f"{p.ready['url']}/metrics", timeout=10).text
        for m in re.finditer(rf"^{name}(?:{{([^}}]*)}})? ([0-9.e+-]+)$", text, re.M):
            if want in (m.group(1) or ""):
                total += float(m.group(2))
    return total


def body(**kw) -> dict:
    return {"model": MODEL, "prompt": [1101, 1102, 1103], "ignore_eos": True,
            "nvext": {"extra_fields": ["completion_token_ids"]}, **kw}


async def test_half_the_callers_leave_mid_stream_and_the_engines_see_every_abort(fleet):
    leaving, staying = 40, 40
    abandoned0 = worker_metric(fleet, "rlfleet_worker_requests_total", outcome="abandoned")
    ok0 = worker_metric(fleet, "rlfleet_worker_requests_total", outcome="ok")

    async def one(http: httpx.AsyncClient, i: int, leave: bool) -> int:
        tokens = 0
        async with http.stream("POST", f"{fleet.url}/v1/completions",
                               json=body(max_tokens=3000 if leave else 40, stream=True,
                                         seed=i)) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                tokens += len(json.loads(line[6:]).get("nvext", {})
                              .get("completion_token_ids", []))
                if leave and tokens >= 20:
                    return tokens  # closes the connection mid-stream
        return tokens

    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=200)) as http:
        got = await asyncio.gather(*(one(http, i, i % 2 == 0)
                                     for i in range(leaving + staying)))
    assert all(t >= 20 for t in got[0::2]) and got[1::2] == [40] * staying
    deadline = time.monotonic() + 15
    while worker_metric(fleet, "rlfleet_worker_running_requests") > 0:
        assert time.monotonic() < deadline, "an engine kept generating for a caller that left"
        await asyncio.sleep(0.1)
    assert worker_metric(fleet, "rlfleet_worker_requests_total",
                         outcome="abandoned") - abandoned0 == leaving
    assert worker_metric(fleet, "rlfleet_worker_requests_total", outcome="ok") - ok0 == staying


async def test_a_slow_reader_gets_every_token_while_others_run(fleet):
    req = body(max_tokens=200, seed=9)
    async with httpx.AsyncClient(timeout=60) as http:
        unary = (await http.post(f"{fleet.url}/v1/completions", json=req)).json()
        ids: list[int] = []
        async with http.stream("POST", f"{fleet.url}/v1/completions",
                               json={**req, "stream": True}) as r:
            lines = r.aiter_lines()
            async for line in lines:
                if line.startswith("data: {"):
                    break
            # while this caller does not read, other requests are served as usual
            others = await asyncio.gather(*(http.post(f"{fleet.url}/v1/completions",
                                                      json=body(max_tokens=5, seed=s))
                                            for s in range(10)))
            assert all(o.status_code == 200 for o in others)
            await asyncio.sleep(2.5)  # the engine has finished meanwhile
            events = [json.loads(line[6:])] + [json.loads(x[6:]) async for x in lines
                                              if x.startswith("data: {")]
        for ev in events:
            ids += ev.get("nvext", {}).get("completion_token_ids", [])
    assert ids == unary["nvext"]["completion_token_ids"] and len(ids) == 200


def test_errors_keep_the_openai_shape(fleet):
    for method, path, status in (("GET", "/v1/nowhere", 404), ("GET", "/v1/completions", 405)):
        r = httpx.request(method, f"{fleet.url}{path}", timeout=10)
        assert r.status_code == status
        err = r.json()["error"]
        assert err["code"] == status and path in err["message"] and err["type"]
    r = httpx.post(f"{fleet.url}/v1/completions", timeout=10,
                   json=body(max_tokens=4, min_tokens=9))
    assert r.status_code == 400 and "min_tokens" in r.json()["error"]["message"]
