"""Several frontends on one fleet, on the mocker (the declared simulator): a frontend of two
processes on one port (`--processes 2`, SO_REUSEPORT) and a second, independent frontend
on the same discovery store. A retry of an X-Request-Id through another process, or the
other frontend, attaches to the first attempt (generations counted at the workers); a
cancel through another process reaches the run and checks its owner; /metrics sums both
processes; the staleness bound (nvext.policy) holds in each process."""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from rlfleet.runtime.launch import spawn
from tests.fleets import pinned_clients, wait_for_workers

MODEL = "mock-procs"
PROCESSES = 2
HOLD = ("--gated-hold", "1")  # a request outside every worker's policy waits this long


@pytest.fixture(scope="module")
def fleet(start_module_fleet):
    f = start_module_fleet([("--served-model-name", MODEL, "--system-port", "0",
                             "--token-delay", "0.02", "--seed", "1")] * 2,
                           model=None, frontend=("--processes", str(PROCESSES), *HOLD))
    f.ids = [int(p.ready["instance_id"]) for p in f.workers]
    # a second frontend (one process) on the same discovery store
    other = spawn("frontend-b", [*f.frontend.popen.args[:3], "--http-port", "0",
                                 *f._common(), *HOLD], f.workdir / "logs")
    f.procs.append(other)
    other.wait_ready(60)
    f.other_url = other.ready["url"]
    f.pinned = pinned_clients(f.url, PROCESSES)
    for c in f.pinned:
        wait_until_routed(c, 2)
    wait_for_workers(f.other_url, MODEL, 2)
    yield f
    for c in f.pinned:
        c.close()


def wait_until_routed(c: httpx.Client, count: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        workers = [w for w in c.get("/health").json()["workers"] if w["model"] == MODEL]
        if len(workers) == count:
            return
        assert time.monotonic() < deadline, f"this process sees {workers}"
        time.sleep(0.1)


def worker_count(f, name: str, labels: str) -> int:
    """A worker series summed over both workers."""
    total = 0.0
    for p in f.workers:
        text = httpx.get(f"{p.ready['url']}/metrics", timeout=10).text
        total += sum(float(v) for v in re.findall(rf'^{name}{{{labels}}} (\S+)$', text, re.M))
    return int(total)


def generations(f) -> int:
    """Generate requests the workers' engines ran (every outcome)."""
    return worker_count(f, "rlfleet_worker_requests_total", f'model="{MODEL}",outcome="[a-z]+"')


def attaches(f) -> int:
    return worker_count(f, "rlfleet_worker_request_id_attaches_total", f'model="{MODEL}"')


BODY = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 60, "ignore_eos": True,
        "temperature": 1.0, "nvext": {"extra_fields": ["completion_token_ids", "worker_id"]}}


def tokens(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return r.json()["nvext"]["completion_token_ids"]


def post(client_or_url, rid: str, body: dict = BODY, **headers) -> httpx.Response:
    h = {"X-Request-Id": rid, **headers}
    if isinstance(client_or_url, httpx.Client):
        return client_or_url.post("/v1/completions", json=body, headers=h)
    return httpx.post(f"{client_or_url}/v1/completions", json=body, headers=h, timeout=30)


def test_a_retry_through_another_process_or_frontend_is_not_generated_again(fleet):
    f = fleet
    a, b = f.pinned
    before, attached = generations(f), attaches(f)
    out: dict = {}
    first = threading.Thread(target=lambda: out.update(r=post(a, "retry-1")))
    first.start()
    time.sleep(0.4)  # the first attempt is generating (60 tokens x 20 ms)
    during_b = post(b, "retry-1")  # the other process: attaches to the run in flight
    during_other = post(f.other_url, "retry-1")  # the other frontend: the same
    first.join()
    want = tokens(out["r"])
    assert len(want) == 60
    assert tokens(during_b) == want and tokens(during_other) == want
    after_b = post(b, "retry-1")  # after the end, through every way in: the kept result
    after_other = post(f.other_url, "retry-1")
    assert tokens(after_b) == want and tokens(after_other) == want
    assert generations(f) - before == 1
    # the two retries during the run joined it at the worker; those after it were answered
    # by the process or frontend that had followed it
    assert attaches(f) - attached == 2
    # the same ID for another body is refused whichever way it comes in
    for via in (a, b, f.other_url):
        r = post(via, "retry-1", {**BODY, "prompt": [9, 9]})
        assert r.status_code == 409, r.text
    assert generations(f) - before == 1
    # ... by the worker too, when the process it comes through has not seen the ID
    assert len(tokens(post(a, "retry-2", {**BODY, "max_tokens": 2}))) == 2
    r = post(b, "retry-2", {**BODY, "max_tokens": 3})
    assert r.status_code == 409 and "different request" in r.text, r.text
    assert generations(f) - before == 2


def test_requests_with_an_id_spread_over_the_workers(fleet):
    f = fleet
    a, b = f.pinned
    seen = {tokens_worker(post(a if i % 2 else b, f"spread-{i}", {**BODY, "max_tokens": 2}))
            for i in range(16)}
    assert seen == set(f.ids)


def tokens_worker(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return r.json()["nvext"]["worker_id"]["decode_worker_id"]


def test_a_cancel_through_another_process_reaches_the_run_and_checks_its_owner(fleet):
    f = fleet
    a, b = f.pinned
    body = {**BODY, "max_tokens": 400}
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=post(a, "cancel-1", body,
                                                          **{"X-Cancel-Token": "mine"})))
    t.start()
    time.sleep(0.5)
    # not the owner: refused, through the other process and the other frontend
    r = b.post("/v1/requests/cancel-1/cancel", headers={"X-Cancel-Token": "not-mine"})
    assert r.status_code == 403, r.text
    r = httpx.post(f"{f.other_url}/v1/requests/cancel-1/cancel", timeout=10)
    assert r.status_code == 403, r.text
    r = b.post("/v1/requests/cancel-1/cancel", headers={"X-Cancel-Token": "mine"})
    assert r.status_code == 200 and r.json()["cancelled"] is True, r.text
    t.join(30)
    res = out["r"]
    assert res.status_code == 200, res.text
    choice = res.json()["choices"][0]
    assert choice["finish_reason"] == "abort" and len(tokens(res)) < 400
    # unknown everywhere: nothing cancelled
    r = b.post("/v1/requests/no-such-run/cancel")
    assert r.status_code == 200 and r.json()["cancelled"] is False, r.text


