"""vLLM's own serving routes on the frontend (/inference/v1/generate, /tokenize,
/detokenize), driven with the mocker (the declared simulator): the token IDs and
logprobs a vLLM client reads are the fleet's own (as /v1/completions reports them in
nvext.completion_token_ids), streamed or not; refusals name the field."""

from __future__ import annotations

import json

import httpx
import pytest

MODEL = "mock"


@pytest.fixture(scope="module")
def url(start_module_fleet) -> str:
    fleet = start_module_fleet([("--served-model-name", MODEL, "--seed", "3")], model=MODEL)
    return fleet.url


PROMPT = [1100, 1101, 1102, 1103]


def generate(url: str, sampling: dict | None = None, **kw) -> httpx.Response:
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 6, "ignore_eos": True,
                                                     "seed": 11, **(sampling or {})}, **kw}
    return httpx.post(f"{url}/inference/v1/generate", json=body, timeout=60)


def stream(url: str, sampling: dict | None = None, **kw) -> list[dict]:
    body = {"token_ids": PROMPT, "stream": True,
            "sampling_params": {"max_tokens": 6, "ignore_eos": True, "seed": 11,
                                **(sampling or {})}, **kw}
    with httpx.stream("POST", f"{url}/inference/v1/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def completion(url: str, **kw) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "seed": 11,
        "nvext": {"extra_fields": ["completion_token_ids"]}, **kw}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_unary_tokens_and_logprobs_are_the_fleets_own(url: str) -> None:
    r = generate(url, {"logprobs": 2}, return_token_ids=True, request_id="mine")
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) >= {"request_id", "model", "created", "usage", "prompt_logprobs",
                         "prompt_token_id_logprobs", "prompt_token_ids", "mm_placeholders",
                         "metrics", "kv_transfer_params", "ec_transfer_params",
                         "output_mode", "choices"}
    assert body["request_id"] == "generate-tokens-mine" and body["model"] == MODEL
    assert body["output_mode"] == "tokens" and body["prompt_token_ids"] == PROMPT
    (c,) = body["choices"]
    ref = completion(url, logprobs=2)
    ids = ref["nvext"]["completion_token_ids"]
    assert c["token_ids"] == ids and len(ids) == 6
    assert c["finish_reason"] == "length" and c["stop_reason"] is None
    content = c["logprobs"]["content"]
    assert [x["token_id"] for x in content] == ids
    assert [x["logprob"] for x in content] == ref["choices"][0]["logprobs"]["token_logprobs"]
    for x in content:  # the sampled token first, then the best others: max(k, 1) = 2
        assert x["top_logprobs"][0] == {"token_id": x["token_id"], "logprob": x["logprob"],
                                        "rank": x["rank"]}
        assert len(x["top_logprobs"]) == 2 and x["rank"] >= 1
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10,
                             "prompt_tokens_details": None, "completion_tokens_details": None}
    spans = c["weight_versions"]  # which policy produced the tokens
    assert spans and spans[0]["start"] == 0 and spans[-1]["end"] == 6
    assert isinstance(spans[0]["version"], str)


def test_stream_carries_the_same_tokens(url: str) -> None:
    whole = generate(url, {"logprobs": 0}).json()["choices"][0]
    events = stream(url, {"logprobs": 0}, return_token_ids=True,
                    stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks, last = events[:-1], events[-1]
    assert chunks[0]["prompt_token_ids"] == PROMPT
    assert all("prompt_token_ids" not in e for e in chunks[1:])
    ids = [t for e in chunks for t in e["choices"][0]["token_ids"]]
    assert ids == whole["token_ids"]
    lps = [x["logprob"] for e in chunks for x in e["choices"][0]["logprobs"]["content"]]
    assert lps == [x["logprob"] for x in whole["logprobs"]["content"]]
    assert [len(x["top_logprobs"]) for e in chunks
            for x in e["choices"][0]["logprobs"]["content"]] == [1] * 6
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"][0]["weight_versions"][-1]["end"] == 6
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    assert last == {"request_id": chunks[0]["request_id"], "output_mode": "tokens",
                    "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 6,
                                             "total_tokens": 10}}


def test_stream_without_usage_ends_with_the_finish(url: str) -> None:
    events = stream(url)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert all(e["usage"] is None for e in events)


