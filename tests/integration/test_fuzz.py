"""Property-based fuzzing of every HTTP server rlfleet runs, against mocker workers (the
declared simulator: the engine is not the point here, the servers' input handling is).

Server kinds: the frontend (OpenAI, SGLang /generate, /tokenize, cancel, models, ...), its
RL listener, a worker's HTTP request plane, and the worker system server with both admin
schemas (vLLM-flavoured and SGLang-flavoured). For each kind, hypothesis generates at
least FUZZ_EXAMPLES requests (methods, paths, headers, and bodies that are near-valid,
random JSON, raw bytes, deeply nested JSON, lone surrogates, huge numbers, NaN, ...).

Properties: no 5xx (the contract's own 500s are not reachable with bad input), error
bodies in the server's error shape, no stream error event with a 5xx code, no hang (every
request has a deadline), no crash (every process still runs), and a good request is
served afterwards. Reproducible: derandomized, no example database."""

from __future__ import annotations

import json
import math
import os
import string
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from rlfleet.runtime.launch import Proc
from rlfleet.testing.fleet import LocalFleet
from tests.fleets import wait_for_workers

MODEL = "mock"
FUZZ_EXAMPLES = int(os.environ.get("RLFLEET_FUZZ_EXAMPLES", 2000))  # per server kind (the
# system server's split over its two admin schemas)
DEADLINE = 20.0  # seconds one fuzzed request may take before it counts as a hang
CONCURRENCY = 8  # fuzzed requests in flight at once

SETTINGS = settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=True)

# ------------------------------------------------------------------ value strategies

NASTY = ["", " ", "\x00", "\ud800", "a\udfffb", "\udc80\ud800", "\u202e", "😀", "\ufffe",
         "<|im_end|>", "null", "1e999", "-1", "NaN", "token_id:5", "../../etc/passwd",
         "a" * 300]
INTS = [0, 1, 2, 3, -1, -2, 16, 127, 128, 4095, 4096, 4097, 1 << 31, 1 << 53, (1 << 63) - 1,
        1 << 63, 1 << 64, 1 << 70, -(1 << 63), -(1 << 70), 151935, 151936]
FLOATS = [0.0, -0.0, 0.5, 1.0, 2.0, 2.5, -1.0, 1e-9, 1e308, -1e308, math.inf, -math.inf,
          math.nan, 100.0, 101.0, -100.5]

texts = st.one_of(st.text(max_size=12), st.sampled_from(NASTY))
small_ints = st.integers(min_value=-2, max_value=8)
ints = st.one_of(small_ints, st.sampled_from(INTS))
numbers = st.one_of(ints, st.sampled_from(FLOATS), st.floats(allow_nan=True, allow_infinity=True))
scalars = st.one_of(st.none(), st.booleans(), ints, numbers, texts,
                    st.sampled_from(["1", "0.5", "1e3", "true", " 2 "]))  # numeric strings
anything = st.recursive(scalars, lambda c: st.one_of(
    st.lists(c, max_size=4), st.dictionaries(texts, c, max_size=4)), max_leaves=8)
token_lists = st.one_of(st.lists(ints, max_size=6), st.lists(st.integers(0, 300), min_size=1,
                                                              max_size=8))
messages = st.lists(st.fixed_dictionaries({"role": st.one_of(
    st.sampled_from(["user", "system", "assistant", "tool", "developer"]), texts)}, optional={
    "content": st.one_of(texts, st.none(), ints, st.lists(st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"]),
                               "text": st.one_of(texts, ints, st.none(), anything)}),
        anything), max_size=3)),
    "name": texts, "tool_calls": anything}), max_size=3)


def deep(depth: int, leaf: object = 1) -> str:
    return "[" * depth + json.dumps(leaf) + "]" * depth


