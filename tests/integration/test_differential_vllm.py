"""Differential test: vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`,
the same venv, the same engine arguments as rlfleet's workers) and rlfleet's frontend on
the same tiny model get the same requests; status, token IDs, text, logprobs (1e-4),
usage, finish and stop reasons and the error shape must agree.

One vLLM server for the module; the rlfleet side is the session's real-vLLM fleet
(`vllm_fleet`, shared with the other engine tests, so it costs no extra worker start).

Differences that are intended, and so not compared (rlfleet's extensions or choices):
- `nvext` (request and response), `X-Request-Id` semantics (a kept run, see runs.py);
- `id`, `created`, `system_fingerprint` (rlfleet names its version and the policy digest),
  the error `type` string (OpenAI's names, e.g. `invalid_request_error`, where vLLM writes
  the exception class, `BadRequestError`), and error message wording;
- `use_beam_search` and the other fields in rlfleet.protocol.openai.REFUSED: a 400 naming
  the field (vLLM runs beam search; rlfleet's rollouts are sampled);
- streamed `prompt_logprobs` without echo: vLLM refuses, rlfleet too unless nvext asks;
- a streamed chat echo: vLLM 0.32 ends it with an error event (its own bug); rlfleet
  streams the echoed message after the role-only chunk, as the unary answer has it.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.compare import close, reference_and_fleet
from tests.fleets import MODEL_NAME

pytestmark = pytest.mark.engine

PROMPT = "Hello world, the answer is"


@pytest.fixture(scope="module")
def servers(request):
    """(vLLM's server, rlfleet's frontend)."""
    return reference_and_fleet(request)


# ------------------------------------------------------------------ comparison


def _post(url: str, route: str, body: dict | bytes) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(url + route, content=body, timeout=120,
                          headers={"content-type": "application/json"})
    return httpx.post(url + route, json=body, timeout=120)


def _stream(url: str, route: str, body: dict) -> tuple[int, list[dict]]:
    with httpx.stream("POST", url + route, json=body, timeout=120) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, [r.json()]
        events = []
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
        return 200, events




CHOICE_KEYS = ("index", "text", "finish_reason", "stop_reason", "logprobs", "token_ids",
               "prompt_token_ids", "prompt_logprobs", "message")


def compare_unary(ref: dict, got: dict) -> None:
    assert ref["object"] == got["object"]
    close(ref["usage"]["prompt_tokens"], got["usage"]["prompt_tokens"], "usage")
    close(ref["usage"]["completion_tokens"], got["usage"]["completion_tokens"], "usage")
    assert len(ref["choices"]) == len(got["choices"])
    for rc, gc in zip(ref["choices"], got["choices"], strict=True):
        for k in CHOICE_KEYS:
            if k in rc and rc[k] is not None:
                if k == "message":
                    close({x: rc[k].get(x) for x in ("role", "content")},
                          {x: gc[k].get(x) for x in ("role", "content")}, k)
                else:
                    close(rc[k], gc.get(k), f"choices.{k}")
    if ref.get("prompt_logprobs") is not None:
        close(ref["prompt_logprobs"], got.get("prompt_logprobs"), "prompt_logprobs")


def fold_stream(events: list[dict]) -> dict:
    """Per choice index: the joined text (or delta content), finish and stop reasons, the
    streamed token IDs and logprob tokens; the roles announced; and the usage chunk."""
    out: dict = {"choices": {}, "usage": None, "first_roles": []}
    for ev in events:
        if ev.get("usage"):
            out["usage"] = {k: ev["usage"][k] for k in ("prompt_tokens", "completion_tokens")}
        for c in ev.get("choices", []):
            ch = out["choices"].setdefault(c["index"], {"text": "", "finish_reason": None,
                                                         "stop_reason": None, "token_ids": [],
                                                         "lp": []})
            if "delta" in c:
                if "role" in c["delta"]:
                    out["first_roles"].append((c["index"], c["delta"]["role"],
                                               c["delta"].get("content") or ""))
                ch["text"] += c["delta"].get("content") or ""
                for e in (c.get("logprobs") or {}).get("content") or []:
                    ch["lp"].append((e["token"], e["logprob"]))
            else:
                ch["text"] += c.get("text") or ""
                lps = c.get("logprobs") or {}
                ch["lp"] += list(zip(lps.get("tokens") or [], lps.get("token_logprobs") or [],
                                     strict=True))
            ch["token_ids"] += c.get("token_ids") or []
            if c.get("finish_reason") is not None:
                ch["finish_reason"] = c["finish_reason"]
                ch["stop_reason"] = c.get("stop_reason")
    return out


def check_error_shape(r: dict, status: int) -> None:
    err = r["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["code"] == status


def same(servers, route: str, body: dict | bytes, stream: bool = False) -> dict:
    """Send `body` to both servers; assert they agree; return rlfleet's folded answer."""
    ref_url, url = servers
    if stream:
        rs, ref = _stream(ref_url, route, body)
        gs, got = _stream(url, route, body)
        assert rs == gs, (body, ref, got)
        if rs != 200:
            check_error_shape(ref[0], rs)
            check_error_shape(got[0], gs)
            return got[0]
        fr, fg = fold_stream(ref), fold_stream(got)
        assert fr["first_roles"] == fg["first_roles"], (fr, fg)
        assert fr["usage"] == fg["usage"]
        assert set(fr["choices"]) == set(fg["choices"])
        for i, rc in fr["choices"].items():
            gc = fg["choices"][i]
            for k in ("text", "finish_reason", "stop_reason", "token_ids"):
                assert rc[k] == gc[k], (k, i, rc, gc)
            close([list(x) for x in rc["lp"]], [list(x) for x in gc["lp"]], "stream logprobs")
        return fg
    r, g = _post(ref_url, route, body), _post(url, route, body)
    assert r.status_code == g.status_code, (body, r.text, g.text)
    if r.status_code != 200:
        check_error_shape(r.json(), r.status_code)
        check_error_shape(g.json(), g.status_code)
        return g.json()
    compare_unary(r.json(), g.json())
    return g.json()


