"""nvext.engine_data as a Dynamo token client reads it, against a mocker fleet (the
declared simulator: the frontend's shapes and placement, not real-engine numbers): asked
for only `engine_data`, a chat rollout gets the engine's completion IDs, their logprobs
and the prompt IDs, unary and streamed, per choice; a second turn sent as
`nvext.token_data` is prompted with them verbatim."""

from __future__ import annotations

import json

import httpx
import pytest

MODEL = "mock-ed"
IDENTITY = ("weight_version", "weight_digest", "weight_step")
MESSAGES = [{"role": "user", "content": "Count to five."}]


@pytest.fixture(scope="module")
def fleet(start_module_fleet):
    return start_module_fleet([("--served-model-name", MODEL)], model=MODEL)


def post(fleet, path: str, body: dict) -> dict:
    r = httpx.post(f"{fleet.url}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream(fleet, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{fleet.url}{path}", json={**body, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def chat(**kw) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "ignore_eos": True,
            "temperature": 0, "nvext": {"extra_fields": ["engine_data"]}, **kw}


def engine_truth(fleet, **kw) -> tuple[list[int], list[int], list[float]]:
    """(prompt IDs, completion IDs, sampled logprobs) through nvext's own fields and the
    OpenAI logprobs, which the frontend has long carried from the engine."""
    out = post(fleet, "/v1/chat/completions", chat(
        logprobs=True, top_logprobs=0, return_tokens_as_token_ids=True,
        nvext={"extra_fields": ["completion_token_ids", "prompt_token_ids"]}, **kw))
    content = out["choices"][0]["logprobs"]["content"]
    ids = out["nvext"]["completion_token_ids"]
    assert [int(e["token"].removeprefix("token_id:")) for e in content] == ids
    return out["nvext"]["prompt_token_ids"], ids, [e["logprob"] for e in content]


def check_tokens(data: dict, prompt: list[int], ids: list[int], lps: list[float]) -> None:
    assert data["completion_token_ids"] == ids
    assert data["completion_logprobs"] == lps
    assert data["prompt_token_ids"] == prompt
    assert data["finished"] is True
    assert set(IDENTITY) <= set(data)  # beside the policy identity


def test_a_chat_rollout_asking_only_for_engine_data_gets_the_engines_tokens(fleet):
    prompt, ids, lps = engine_truth(fleet)
    assert len(ids) == 6 and len(lps) == 6
    unary = post(fleet, "/v1/chat/completions", chat())
    assert unary["choices"][0]["logprobs"] is None  # not asked for in the OpenAI body
    assert "completion_token_ids" not in unary["nvext"]
    check_tokens(unary["nvext"]["engine_data"], prompt, ids, lps)

    events = stream(fleet, "/v1/chat/completions", chat())
    ended = [e for e in events if any(c.get("finish_reason") for c in e["choices"])]
    assert len(ended) == 1  # the choice's last chunk carries its tokens
    check_tokens(ended[0]["nvext"]["engine_data"], prompt, ids, lps)
    for e in events:  # every other content chunk names the policy only
        if e is not ended[0] and "nvext" in e:
            assert set(e["nvext"]["engine_data"]) == set(IDENTITY)

    # turn 2: the engine's tokens verbatim, then the next user turn, as nvext.token_data
    turn = prompt + ids + [1101, 1102, 1103]
    again = post(fleet, "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 4, "ignore_eos": True,
        "nvext": {"token_data": turn, "extra_fields": ["engine_data"]}})
    data = again["nvext"]["engine_data"]
    assert data["prompt_token_ids"] == turn
    assert data["prompt_token_ids"][:len(prompt) + len(ids)] == prompt + ids
    assert len(data["completion_token_ids"]) == len(data["completion_logprobs"]) == 4
    last = [e for e in stream(fleet, "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 4, "ignore_eos": True,
        "nvext": {"token_data": turn, "extra_fields": ["engine_data"]}})
        if any(c.get("finish_reason") for c in e["choices"])]
    assert last[0]["nvext"]["engine_data"]["prompt_token_ids"] == turn


def test_engine_data_sits_with_each_choice(fleet):
    """n > 1: unary, per choice under nvext.choices (the top level is choice 0, as for
    every per-choice nvext field); streamed, in each choice's last chunk."""
    fields = ["engine_data", "completion_token_ids"]
    body = chat(n=3, temperature=1.0, seed=7, nvext={"extra_fields": fields})
    unary = post(fleet, "/v1/chat/completions", body)
    per = unary["nvext"]["choices"]
    assert len(per) == 3
    for c in per:
        assert c["engine_data"]["completion_token_ids"] == c["completion_token_ids"]
        assert len(c["engine_data"]["completion_logprobs"]) == 6
    assert unary["nvext"]["engine_data"] == per[0]["engine_data"]

    deltas: dict[int, list[int]] = {0: [], 1: [], 2: []}
    whole: dict[int, dict] = {}
    for e in stream(fleet, "/v1/chat/completions", body):
        for c in e["choices"]:
            deltas[c["index"]] += e.get("nvext", {}).get("completion_token_ids", [])
            if c.get("finish_reason"):
                whole[c["index"]] = e["nvext"]["engine_data"]
    assert sorted(whole) == [0, 1, 2]
    for i, data in whole.items():
        assert data["completion_token_ids"] == deltas[i] and len(deltas[i]) == 6
        assert len(data["completion_logprobs"]) == 6


def test_completions_batches_carry_each_prompts_ids(fleet):
    prompts = [[1101, 1102, 1103], [1201, 1202]]
    body = {"model": MODEL, "prompt": prompts, "n": 2, "max_tokens": 3, "ignore_eos": True,
            "nvext": {"extra_fields": ["engine_data", "completion_token_ids"]}}
    unary = post(fleet, "/v1/completions", body)
    per = unary["nvext"]["choices"]
    assert len(per) == 4
    for k, c in enumerate(per):
        assert c["engine_data"]["prompt_token_ids"] == prompts[k // 2]
        assert c["engine_data"]["completion_token_ids"] == c["completion_token_ids"]
    ended = {}
    for e in stream(fleet, "/v1/completions", body):
        for c in e["choices"]:
            if c.get("finish_reason"):
                ended[c["index"]] = e["nvext"]["engine_data"]
    assert sorted(ended) == [0, 1, 2, 3]
    for k, data in ended.items():
        assert data["prompt_token_ids"] == prompts[k // 2]
        assert data["completion_token_ids"] == per[k]["completion_token_ids"]