def fields(spec: dict[str, st.SearchStrategy]) -> st.SearchStrategy[dict]:
    """A JSON object with some of the named fields (typed values mostly, anything
    sometimes) and sometimes an unknown field."""
    keyed = {k: st.one_of(v, v, v, anything) for k, v in spec.items()}
    return st.tuples(
        st.fixed_dictionaries({}, optional=keyed),
        st.dictionaries(texts, anything, max_size=2),
    ).map(lambda t: {**t[1], **t[0]})


SAMPLING = {
    "n": ints, "temperature": numbers, "top_p": numbers, "top_k": ints, "min_p": numbers,
    "seed": ints, "max_tokens": st.one_of(small_ints, ints, st.none()), "min_tokens": ints,
    "stop": st.one_of(texts, st.lists(texts, max_size=5), st.none()),
    "stop_token_ids": token_lists, "ignore_eos": st.booleans(), "logprobs": st.one_of(
        ints, st.booleans(), st.none()), "top_logprobs": ints, "prompt_logprobs": ints,
    "presence_penalty": numbers, "frequency_penalty": numbers, "repetition_penalty": numbers,
    "logit_bias": st.dictionaries(st.one_of(st.integers(0, 300).map(str), texts), numbers,
                                  max_size=3),
    "allowed_token_ids": token_lists, "bad_words": st.lists(texts, max_size=3),
    "echo": st.booleans(), "stream": st.booleans(), "stream_options": st.one_of(
        st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                            "continuous_usage_stats": st.booleans()}), anything),
    "return_tokens_as_token_ids": st.booleans(), "return_token_ids": st.booleans(),
    "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(),
    "truncate_prompt_tokens": ints, "truncation_side": st.sampled_from(["left", "right", "up"]),
    "add_special_tokens": st.booleans(), "cache_salt": texts, "priority": ints,
    "request_id": texts, "user": texts, "use_beam_search": st.booleans(), "suffix": texts,
    "best_of": ints, "response_format": anything, "structured_outputs": anything,
    "stream_interval": ints, "nvext": st.fixed_dictionaries({}, optional={
        "extra_fields": st.lists(st.sampled_from(
            ["completion_token_ids", "prompt_token_ids", "prompt_logprobs", "worker_id",
             "timing", "detailed_finish_reason", "stop_reason", "engine_data", "weight_versions",
             "x"]), max_size=4),
        "token_data": token_lists, "policy": anything}),
}
OPENAI_COMPLETION = {"model": st.one_of(st.just(MODEL), texts, st.none()),
                     "prompt": st.one_of(texts, token_lists, st.lists(texts, max_size=3),
                                         st.lists(token_lists, max_size=3)), **SAMPLING}
OPENAI_CHAT = {"model": st.one_of(st.just(MODEL), texts, st.none()), "messages": messages,
               "max_completion_tokens": ints, "add_generation_prompt": st.booleans(),
               "continue_final_message": st.booleans(), "chat_template_kwargs": anything,
               "tools": anything, "tool_choice": anything, "documents": anything, **SAMPLING}
SGLANG = {"model": st.one_of(st.just(MODEL), st.none()), "input_ids": token_lists,
          "text": texts, "rid": texts, "stream": st.booleans(), "return_logprob": st.booleans(),
          "logprob_start_len": ints, "top_logprobs_num": ints,
          "sampling_params": fields({"max_new_tokens": ints, "temperature": numbers,
                                     "top_p": numbers, "top_k": ints, "n": ints,
                                     "stop_token_ids": token_lists, "stop": texts})}
TOKENIZE = {"model": st.one_of(st.just(MODEL), texts), "prompt": texts, "messages": messages,
            "add_generation_prompt": st.booleans()}
INPUT_TOKENS = {"model": st.one_of(st.just(MODEL), st.none()),
                "input": st.one_of(texts, messages), "instructions": texts, "tools": anything}
ENGINE_GENERATE = {"request_id": texts, "prompt": texts, "prompt_token_ids": token_lists,
                   "messages": messages, "sampling": fields(SAMPLING), "stream": st.booleans(),
                   "echo": st.booleans(), "truncate_prompt_tokens": ints,
                   "chat_template_kwargs": anything}