def test_text_mode_adds_the_text(url: str) -> None:
    r = generate(url, {"logprobs": 1}, output_mode="text")
    assert r.status_code == 200, r.text
    (c,) = r.json()["choices"]
    ref = completion(url, logprobs=1)["choices"][0]
    assert c["text"] == ref["text"]
    assert [x["token"] for x in c["logprobs"]["content"]] == ref["logprobs"]["tokens"]
    assert all(x["bytes"] == list(x["token"].encode()) for x in c["logprobs"]["content"])


def test_n_choices_each_with_its_tokens(url: str) -> None:
    body = generate(url, {"n": 3, "temperature": 1.0}).json()
    ref = completion(url, n=3, temperature=1.0)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["token_ids"] for c in body["choices"]] == \
        [c["completion_token_ids"] for c in ref["nvext"]["choices"]]


def test_prompt_logprobs(url: str) -> None:
    body = generate(url, {"prompt_logprobs": 1}).json()
    pl = body["prompt_logprobs"]
    assert len(pl) == len(PROMPT) and pl[0] is None
    assert all(str(t) in e for t, e in zip(PROMPT[1:], pl[1:], strict=True))


def test_x_request_id_names_the_run(url: str) -> None:
    r = httpx.post(f"{url}/inference/v1/generate", headers={"X-Request-Id": "vn-keep-1"},
                   json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 3}}, timeout=60)
    assert r.status_code == 200 and r.json()["request_id"] == "generate-tokens-vn-keep-1"
    # a retry of the same request is answered from the kept run, not generated again
    again = httpx.post(f"{url}/inference/v1/generate", headers={"X-Request-Id": "vn-keep-1"},
                       json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 3}},
                       timeout=60)
    assert again.json()["choices"] == r.json()["choices"]


def test_unknown_fields_are_ignored_as_vllm_ignores_them(url: str) -> None:
    """Fields vLLM's models drop (unknown ones, and the engine-internal `output_kind`) change
    nothing: the same tokens and logprobs as the request without them, nothing echoed."""
    plain = generate(url, {"logprobs": 1})
    r = generate(url, {"logprobs": 1, "not_a_sampler": 1, "output_kind": 1,
                       "skip_reading_prefix_cache": True},
                 some_future_field={"x": 1}, reasoning_ended=True)
    assert r.status_code == 200, r.text
    assert set(r.json()) == set(plain.json())
    (c,), (ref,) = r.json()["choices"], plain.json()["choices"]
    assert c["token_ids"] == ref["token_ids"] and len(c["token_ids"]) == 6
    assert c["logprobs"] == ref["logprobs"] and c["finish_reason"] == ref["finish_reason"]


@pytest.mark.parametrize(("kw", "param"), [
    ({"sampling": {"logprob_token_ids": [5]}}, "sampling_params.logprob_token_ids"),
    ({"sampling": {"trace_decode_token_ids": [5]}}, "sampling_params.trace_decode_token_ids"),
    ({"sampling": {"extra_args": {"k": 1}}}, "sampling_params.extra_args"),
    ({"kv_transfer_params": {"do_remote_prefill": True}}, "kv_transfer_params"),
    ({"content_parts": [{"type": "image_url", "url": "x"}]}, "content_parts"),
    ({"sampling": {"temperature": 3}}, "temperature"),
])
def test_refused_by_name(url: str, kw: dict, param: str) -> None:
    r = generate(url, kw.pop("sampling", None), **kw)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("body", [
    {"token_ids": [], "sampling_params": {}},
    {"token_ids": [1, -1], "sampling_params": {}},
    {"token_ids": [1]},
    {"token_ids": [10 ** 9], "sampling_params": {}},  # outside the vocabulary
])
def test_bad_requests_are_400(url: str, body: dict) -> None:
    r = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]


# ------------------------------------------------------------------ tokenize, detokenize


def test_tokenize_answers_vllms_shape(url: str) -> None:
    r = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "héllo",
                                            "add_special_tokens": True,
                                            "return_token_strs": True}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    models = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    assert body["count"] == len(body["tokens"]) == 6
    assert body["max_model_len"] == models[0]["max_model_len"]
    assert body["token_strs"] == ["h", "<0xC3>", "<0xA9>", "l", "l", "o"]
    plain = httpx.post(f"{url}/tokenize", json={"prompt": "héllo"}, timeout=30).json()
    assert plain["tokens"] == body["tokens"] and plain["token_strs"] is None


