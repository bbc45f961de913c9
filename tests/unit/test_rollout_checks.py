"""The admission checks, each against a good response and against tampered ones.

Good responses are rendered by the frontend's own renderers (rlfleet.frontend.openai /
sglang) from a synthetic engine result, so they have exactly the wire shape the client
meets; the tampering is done on the JSON, as a broken or hostile server would."""

from __future__ import annotations

import copy

import pytest

from rlfleet.frontend.result import Result
from rlfleet.protocol.openai import CompletionRequest
from rlfleet.protocol.sglang import SglangGenerateRequest
from rlfleet.rl import (
    CheckFailed,
    IdentityMismatch,
    LogprobsMisaligned,
    MixedPolicy,
    NotTerminal,
    PolicyIdentity,
    PromptLogprobsShifted,
    SampleRules,
    TokenIdsMissing,
    WeightSpan,
    WrongAdapter,
)
from rlfleet.rollout.checks import (
    CHECKS,
    Expectation,
    identity,
    logprobs_aligned,
    prompt_logprobs_unshifted,
    single_policy,
    span_adapters,
    terminal_state,
    token_ids_present,
    verify,
    weight_spans,
)
from rlfleet.rollout.response import OpenAIStream, parse_openai, parse_sglang
from tests import render
from tests.render import event

MODEL = "tiny"
RID = "rid-1"
PROMPT = [1000, 1001, 1002, 1003]
TOKENS = [[5, 6, 7, 8], [9, 10, 11]]
FIELDS = ["completion_token_ids", "prompt_token_ids", "prompt_logprobs", "worker_id",
          "detailed_finish_reason", "engine_data", "weight_versions"]


def wspan(version: str, digest: str, start: int, end: int) -> WeightSpan:
    return WeightSpan(version=version, digest=digest, start=start, end=end)


def engine_result(n: int = 1, finish: str = "length", stream: bool = False) -> tuple[Result, list]:
    """A frontend Result as a worker would fill it; also the per-step deltas."""
    res = Result(RID, n)
    res.apply(event({"prompt_token_ids": PROMPT, "worker_id": 7, "weight_version": "v1",
                     "weight_digest": "d1"}))
    deltas = []
    for i in range(n):
        ids = TOKENS[i]
        steps = [[t] for t in ids] if stream else [ids]
        for k, step in enumerate(steps):
            last = k == len(steps) - 1
            deltas += res.apply(event({"choices": [{
                "index": i, "token_ids": step, "text": "".join(f"<{t}>" for t in step),
                "logprobs": [{"token_id": t, "logprob": -0.25 * (t % 4 + 1), "decoded": f"<{t}>",
                              "top": []} for t in step],
                "finish_reason": finish if last else None, "stop_reason": None}]}))
    res.apply(event({"done": True, "prompt_logprobs": [None] + [
        {str(t): {"logprob": -1.5, "rank": 3, "decoded_token": "x"}} for t in PROMPT[1:]]}))
    return res, deltas


def openai_request(n: int = 1, stream: bool = False) -> CompletionRequest:
    return CompletionRequest.model_validate({
        "model": MODEL, "prompt": PROMPT, "n": n, "stream": stream, "logprobs": 0,
        "prompt_logprobs": 0, "return_tokens_as_token_ids": True, "max_tokens": 4,
        "nvext": {"extra_fields": FIELDS}})


def openai_body(n: int = 1, finish: str = "length") -> dict:
    res, _ = engine_result(n, finish)
    return render.completion_response(openai_request(n), res, MODEL)


def openai_chunks(n: int = 1, finish: str = "length") -> list[dict]:
    req = openai_request(n, stream=True)
    res, deltas = engine_result(n, finish, stream=True)
    chunks = [render.completion_chunk(req, res, MODEL, d, 0) for d in deltas]
    return chunks + [render.final_chunk(req, res, MODEL, "text_completion")]


def sglang_body(finish: str = "length") -> dict:
    res, _ = engine_result(1, finish)
    req = SglangGenerateRequest.model_validate({
        "input_ids": PROMPT, "model": MODEL, "return_logprob": True, "logprob_start_len": 0,
        "rid": RID, "sampling_params": {"max_new_tokens": 4}})
    return render.sglang_body(req, res)


def expectation(n: int = 1, expected_version="v1", expected_digest="d1", **rules) -> Expectation:
    expected = PolicyIdentity(version=expected_version, digest=expected_digest)
    return Expectation(RID, PROMPT, n, SampleRules(MODEL, expected, **rules), prompt_logprobs=True)


def rejects(check, gen, exp, error: type[CheckFailed]) -> CheckFailed:
    with pytest.raises(error) as info:
        check(gen, exp)
    assert info.value.check == error.check == check.__name__ or error is MixedPolicy
    return info.value