# loopback-only values for every field that names a place to connect to: fuzzing must never
# send traffic off this machine (closed ports answer at once)
PLACES = st.sampled_from(["127.0.0.1", "http://127.0.0.1:9", "127.0.0.1:9",
                          "s3://bucket/prefix/v1", "/nonexistent", "", "\x00"])
SOURCE = st.fixed_dictionaries({"kind": st.one_of(
    st.sampled_from(["disk", "s3", "trainer", "peer"]), texts)}, optional={
    "path": st.one_of(PLACES, texts), "uri": PLACES, "url": PLACES, "timeout": numbers,
    "chain": anything, "max_bytes_per_s": numbers})
ADMIN = {"mode": st.one_of(st.sampled_from(["keep", "wait", "abort"]), texts),
         "clear_cache": anything, "request_id": texts, "model_path": st.one_of(PLACES, texts),
         "weight_version": st.one_of(texts, st.none(), ints), "version": texts,
         "master_address": PLACES, "master_port": st.sampled_from([9, 0, -1, 70000, "9"]),
         "world_size": ints, "rank_offset": ints, "backend": texts, "group_name": texts,
         "timeout": st.sampled_from([0.05, 0, -1, "x", math.nan]),
         "names": st.lists(texts, max_size=2), "dtypes": st.lists(texts, max_size=2),
         "shapes": anything, "reset_prefix_cache": anything, "allow_unpaused": anything,
         "source": st.one_of(SOURCE, anything), "digest": texts, "handle": texts,
         "flush_cache": anything, "keep_pause": anything, "abort_all_requests": anything,
         "new_version": texts, "torch_empty_cache": anything, "admission": anything,
         "open": anything, "gated": anything, "reason": texts}

VLLM_ROUTES = ["liveness_probe", "pause_generation", "resume_generation", "flush_cache",
               "abort_request", "update_weights_from_disk", "get_weight_version",
               "set_weight_version", "init_weights_update_group",
               "update_weights_from_distributed", "destroy_weights_update_group",
               "stage_weights", "get_staged_weights", "apply_staged_weights",
               "release_staged_weights", "set_admission"]
SGLANG_ROUTES = ["control/update_weights_from_disk", "control/update_weights_from_distributed",
                 "control/update_weights_from_tensor", "control/update_weights_from_ipc",
                 "control/update_weight_version", "pause_generation", "continue_generation",
                 "set_admission"]

METHODS = st.sampled_from(["POST"] * 8 + ["GET", "GET", "PUT", "DELETE", "PATCH", "OPTIONS"])
RAW = st.one_of(
    st.binary(max_size=64),
    st.integers(1, 200_000).map(lambda d: deep(d).encode()),
    st.integers(990, 5000).map(lambda d: ('{"prompt": "x", "nvext": ' + deep(d) + "}").encode()),
    st.integers(990, 5000).map(lambda d: ('{"a":' * d + "1" + "}" * d).encode()),
    st.sampled_from([b"", b"{", b"null", b"[]", b"1", b'"x"', b'{"prompt": "\\ud800"}',
                     b"\xff\xfe", b'{"model": NaN}', b"{}" * 3]),
)
ID_CHARS = string.ascii_letters + string.digits + "-_.:/ %"
HEADERS = st.fixed_dictionaries({}, optional={
    "x-request-id": st.text(ID_CHARS, max_size=300).map(str.strip),  # h11 refuses edge spaces
    "content-type": st.sampled_from(["application/json", "text/plain", "", "application/x-www-form"
                                     "-urlencoded", "multipart/form-data; boundary=x"]),
    "authorization": st.sampled_from(["Bearer x", "", "Basic Zm9vOmJhcg=="]),
})


@dataclass
class Call:
    method: str
    path: str
    body: bytes
    headers: dict[str, str]

    def __repr__(self) -> str:
        body = self.body if len(self.body) <= 300 else self.body[:300] + b"..."
        return f"Call({self.method} {self.path!r} body={body!r} headers={self.headers})"


