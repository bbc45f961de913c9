"""SGLang's server surface on the frontend, driven as an SGLang client drives a server,
against a mocker fleet (the declared simulator: the frontend's shapes, not real-engine
numbers): /generate by text and by IDs, single and batch, unary and streamed, with
logprobs; the metadata routes (/model_info, /server_info with vLLM's fields too,
/get_load), /health and /health_generate; /abort_request by rid and abort_all."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from rlfleet.models import make_adapter

MODEL = "mock-sgl"
# every meta_info field SGLang 0.5 returns for a finished request without logprobs
# (tokenizer_manager.py), and those it adds with return_logprob / top_logprobs_num
META = {"id", "finish_reason", "prompt_tokens", "weight_version", "total_retractions",
        "reasoning_tokens", "completion_tokens", "cached_tokens", "e2e_latency"}
LOGPROB_META = {"input_token_logprobs", "output_token_logprobs", "output_token_logprobs_length"}
TOP_META = {"input_top_logprobs", "output_top_logprobs"}


@pytest.fixture(scope="module")
def fleet(start_module_fleet):
    return start_module_fleet([("--served-model-name", MODEL, "--token-delay", "0.01")],
                              model=MODEL)


def post(fleet, path: str, body: dict, status: int = 200) -> httpx.Response:
    r = httpx.post(f"{fleet.url}{path}", json=body, timeout=60)
    assert r.status_code == status, r.text
    return r


def stream(fleet, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{fleet.url}/generate", json={**body, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def completion(fleet, prompt, n: int) -> dict:
    """The fleet's own answer (nvext) for the same prompt, greedy."""
    return post(fleet, "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0,
        "ignore_eos": True, "logprobs": 0,
        "nvext": {"extra_fields": ["completion_token_ids", "prompt_token_ids"]}}).json()


def params(n: int = 5, **kw) -> dict:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **kw}


def test_text_and_ids_give_the_fleets_own_tokens(fleet):
    truth = completion(fleet, "Count to five.", 5)
    ids = truth["nvext"]["completion_token_ids"]
    prompt = truth["nvext"]["prompt_token_ids"]
    by_text = post(fleet, "/generate", {"text": "Count to five.", "sampling_params": params(),
                                        "return_logprob": True}).json()
    assert by_text["output_ids"] == ids
    meta = by_text["meta_info"]
    assert META | LOGPROB_META <= set(meta), sorted(META | LOGPROB_META - set(meta))
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == 5
    assert [e[1] for e in meta["output_token_logprobs"]] == ids
    assert [e[0] for e in meta["output_token_logprobs"]] == pytest.approx(
        truth["choices"][0]["logprobs"]["token_logprobs"], abs=1e-6)
    assert meta["output_token_logprobs_length"] == 5
    assert all(e[2] is None for e in meta["output_token_logprobs"])  # no text unless asked
    assert meta["input_token_logprobs"] == []  # logprob_start_len -1: none of the prompt
    assert isinstance(meta["e2e_latency"], float) and meta["e2e_latency"] >= 0
    assert meta["weight_versions"][0]["end"] == 5  # rlfleet's spans stay
    by_ids = post(fleet, "/generate", {"input_ids": prompt, "sampling_params": params()}).json()
    assert by_ids["output_ids"] == ids and by_ids["text"] == by_text["text"]
    assert "output_token_logprobs" not in by_ids["meta_info"]
    assert META <= set(by_ids["meta_info"])
    # input_ids win over text, as in SGLang's tokenizer manager
    both = post(fleet, "/generate", {"input_ids": prompt, "text": "other words",
                                     "sampling_params": params()}).json()
    assert both["output_ids"] == ids