# ---------------------------------------------------------------- good responses pass

@pytest.mark.parametrize("n", [1, 2])
def test_a_good_openai_response_passes_every_check(n):
    gen = parse_openai(openai_body(n), RID)
    for check in CHECKS:
        check(gen, expectation(n))
    assert [c.token_ids for c in gen.choices] == TOKENS[:n]
    assert gen.worker_id == 7 and gen.policy.version == "v1" and gen.policy.digest == "d1"


@pytest.mark.parametrize("n", [1, 2])
def test_a_good_openai_stream_folds_into_the_unary_response(n):
    acc = OpenAIStream(n, RID)
    assert sum(acc.feed(c) for c in openai_chunks(n)) == sum(map(len, TOKENS[:n]))
    streamed, unary = acc.result(), parse_openai(openai_body(n), RID)
    verify(streamed, expectation(n))
    assert [c.token_ids for c in streamed.choices] == [c.token_ids for c in unary.choices]
    assert [c.logprobs for c in streamed.choices] == [c.logprobs for c in unary.choices]
    assert streamed.prompt_logprobs == unary.prompt_logprobs
    assert streamed.policy == unary.policy


def test_a_good_sglang_response_passes_every_check():
    gen = parse_sglang(sglang_body(), RID)
    for check in CHECKS:
        check(gen, expectation())
    assert gen.choices[0].token_ids == TOKENS[0]


# ---------------------------------------------------------------- 1. token_ids_present

@pytest.mark.parametrize("tamper", [
    lambda b: (b["nvext"].pop("completion_token_ids"),
               b["nvext"]["engine_data"].pop("completion_token_ids")),
    lambda b: b["nvext"].update(completion_token_ids="5 6 7 8"),
    lambda b: b["nvext"]["completion_token_ids"].__setitem__(1, -6),
    lambda b: b["nvext"]["completion_token_ids"].__setitem__(1, "6"),
    lambda b: b["nvext"].update(prompt_token_ids=PROMPT[1:]),
    lambda b: b.pop("nvext"),
])
def test_token_ids_present_rejects_missing_or_broken_ids(tamper):
    body = openai_body()
    tamper(body)
    rejects(token_ids_present, parse_openai(body, RID), expectation(), TokenIdsMissing)


def test_token_ids_present_counts_the_choices():
    body = openai_body(2)
    body["choices"].pop()
    rejects(token_ids_present, parse_openai(body, RID), expectation(2), TokenIdsMissing)
    body = openai_body(2)
    del body["nvext"]["choices"]  # n = 2 needs the per-choice IDs
    rejects(token_ids_present, parse_openai(body, RID), expectation(2), TokenIdsMissing)
    rejects(token_ids_present, parse_openai(openai_body(1), RID), expectation(2), TokenIdsMissing)


def test_token_ids_present_on_sglang():
    body = sglang_body()
    del body["output_ids"]
    rejects(token_ids_present, parse_sglang(body, RID), expectation(), TokenIdsMissing)


# ---------------------------------------------------------------- 2. logprobs_aligned

@pytest.mark.parametrize("tamper", [
    lambda lp: lp["token_logprobs"].pop(),  # one logprob short
    lambda lp: lp["tokens"].reverse(),  # the right tokens, in the wrong order
    lambda lp: lp["tokens"].__setitem__(2, "token_id:99"),
    lambda lp: lp["tokens"].__setitem__(0, "<5>"),  # a decoded string, not an ID
    lambda lp: lp["token_logprobs"].__setitem__(1, 0.7),  # not a log-probability
    lambda lp: lp["token_logprobs"].__setitem__(1, None),
    lambda lp: lp.clear(),
])
def test_logprobs_aligned_rejects_misaligned_logprobs(tamper):
    body = openai_body()
    tamper(body["choices"][0]["logprobs"])
    rejects(logprobs_aligned, parse_openai(body, RID), expectation(), LogprobsMisaligned)


def test_logprobs_aligned_rejects_a_shifted_choice_among_several():
    body = openai_body(2)
    body["choices"][1]["logprobs"]["tokens"] = body["choices"][0]["logprobs"]["tokens"][:3]
    rejects(logprobs_aligned, parse_openai(body, RID), expectation(2), LogprobsMisaligned)


@pytest.mark.parametrize("tamper", [
    lambda m: m["output_token_logprobs"][1].__setitem__(1, 99),
    lambda m: m["output_token_logprobs"].pop(0),
    lambda m: m.pop("output_token_logprobs"),
])
def test_logprobs_aligned_on_sglang(tamper):
    body = sglang_body()
    tamper(body["meta_info"])
    rejects(logprobs_aligned, parse_sglang(body, RID), expectation(), LogprobsMisaligned)