def test_tokenize_chat_form(url: str) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(f"{url}/tokenize", json={
        "messages": msgs, "add_generation_prompt": True, "tools": [
            {"type": "function", "function": {"name": "f"}}],
        "chat_template_kwargs": {"enable_thinking": False}}, timeout=30)
    assert r.status_code == 200, r.text
    with_prompt = r.json()["tokens"]
    without = httpx.post(f"{url}/tokenize", json={"messages": msgs,
                                                  "add_generation_prompt": False},
                         timeout=30).json()["tokens"]
    assert with_prompt[:len(without)] == without and len(with_prompt) > len(without)
    # the IDs a chat completion is prompted with
    chat = httpx.post(f"{url}/v1/chat/completions", json={
        "messages": msgs, "max_tokens": 1,
        "nvext": {"extra_fields": ["prompt_token_ids"]}}, timeout=30).json()
    assert chat["nvext"]["prompt_token_ids"] == with_prompt


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"},
     "chat_template"),
    ({"prompt": "x", "continue_final_message": True, "add_generation_prompt": True}, None),
    ({"model": MODEL}, None),
])
def test_tokenize_refusals(url: str, body: dict, param: str | None) -> None:
    r = httpx.post(f"{url}/tokenize", json=body, timeout=30)
    assert r.status_code == 400, r.text
    if param:
        assert r.json()["error"]["param"] == param


def test_detokenize_round_trips(url: str) -> None:
    ids = httpx.post(f"{url}/tokenize", json={"prompt": "héllo wörld"}, timeout=30).json()["tokens"]
    r = httpx.post(f"{url}/detokenize", json={"model": MODEL, "tokens": ids}, timeout=30)
    assert r.status_code == 200 and r.json() == {"prompt": "héllo wörld"}
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [10 ** 9]}, timeout=30)
    assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]["message"]
    missing = httpx.post(f"{url}/detokenize", json={"prompt": "x"}, timeout=30)
    assert missing.status_code == 400 and "tokens" in missing.json()["error"]["message"]


# ------------------------------------------------------------------ render


def test_chat_render_is_the_request_generate_runs(url: str) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(f"{url}/v1/chat/completions/render", json={
        "model": MODEL, "messages": msgs, "max_tokens": 5, "seed": 4, "logprobs": True,
        "top_logprobs": 2, "request_id": "r1"}, timeout=30)
    assert r.status_code == 200, r.text
    rendered = r.json()
    assert rendered["request_id"] == "chatcmpl-r1" and rendered["output_mode"] == "tokens"
    assert rendered["token_ids"] == httpx.post(f"{url}/tokenize", json={"messages": msgs},
                                               timeout=30).json()["tokens"]
    sp = rendered["sampling_params"]
    assert (sp["max_tokens"], sp["seed"], sp["logprobs"], sp["output_kind"]) == (5, 4, 2, 2)
    # the rendered request, sent to /inference/v1/generate, runs as the chat completion does
    out = httpx.post(f"{url}/inference/v1/generate", json=rendered, timeout=30).json()
    chat = httpx.post(f"{url}/v1/chat/completions", json={
        "model": MODEL, "messages": msgs, "max_tokens": 5, "seed": 4,
        "nvext": {"extra_fields": ["completion_token_ids"]}}, timeout=30).json()
    assert out["choices"][0]["token_ids"] == chat["nvext"]["completion_token_ids"]


def test_completion_render_one_request_per_prompt(url: str) -> None:
    r = httpx.post(f"{url}/v1/completions/render", json={
        "model": MODEL, "prompt": ["ab", "c"], "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}}, timeout=30)
    assert r.status_code == 200, r.text
    a, b = r.json()
    assert a["request_id"].endswith("-0") and b["request_id"].endswith("-1")
    assert a["token_ids"] == [1097, 1098] and b["token_ids"] == [1099]
    assert a["stream"] is True and a["stream_options"]["include_usage"] is True
    assert a["sampling_params"]["output_kind"] == 1 and a["sampling_params"]["max_tokens"] == 3
    long = httpx.post(f"{url}/v1/completions/render", json={
        "prompt": [1, 2, 3, 4], "truncate_prompt_tokens": 2}, timeout=30).json()
    assert long[0]["token_ids"] == [3, 4]  # truncated from the left, as the engine would


def test_render_refusals(url: str) -> None:
    r = httpx.post(f"{url}/v1/chat/completions/render", json={
        "messages": [{"role": "user", "content": "x"}], "use_beam_search": True}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "use_beam_search"
    r = httpx.post(f"{url}/v1/completions/render", json={"prompt": ""}, timeout=30)
    assert r.status_code == 400