def test_logprobs_with_top_and_prompt_and_text(fleet):
    prompt = [11, 12, 13, 14]
    out = post(fleet, "/generate", {
        "input_ids": prompt, "sampling_params": params(3), "return_logprob": True,
        "top_logprobs_num": 2, "logprob_start_len": 1, "return_text_in_logprobs": True}).json()
    meta = out["meta_info"]
    assert META | LOGPROB_META | TOP_META <= set(meta)
    assert [e[1] for e in meta["input_token_logprobs"]] == prompt[1:]
    assert all(isinstance(e[0], float) and isinstance(e[2], str)
               for e in meta["input_token_logprobs"])
    assert len(meta["input_top_logprobs"]) == 3
    assert all(len(row) == 2 for row in meta["input_top_logprobs"])
    assert len(meta["output_top_logprobs"]) == 3
    for chosen, top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"],
                           strict=True):
        assert len(top) == 2 and top[0][0] >= top[1][0]  # best first
        assert isinstance(chosen[2], str) and all(isinstance(e[2], str) for e in top)
    # from the first position, it has no logprob (null), as in SGLang
    first = post(fleet, "/generate", {"input_ids": prompt, "sampling_params": params(2),
                                      "return_logprob": True, "logprob_start_len": 0}).json()
    entries = first["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == prompt and entries[0][0] is None
    assert entries[0][2] is None  # text only with return_text_in_logprobs
    texts = post(fleet, "/generate", {"input_ids": prompt, "sampling_params": params(2),
                                      "return_logprob": True, "logprob_start_len": 0,
                                      "return_text_in_logprobs": True}).json()
    assert all(isinstance(e[2], str) for e in texts["meta_info"]["input_token_logprobs"])


def test_batches_by_text_and_by_ids(fleet):
    prompts = [[5, 6, 7], [8, 9]]
    out = post(fleet, "/generate", {"input_ids": prompts, "sampling_params": params(3),
                                    "rid": ["a-1", "a-2"]}).json()
    assert isinstance(out, list) and [o["meta_info"]["id"] for o in out] == ["a-1", "a-2"]
    for o, p in zip(out, prompts, strict=True):
        assert o["output_ids"] == completion(fleet, p, 3)["nvext"]["completion_token_ids"]
        assert o["meta_info"]["prompt_tokens"] == len(p)
    texts = post(fleet, "/generate", {"text": ["one", "two", "three"], "rid": "b",
                                      "sampling_params": [params(2), params(3), params(4)],
                                      "return_logprob": [True, False, True]}).json()
    assert [o["meta_info"]["id"] for o in texts] == ["b_0", "b_1", "b_2"]
    assert [len(o["output_ids"]) for o in texts] == [2, 3, 4]
    assert ["output_token_logprobs" in o["meta_info"] for o in texts] == [True, False, True]
    events = stream(fleet, {"input_ids": prompts, "sampling_params": params(4)})
    assert {e["index"] for e in events} == {0, 1}
    for i in (0, 1):
        mine = [e for e in events if e["index"] == i]
        assert mine[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
        assert mine[-1]["output_ids"] == out[i]["output_ids"][:3] + mine[-1]["output_ids"][3:]
        lengths = [len(e["output_ids"]) for e in mine]
        assert lengths == sorted(lengths) and lengths[-1] == 4  # cumulative, as SGLang


def test_single_stream_is_cumulative(fleet):
    body = {"input_ids": [3, 4, 5], "sampling_params": params(6), "return_logprob": True}
    unary = post(fleet, "/generate", body).json()
    events = stream(fleet, body)
    assert all("index" not in e for e in events)
    assert events[-1]["output_ids"] == unary["output_ids"]
    assert [e[1] for e in events[-1]["meta_info"]["output_token_logprobs"]] == unary["output_ids"]
    assert "e2e_latency" in events[-1]["meta_info"]
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])


@pytest.mark.parametrize("body, named", [
    ({"input_ids": [1], "image_data": "http://127.0.0.1:9/x.png"}, "image_data"),
    ({"input_ids": [1], "return_hidden_states": True}, "return_hidden_states"),
    ({"input_ids": [1], "token_ids_logprob": [3]}, "token_ids_logprob"),
    ({"input_ids": [1], "sampling_params": {"no_such_param": 1}}, "no_such_param"),
    ({"input_ids": [1], "sampling_params": {"stop_regex": "a+"}}, "stop_regex"),
    ({"input_ids": [1], "sampling_params": {"json_schema": "{", "max_new_tokens": 2}},
     "json_schema"),
    ({"sampling_params": {}}, "input_ids"),
    ({"input_ids": [[1], [2]], "rid": ["x", "x"]}, "Duplicate"),
    ({"input_ids": [[1], [2]], "rid": ["x"]}, "rid"),
    ({"input_ids": [1], "top_logprobs_num": 99, "return_logprob": True}, "top_logprobs_num"),
])
def test_what_cannot_be_honoured_is_refused_by_name(fleet, body, named):
    r = post(fleet, "/generate", body, 400)
    assert named in r.json()["error"]["message"]


