"""vLLM 0.32's native RL routes: an rlfleet vLLM worker's system server against
`VLLM_SERVER_DEV_MODE=1 vllm serve` on the same tiny model, route by route (status, body
shape, effect), and vLLM's own HTTPVLLMWeightSyncClient driving an rlfleet worker.

Intended differences (rlfleet's safety rules), not compared as equal:
- the weight-transfer steps with a backend that needs a GPU, on the CPU build (the worker
  here is started with `--weight-transfer-config '{"backend": "nccl"}'`): vLLM's server (no
  backend configured) fails them; rlfleet refuses them with HTTP 400 saying they need a GPU.
  The backend the CPU build runs, modelexpress, is test_modelexpress_transfer_vllm.py's: the
  client's public methods move a worker through pause -> update -> resume there, and vLLM's
  server with that backend is compared step by step;
- `collective_rpc` runs `reload_weights` only, and only while paused (HTTP 409 otherwise).
Here the client drives pause -> reload_weights (collective_rpc) -> update_weight_version ->
resume through its transport (it has no method for those routes), and its
init_weight_transfer_engine for nccl is shown refused.

The effects on requests in flight (test_requests_in_flight_fare_as_on_vllm; VLLM_DOES says
what vLLM does) are compared where both servers expose them: the OpenAI routes (rlfleet's
through its frontend), by status, finish reason and how many tokens, not byte for byte. One
difference there is the frontend's, not the native routes': a request's `id`. vLLM's is
`chatcmpl-<base>` / `cmpl-<base>` (`<base>`: the X-Request-Id, else random) and its engine
calls prompt i of a completion `cmpl-<base>-<i>`; rlfleet's frontend answers with the
X-Request-Id as given, and names the engine's request by the response `id` (prompt i of a
batch `<id>-<i>`). `/abort_requests` takes the IDs a caller of vLLM would send (the
response `id` of a chat completion, `<id>-0` of a completion, `cmpl-<X-Request-Id>-0`, ...)
and finds the request they name (rlfleet.worker.native_rl.vllm_request_aliases)."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from rlfleet.testing.fleet import LocalFleet
from rlfleet.weights.digest import checkpoint_digest
from tests.fleets import MODEL_NAME, vllm_serve, vllm_worker_args

pytestmark = pytest.mark.engine

# both engines compute on one thread (tests/conftest.py sets it for every process of the
# suite): an engine whose threads spin on every core of a small machine starves its own HTTP
# server, which then takes in an /abort_requests (or the next chunk) only after the engine
# has run the request to its end


@pytest.fixture(scope="module")
def vllm_dev_url(tiny_model: Path, tmp_path_factory):
    """vLLM's own server in dev mode (its RL routes), with the workers' engine flags."""
    with vllm_serve(tiny_model, tmp_path_factory.mktemp("vllm-dev"),
                    env={"VLLM_SERVER_DEV_MODE": "1"}) as url:
        yield url


@pytest.fixture(scope="module")
def fleet(start_module_fleet, tiny_model: Path) -> LocalFleet:
    """One rlfleet vLLM worker and a frontend (its OpenAI routes, as vLLM's server has)."""
    nccl = ("--weight-transfer-config", '{"backend": "nccl"}')  # a backend needing a GPU
    return start_module_fleet([vllm_worker_args(tiny_model, MODEL_NAME, *nccl)], kind="vllm",
                              model=MODEL_NAME, name="native-rl")


@pytest.fixture(scope="module")
def worker_url(fleet: LocalFleet) -> str:
    """The worker's admin_base_url (its system server)."""
    return fleet.workers[0].ready["system_url"]


def shape(x: Any) -> Any:
    """A body's shape: keys and value types, not values."""
    if isinstance(x, dict):
        return {k: shape(v) for k, v in x.items()}
    if isinstance(x, list):
        return [shape(v) for v in x]
    return type(x).__name__


def call(url: str, method: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.request(method, url + path, timeout=120, **kw)


# (method, path, request kwargs, whether the bodies must be equal, not only alike)
SEQUENCE = [
    ("GET", "/is_paused", {}, True),
    ("GET", "/weight_info", {}, True),
    ("GET", "/get_world_size", {}, True),
    ("GET", "/get_world_size", {"params": {"include_dp": "false"}}, True),
    ("POST", "/pause", {"params": {"mode": "sideways"}}, False),
    ("POST", "/pause", {"params": {"mode": "keep", "clear_cache": "false"}}, True),
    ("GET", "/is_paused", {}, True),
    ("POST", "/update_weight_version", {"json": {}}, False),
    ("POST", "/update_weight_version", {"json": {"new_version": "v2"}}, True),
    ("GET", "/weight_info", {}, True),
    ("POST", "/collective_rpc", {"json": {}}, False),
    ("POST", "/collective_rpc", {"json": {"method": "reload_weights"}}, True),
    ("GET", "/weight_info", {}, True),
    ("POST", "/abort_requests", {"content": b"{no"}, False),
    ("POST", "/abort_requests", {"json": {}}, True),
    ("POST", "/resume", {}, True),
    ("GET", "/is_paused", {}, True),
    ("POST", "/pause", {}, True),  # vLLM's default: abort, clear the cache
    ("POST", "/resume", {}, True),
]


def test_native_routes_answer_as_vllm_does(vllm_dev_url: str, worker_url: str) -> None:
    for method, path, kw, equal in SEQUENCE:
        ref, got = call(vllm_dev_url, method, path, **kw), call(worker_url, method, path, **kw)
        where = f"{method} {path} {kw}: vLLM {ref.status_code} {ref.text[:300]} / " \
                f"rlfleet {got.status_code} {got.text[:300]}"
        assert got.status_code == ref.status_code, where
        if equal:
            assert got.json() == ref.json(), where
        else:
            assert shape(got.json()) == shape(ref.json()), where


# vLLM's dev-mode cache and sleep routes; sleep mode is unsupported on the CPU build, which
# pauses, marks the executor asleep and keeps the memory (rlfleet.protocol.vllm_rl.SLEEP)
SLEEP_SEQUENCE = [
    ("POST", "/reset_prefix_cache", {}, True),
    ("GET", "/is_sleeping", {}, True),
    ("POST", "/sleep", {"params": {"level": "3"}}, False),
    ("POST", "/sleep", {"params": {"level": "1"}}, True),
    ("GET", "/is_sleeping", {}, True),
    ("GET", "/is_paused", {}, True),
    ("POST", "/wake_up", {"params": {"tags": "weights"}}, True),
    ("GET", "/is_sleeping", {}, True),
    ("POST", "/wake_up", {"params": {"tags": "weights"}}, True),  # not asleep: no change
    ("POST", "/wake_up", {}, True),
    ("GET", "/is_sleeping", {}, True),
    ("GET", "/is_paused", {}, True),
    ("POST", "/sleep", {"params": {"level": "0", "mode": "keep"}}, True),
    ("GET", "/is_sleeping", {}, True),
    ("POST", "/wake_up", {"params": {"tags": "scheduling"}}, True),
    ("GET", "/is_sleeping", {}, True),
    ("POST", "/reset_prefix_cache", {"params": {"reset_running_requests": "true"}}, True),
]


def test_cache_and_sleep_routes_answer_as_vllm_does(vllm_dev_url: str, worker_url: str) -> None:
    for method, path, kw, equal in SLEEP_SEQUENCE:
        ref, got = call(vllm_dev_url, method, path, **kw), call(worker_url, method, path, **kw)
        where = f"{method} {path} {kw}: vLLM {ref.status_code} {ref.text[:300]} / " \
                f"rlfleet {got.status_code} {got.text[:300]}"
        assert got.status_code == ref.status_code, where
        if equal:
            assert got.json() == ref.json(), where
        else:
            assert shape(got.json()) == shape(ref.json()), where


# ---------------------------------------------------------------- effects on requests in flight
# Each scenario runs on vLLM's server, then on rlfleet's worker (its OpenAI routes through the
# frontend), and returns what a caller sees; the two must be equal. What both expose is
# compared (status, finish reason, how many tokens), not bodies: the surfaces differ.

LONG = 1500  # tokens: several seconds of generation here, on either server
SETTLE = 1.0  # seconds to watch a frozen or held request not move


@dataclass
class Server:
    openai: str  # its OpenAI routes
    admin: str  # its native RL routes

    def pause(self, **params: str) -> tuple[int, Any]:
        r = call(self.admin, "POST", "/pause", params=params)
        return r.status_code, r.json()

    def post(self, path: str, **kw: Any) -> tuple[int, Any]:
        r = call(self.admin, "POST", path, **kw)
        return r.status_code, r.json()

    def is_paused(self) -> bool:
        return call(self.admin, "GET", "/is_paused").json()["is_paused"]


@pytest.fixture(scope="module")
def servers(vllm_dev_url: str, fleet: LocalFleet, worker_url: str) -> tuple[Server, Server]:
    """(vLLM's server, rlfleet's worker)."""
    return Server(vllm_dev_url, vllm_dev_url), Server(fleet.url, worker_url)


class Generation:
    """One greedy generation of `max_tokens` (ignore_eos) running in a thread: a chat
    completion or a completion, streamed (with usage) or not. `tokens`: streamed so far
    (chunks carrying text), then the usage's completion tokens."""

    def __init__(self, server: Server, *, stream: bool, api: str = "chat",
                 max_tokens: int = LONG, headers: dict[str, str] | None = None) -> None:
        self.id: str | None = None
        self.status: int | None = None
        self.finish: str | None = None
        self.tokens = 0
        self.error: str | None = None
        body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": max_tokens, "ignore_eos": True,
                                "temperature": 0, "stream": stream}
        if api == "chat":
            body["messages"] = [{"role": "user", "content": "Count on."}]
        else:
            body["prompt"] = "Count on:"
        if stream:
            body["stream_options"] = {"include_usage": True}
        self.max_tokens = max_tokens
        self.url = f"{server.openai}/v1/{'chat/completions' if api == 'chat' else 'completions'}"
        self.thread = threading.Thread(target=self._run, args=(body, headers), daemon=True)
        self.thread.start()

    def _run(self, body: dict[str, Any], headers: dict[str, str] | None) -> None:
        try:
            if not body["stream"]:
                r = httpx.post(self.url, json=body, headers=headers, timeout=300)
                self.status = r.status_code
                self._read(r.json())
                return
            with httpx.stream("POST", self.url, json=body, headers=headers, timeout=300) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        self._read(json.loads(line.removeprefix("data: ")), streamed=True)
        except Exception as e:  # noqa: BLE001 - the test says what happened
            self.error = repr(e)

    def _read(self, event: dict[str, Any], streamed: bool = False) -> None:
        if "error" in event:
            self.error = str(event["error"])
        self.id = self.id or event.get("id")
        for c in event.get("choices", []):
            self.finish = c.get("finish_reason") or self.finish
            text = c.get("delta", {}).get("content") if "delta" in c else c.get("text")
            self.tokens += bool(streamed and text)
        if event.get("usage"):
            self.tokens = event["usage"]["completion_tokens"]

    def running(self, tokens: int = 20, timeout: float = 60) -> Generation:
        """Once it has streamed `tokens` tokens (so it is in the engine)."""
        deadline = time.monotonic() + timeout
        while self.tokens < tokens:
            assert self.thread.is_alive() and time.monotonic() < deadline, self.outcome()
            time.sleep(0.02)
        return self

    def settled(self, quiet: float = 0.5, timeout: float = 10) -> int:
        """Its tokens so far, once none has arrived for `quiet` seconds."""
        deadline = time.monotonic() + timeout
        seen, since = self.tokens, time.monotonic()
        while time.monotonic() - since < quiet and time.monotonic() < deadline:
            time.sleep(0.05)
            if self.tokens != seen:
                seen, since = self.tokens, time.monotonic()
        return seen

    def ended(self, timeout: float = 60) -> tuple[Any, ...]:
        """Its outcome once it has ended; `("running",)` if it has not within `timeout`."""
        self.thread.join(timeout)
        return ("running",) if self.thread.is_alive() else self.outcome()

    def outcome(self) -> tuple[Any, ...]:
        """(status, finish reason, whole | partial | none), and an error if any."""
        size = "whole" if self.tokens == self.max_tokens else "partial" if self.tokens else "none"
        return (self.status, self.finish, size) + ((self.error,) if self.error else ())


def two_in_flight(s: Server, max_tokens: int = LONG) -> tuple[Generation, Generation]:
    """A completion (not streamed), then a streamed chat completion; once the second
    streams, both are in the engine."""
    unary = Generation(s, stream=False, api="completions", max_tokens=max_tokens)
    time.sleep(0.2)
    return unary, Generation(s, stream=True, max_tokens=max_tokens).running()


def paused_with_abort(s: Server) -> dict[str, Any]:
    unary, streamed = two_in_flight(s)
    out: dict[str, Any] = {"pause": s.pause(mode="abort", clear_cache="true"),
                           "unary": unary.ended(), "streamed": streamed.ended(),
                           "paused": s.is_paused()}
    new = Generation(s, stream=False, max_tokens=8)
    time.sleep(SETTLE)
    out["new request while paused"] = "held" if new.thread.is_alive() else new.outcome()
    out["resume"] = s.post("/resume")
    out["new request after resume"] = new.ended()
    out["paused after resume"] = s.is_paused()
    return out


def paused_with_keep(s: Server) -> dict[str, Any]:
    unary, streamed = two_in_flight(s, 600)
    out: dict[str, Any] = {"pause": s.pause(mode="keep", clear_cache="true")}
    before = streamed.settled()  # what was on its way has arrived
    time.sleep(SETTLE)
    out["frozen"] = (streamed.tokens == before < 600, unary.thread.is_alive())
    out["paused"] = s.is_paused()
    out["resume"] = s.post("/resume")
    out["unary"], out["streamed"] = unary.ended(), streamed.ended()
    return out


def paused_with_wait(s: Server) -> dict[str, Any]:
    unary, streamed = two_in_flight(s, 600)
    out: dict[str, Any] = {"in flight when paused": streamed.tokens < 600,
                           "pause": s.pause(mode="wait", clear_cache="false")}
    out["paused"] = s.is_paused()
    # ended while paused: they finished before the engine stopped
    out["unary"], out["streamed"] = unary.ended(15), streamed.ended(15)
    out["resume"] = s.post("/resume")
    return out


def aborted_by_id(s: Server) -> dict[str, Any]:
    """A request aborted by the engine ID vLLM gives it, learnt from its response `id` (and
    the X-Request-Id): a chat completion's ID is its `id`; prompt i of a completion's is
    `<id>-<i>`, `<id>` being `cmpl-<X-Request-Id>` when the caller sent one. Another request
    in flight runs on; `{}` aborts all."""
    out: dict[str, Any] = {}
    for api, given, engine_id in [("chat", None, lambda g: g.id),
                                  ("completions", None, lambda g: f"{g.id}-0"),
                                  ("completions", "rid-native", lambda g: "cmpl-rid-native-0"),
                                  ("chat", "rid-native-2", lambda g: "chatcmpl-rid-native-2")]:
        other = Generation(s, stream=False, max_tokens=400)
        named = Generation(s, stream=True, api=api, headers={"X-Request-Id": given}
                           if given else None).running()
        reply = s.post("/abort_requests", json={"request_ids": [engine_id(named)]})
        out[f"{api} {given}"] = (reply, named.ended(), other.ended())
    first, second = two_in_flight(s)
    out["all"] = (s.post("/abort_requests", json={}), first.ended(), second.ended())
    return out


PAUSED, RESUMED = (200, {"status": "paused"}), (200, {"status": "resumed"})
ENDED, CUT = (200, "length", "whole"), (200, "abort", "partial")
ABORTED_ONE = (200, {"status": "aborted", "aborted": 1})
#: what vLLM 0.32's server does (observed), which rlfleet's worker must do too
VLLM_DOES = {
    # the requests in flight end at once, cut short; a new one waits for /resume
    "paused_with_abort": {
        "pause": PAUSED, "unary": CUT, "streamed": CUT, "paused": True,
        "new request while paused": "held", "resume": RESUMED,
        "new request after resume": ENDED,
        "paused after resume": False},
    # frozen where they are; after /resume they run to their full length
    "paused_with_keep": {"pause": PAUSED, "frozen": (True, True), "paused": True,
                         "resume": RESUMED, "unary": ENDED, "streamed": ENDED},
    # /pause returns once the requests in flight have finished, whole
    "paused_with_wait": {"in flight when paused": True, "pause": PAUSED, "paused": True,
                         "unary": ENDED, "streamed": ENDED, "resume": RESUMED},
    # the named request ends, cut short, the other runs to its end; the reply counts the IDs
    "aborted_by_id": {
        **{case: (ABORTED_ONE, CUT, ENDED) for case in
           ["chat None", "completions None", "completions rid-native", "chat rid-native-2"]},
        "all": ((200, {"status": "aborted", "aborted": 2}), CUT, CUT)},
}


@pytest.mark.parametrize("scenario", [paused_with_abort, paused_with_keep, paused_with_wait,
                                      aborted_by_id], ids=lambda f: f.__name__)
def test_requests_in_flight_fare_as_on_vllm(servers: tuple[Server, Server], scenario) -> None:
    ref, got = (scenario(s) for s in servers)
    assert ref == VLLM_DOES[scenario.__name__], f"vLLM did: {ref}"
    assert got == ref, f"vLLM: {ref}\nrlfleet: {got}"
    assert not any(s.is_paused() for s in servers)


def test_weight_transfer_is_refused_on_the_cpu_build(vllm_dev_url: str, worker_url: str) -> None:
    """A backend other than modelexpress on the CPU build: vLLM fails (no weight-transfer
    engine configured: its backends need a GPU); rlfleet refuses with a 4xx that says so and
    names the backend the CPU build runs, and nothing changes."""
    for path, body in [("/init_weight_transfer_engine", {"init_info": {}}),
                       ("/start_weight_update", None),
                       ("/update_weights", {"update_info": {"names": []}}),
                       ("/finish_weight_update", None)]:
        ref, got = call(vllm_dev_url, "POST", path, json=body), \
            call(worker_url, "POST", path, json=body)
        assert ref.status_code >= 400, (path, ref.text)
        assert got.status_code == 400 and "need a GPU" in got.json()["error"], (path, got.text)
        assert "modelexpress" in got.json()["error"], got.text
    assert call(worker_url, "GET", "/is_paused").json() == {"is_paused": False}


def test_vllms_weight_sync_client_drives_a_worker(worker_url: str, tiny_model_b: Path) -> None:
    import requests
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    client = HTTPVLLMWeightSyncClient(worker_url, timeout=120)
    with pytest.raises(requests.HTTPError) as refused:
        client.init_weight_transfer_engine({"master_address": "127.0.0.1", "master_port": 1})
    assert refused.value.response.status_code == 400
    client._post("pause?mode=keep")
    client._post("collective_rpc", {"method": "reload_weights",
                                    "kwargs": {"weights_path": str(tiny_model_b)}})
    client._post("update_weight_version", {"new_version": "policy-b"})
    client._post("resume")
    version = httpx.get(f"{worker_url}/engine/get_weight_version", timeout=30).json()
    assert version["version"] == "policy-b"
    assert version["weight_digest"] == checkpoint_digest(tiny_model_b)
    assert httpx.get(f"{worker_url}/weight_info", timeout=30).json() == \
        {"weight_version": "policy-b"}
    probe = httpx.post(f"{worker_url}/engine/liveness_probe", timeout=30).json()
    assert probe["status"] == "ok" and "self_check" not in probe, probe  # it passed on resume
