"""RolloutClient against real vLLM on the tiny model (the session fleet: frontend + 2
workers serving "tiny"): real responses pass every admission check, on both routes, unary
and streamed; a wrong policy expectation is refused. Reads only: no weights change."""

from __future__ import annotations

import httpx
import pytest

from rlfleet.protocol.identity import PolicyIdentity
from rlfleet.rl import RetryPolicy, RolloutClient, SampleFailed, SamplingSpec
from rlfleet.rollout.checks import CHECKS, Expectation, SampleRules, single_policy, weight_spans
from rlfleet.rollout.client import request_body
from rlfleet.rollout.response import parse_openai, parse_sglang
from tests.fleets import MODEL_NAME

pytestmark = pytest.mark.engine

PROMPT = [151644, 8948, 198, 40, 1079, 264]
GREEDY = SamplingSpec(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=True)
SAMPLED = SamplingSpec(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True, prompt_logprobs=True)


@pytest.mark.parametrize("route,n", [("openai", 1), ("openai", 2), ("sglang", 1)])
def test_each_check_passes_a_real_response(vllm_fleet, route, n):
    spec = GREEDY if n == 1 else SAMPLED  # vLLM refuses n > 1 with greedy sampling
    path, body = request_body(route, PROMPT, spec, n, False, MODEL_NAME, f"check-{route}-{n}")
    r = httpx.post(vllm_fleet.url + path, content=body, timeout=120,
                   headers={"content-type": "application/json", "x-request-id": f"check-{route}-{n}"})
    assert r.status_code == 200, r.text
    parse = parse_openai if route == "openai" else parse_sglang
    gen = parse(r.json(), r.headers.get("x-request-id"))
    rules = SampleRules(MODEL_NAME, PolicyIdentity(digest=gen.policy.digest))
    exp = Expectation(f"check-{route}-{n}", PROMPT, n, rules, prompt_logprobs=True)
    assert gen.policy.digest  # the worker reports the checkpoint it serves
    for check in CHECKS:
        check(gen, exp)
    for c in gen.choices:
        assert len(c.token_ids) == 8
        single_policy(weight_spans(c.weight_spans, len(c.token_ids)), rules)


async def test_the_client_admits_real_samples_unary_and_streamed(vllm_fleet):
    async with RolloutClient(vllm_fleet.url, MODEL_NAME, retry=RetryPolicy(2)) as client:
        unary = await client.generate("vllm-unary", PROMPT, GREEDY)
        streamed = await client.generate("vllm-stream", PROMPT, GREEDY, stream=True)
        # (the frontend's streamed /generate carries no input_token_logprobs: unary here)
        sglang = await client.generate("vllm-sglang", PROMPT, GREEDY, route="sglang")
        several = await client.generate("vllm-n2", PROMPT, SAMPLED, n=2, stream=True)
        assert set(client.ledger.admitted()) == {"vllm-unary", "vllm-stream", "vllm-sglang",
                                                 "vllm-n2"}
    assert len(several.completions) == 2
    for s in (unary, streamed, sglang, several):
        assert s.attempt == 1 and s.model == MODEL_NAME and s.policy.digest
        assert s.prompt_logprobs[0] is None and len(s.prompt_logprobs) == len(PROMPT)
        assert all(lp is not None and lp <= 0 for lp in s.prompt_logprobs[1:])
        for c in s.completions:
            assert c.finish_reason == "length" and len(c.token_ids) == len(c.logprobs) == 8
            assert [(w.start, w.end) for w in c.weight_spans] == [(0, 8)]
            assert c.weight_spans[0].digest == s.policy.digest
    # greedy: the same tokens whatever the route or transport
    ids = unary.completion.token_ids
    assert streamed.completion.token_ids == sglang.completion.token_ids == ids
    assert streamed.completion.logprobs == pytest.approx(unary.completion.logprobs, abs=1e-4)


async def test_a_real_sample_from_another_policy_is_refused(vllm_fleet):
    async with RolloutClient(vllm_fleet.url, MODEL_NAME, retry=RetryPolicy(1),
                             expected_version="not-this-one") as client:
        with pytest.raises(SampleFailed) as info:
            await client.generate("vllm-stale", PROMPT, GREEDY)
        assert client.ledger.admitted() == {}
    assert info.value.reason == "identity"
