"""nvext.engine_data in Dynamo's shape, rendered by the frontend's own renderers from a
Result as a worker fills it, and read back by the rollout client from engine_data alone
(what a server that fills only engine_data sends)."""

from __future__ import annotations

import pytest

from rlfleet.frontend.result import Result
from rlfleet.protocol.identity import PolicyIdentity
from rlfleet.protocol.openai import ChatCompletionRequest, CompletionRequest
from rlfleet.rollout.response import OpenAIStream, parse_openai
from tests import render
from tests.render import event

PROMPT = [1000, 1001, 1002]
TOKENS = [[5, 6, 7], [8, 9, 10]]
POLICY = PolicyIdentity(version="v3", digest="d3", step=3)
ONLY = {"extra_fields": ["engine_data"]}


def lp(t: int) -> float:
    return -0.5 - t / 100


def filled(n: int, stream: bool) -> tuple[Result, list]:
    """A Result as a worker fills it (one token per step when `stream`), and its deltas."""
    res = Result("rid", n)
    res.apply(event({"prompt_token_ids": PROMPT, "worker_id": 1, **POLICY.stamped()}))
    deltas = []
    for i in range(n):
        steps = [[t] for t in TOKENS[i]] if stream else [TOKENS[i]]
        for k, step in enumerate(steps):
            deltas += res.apply(event({"choices": [{
                "index": i, "token_ids": step, "text": "x" * len(step),
                "logprobs": [{"token_id": t, "logprob": lp(t), "decoded": "x", "top": []}
                             for t in step],
                "finish_reason": "length" if k == len(steps) - 1 else None}]}))
    res.apply(event({"done": True}))
    return res, deltas


def whole(i: int) -> dict:
    return {**POLICY.stamped(), "completion_token_ids": TOKENS[i], "finished": True,
            "completion_logprobs": [lp(t) for t in TOKENS[i]], "prompt_token_ids": PROMPT}


def test_asked_only_for_engine_data_the_engine_computes_the_sampled_logprobs():
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest.model_validate({**chat, "nvext": ONLY}).engine_logprobs == 0
    assert ChatCompletionRequest.model_validate(chat).engine_logprobs is None
    assert ChatCompletionRequest.model_validate(
        {**chat, "logprobs": True, "top_logprobs": 2, "nvext": ONLY}).engine_logprobs == 2
    assert CompletionRequest.model_validate(
        {"model": "m", "prompt": PROMPT, "nvext": ONLY}).engine_logprobs == 0
    assert CompletionRequest.model_validate(
        {"model": "m", "prompt": PROMPT, "logprobs": 3, "nvext": ONLY}).engine_logprobs == 3
    assert CompletionRequest.model_validate({"model": "m", "prompt": PROMPT}).engine_logprobs \
        is None


@pytest.mark.parametrize("n", [1, 2])
def test_unary_engine_data_per_choice_and_the_client_reads_it(n):
    req = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "n": n, "nvext": ONLY})
    res, _ = filled(n, stream=False)
    body = render.chat_response(req, res, "m")
    assert body["nvext"]["engine_data"] == whole(0)
    assert body["choices"][0]["logprobs"] is None  # not asked for in the OpenAI body
    if n > 1:
        assert [c["engine_data"] for c in body["nvext"]["choices"]] == [whole(0), whole(1)]
    gen = parse_openai(body)
    assert gen.prompt_token_ids == PROMPT and gen.policy == POLICY
    assert [c.token_ids for c in gen.choices] == TOKENS[:n]


def test_streamed_engine_data_in_each_choices_last_chunk():
    req = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2, "stream": True,
        "nvext": ONLY})
    res, deltas = filled(2, stream=True)
    chunks = [render.chat_chunk(req, res, "m", d, False) for d in deltas]
    last = {c["choices"][0]["index"]: c["nvext"]["engine_data"] for c in chunks
            if c["choices"][0]["finish_reason"]}
    assert last == {0: whole(0), 1: whole(1)}
    for c in chunks:
        if not c["choices"][0]["finish_reason"]:
            assert c["nvext"]["engine_data"] == POLICY.stamped()
    final = render.final_chunk(req, res, "m")
    assert final is not None and final["nvext"]["engine_data"] == POLICY.stamped()
    folded = OpenAIStream(2)
    assert sum(folded.feed(c) for c in chunks + [final]) == 6
    gen = folded.result()
    assert [c.token_ids for c in gen.choices] == TOKENS and gen.prompt_token_ids == PROMPT


def test_a_completion_batch_names_each_prompts_ids():
    req = CompletionRequest.model_validate({
        "model": "m", "prompt": [PROMPT, PROMPT[:2]], "max_tokens": 3, "nvext": ONLY})
    a, _ = filled(1, stream=False)
    b = Result("rid", 1)
    b.apply(event({"prompt_token_ids": PROMPT[:2], "worker_id": 1, **POLICY.stamped()}))
    b.apply(event({"choices": [{"index": 0, "token_ids": [4], "text": "x", "finish_reason": "stop"}]}))
    body = render.completion_response(req, [a, b], "m")
    first, second = body["nvext"]["choices"]
    assert first["engine_data"] == whole(0)
    # no logprobs from the engine: no completion_logprobs (Dynamo omits what it lacks)
    assert second["engine_data"] == {**POLICY.stamped(), "completion_token_ids": [4],
                                     "finished": True, "prompt_token_ids": PROMPT[:2]}