def encode(obj: object) -> bytes:
    """JSON with every str as written, lone surrogates included (as \\uXXXX escapes); NaN
    and infinities as Python writes them (not JSON: the servers must refuse them cleanly)."""
    return json.dumps(obj, ensure_ascii=True).encode()


def calls(routes: dict[str, st.SearchStrategy], extra_paths: list[str]) -> st.SearchStrategy:
    """Requests to `routes` (path -> body strategy) and a few other paths."""
    path = st.one_of(st.sampled_from(sorted(routes)), st.sampled_from(sorted(routes)),
                     st.sampled_from(sorted(routes)), st.sampled_from(extra_paths),
                     st.text(ID_CHARS, max_size=20).map(lambda s: "/" + s.lstrip("/")))

    @st.composite
    def build(draw) -> Call:
        p = draw(path)
        body_strategy = routes.get(p, anything)
        kind = draw(st.sampled_from(["fields"] * 6 + ["any", "raw"]))
        if kind == "fields":
            body = encode(draw(body_strategy))
        elif kind == "any":
            body = encode(draw(anything))
        else:
            body = draw(RAW)
        return Call(draw(METHODS), p, body, draw(HEADERS))

    return build()


# ------------------------------------------------------------------ the servers


@dataclass
class Servers:
    frontend: str
    rl: str
    request_plane: str
    system_vllm: str
    system_sglang: str
    procs: list[Proc]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    weights = root / "weights"
    weights.mkdir()
    # anything S3 would reach stays on this machine (a closed port)
    env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "fuzz",
           "AWS_SECRET_ACCESS_KEY": "fuzz", "AWS_EC2_METADATA_DISABLED": "true"}
    mock = ("--served-model-name", MODEL, "--max-model-len", "512", "--system-port", "0",
            "--allowed-weights-root", str(weights), "--weights-staging-dir", str(root / "stage"))
    # the served fleet (frontend, RL listener, one worker) and, in another namespace, the
    # two workers whose system servers are fuzzed (a fuzzed pause or gate must not stall
    # the frontend's worker)
    with LocalFleet(root / "serve") as serve, LocalFleet(root / "admin", namespace="fuzzadmin") as admin:
        serve.start_frontend("--request-timeout", "15", enable_rl=True, env=env)
        w = serve.start_worker(*mock, "--enable-rl", kind="mocker", env=env)
        wait_for_workers(serve.url, MODEL, 1)
        v = admin.start_worker(*mock, kind="mocker", env=env)
        s = admin.start_worker(*mock, "--admin-schema", "sglang", kind="mocker",
                               env={**env, "DYN_SGLANG_ENGINE_ROUTES":
                                    "pause_generation continue_generation:tm"})
        yield Servers(frontend=serve.url, rl=serve.rl_url, request_plane=w.ready["url"],
                      system_vllm=v.ready["system_url"], system_sglang=s.ready["system_url"],
                      procs=[*serve.procs, *admin.procs])


def send(client: httpx.Client, base: str, c: Call) -> httpx.Response:
    try:
        return client.request(c.method, base + c.path, content=c.body, headers=c.headers)
    except httpx.TimeoutException as e:
        raise AssertionError(f"hang: no answer in {DEADLINE:.0f}s to {c}") from e
    except httpx.HTTPError as e:
        raise AssertionError(f"connection failed ({type(e).__name__}: {e}) on {c}") from e


def check_openai_shape(r: httpx.Response, c: Call) -> None:
    """A frontend or request-plane error: {"error": {"message": str, "code": status}}."""
    try:
        err = r.json()["error"]
    except Exception as e:
        raise AssertionError(f"{r.status_code} without the error shape: {r.text[:300]!r} "
                             f"for {c}") from e
    assert isinstance(err["message"], str) and err["message"], (r.text, c)
    assert err["code"] == r.status_code, (r.text, c)


