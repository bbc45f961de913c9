"""Differential test of vLLM's own serving routes: vLLM's server (`vllm serve
--enable-scale-out`, the same venv and engine arguments as rlfleet's workers) and rlfleet's
frontend on the same tiny model get the same requests on POST /inference/v1/generate,
/tokenize and /detokenize; status, token IDs, logprobs (1e-4), ranks, finish and stop
reasons, usage, prompt token IDs and logprobs, the keys of every answer and the error
shape must agree. The token IDs and logprobs are also the fleet's own, as /v1/completions
reports them (nvext.completion_token_ids).

One vLLM server for the module; the rlfleet side is the session's real-vLLM fleet.

Differences that are intended, and so not compared:
- `request_id` (both "generate-tokens-<id>"; the ID is a new UUID on each side) and
  `created`;
- `weight_versions`: vLLM's is null without a weight label; rlfleet names the policy that
  produced the tokens (its label, or "<version>|<digest>|<step>", with digest and step);
- fields rlfleet refuses by name (rlfleet.protocol.vllm_native's *_REFUSED), error
  `type` strings and message wording.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.compare import close, reference_and_fleet
from tests.fleets import MODEL_NAME

pytestmark = pytest.mark.engine

TEXT = "Hello world, the answer is"
IGNORED = {"request_id", "created", "weight_versions", "nvext"}


@pytest.fixture(scope="module")
def servers(request):
    """(vLLM's server, rlfleet's frontend)."""
    return reference_and_fleet(request)


@pytest.fixture(scope="module")
def prompt_ids(servers) -> list[int]:
    ref, _ = servers
    return httpx.post(f"{ref}/tokenize", json={"model": MODEL_NAME, "prompt": TEXT},
                      timeout=60).json()["tokens"]




def _strip(obj):
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k not in IGNORED}
    if isinstance(obj, list):
        return [_strip(x) for x in obj]
    return obj


def _post(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(url + route, json=body, timeout=120)


def _stream(url: str, body: dict) -> tuple[int, list[dict]]:
    with httpx.stream("POST", url + "/inference/v1/generate", json=body, timeout=120) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, [r.json()]
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    return 200, [json.loads(x) for x in lines[:-1]]


def check_error(body: dict, status: int) -> None:
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert body["error"]["code"] == status


def same(servers, route: str, body: dict) -> dict:
    """`body` to both servers; they agree (see the module's docstring); rlfleet's answer."""
    ref_url, url = servers
    r, g = _post(ref_url, route, body), _post(url, route, body)
    assert r.status_code == g.status_code, (body, r.text, g.text)
    if r.status_code != 200:
        check_error(r.json(), r.status_code)
        check_error(g.json(), g.status_code)
        return g.json()
    close(_strip(r.json()), _strip(g.json()), route)
    return g.json()


def gen(ids: list[int], sampling: dict, **kw) -> dict:
    return {"model": MODEL_NAME, "token_ids": ids,
            "sampling_params": {"max_tokens": 8, **sampling}, **kw}


SAMPLING = {
    "greedy": dict(temperature=0),
    "greedy_logprobs": dict(temperature=0, logprobs=3),
    "logprobs_zero": dict(temperature=0, logprobs=0),
    "seeded": dict(temperature=1.0, seed=1234, logprobs=1),
    "seeded_n2": dict(temperature=0.8, seed=7, n=2, top_p=0.9, top_k=50, min_p=0.01),
    "penalties": dict(temperature=0, presence_penalty=0.5, frequency_penalty=0.3,
                      repetition_penalty=1.2),
    "min_tokens_ignore_eos": dict(temperature=0, min_tokens=4, ignore_eos=True, max_tokens=12),
    "prompt_logprobs": dict(temperature=0, prompt_logprobs=2),
    "logit_bias": dict(temperature=0, logit_bias={"100": 50}),
    "allowed_token_ids": dict(temperature=0, allowed_token_ids=[100, 200, 300]),
    "stop_token_ids": dict(temperature=0, stop_token_ids=[100], allowed_token_ids=[100]),
    "bad_words": dict(temperature=0, bad_words=["the"]),
}


@pytest.mark.parametrize("case", sorted(SAMPLING))
def test_generate_unary(servers, prompt_ids, case: str) -> None:
    got = same(servers, "/inference/v1/generate",
               gen(prompt_ids, SAMPLING[case], return_token_ids=True))
    assert got["request_id"].startswith("generate-tokens-")


@pytest.mark.parametrize("case", ["greedy_logprobs", "seeded", "seeded_n2"])
def test_generate_stream(servers, prompt_ids, case: str) -> None:
    body = gen(prompt_ids, SAMPLING[case], return_token_ids=True, stream=True,
               stream_options={"include_usage": True, "continuous_usage_stats": True})
    (rs, ref), (gs, got) = _stream(servers[0], body), _stream(servers[1], body)
    assert rs == gs == 200
    # the first chunk carries the prompt's IDs, the last one the whole usage
    close(_strip(ref[-1]), _strip(got[-1]), "usage chunk")
    assert ref[0]["prompt_token_ids"] == got[0]["prompt_token_ids"] == prompt_ids
    assert set(ref[0]) == set(got[0]) and set(ref[1]) == set(got[1])

    def fold(events: list[dict]) -> dict:
        out: dict = {}
        for e in events[:-1]:
            for c in e["choices"]:
                ch = out.setdefault(c["index"], {"token_ids": [], "logprobs": [],
                                                 "finish_reason": None, "stop_reason": None})
                assert set(c) == {"index", "finish_reason", "stop_reason", "token_ids",
                                  "routed_experts", "sampling_mask", "weight_versions",
                                  "logprobs"}, c
                ch["token_ids"] += c["token_ids"]
                ch["logprobs"] += (c["logprobs"] or {}).get("content") or []
                if c["finish_reason"] is not None:
                    ch["finish_reason"], ch["stop_reason"] = c["finish_reason"], c["stop_reason"]
        return out

    close(fold(ref), fold(got), "stream")


def test_generate_text_mode(servers, prompt_ids) -> None:
    same(servers, "/inference/v1/generate",
         gen(prompt_ids, dict(temperature=0, logprobs=2), output_mode="text"))


def test_generate_stop_string(servers, prompt_ids) -> None:
    """A stop string ends the choice where vLLM ends it, naming it as the stop reason."""
    ref_url, _ = servers
    greedy = _post(ref_url, "/inference/v1/generate",
                   gen(prompt_ids, dict(temperature=0, max_tokens=8), output_mode="text")).json()
    text = greedy["choices"][0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 2] or text
    got = same(servers, "/inference/v1/generate",
               gen(prompt_ids, dict(temperature=0, stop=[stop]), output_mode="text"))
    assert got["choices"][0]["finish_reason"] == "stop"


def test_generate_tokens_are_the_fleets_own(servers, prompt_ids) -> None:
    _, url = servers
    body = _post(url, "/inference/v1/generate",
                 gen(prompt_ids, dict(temperature=0, logprobs=1))).json()
    ref = _post(url, "/v1/completions", {
        "model": MODEL_NAME, "prompt": prompt_ids, "max_tokens": 8, "temperature": 0,
        "logprobs": 1, "nvext": {"extra_fields": ["completion_token_ids"]}}).json()
    (c,) = body["choices"]
    assert c["token_ids"] == ref["nvext"]["completion_token_ids"]
    close([x["logprob"] for x in c["logprobs"]["content"]],
          ref["choices"][0]["logprobs"]["token_logprobs"], "logprobs")
    spans = c["weight_versions"]
    assert spans and spans[0]["start"] == 0 and spans[-1]["end"] == len(c["token_ids"])


@pytest.mark.parametrize("body", [
    {"token_ids": [], "sampling_params": {}},
    {"token_ids": [1, -1], "sampling_params": {}},
    {"token_ids": [1]},
    {"token_ids": [1], "sampling_params": {"logprobs": 21}},
    {"token_ids": [1], "sampling_params": {"temperature": -1}},
    {"token_ids": [1], "sampling_params": {"stop": ["x"], "detokenize": False}},
    {"token_ids": [1], "sampling_params": {"detokenize": False}, "output_mode": "text"},
    {"token_ids": [1], "sampling_params": {}, "output_mode": "words"},
    {"token_ids": [1], "sampling_params": {"max_tokens": 0}},
])
def test_generate_refusals(servers, body: dict) -> None:
    same(servers, "/inference/v1/generate", {"model": MODEL_NAME, **body})


# ------------------------------------------------------------------ tokenize, detokenize

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hel"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}}}}]


@pytest.mark.parametrize("body", [
    {"prompt": TEXT},
    {"prompt": TEXT, "add_special_tokens": False, "return_token_strs": True},
    {"prompt": "  spaces\n\tand ünïcode 😀"},
    {"messages": MESSAGES[:2]},
    {"messages": MESSAGES[:2], "add_generation_prompt": False, "return_token_strs": True},
    {"messages": MESSAGES, "add_generation_prompt": False, "continue_final_message": True},
    {"messages": MESSAGES[:2], "add_special_tokens": True},
    {"messages": MESSAGES[:2], "tools": TOOLS},
    {"messages": MESSAGES[:2], "chat_template_kwargs": {"enable_thinking": False}},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                               {"type": "text", "text": "b"}]}]},
    {"prompt": "x", "messages": MESSAGES[:2]},
    {"prompt": TEXT, "unknown_field": 1},
])
def test_tokenize(servers, body: dict) -> None:
    same(servers, "/tokenize", {"model": MODEL_NAME, **body})


@pytest.mark.parametrize("body", [
    {},
    {"messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": True},
    {"prompt": 5},
])
def test_tokenize_refusals(servers, body: dict) -> None:
    same(servers, "/tokenize", {"model": MODEL_NAME, **body})


def test_detokenize(servers, prompt_ids) -> None:
    ref_url, _ = servers
    chat = _post(ref_url, "/tokenize", {"model": MODEL_NAME, "messages": MESSAGES[:2]}).json()
    for ids in (prompt_ids, chat["tokens"], prompt_ids[1:3]):
        same(servers, "/detokenize", {"model": MODEL_NAME, "tokens": ids})
    same(servers, "/detokenize", {"model": MODEL_NAME, "tokens": [-1]})


# ------------------------------------------------------------------ render

# vLLM's SamplingParams defaults: a rendered request leaves out what equals them (which of
# the others it lists may differ between the servers; their values may not)
SAMPLING_DEFAULTS = {"n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                     "seed": None, "max_tokens": 16, "min_tokens": 0, "logprobs": None,
                     "prompt_logprobs": None, "stop": [], "stop_token_ids": [],
                     "ignore_eos": False, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                     "repetition_penalty": 1.0, "output_kind": 0, "logit_bias": None,
                     "allowed_token_ids": None, "bad_words": [],
                     "include_stop_str_in_output": False, "skip_special_tokens": True}


def _effective(sp: dict) -> dict:
    return {k: (sp.get(k, d) if sp.get(k) is not None or d is None else d)
            for k, d in SAMPLING_DEFAULTS.items()}


def same_render(servers, route: str, body: dict) -> list[dict]:
    """Both servers render `body` to the same generate request(s); each, sent to both
    servers' /inference/v1/generate, is answered alike."""
    ref_url, url = servers
    r, g = _post(ref_url, route, body), _post(url, route, body)
    assert r.status_code == g.status_code, (body, r.text, g.text)
    if r.status_code != 200:
        check_error(r.json(), r.status_code)
        check_error(g.json(), g.status_code)
        return []
    refs, gots = r.json(), g.json()
    if isinstance(refs, dict):
        refs, gots = [refs], [gots]
    assert len(refs) == len(gots)
    for ref, got in zip(refs, gots, strict=True):
        assert set(ref) == set(got)
        assert ref["request_id"].split("-")[0] == got["request_id"].split("-")[0]
        close({k: v for k, v in ref.items() if k not in ("request_id", "sampling_params")},
              {k: v for k, v in got.items() if k not in ("request_id", "sampling_params")},
              route)
        close(_effective(ref["sampling_params"]), _effective(got["sampling_params"]),
              "sampling_params")
        sp = _effective(got["sampling_params"])
        if not got["stream"] and (sp["temperature"] == 0 or sp["seed"] is not None):
            same(servers, "/inference/v1/generate", got)  # what it runs is the same
    return gots


@pytest.mark.parametrize("body", [
    {"messages": MESSAGES[:2], "max_tokens": 6, "temperature": 0},
    {"messages": MESSAGES[:2], "seed": 5, "logprobs": True, "top_logprobs": 2,
     "stop": ["\n"], "n": 2, "temperature": 0.7, "max_tokens": 6},
    {"messages": MESSAGES, "add_generation_prompt": False, "continue_final_message": True,
     "max_completion_tokens": 4, "temperature": 0},
    {"messages": MESSAGES[:2], "tools": TOOLS, "tool_choice": "none", "max_tokens": 3},
    {"messages": MESSAGES[:2], "stream": True, "stream_options": {"include_usage": True}},
    {"messages": MESSAGES[:2], "truncate_prompt_tokens": 5, "max_tokens": 2},
    {"messages": []},
])
def test_chat_render(servers, body: dict) -> None:
    same_render(servers, "/v1/chat/completions/render", {"model": MODEL_NAME, **body})


@pytest.mark.parametrize("body", [
    {"prompt": TEXT},
    {"prompt": [TEXT, "Another one"], "max_tokens": 4, "temperature": 0, "logprobs": 2},
    {"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 3, "seed": 9},
    {"prompt": TEXT, "echo": True, "logprobs": 1, "max_tokens": 2, "temperature": 0},
    {"prompt": TEXT, "add_special_tokens": False, "truncate_prompt_tokens": 3},
    {"prompt": ""},
])
def test_completion_render(servers, body: dict) -> None:
    same_render(servers, "/v1/completions/render", {"model": MODEL_NAME, **body})