def test_fields_that_change_nothing_are_accepted(fleet):
    out = post(fleet, "/generate", {
        "input_ids": [1, 2], "sampling_params": params(2, temperature=None, top_k=None),
        "log_metrics": False, "custom_labels": {"a": "b"}, "routing_key": "k",
        "image_data": None, "return_hidden_states": False, "not_an_sglang_field": 1}).json()
    assert len(out["output_ids"]) == 2


def test_metadata_routes(fleet):
    for path in ("/model_info", "/get_model_info"):
        info = httpx.get(f"{fleet.url}{path}", timeout=10).json()
        assert info["model_path"] == f"mock://{MODEL}" and info["is_generation"] is True
        assert {"tokenizer_path", "weight_version", "preferred_sampling_params"} <= set(info)
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(f"{fleet.url}{path}", timeout=10).json()
        assert info["served_model_name"] == MODEL and info["model_path"] == f"mock://{MODEL}"
        assert len(info["internal_states"]) == 1 and "version" in info
        assert isinstance(info["vllm_config"], str)  # vLLM's default, config_format=text
    tree = httpx.get(f"{fleet.url}/server_info", params={"config_format": "json"},
                     timeout=10).json()
    assert tree["vllm_config"]["model_config"]["served_model_name"] == MODEL
    assert "logprobs_mode" in tree["vllm_config"]["model_config"]
    assert "weight_transfer_config" in tree["vllm_config"]
    bad = httpx.get(f"{fleet.url}/server_info", params={"config_format": "yaml"}, timeout=10)
    assert bad.status_code == 400 and "config_format" in bad.json()["error"]["message"]
    version = httpx.get(f"{fleet.url}/get_weight_version", timeout=10).json()
    assert "weight_version" in version and "weight_digest" in version
    (load,) = httpx.get(f"{fleet.url}/get_load", timeout=10).json()
    assert load["dp_rank"] == 0 and load["num_reqs"] == 0 and load["model"] == MODEL
    assert httpx.get(f"{fleet.url}/health", timeout=10).status_code == 200
    r = httpx.get(f"{fleet.url}/health_generate", timeout=30)
    assert r.status_code == 200, r.text


def _long(fleet, rid: str, out: dict) -> None:
    out["events"] = stream(fleet, {"input_ids": [1, 2, 3], "rid": rid,
                                   "sampling_params": params(2000)})