# ---------------------------------------------------------------- 3. prompt_logprobs_unshifted

@pytest.mark.parametrize("tamper", [
    lambda p: p.pop(0),  # shifted left: entry i describes token i+1
    lambda p: p.insert(0, None) or p.pop(),  # shifted right
    lambda p: p.__setitem__(0, {"1000": {"logprob": -1.0}}),
    lambda p: p.__setitem__(2, {"1": {"logprob": -1.0}}),
    lambda p: p.__setitem__(3, None),
    lambda p: p.clear(),
])
def test_prompt_logprobs_unshifted_rejects_shifted_entries(tamper):
    body = openai_body()
    tamper(body["nvext"]["prompt_logprobs"])
    rejects(prompt_logprobs_unshifted, parse_openai(body, RID), expectation(),
            PromptLogprobsShifted)


def test_prompt_logprobs_unshifted_needs_them_only_when_asked():
    body = openai_body()
    del body["nvext"]["prompt_logprobs"]
    gen = parse_openai(body, RID)
    rejects(prompt_logprobs_unshifted, gen, expectation(), PromptLogprobsShifted)
    prompt_logprobs_unshifted(gen, Expectation(RID, PROMPT, 1, SampleRules(MODEL)))


def test_prompt_logprobs_unshifted_on_sglang():
    body = sglang_body()
    lps = body["meta_info"]["input_token_logprobs"]
    assert lps[0][0] is None
    body["meta_info"]["input_token_logprobs"] = [[None, PROMPT[0], None]] + [
        [e[0], t, None] for e, t in zip(lps[1:], PROMPT[2:] + [5], strict=True)]  # off by one
    rejects(prompt_logprobs_unshifted, parse_sglang(body, RID), expectation(),
            PromptLogprobsShifted)


# ---------------------------------------------------------------- 4. terminal_state

@pytest.mark.parametrize("finish", ["abort", None, "content_filter", "cancelled"])
def test_terminal_state_rejects_unrecognised_endings(finish):
    body = openai_body()
    body["choices"][0]["finish_reason"] = finish
    err = rejects(terminal_state, parse_openai(body, RID), expectation(), NotTerminal)
    assert err.finish_reason == finish


def test_terminal_state_on_an_aborted_engine_result():
    gen = parse_openai(openai_body(finish="abort"), RID)
    assert rejects(terminal_state, gen, expectation(), NotTerminal).finish_reason == "abort"
    assert gen.choices[0].detailed_finish_reason == "cancelled"
    gen = parse_sglang(sglang_body(finish="abort"), RID)
    assert rejects(terminal_state, gen, expectation(), NotTerminal).finish_reason == "abort"
    terminal_state(gen, expectation(finish_reasons=frozenset({"length", "stop", "abort"})))


# ---------------------------------------------------------------- 5. identity

@pytest.mark.parametrize("tamper", [
    lambda b: b.update(model="other-model"),
    lambda b: b["nvext"]["engine_data"].update(weight_version="v0"),
    lambda b: b["nvext"]["engine_data"].update(weight_digest="d0"),
    lambda b: b["nvext"].pop("engine_data"),
])
def test_identity_rejects_another_model_or_policy(tamper):
    body = openai_body()
    tamper(body)
    rejects(identity, parse_openai(body, RID), expectation(), IdentityMismatch)


def test_identity_checks_the_echoed_request_id():
    rejects(identity, parse_openai(openai_body(), "rid-2"), expectation(), IdentityMismatch)
    rejects(identity, parse_openai(openai_body(), None), expectation(), IdentityMismatch)


def test_identity_without_an_expected_policy_checks_the_model_only():
    body = openai_body()
    body["nvext"]["engine_data"]["weight_version"] = "anything"
    identity(parse_openai(body, RID), expectation(expected_version=None, expected_digest=None))


@pytest.mark.parametrize("tamper", [
    lambda m: m.update(weight_version="v0"),
    lambda m: m.update(weight_digest="d0"),
    lambda m: m.update(id="someone-else"),
])
def test_identity_on_sglang(tamper):
    body = sglang_body()
    tamper(body["meta_info"])
    rejects(identity, parse_sglang(body, RID), expectation(), IdentityMismatch)


def from_adapter(adapter: str | None, model: str = "a") -> dict:
    """A good response to a request naming `model`, from the LoRA adapter `adapter` (None:
    the base model), as the worker stamps it in engine_data (the frontend echoes `model`)."""
    body = openai_body()
    body["model"] = model
    if adapter is not None:
        body["nvext"]["engine_data"]["weight_adapter"] = adapter
    return body


def adapter_rules(model: str = "a", adapter: bool | None = True, **kw) -> Expectation:
    return Expectation(RID, PROMPT, 1, SampleRules(model, adapter=adapter, **kw))