def check_stream(r: httpx.Response, c: Call) -> None:
    """No error event of a stream says 5xx."""
    for line in r.text.splitlines():
        line = line.removeprefix("data: ")
        if '"error"' in line and line.startswith("{"):
            ev = json.loads(line)
            code = ev.get("error", {}).get("code") if isinstance(ev.get("error"), dict) else None
            assert not (isinstance(code, int) and code >= 500), (line, c)


def check(r: httpx.Response, c: Call, shape: str) -> None:
    assert r.status_code < 500, f"{r.status_code} {r.text[:500]!r} for {c}"
    if r.status_code >= 400 and c.method != "HEAD":
        if shape == "openai":
            check_openai_shape(r, c)
        else:  # the contract's system-server and listener errors: {"error": str, "message"}
            body = r.json()
            assert isinstance(body, dict) and body.get("error"), (r.text, c)
    elif r.headers.get("content-type", "").startswith(("text/event-stream",
                                                       "application/x-ndjson")):
        check_stream(r, c)


def generate(strategy: st.SearchStrategy, n: int) -> list:
    """n examples of `strategy` (derandomized: the same list on every run)."""
    out: list = []

    @settings(SETTINGS, max_examples=n, phases=[Phase.generate])
    @given(strategy)
    def collect(x) -> None:
        out.append(x)

    collect()
    return out


def send_all(client: httpx.Client, jobs: list[tuple[str, Call]], judge) -> None:
    """Send every (base URL, call), CONCURRENCY at a time (the servers see concurrent
    garbage too), and judge each answer; the first failure names its call."""
    def one(job: tuple[str, Call]) -> None:
        base, c = job
        judge(send(client, base, c), c)

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        for f in [pool.submit(one, j) for j in jobs]:
            f.result()


def all_alive(s: Servers) -> None:
    for p in s.procs:
        assert p.popen.poll() is None, f"{p.name} exited: {p.tail()}"


def good_completion(client: httpx.Client, url: str) -> None:
    r = client.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                   "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3



def _client() -> httpx.Client:
    return httpx.Client(timeout=DEADLINE)


# ------------------------------------------------------------------ the properties


FRONTEND = calls({
    "/v1/completions": fields(OPENAI_COMPLETION), "/v1/chat/completions": fields(OPENAI_CHAT),
    "/generate": fields(SGLANG), "/tokenize": fields(TOKENIZE),
    "/v1/responses/input_tokens": fields(INPUT_TOKENS), "/v1/models": anything,
    "/health": anything, "/metrics": anything,
}, ["/v1/requests/x/cancel", "/v1/requests/%ud800/cancel", "/v1/requests//cancel",
    "/v1/rl/workers", "/v1", "/", "/v1/completions/", "/v1/embeddings", "/docs"])


def test_frontend_fuzz(servers: Servers) -> None:
    jobs = [(servers.frontend, c) for c in generate(FRONTEND, FUZZ_EXAMPLES)]
    with _client() as client:
        send_all(client, jobs, lambda r, c: check(r, c, "openai"))
        all_alive(servers)
        good_completion(client, servers.frontend)
    assert len(jobs) >= FUZZ_EXAMPLES


RL = calls({"/v1/rl/workers": anything},
           ["/v1/rl/engine", "/v1/rl/engines", "/v1/rl/", "/v1/completions", "/"])


def test_rl_listener_fuzz(servers: Servers) -> None:
    jobs = [(servers.rl, c) for c in generate(RL, FUZZ_EXAMPLES)]
    with _client() as client:
        send_all(client, jobs, lambda r, c: check(r, c, "contract"))
        all_alive(servers)
        r = client.get(f"{servers.rl}/v1/rl/workers")
        assert r.status_code == 200 and len(r.json()["workers"]) == 1
    assert len(jobs) >= FUZZ_EXAMPLES


REQUEST_PLANE = calls({"/generate": fields(ENGINE_GENERATE),
                       "/abort": fields({"request_id": texts}),
                       "/tokenize": fields(TOKENIZE), "/health": anything, "/metrics": anything},
                      ["/", "/generate/", "/v1/completions"])


