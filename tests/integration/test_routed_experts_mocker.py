"""Routed experts on the wire (request plane, OpenAI routes unary and streamed, rollout
client, NextTurn), from mocker workers that simulate a MoE engine (--routed-experts: a
declared simulator; its experts are a hash, not a model's routing). vLLM's CPU build
cannot return routed experts (see docs/routing.md: routed experts)."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import httpx
import numpy as np
import pytest

from rlfleet.rollout.client import RolloutClient
from rlfleet.rollout.sample import NextTurn, SamplingSpec
from rlfleet.runtime.routed_experts import as_array, from_npy_b64

MODEL = "mock-moe"
LAYERS, TOPK = 3, 2


@pytest.fixture(scope="module")
def fleet(start_module_fleet):
    return start_module_fleet([("--served-model-name", MODEL, "--routed-experts",
                                f"{LAYERS}x8x{TOPK}", "--eos-prob", "0.05")],
                              model=MODEL, frontend=())


def _post(url: str, path: str, **body):
    r = httpx.post(f"{url}{path}", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r


def _sse(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines()
            if line.startswith("data: {")]


PROMPT = list(range(200, 230))
WANT = {"nvext": {"extra_fields": ["routed_experts", "completion_token_ids"]}}


def test_unary_and_streamed_completions_carry_one_row_per_token(fleet):
    body = _post(fleet.url, "/v1/completions", prompt=PROMPT, max_tokens=12, seed=3,
                 **WANT).json()
    ch = body["choices"][0]
    toks = body["nvext"]["completion_token_ids"]
    # vLLM's encoding, read as a vLLM client reads it
    arr = np.load(io.BytesIO(base64.b64decode(ch["routed_experts"])))
    assert arr.shape == (len(toks), LAYERS, TOPK) and arr.dtype == np.uint8
    assert arr.size == len(toks) * LAYERS * TOPK
    assert all(len(set(row)) == TOPK for row in arr.reshape(-1, TOPK).tolist())
    chunks = _sse(_post(fleet.url, "/v1/completions", prompt=PROMPT, max_tokens=12, seed=3,
                        stream=True, **WANT))
    streamed = [c["choices"][0]["routed_experts"] for c in chunks
                if c.get("choices") and c["choices"][0].get("routed_experts")]
    assert streamed == [ch["routed_experts"]]  # once, in the choice's last chunk


def test_vllm_prompt_start_and_chat(fleet):
    body = _post(fleet.url, "/v1/completions", prompt=PROMPT, max_tokens=6, seed=1,
                 ignore_eos=True, routed_experts_prompt_start=10).json()
    r = from_npy_b64(body["choices"][0]["routed_experts"], 10)
    assert r.tokens == len(PROMPT) + 6 - 1 - 10  # vLLM's rows: forwarded tokens from 10
    chat = _post(fleet.url, "/v1/chat/completions", max_tokens=5, ignore_eos=True,
                 messages=[{"role": "user", "content": "hi"}], **WANT).json()
    assert from_npy_b64(chat["choices"][0]["routed_experts"]).tokens == 5
    plain = _post(fleet.url, "/v1/completions", prompt=PROMPT, max_tokens=3).json()
    assert "routed_experts" not in plain["choices"][0]  # not asked
    bad = httpx.post(f"{fleet.url}/v1/completions", json={
        "model": MODEL, "prompt": PROMPT, "routed_experts_prompt_start": len(PROMPT) + 1},
        timeout=30)
    assert bad.status_code == 400 and "routed_experts_prompt_start" in bad.text


@pytest.mark.parametrize("stream", [False, True])
def test_rollout_client_keeps_experts_across_turns(fleet, stream):
    async def go():
        async with RolloutClient(fleet.url, MODEL) as client:
            spec = SamplingSpec(max_tokens=10, routed_experts=True, seed=5)
            first = await client.generate(f"t1-{stream}", PROMPT, spec, stream=stream)
            nxt = NextTurn(first, [{"role": "user", "content": "and then?"}])
            second = await client.generate(f"t2-{stream}", nxt, spec, stream=stream)
            return first, second

    first, second = asyncio.run(go())
    c1 = first.completion
    assert c1.routed_experts is not None
    assert as_array(c1.routed_experts).shape == (len(c1.token_ids), LAYERS, TOPK)
    assert c1.routed_experts.start == len(first.prompt_ids) - 1
    assert second.prompt_routed_experts == (c1.routed_experts,)  # the earlier turn's
    c2 = second.completion
    assert c2.routed_experts.tokens == len(c2.token_ids)
    assert c2.routed_experts.start == len(second.prompt_ids) - 1
    # the earlier turn's tokens are in the continuation's prompt where its experts say
    at = c1.routed_experts.start + 1
    assert second.prompt_ids[at:at + len(c1.token_ids)] == c1.token_ids