def cmpl(**kw) -> dict:
    return {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "return_token_ids": True,
            **kw}


def chat(**kw) -> dict:
    return {"model": MODEL_NAME, "max_tokens": 8, "return_token_ids": True,
            "messages": [{"role": "user", "content": "Say hello"}], **kw}


# ------------------------------------------------------------------ cases

SAMPLING = {
    "greedy": dict(temperature=0),
    "greedy_logprobs": dict(temperature=0, logprobs=3),
    "seeded": dict(temperature=1.0, seed=1234, logprobs=0),
    "seeded_n2": dict(temperature=0.8, seed=7, n=2, top_p=0.9, top_k=50, min_p=0.01),
    "penalties": dict(temperature=0, presence_penalty=1.5, frequency_penalty=0.5,
                      repetition_penalty=1.3, max_tokens=16),
    "stop": dict(temperature=0, stop=[" the", "ing"], include_stop_str_in_output=True,
                 max_tokens=24),
    "stop_token_ids": dict(temperature=0, stop_token_ids=[11, 13, 198], max_tokens=24),
    "min_tokens_ignore_eos": dict(temperature=0, min_tokens=6, ignore_eos=True),
    "logit_bias_eos": dict(temperature=0, logit_bias={"151645": 100}, max_tokens=5),
    "allowed_token_ids": dict(temperature=1.0, seed=3, allowed_token_ids=[100, 200, 300]),
    "bad_words": dict(temperature=0, bad_words=[" the", " a"]),
    "echo_logprobs": dict(temperature=0, echo=True, logprobs=2, max_tokens=4),
    "echo_prompt_logprobs": dict(temperature=0, echo=True, logprobs=1, prompt_logprobs=2,
                                 max_tokens=3),
    "prompt_logprobs": dict(temperature=0, prompt_logprobs=3, max_tokens=2),
    "token_ids_as_tokens": dict(temperature=0, logprobs=1, return_tokens_as_token_ids=True),
    "token_prompt": dict(temperature=0, prompt=[9707, 1879, 11, 279, 4226]),
    "batch_texts": dict(temperature=0, prompt=["Hello", "The sky is"]),
    "batch_token_lists": dict(temperature=0, prompt=[[1, 2, 3], [40, 41]], n=1),
    "numeric_strings": dict(temperature="0", max_tokens="5", top_p="1", logprobs=1),
    "truncate": dict(temperature=0, truncate_prompt_tokens=3),
    "skip_special_off": dict(temperature=0, skip_special_tokens=False, max_tokens=12),
    # a budget beyond the room the prompt leaves is lowered to it (8 tokens here)
    "max_tokens_clamped": dict(temperature=0, prompt=[5] * 2040, max_tokens=100,
                               ignore_eos=True),
}


@pytest.mark.parametrize("name", sorted(SAMPLING))
def test_completions(servers, name: str) -> None:
    got = same(servers, "/v1/completions", cmpl(**SAMPLING[name]))
    assert got["system_fingerprint"].startswith("rlfleet-")  # finding 4 (vLLM: "vllm-...")


STREAMED = ("greedy_logprobs", "seeded_n2", "stop", "batch_texts", "echo_logprobs",
            "logit_bias_eos")


@pytest.mark.parametrize("name", STREAMED)
def test_completions_streamed(servers, name: str) -> None:
    same(servers, "/v1/completions",
         cmpl(**SAMPLING[name], stream=True, stream_options={"include_usage": True}),
         stream=True)


def test_missing_model_with_one_served(servers) -> None:
    body = cmpl(temperature=0)
    del body["model"]
    same(servers, "/v1/completions", body)