def test_request_plane_fuzz(servers: Servers) -> None:
    jobs = [(servers.request_plane, c) for c in generate(REQUEST_PLANE, FUZZ_EXAMPLES)]
    with _client() as client:
        send_all(client, jobs, lambda r, c: check(r, c, "openai"))
        all_alive(servers)
        r = client.post(f"{servers.request_plane}/generate", json={
            "request_id": "good", "prompt_token_ids": [1, 2], "sampling": {"max_tokens": 2}})
        assert r.status_code == 200 and '"done":true' in r.text
        good_completion(client, servers.frontend)
    assert len(jobs) >= FUZZ_EXAMPLES


SYSTEM = st.one_of(
    st.tuples(st.just("vllm"), calls({f"/engine/{r}": fields(ADMIN) for r in VLLM_ROUTES},
                                     ["/engine", "/health", "/live", "/metrics", "/engine/x",
                                      "/engine/fault_injection", "/engine/"])),
    st.tuples(st.just("sglang"), calls({f"/engine/{r}": fields(ADMIN) for r in SGLANG_ROUTES},
                                       ["/engine", "/health", "/engine/control/x",
                                        "/engine/liveness_probe"])))


def test_system_server_fuzz(servers: Servers) -> None:
    picks = generate(SYSTEM, FUZZ_EXAMPLES)
    bases = {"vllm": servers.system_vllm, "sglang": servers.system_sglang}
    schemas = Counter(schema for schema, _ in picks)

    def judge(r: httpx.Response, c: Call) -> None:
        # an allow-listed native SGLang method (pause_generation, ...) takes the body as its
        # keyword arguments; an unknown or bad argument is a 400 naming it (issue 43), not
        # the 500 a raising handler would be
        check(r, c, "contract")

    with _client() as client:
        send_all(client, [(bases[schema], c) for schema, c in picks], judge)
        all_alive(servers)
        for base in bases.values():
            r = client.get(f"{base}/health")
            assert r.status_code == 200 and r.json()["status"] == "ready"
        r = client.post(f"{servers.system_vllm}/engine/liveness_probe")
        assert r.json()["status"] == "ok"
    assert len(picks) >= FUZZ_EXAMPLES
    assert min(schemas.values()) >= FUZZ_EXAMPLES // 3, schemas


SURROGATE = "a\ud800b"
MALFORMED = [  # issue 10, finding 10: each was a plain-text 500 before
    ("/v1/completions", encode({"model": MODEL, "prompt": SURROGATE})),
    ("/v1/completions", encode({"model": MODEL, "prompt": "x", "stop": [SURROGATE]})),
    ("/v1/completions", encode({"model": MODEL, "prompt": "x", "request_id": SURROGATE})),
    ("/v1/chat/completions", encode({"model": MODEL, "messages": [
        {"role": "user", "content": SURROGATE}]})),
    ("/v1/chat/completions", encode({"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "text", "text": 5}]}]})),
    ("/v1/chat/completions", encode({"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "text", "text": {"nested": "x"}}]}]})),
    ("/generate", encode({"input_ids": [1, 2], "rid": SURROGATE})),
    ("/v1/completions", deep(1000).encode()),
    ("/v1/completions", ('{"model": "mock", "prompt": "x", "nvext": ' + deep(1000) + "}").encode()),
    ("/v1/chat/completions", ('{"a":' * 100_000 + "1" + "}" * 100_000).encode()),
]


@pytest.mark.parametrize("path, body", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_input_is_a_clear_400(servers: Servers, path: str, body: bytes) -> None:
    with _client() as client:
        r = client.post(servers.frontend + path, content=body)
        assert r.status_code == 400, r.text
        check_openai_shape(r, Call("POST", path, body, {}))
        good_completion(client, servers.frontend)  # and the connection still serves
    if b"\\ud800" in body:
        assert "surrogate" in r.json()["error"]["message"]
