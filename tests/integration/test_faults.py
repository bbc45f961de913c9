"""The fault suite (issue 10): a hostile client and stopped or killed workers against one
mocker fleet (the declared simulator: what is under test is the frontend and the planes,
not the engine), every server under an admin token and small limits. Every request ends
with a clear error or a correct answer, nothing is admitted twice, no worker that stopped
answering keeps its requests, and no server grows past its bound.

Real-engine faults (corrupt, NaN and vanishing checkpoints, a half-done load, SIGKILL of a
vLLM worker and its engine core) are in test_weight_safety.py, test_worker_lifetime.py and
test_fleet_faults.py; discovery garbage (non-UTF-8, FIFO, schema-breaking entries, the
directory vanishing) in test_discovery.py. Tests run in order: the worker faults come last.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from rlfleet.frontend.router import rank
from rlfleet.mocker.engine import write_mock_checkpoint
from rlfleet.refresh.coordinator import PolicyRefresh
from tests.fleets import RL_PROBE_ENV, exec_started

MODEL = "mock"
TOKEN = "fault-suite-admin-token"
MAX_BODY = 1 << 20
READ_TIMEOUT = 2.0
STALL = 2.0
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# the same simulated weights everywhere: an answer is the same whichever worker gives it
WORKER = ("--served-model-name", MODEL, "--seed", "7", "--token-delay", "0.005",
          "--max-model-len", "4096")


def worker_args(ckpts: Path) -> tuple[str, ...]:
    return (*WORKER, "--enable-rl", "--system-port", "0", "--enable-fault-injection",
            "--allowed-weights-root", str(ckpts))


@pytest.fixture(scope="module", autouse=True)
def exec_only() -> Iterator[None]:
    """The last test bounds the servers' memory: their processes exec'd, not forked."""
    with exec_started():
        yield


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, start_module_fleet):
    env = {"RLFLEET_ADMIN_TOKEN": TOKEN, **RL_PROBE_ENV}
    base = tmp_path_factory.mktemp("faults")
    ckpts = base / "weights"
    write_mock_checkpoint(ckpts / "B", 8)
    f = start_module_fleet(
        [worker_args(ckpts)] * 2, model=MODEL, lease_ttl=3, enable_rl=True,
        frontend=("--max-body-bytes", str(MAX_BODY), "--read-timeout", str(READ_TIMEOUT),
                  "--idle-timeout", "2", "--max-connections", "400",
                  "--stall-timeout", str(STALL), "--max-response-entries", "200000"),
        frontend_env=env, worker_env=env)
    f.ckpts = ckpts
    return f


def post(fleet, body: dict, path: str = "/v1/completions", headers: dict | None = None,
         timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{fleet.url}{path}", json=body, headers=headers, timeout=timeout)


def error_of(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and body["error"]["code"] == r.status_code, body
    return body["error"]


def peak_rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


# ---------------------------------------------------------------- a hostile client


def test_a_huge_body_is_refused_before_it_is_kept(fleet):
    huge = {"model": MODEL, "prompt": "x" * (4 * MAX_BODY), "max_tokens": 1}
    r = post(fleet, huge)
    assert r.status_code == 413 and "--max-body-bytes" in error_of(r)["message"]

    def chunks():  # no Content-Length: refused once the bytes pass the limit
        data = json.dumps(huge).encode()
        for i in range(0, len(data), 1 << 16):
            yield data[i:i + (1 << 16)]
    try:
        r = httpx.post(f"{fleet.url}/v1/completions", content=chunks(), timeout=30)
        assert r.status_code == 413
    except httpx.WriteError:
        pass  # the server answered and closed while the client still wrote: also refused
    ok = post(fleet, {"model": MODEL, "prompt": "x" * 1000, "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_a_huge_fan_out_is_refused_with_what_to_lower(fleet):
    r = post(fleet, {"model": MODEL, "prompt": [1, 2, 3], "n": 64, "max_tokens": 4000,
                     "logprobs": 20})
    assert r.status_code == 400
    msg = error_of(r)["message"]
    assert "n=64" in msg and "lower n, max_tokens or logprobs" in msg
    r = post(fleet, {"model": MODEL, "prompt": [1, 2, 3], "n": 4, "max_tokens": 8, "logprobs": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4


def test_slow_and_idle_sockets_are_closed_while_requests_are_served(fleet):
    host, port = fleet.url.removeprefix("http://").rsplit(":", 1)
    socks = []
    for i in range(100):
        s = socket.create_connection((host, int(port)), timeout=10)
        if i % 2:  # slowloris: a head that never ends
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        socks.append(s)
    try:
        ok = post(fleet, {"model": MODEL, "prompt": [1, 2], "max_tokens": 2})
        assert ok.status_code == 200
        deadline = time.monotonic() + READ_TIMEOUT + 10
        for s in socks:  # every one of them is closed by the server
            s.settimeout(max(0.1, deadline - time.monotonic()))
            assert s.recv(1) == b""
    finally:
        for s in socks:
            s.close()
    # beyond --max-connections, a new connection is closed at once; the rest still serve
    flood = [socket.create_connection((host, int(port)), timeout=10) for _ in range(420)]
    try:
        time.sleep(0.3)
        closed = 0
        for s in flood[-20:]:
            s.settimeout(5)
            try:
                closed += s.recv(1) == b""
            except (ConnectionResetError, TimeoutError):
                closed += 1
        assert closed == 20
    finally:
        for s in flood:
            s.close()
    assert post(fleet, {"model": MODEL, "prompt": [1, 2], "max_tokens": 2}).status_code == 200


def test_a_client_template_is_refused(fleet):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "chat_template_kwargs": {"chat_template": "{% for i in range(10**9) %}{% endfor %}"}}
    r = post(fleet, body, "/v1/chat/completions")
    assert r.status_code == 400
    assert "--trust-request-chat-template" in error_of(r)["message"]
    del body["chat_template_kwargs"]
    assert post(fleet, body, "/v1/chat/completions").status_code == 200


def test_a_request_id_names_the_route_and_the_body_as_data(fleet):
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 6, "seed": 1,
            "nvext": {"extra_fields": ["completion_token_ids"]}}
    h = {"X-Request-Id": "fp-1", "content-type": "application/json"}
    first = httpx.post(f"{fleet.url}/v1/completions", content=json.dumps(body), headers=h,
                       timeout=30)
    assert first.status_code == 200
    respaced = json.dumps(dict(reversed(list(body.items()))), indent=3).encode()
    again = httpx.post(f"{fleet.url}/v1/completions", content=respaced, headers=h, timeout=30)
    assert again.status_code == 200, again.text  # the same request: replayed
    assert again.json()["nvext"]["completion_token_ids"] == \
        first.json()["nvext"]["completion_token_ids"]
    other_route = httpx.post(f"{fleet.url}/generate", content=json.dumps(body), headers=h,
                             timeout=30)
    assert other_route.status_code in (400, 409), other_route.text
    if other_route.status_code == 409:
        assert "different request" in error_of(other_route)["message"]


def test_cancel_only_by_its_owner(fleet):
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 3000, "ignore_eos": True}
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(post(
        fleet, body, headers={"X-Request-Id": "own-1", "X-Cancel-Token": "mine"}).json()))
    t.start()
    try:
        time.sleep(0.5)
        cancel = f"{fleet.url}/v1/requests/own-1/cancel"
        assert httpx.post(cancel, timeout=10).status_code == 403
        assert httpx.post(cancel, headers={"X-Cancel-Token": "yours"}, timeout=10).status_code == 403
        r = httpx.post(cancel, headers=AUTH, timeout=10)  # the operator's admin token may
        assert r.status_code == 200 and r.json()["cancelled"] is True
    finally:
        t.join(60)
    assert out["choices"][0]["finish_reason"] == "abort"


def test_the_worker_request_plane_requires_the_admin_token(fleet):
    w = fleet.workers[0].ready["url"]
    req = {"request_id": "direct-1", "prompt_token_ids": [1, 2], "stream": False,
           "sampling": {"max_tokens": 2}}
    for path, body in (("/generate", req), ("/abort", {"request_id": "x"}),
                       ("/tokenize", {"prompt": "hi"})):
        r = httpx.post(f"{w}{path}", json=body, timeout=10)
        assert r.status_code == 401 and "admin token" in error_of(r)["message"], (path, r.text)
    r = httpx.post(f"{w}/generate", json=req, headers=AUTH, timeout=10)
    assert r.status_code == 200 and json.loads(r.text.splitlines()[-1])["done"]
    # the stream plane: a connection without the token is refused and closed
    host, port = fleet.workers[0].ready["stream"].rsplit(":", 1)
    from rlfleet.protocol.engine import GenerateRequest
    from rlfleet.runtime.request_plane import StreamClient, WorkerError

    async def without_token():
        client = StreamClient()
        try:
            with pytest.raises(WorkerError) as e:
                stream = await client.generate(f"{host}:{port}", GenerateRequest(
                    request_id="nt", prompt_token_ids=[1, 2]))
                async for _ in stream:
                    pass
            return e.value
        finally:
            await client.close()
    err = asyncio.run(without_token())
    assert "admin token" in err.message, err.message


# ---------------------------------------------------------------- workers that stop


def completion(fleet, rid: str, max_tokens: int = 400) -> httpx.Response:
    return post(fleet, {"model": MODEL, "prompt": [9, 8, 7], "max_tokens": max_tokens,
                        "ignore_eos": True, "seed": 5}, headers={"X-Request-Id": rid},
                timeout=120)


def streamed(fleet, rid: str, max_tokens: int = 400,
             begun: threading.Semaphore | None = None) -> tuple[str, str]:
    """("ok", the text) or ("error", the message of the stream's error event); `begun` is
    released once its first text has arrived."""
    text: list[str] = []
    with httpx.stream("POST", f"{fleet.url}/v1/completions", timeout=120,
                      headers={"X-Request-Id": rid},
                      json={"model": MODEL, "prompt": [9, 8, 7], "max_tokens": max_tokens,
                            "ignore_eos": True, "seed": 5, "stream": True}) as r:
        if r.status_code != 200:
            r.read()
            return "error", error_of(r)["message"]
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                return "error", ev["error"]["message"]
            if begun is not None and not text:
                begun.release()
            text += [c["text"] for c in ev["choices"]]
    return "ok", "".join(text)


def when_all_begun(begun: threading.Semaphore, n: int) -> None:
    for _ in range(n):
        assert begun.acquire(timeout=60), "a stream never began"


def frontend_metric(fleet, name: str) -> float:
    for line in httpx.get(f"{fleet.url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def inflight(fleet, worker) -> int:
    """The requests in flight on `worker`, as the frontend counts them."""
    return sum(w["inflight"] for w in httpx.get(f"{fleet.url}/health", timeout=5).json()["workers"]
               if w["url"] == worker.ready["url"])


def placed_on(fleet, iid: int, prefix: str, n: int, on: bool = True) -> list[str]:
    """`n` request IDs (`prefix` and a number) that rank worker `iid` first among the usable
    workers (`on`), or another worker (not `on`): a request with an X-Request-Id goes to the
    worker its ID ranks first (rendezvous hashing over instance IDs, random each run)."""
    live = [SimpleNamespace(instance_id=i) for i in usable(fleet)]
    return [rid for rid in (f"{prefix}{i}" for i in range(1000))
            if (rank(rid, live)[0].instance_id == iid) == on][:n]


def usable(fleet) -> set[int]:
    return {w["instance_id"] for w in httpx.get(f"{fleet.url}/health", timeout=5).json()["workers"]
            if w["usable"]}


def test_a_stopped_worker_fails_over_and_retries_start_anew(fleet):
    """SIGSTOP one worker under load. Within the stall deadline (not the 600 s request
    timeout) its requests end: those of which nothing reached the caller yet (unary ones:
    the worker sends them whole) are served by the other worker; streams already under way
    end with a clear "stalled" error, and a retry with the same X-Request-Id starts anew on
    the other worker. Every request ends with exactly one full, correct answer."""
    reference = completion(fleet, "ref-0", 1000).json()["choices"][0]["text"]
    stopped = fleet.workers[0]
    unary_ids = [f"stall-u{i}" for i in range(6)]
    # three streams on the stopped worker, three on the other
    iid = int(stopped.ready["instance_id"])
    stream_ids = placed_on(fleet, iid, "stall-s", 3) + placed_on(fleet, iid, "stall-s", 3, on=False)
    with ThreadPoolExecutor(12) as pool:
        begun = threading.Semaphore(0)
        streams = [pool.submit(streamed, fleet, rid, 1000, begun) for rid in stream_ids]
        when_all_begun(begun, len(stream_ids))
        unary = [pool.submit(completion, fleet, rid, 1000) for rid in unary_ids]
        time.sleep(0.3)
        # stopped while it carries requests (on a loaded machine its streams' placement and
        # the unary requests' arrival take a while): else the stop breaks nothing
        deadline = time.monotonic() + 30
        while inflight(fleet, stopped) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        stopped.signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            unary_out = [f.result(timeout=60) for f in unary]
            stream_out = [f.result(timeout=60) for f in streams]
            waited = time.monotonic() - t0
            assert waited < 20, waited
            assert int(stopped.ready["instance_id"]) not in usable(fleet)
            for r in unary_out:
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == reference
            failed = [rid for rid, (kind, _) in zip(stream_ids, stream_out, strict=True)
                      if kind == "error"]
            assert failed, "no stream was under way on the stopped worker"
            for kind, msg in stream_out:
                assert kind == "ok" and msg == reference or "stalled" in msg, (kind, msg)
            retried = dict(zip(failed, pool.map(lambda rid: streamed(fleet, rid, 1000), failed),
                               strict=True))
        finally:
            stopped.signal(signal.SIGCONT)
    assert all(out == ("ok", reference) for out in retried.values()), retried
    # a retry of a request that completed replays it: nothing is generated twice
    replays = frontend_metric(fleet, "rlfleet_frontend_request_id_replays_total")
    again = completion(fleet, unary_ids[0], 1000)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == reference
    assert frontend_metric(fleet, "rlfleet_frontend_request_id_replays_total") == replays + 1


def test_a_killed_worker_mid_stream_ends_cleanly_and_retries_complete(fleet):
    # ten times slower than the others (same text): its streams are still under way when
    # it is killed, however long the eight took to begin on a loaded box
    victim = fleet.start_worker(*worker_args(fleet.ckpts), "--token-delay", "0.05",
                                kind="mocker", env={"RLFLEET_ADMIN_TOKEN": TOKEN})
    iid = int(victim.ready["instance_id"])
    deadline = time.monotonic() + 30
    while iid not in usable(fleet):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    reference = completion(fleet, "ref-1").json()["choices"][0]["text"]
    # a request with an X-Request-Id goes to the worker its ID ranks first (rendezvous
    # hashing over instance IDs, random each run): three of the eight rank the victim first
    ids = placed_on(fleet, iid, "kill-", 3) + [f"kill-{i}" for i in range(1000, 1005)]
    with ThreadPoolExecutor(8) as pool:
        begun = threading.Semaphore(0)
        futures = [pool.submit(streamed, fleet, rid, 400, begun) for rid in ids]
        when_all_begun(begun, len(ids))
        victim.signal(signal.SIGKILL)
        first = [f.result(timeout=60) for f in futures]
    assert any(kind == "error" for kind, _ in first), "nothing ran on the killed worker"
    final = {rid: out if out[0] == "ok" else streamed(fleet, rid)
             for rid, out in zip(ids, first, strict=True)}
    assert all(out == ("ok", reference) for out in final.values()), final


def test_a_worker_stopped_mid_refresh_is_never_routed_on_uncertain_weights(fleet, tmp_path):
    """SIGSTOP a worker while it loads the new policy: the coordinator leaves it out and
    reopens on the other; under load meanwhile every answer comes from a verified worker,
    and once it wakes up the stopped worker stays out of rotation (its weights were never
    verified)."""
    stopped, other = fleet.workers[0], fleet.workers[1]
    r = httpx.post(f"{stopped.ready['system_url']}/engine/fault_injection", headers=AUTH,
                   json={"route": "update_weights_from_disk", "mode": "hang",
                         "hang_seconds": 2}, timeout=5)
    assert r.json()["status"] == "ok", r.text
    coordinator = PolicyRefresh(fleet.rl_url, model=MODEL, timeout=4, admin_token=TOKEN,
                                journal=tmp_path / "journal.sqlite")
    answers: list[tuple[int, dict]] = []
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                out = http.post(f"{fleet.url}/v1/completions", json={
                    "model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4,
                    "nvext": {"extra_fields": ["weight_versions", "worker_id"]}})
                answers.append((out.status_code, out.json()))

    async def refresh():
        task = asyncio.create_task(coordinator.refresh(fleet.ckpts / "B", "B",
                                                       digest="mock:8"))
        await asyncio.sleep(1.0)  # it is inside update_weights_from_disk
        stopped.signal(signal.SIGSTOP)
        return await task

    loaders = [threading.Thread(target=load) for _ in range(3)]
    for t in loaders:
        t.start()
    try:
        res = asyncio.run(refresh())
        time.sleep(1)
    finally:
        stop.set()
        for t in loaders:
            t.join(60)
        stopped.signal(signal.SIGCONT)
    assert res.decision == "reopened", res.reason
    verdict = {w["instance_id"]: w["status"] for w in res.workers}
    assert verdict[int(other.ready["instance_id"])] == "verified"
    assert verdict[int(stopped.ready["instance_id"])] != "verified", verdict
    assert answers and all(code == 200 for code, _ in answers), \
        [a for a in answers if a[0] != 200][:3]
    after = [body for _, body in answers[-5:]]  # the last answers: the new policy, verified
    assert {s["digest"] for body in after for s in body["nvext"]["weight_versions"]} == {"mock:8"}
    time.sleep(2)  # it is running again
    assert int(stopped.ready["instance_id"]) not in usable(fleet)
    assert usable(fleet) == {int(other.ready["instance_id"])}


def test_no_server_grew_past_its_bound(fleet):
    """After everything above (a 4 MiB body, 500 sockets, runs kept for retries, workers
    stopped and killed), the frontend and the workers stay small."""
    assert peak_rss_mb(fleet.frontend.pid) < 400
    for w in fleet.workers:
        if w.popen.poll() is None:
            assert peak_rss_mb(w.pid) < 600