def metric(text: str, name: str, labels: str = "") -> float:
    pat = rf"^{re.escape(name)}{re.escape(labels)} (\S+)$" if labels else \
        rf"^{re.escape(name)} (\S+)$"
    return sum(float(v) for v in re.findall(pat, text, re.M))


def test_metrics_sum_every_process(fleet):
    f = fleet
    a, b = f.pinned
    name = "rlfleet_frontend_requests_total"
    labels = f'{{model="{MODEL}",route="/v1/completions",status="200"}}'
    start = [metric(c.get("/metrics").text, name, labels) for c in (a, b)]
    assert start[0] == start[1]  # either process answers for both
    body = {**BODY, "max_tokens": 3}
    for _ in range(3):
        assert a.post("/v1/completions", json=body).status_code == 200
    for _ in range(2):
        assert b.post("/v1/completions", json=body).status_code == 200
    for c in (a, b):
        text = c.get("/metrics").text
        assert metric(text, name, labels) - start[0] == 5
        assert metric(text, "rlfleet_frontend_workers", f'{{model="{MODEL}"}}') == 2
        assert metric(text, "rlfleet_frontend_inflight_requests",
                      '{route="/metrics"}') == 1  # this scrape, not one per process
        assert "rlfleet_frontend_generated_tokens_total" in text


def set_step(f, i: int, step: int) -> None:
    r = httpx.post(f"{f.workers[i].ready['system_url']}/engine/set_weight_version",
                   json={"weight_version": f"s{step}", "step": step}, timeout=5)
    assert r.status_code == 200, r.text


def test_the_staleness_bound_holds_in_every_process(fleet):
    f = fleet
    set_step(f, 0, 3)
    set_step(f, 1, 4)
    for c in f.pinned:  # each process follows discovery on its own
        deadline = time.monotonic() + 10
        while {w["instance_id"]: w["step"] for w in c.get("/health").json()["workers"]} \
                != {f.ids[0]: 3, f.ids[1]: 4}:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    bounded = {**BODY, "max_tokens": 2, "nvext": {**BODY["nvext"], "policy": {"min_step": 4}}}
    for c in f.pinned:
        for i in range(4):
            r = c.post("/v1/completions", json=bounded)
            assert tokens_worker(r) == f.ids[1]
            # with an X-Request-Id too (routed by the ID, within the bound)
            r = c.post("/v1/completions", json=bounded, headers={"X-Request-Id": f"b-{c}-{i}"})
            assert tokens_worker(r) == f.ids[1]
        r = c.post("/v1/completions", json={**bounded, "nvext": {
            "policy": {"min_step": 9}}}, headers={"X-Request-Id": "never"})
        assert r.status_code == 409 and "steps served: 3, 4" in r.json()["error"]["message"], \
            r.text


def test_a_worker_keeps_a_run_for_direct_callers_over_http_too(fleet):
    f = fleet
    url = f"{f.workers[0].ready['url']}/generate"
    body = {"request_id": "http-1", "prompt_token_ids": [1, 2, 3], "retain": "body-1",
            "sampling": {"max_tokens": 5, "ignore_eos": True}}
    before = generations(f)
    first = httpx.post(url, json=body, timeout=30)
    again = httpx.post(url, json=body, timeout=30)
    assert first.status_code == 200 and again.status_code == 200, (first.text, again.text)
    lines = first.text.splitlines()
    assert len(lines) >= 3 and lines == again.text.splitlines()  # Head, steps, done
    assert generations(f) - before == 1
    r = httpx.post(url, json={**body, "retain": "body-2"}, timeout=30)
    assert r.status_code == 409, r.text
    r = httpx.post(url, json={**body, "request_id": "http-2", "prompt_token_ids": [10 ** 9]},
                   timeout=30)
    assert r.status_code == 400, r.text  # refused as given: a status, and nothing kept