def _started(fleet) -> None:
    deadline = time.monotonic() + 20
    while httpx.get(f"{fleet.url}/get_load", timeout=5).json()[0]["num_reqs"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.parametrize("abort", [{"rid": "long-1"}, {"abort_all": True}])
def test_abort_request_ends_a_running_request(fleet, abort):
    out: dict = {}
    t = threading.Thread(target=_long, args=(fleet, "long-1", out))
    t.start()
    _started(fleet)
    r = post(fleet, "/abort_request", abort)
    assert r.json()["aborted"] == 1
    t.join(30)
    assert not t.is_alive()
    last = out["events"][-1]["meta_info"]
    assert last["finish_reason"]["type"] == "abort" and last["id"] == "long-1"
    assert last["completion_tokens"] < 2000
    # nothing of that name runs now: SGLang answers 200 and does nothing
    assert post(fleet, "/abort_request", {"rid": "long-1"}).json()["aborted"] == 0


def _long_unary(fleet, rid: str, out: dict) -> None:
    out["body"] = post(fleet, "/generate", {"input_ids": [1, 2, 3], "rid": rid,
                                            "sampling_params": params(2000)}).json()


@pytest.mark.parametrize("abort", [{"rid": "r-1"}, {"abort_all": True}])
@pytest.mark.parametrize("streamed", [False, True], ids=["unary", "streamed"])
def test_abort_request_ends_a_generate_by_rid(fleet, abort, streamed):
    """/abort_request by rid or abort_all ends a /generate sent with that rid, unary or
    streamed, with SGLang's abort finish reason and its partial output: the tokens it has
    are the fleet's own first ones for that prompt."""
    out: dict = {}
    t = threading.Thread(target=_long if streamed else _long_unary, args=(fleet, "r-1", out))
    t.start()
    try:
        _started(fleet)
        assert post(fleet, "/abort_request", abort).json()["aborted"] == 1
    finally:
        t.join(60)
    assert not t.is_alive()
    body = out["events"][-1] if streamed else out["body"]
    meta = body["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["id"] == "r-1"
    n = meta["completion_tokens"]
    assert 0 < n < 2000 and len(body["output_ids"]) == n
    own = post(fleet, "/generate", {"input_ids": [1, 2, 3], "sampling_params": params(n)})
    assert body["output_ids"] == own.json()["output_ids"]
    assert post(fleet, "/abort_request", {"rid": "r-1"}).json()["aborted"] == 0


def test_lora_path_names_a_served_adapter(start_fleet, tmp_path):
    """lora_path (SGLang's adapter name) runs the request on that adapter: its tokens are
    the adapter's (as /v1/completions with model=<adapter>), meta_info names it."""
    adapter = make_adapter(tmp_path / "ad", rank=4, seed=3)
    f = start_fleet([("--served-model-name", MODEL, "--enable-lora", "--max-lora-rank", "16",
                      "--lora-modules", f"ad={adapter}")], model=MODEL)
    body = {"input_ids": [1, 2, 3], "sampling_params": params(4)}
    base = post(f, "/generate", body).json()
    ran = post(f, "/generate", {**body, "lora_path": "ad"}).json()
    own = post(f, "/v1/completions", {"model": "ad", "prompt": [1, 2, 3], "max_tokens": 4,
                                      "temperature": 0, "ignore_eos": True, "nvext": {
                                          "extra_fields": ["completion_token_ids"]}}).json()
    assert ran["output_ids"] == own["nvext"]["completion_token_ids"] != base["output_ids"]
    assert ran["meta_info"]["weight_adapter"] == "ad"
    assert "weight_adapter" not in base["meta_info"]
    missing = post(f, "/generate", {**body, "lora_path": "nope"}, 404)
    assert "nope" in missing.json()["error"]["message"]


def test_without_workers(start_fleet):
    f = start_fleet([])
    r = httpx.get(f"{f.url}/health", timeout=10)
    assert r.status_code == 503 and r.json()["status"] == "no_workers"  # body as before
    assert httpx.get(f"{f.url}/health_generate", timeout=10).status_code == 503
    assert httpx.get(f"{f.url}/server_info", timeout=10).status_code == 503
    assert httpx.get(f"{f.url}/get_load", timeout=10).json() == []


def test_sglang_0_5_23s_own_decoders_read_the_answers(fleet):
    """SGLang 0.5.23's API types (installed by scripts/setup.sh, decoded as its server
    decodes): /generate, unary and each streamed event, its per-token
    `meta_info.weight_versions` spans covering the output with the answer's `weight_version`
    last (SGLang's `default` for unversioned weights); /model_info with the weight version;
    /server_info."""
    from tests import clients

    api = clients.sglang_api()
    body = {"input_ids": [1, 2, 3], "sampling_params": params(6), "return_logprob": True}
    unary = api.GenerateResponse.from_json_value(post(fleet, "/generate", body).json())
    events = [api.GenerateResponse.from_json_value(e) for e in stream(fleet, body)]
    for out in (unary, events[-1]):
        meta = out.meta_info
        assert meta.completion_tokens == len(out.output_ids) == 6
        spans = meta.weight_versions
        assert spans and spans[0].start == 0 and spans[-1].end == 6
        assert all(a.end == b.start for a, b in zip(spans, spans[1:], strict=False))
        # an unversioned policy's spans carry SGLang's label for it; meta_info's own
        # weight_version stays null (SGLang's decoder takes both)
        assert spans[-1].version == (meta.weight_version or "default")
        assert [e.token_id for e in meta.output_token_logprobs] == list(out.output_ids)
    info = api.GetModelInfoResponse.from_json_value(httpx.get(f"{fleet.url}/model_info").json())
    assert info.served_model_name == MODEL and info.weight_version == unary.meta_info.weight_version
    server = api.GetServerInfoResponse.from_json_value(
        httpx.get(f"{fleet.url}/server_info").json())
    assert server.served_model_name == MODEL