CHAT = {
    "greedy": dict(temperature=0),
    "logprobs": dict(temperature=0, logprobs=True, top_logprobs=3),
    "seeded": dict(temperature=1.0, seed=11, n=2),
    "max_completion_tokens": dict(temperature=0, max_completion_tokens=3),
    "system_and_turns": dict(temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": [
            {"type": "text", "text": "Count"}, {"type": "text", "text": "to three"}]}]),
    "continue_final": dict(temperature=0, add_generation_prompt=False,
                           continue_final_message=True, messages=[
                               {"role": "user", "content": "Hi"},
                               {"role": "assistant", "content": "Hello, I am"}]),
    "echo": dict(temperature=0, echo=True, add_generation_prompt=False,
                 continue_final_message=True, messages=[
                     {"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": "Sure:"}]),
    "stop": dict(temperature=0, stop=["o"], max_tokens=16),
    "prompt_logprobs": dict(temperature=0, prompt_logprobs=1, max_tokens=2),
}


@pytest.mark.parametrize("name", sorted(CHAT))
def test_chat(servers, name: str) -> None:
    same(servers, "/v1/chat/completions", chat(**CHAT[name]))


# not "echo": vLLM 0.32 fails a streamed chat echo itself (an error event: its DeltaMessage
# refuses the echoed content); unary chat echo is compared above
@pytest.mark.parametrize("name", ["greedy", "logprobs", "seeded", "stop"])
def test_chat_streamed(servers, name: str) -> None:
    got = same(servers, "/v1/chat/completions",
               chat(**CHAT[name], stream=True, stream_options={"include_usage": True}),
               stream=True)
    # every choice opens with a role-only chunk (finding 4)
    assert {i for i, _, text in got["first_roles"] if text == ""} == set(got["choices"])


BAD = {
    "min_tokens_over_max": dict(min_tokens=9, max_tokens=4),
    "seed_too_big": dict(seed=1 << 70),
    "temperature_negative": dict(temperature=-1),
    "top_p_zero": dict(top_p=0),
    "top_k_bad": dict(top_k=-5),
    "n_zero": dict(n=0),
    "logprobs_too_many": dict(logprobs=21),
    "max_tokens_zero": dict(max_tokens=0),
    "max_tokens_over_context": dict(max_tokens=5000),
    "empty_prompt": dict(prompt=""),
    "empty_prompt_list": dict(prompt=[]),
    "token_out_of_vocab": dict(prompt=[1, 151936]),
    "prompt_too_long": dict(prompt=[5] * 2048),
    "stream_options_without_stream": dict(stream_options={"include_usage": True}),
    "unknown_model": dict(model="nope"),
    "logit_bias_bad_key": dict(logit_bias={"x": 1}),
    "stop_token_out_of_vocab": dict(stop_token_ids=[151936]),
    "presence_penalty_range": dict(presence_penalty=3),
    "repetition_penalty_zero": dict(repetition_penalty=0),
    "wrong_type": dict(max_tokens=[1]),
    "logprobs_as_string": dict(logprobs="1"),  # numeric strings: not for the logprob counts
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_completions_refused_alike(servers, name: str) -> None:
    got = same(servers, "/v1/completions", cmpl(**BAD[name]))
    assert got["error"]["code"] in (400, 404)


@pytest.mark.parametrize("name", ["min_tokens_over_max", "seed_too_big"])
def test_bad_streamed_refused_alike(servers, name: str) -> None:
    same(servers, "/v1/completions", cmpl(**BAD[name], stream=True), stream=True)
    same(servers, "/v1/chat/completions", chat(**BAD[name], stream=True), stream=True)


BAD_CHAT = {
    "empty_messages": dict(messages=[]),
    "top_logprobs_without_logprobs": dict(top_logprobs=2),
    "continue_and_generation_prompt": dict(continue_final_message=True),
    "min_tokens_over_max": dict(min_tokens=9, max_tokens=4),
}


@pytest.mark.parametrize("name", sorted(BAD_CHAT))
def test_bad_chat_refused_alike(servers, name: str) -> None:
    same(servers, "/v1/chat/completions", chat(**BAD_CHAT[name]))


def test_not_json_refused_alike(servers) -> None:
    same(servers, "/v1/completions", b"{not json")


def test_kept_alive_connection_survives_a_refusal(servers) -> None:
    """Finding 2: after a refused request, the next one on the same connection is served."""
    _, url = servers
    with httpx.Client(timeout=60) as c:
        for _ in range(2):
            r = c.post(f"{url}/v1/completions", json=cmpl(min_tokens=9, max_tokens=4))
            assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
            r = c.post(f"{url}/v1/completions", json=cmpl(temperature=0, max_tokens=2))
            assert r.status_code == 200


def test_models_alike(servers) -> None:
    ref_url, url = servers
    ref = httpx.get(f"{ref_url}/v1/models").json()["data"][0]
    got = httpx.get(f"{url}/v1/models").json()["data"][0]
    for k in ("id", "object", "max_model_len"):
        assert ref[k] == got[k], k
    assert Path(got["root"]).resolve() == Path(ref["root"]).resolve()
    assert set(got["permission"][0]) == set(ref["permission"][0])