@pytest.mark.parametrize("served, asked, says", [
    ("b", adapter_rules(), "names adapter 'b'; the request named adapter 'a'"),
    (None, adapter_rules(), "names no adapter (the base model); the request named adapter 'a'"),
    ("a", adapter_rules(MODEL, adapter=False),
     "names adapter 'a'; the request named the base model 'tiny'"),
    ("b", adapter_rules(adapter=None), "names adapter 'b'; the request named 'a'"),
    ("a", adapter_rules(MODEL, adapter=None), "names adapter 'a'; the request named 'tiny'"),
])
def test_a_sample_from_another_adapter_or_the_base_is_refused(served, asked, says):
    """The response's `model` is the request's (the frontend echoes it): the adapter the
    worker reports is what says where the tokens came from."""
    body = from_adapter(served, asked.rules.model)
    with pytest.raises(WrongAdapter) as info:
        identity(parse_openai(body, RID), asked)
    assert says in info.value.reason and info.value.reason.startswith("adapter: ")
    assert isinstance(info.value, IdentityMismatch)


def test_a_sample_from_the_adapter_asked_for_is_admitted_at_the_version_expected():
    identity(parse_openai(from_adapter("a"), RID), adapter_rules())
    identity(parse_openai(from_adapter("a"), RID), adapter_rules(adapter=None))
    identity(parse_openai(from_adapter(None, MODEL), RID), adapter_rules(MODEL, adapter=False))
    identity(parse_openai(from_adapter(None, MODEL), RID), adapter_rules(MODEL, adapter=None))
    expected = adapter_rules(expected=PolicyIdentity(version="a-v2"))
    with pytest.raises(IdentityMismatch, match="policy version 'v1', expected 'a-v2'"):
        identity(parse_openai(from_adapter("a"), RID), expected)
    body = from_adapter(None)
    body["nvext"].pop("engine_data")
    with pytest.raises(WrongAdapter, match="names no policy at all"):
        identity(parse_openai(body, RID), adapter_rules())


def test_every_span_must_come_from_the_adapter_asked_for():
    rules = SampleRules("a", adapter=True)
    mine = WeightSpan(version="a-v1", start=0, end=2, adapter="a")
    span_adapters([mine, WeightSpan(version="a-v2", start=2, end=4, adapter="a")], rules)
    with pytest.raises(WrongAdapter, match=r"span \[2, 4\) names adapter 'b'; the request "
                                           "named adapter 'a'"):
        span_adapters([mine, WeightSpan(version="b-v1", start=2, end=4, adapter="b")], rules)
    with pytest.raises(WrongAdapter, match="no adapter"):
        span_adapters([mine, wspan("v1", "d1", 2, 4)], rules)
    raw = [WeightSpan.of(mine.policy, 0, 4).to_dict()]
    assert weight_spans(raw, 4)[0].adapter == "a"  # the wire carries the span's adapter


# ---------------------------------------------------------------- single_policy (spans)

def spans(*parts: tuple[str, int, int]) -> list[dict]:
    return [{"version": v, "digest": f"d-{v}", "start": s, "end": e} for v, s, e in parts]


def test_single_policy_rejects_mixed_versions_unless_allowed():
    body = openai_body()
    body["nvext"]["weight_versions"] = spans(("v1", 0, 2), ("v2", 2, 4))
    gen = parse_openai(body, RID)
    parsed = weight_spans(gen.choices[0].weight_spans, 4)
    assert parsed == [wspan("v1", "d-v1", 0, 2), wspan("v2", "d-v2", 2, 4)]
    with pytest.raises(MixedPolicy) as info:
        single_policy(parsed, SampleRules(MODEL))
    assert info.value.check == "single_policy"
    single_policy(parsed, SampleRules(MODEL, allow_mixed_versions=True))
    single_policy(weight_spans(spans(("v1", 0, 4)), 4), SampleRules(MODEL))


@pytest.mark.parametrize("raw", [
    spans(("v1", 0, 2), ("v1", 3, 4)),  # a gap
    spans(("v1", 0, 3)),  # short of the 4 tokens
    spans(("v1", 1, 4)),
    [{"version": "v1"}],
    "v1",
])
def test_weight_spans_must_cover_the_tokens(raw):
    with pytest.raises(MixedPolicy):
        weight_spans(raw, 4)


def test_verify_stops_at_the_first_failed_check():
    body = openai_body()
    body["model"] = "other"
    body["choices"][0]["finish_reason"] = "abort"
    with pytest.raises(NotTerminal):  # terminal_state runs before identity
        verify(parse_openai(body, RID), expectation())
    verify(parse_openai(copy.deepcopy(openai_body()), RID), expectation())
