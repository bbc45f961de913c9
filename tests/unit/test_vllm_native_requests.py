"""vLLM's own serving routes' request models against vLLM's: every field vLLM's
/inference/v1/generate, /tokenize and /detokenize accept is known (honoured, or refused by
name), every field of vLLM's responses is in rlfleet's, and the engine request is what
vLLM would run."""

from __future__ import annotations

import msgspec
import pytest
from pydantic import ValidationError

from rlfleet.protocol.engine import InvalidParam
from rlfleet.protocol.vllm_native import (
    GENERATE_REFUSED,
    SAMPLING_REFUSED,
    TOKENIZE_REFUSED,
    DetokenizeRouteRequest,
    GenerateChoice,
    GenerateLogProb,
    GenerateLogProbsContent,
    SamplingParamsIn,
    TextLogProbsContent,
    TokenizeRouteRequest,
    TokenizeRouteResponse,
    TokensGenerateChunk,
    TokensGenerateRequest,
    TokensGenerateResponse,
    Tool,
    UsageInfo,
)
from rlfleet.runtime.request_checks import check_sampling


def _vllm() -> dict[str, type]:
    """vLLM's own models, imported when the module is collected: vLLM's first import starts
    a process (its platform probe), which a unit test may not."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam
    from vllm.entrypoints.scale_out.token_in_token_out import protocol as tito
    from vllm.entrypoints.serve.engine.protocol import UsageInfo as VUsage
    from vllm.entrypoints.serve.tokenize import protocol as tok
    from vllm.sampling_params import SamplingParams

    return {"generate": tito.GenerateRequest, "sampling": SamplingParams,
            "tokens_response": tito.GenerateTokensResponse,
            "text_response": tito.GenerateTextResponse,
            "tokens_choice": tito.GenerateTokensChoice, "text_choice": tito.GenerateTextChoice,
            "tokens_chunk": tito.GenerateTokensStreamResponse,
            "tokens_stream_choice": tito.GenerateTokensStreamChoice,
            "logprob": tito.GenerateLogProb, "logprobs_content": tito.GenerateLogProbsContent,
            "tokenize_text": tok.TokenizeCompletionRequest, "tokenize_chat": tok.TokenizeChatRequest,
            "tokenize_response": tok.TokenizeResponse, "detokenize": tok.DetokenizeRequest,
            "usage": VUsage, "tool": ChatCompletionToolsParam}


VLLM = _vllm()


def gen(sampling: dict | None = None, **kw) -> TokensGenerateRequest:
    return TokensGenerateRequest.model_validate(
        {"token_ids": [1, 2, 3], "sampling_params": sampling or {}, **kw})


def fields(struct: type) -> set[str]:
    return set(struct.__struct_fields__)


def test_every_vllm_request_field_is_known() -> None:
    assert set(VLLM["generate"].model_fields) <= set(TokensGenerateRequest.model_fields)
    public = {f.name for f in msgspec.structs.fields(VLLM["sampling"]) if not f.name.startswith("_")}
    assert public <= set(SamplingParamsIn.model_fields), public - set(SamplingParamsIn.model_fields)
    assert set(VLLM["tokenize_text"].model_fields) | set(VLLM["tokenize_chat"].model_fields) \
        <= set(TokenizeRouteRequest.model_fields)
    assert set(VLLM["detokenize"].model_fields) <= set(DetokenizeRouteRequest.model_fields)


def test_every_vllm_response_field_is_sent() -> None:
    assert set(VLLM["tokens_response"].model_fields) <= fields(TokensGenerateResponse)
    assert set(VLLM["text_response"].model_fields) <= fields(TokensGenerateResponse)
    assert set(VLLM["tokens_choice"].model_fields) <= fields(GenerateChoice)
    assert set(VLLM["text_choice"].model_fields) <= fields(GenerateChoice)
    assert set(VLLM["tokens_stream_choice"].model_fields) <= fields(GenerateChoice)
    # a stream chunk: vLLM leaves mm_placeholders and metrics out while they are null
    assert set(VLLM["tokens_chunk"].model_fields) - {"mm_placeholders", "metrics"} \
        <= fields(TokensGenerateChunk)
    assert set(VLLM["logprob"].model_fields) == fields(GenerateLogProb)
    assert set(VLLM["logprobs_content"].model_fields) == fields(GenerateLogProbsContent)
    assert set(VLLM["tokenize_response"].model_fields) == fields(TokenizeRouteResponse)
    assert set(VLLM["usage"].model_fields) == fields(UsageInfo)
    assert {"token", "logprob", "bytes", "top_logprobs"} == fields(TextLogProbsContent)


def test_a_vllm_clients_request_reaches_the_engine_as_sent() -> None:
    req = gen({"max_tokens": "8", "temperature": 0.5, "top_k": 3, "stop": "x", "seed": 7,
               "logprobs": 2, "logit_bias": {"5": 200}, "min_tokens": 1, "n": 2,
               "output_kind": 2, "skip_clone": True, "flat_logprobs": True, "unknown": 1},
              return_token_ids=True, cache_salt="s", priority=3, something_new=True)
    req.refusals()
    s = check_sampling(req.sampling_params.engine(stream=False))
    assert (s.max_tokens, s.temperature, s.top_k, s.stop, s.seed, s.logprobs, s.n) == \
        (8, 0.5, 3, ["x"], 7, 2, 2)
    assert s.logit_bias == {5: 100.0} and s.min_tokens == 1  # clamped as vLLM clamps


def test_max_tokens_not_sent_is_the_room_the_prompt_leaves() -> None:
    """vLLM's server: sampling_params without max_tokens is not its dataclass default 16,
    but what the context leaves (rlfleet: None, clamped by the worker)."""
    assert gen({}).sampling_params.engine(stream=False).max_tokens is None
    assert gen({"max_tokens": 16}).sampling_params.engine(stream=False).max_tokens == 16


def test_prompt_logprobs_are_not_computed_for_a_stream() -> None:
    """vLLM's stream chunks have no place for them."""
    req = gen({"prompt_logprobs": 1})
    assert req.sampling_params.engine(stream=True).prompt_logprobs is None
    assert req.sampling_params.engine(stream=False).prompt_logprobs == 1


def test_routed_experts_are_asked_for_when_their_start_is_sent() -> None:
    assert gen({}).sampling_params.routed_experts_start is None
    assert gen({"routed_experts_prompt_start": 2}).sampling_params.routed_experts_start == 2


@pytest.mark.parametrize("name", sorted(SAMPLING_REFUSED))
def test_sampling_fields_rlfleet_cannot_honour_are_refused_by_name(name: str) -> None:
    value = {"prompt_logprob_token_ids": [[1]], "prompt_logprob_start": 0,
             "logprob_token_ids": [1], "extra_args": {"a": 1},
             "repetition_detection": {"max_pattern_size": 2, "min_count": 2},
             "trace_decode_token_ids": [1]}[name]
    with pytest.raises(InvalidParam) as e:
        gen({name: value}).refusals()
    assert e.value.param == f"sampling_params.{name}"


@pytest.mark.parametrize("name", sorted(GENERATE_REFUSED))
def test_request_fields_rlfleet_cannot_honour_are_refused_by_name(name: str) -> None:
    value = [{"type": "image_url", "url": "x"}] if name == "content_parts" else {"a": 1}
    with pytest.raises(InvalidParam) as e:
        gen(**{name: value}).refusals()
    assert e.value.param == name


def _refused_cases() -> list[tuple[str, str, object, object]]:
    """(where, field, an empty value, a set value) for every field refused when set; the
    values follow each field's type."""
    def values(model: type, name: str) -> tuple[list[object], object]:
        kind = str(model.model_fields[name].annotation)
        if kind.startswith("dict"):
            return [None, {}], {"k": 1}
        if kind.startswith("list[list"):
            return [None, []], [[1]]
        if kind.startswith("list[dict"):
            return [None, []], [{"type": "text", "text": "x"}]
        if kind.startswith("list"):
            return [None, []], [1]
        return [None], 1
    cases = []
    for where, model, names in (("sampling", SamplingParamsIn, SAMPLING_REFUSED),
                                ("request", TokensGenerateRequest, GENERATE_REFUSED)):
        for name in names:
            empties, value = values(model, name)
            cases += [(where, name, e, value) for e in empties]
    return cases


def _with(where: str, name: str, value: object) -> TokensGenerateRequest:
    if where == "sampling":
        return gen({"max_tokens": 4, name: value})
    return gen({"max_tokens": 4}, **{name: value})


@pytest.mark.parametrize(("where", "name", "empty", "value"), _refused_cases())
def test_empty_refused_fields_are_not_refused(where: str, name: str, empty: object,
                                              value: object) -> None:
    """A refused field sent empty (as clients serialise their defaults) is not refused, and
    the engine runs what it would without it; the same field with a value is refused."""
    plain = gen({"max_tokens": 4})
    req = _with(where, name, empty)
    req.refusals()
    assert req.sampling_params.engine(False) == plain.sampling_params.engine(False)
    with pytest.raises(InvalidParam) as e:
        _with(where, name, value).refusals()
    assert e.value.param in (name, f"sampling_params.{name}")


@pytest.mark.parametrize("body", [
    {"token_ids": [], "sampling_params": {}},
    {"token_ids": [1, -2], "sampling_params": {}},
    {"token_ids": [1]},
    {"token_ids": [1], "sampling_params": {}, "output_mode": "words"},
    {"token_ids": [1], "sampling_params": {"detokenize": False}, "output_mode": "text"},
])
def test_what_vllm_refuses_is_refused(body: dict) -> None:
    with pytest.raises(ValidationError):
        TokensGenerateRequest.model_validate(body)


def test_stop_strings_need_detokenize() -> None:
    with pytest.raises(InvalidParam, match="detokenize"):
        gen({"stop": ["x"], "detokenize": False}).refusals()


def test_continuous_usage_only_with_include_usage() -> None:
    """vLLM: continuous_usage_stats counts only with include_usage."""
    assert not gen(stream=True, stream_options={"continuous_usage_stats": True}).continuous_usage
    assert gen(stream=True, stream_options={"include_usage": True,
                                            "continuous_usage_stats": True}).continuous_usage


# ------------------------------------------------------------------ tokenize


def tok(**kw) -> TokenizeRouteRequest:
    return TokenizeRouteRequest.model_validate(kw)


def test_tokenize_text_adds_special_tokens_unless_told_not_to() -> None:
    assert tok(prompt="hi").engine_request().add_special_tokens is True
    r = tok(prompt="hi", add_special_tokens=False, return_token_strs=True).engine_request()
    assert r.add_special_tokens is False and r.return_token_strs is True and r.prompt == "hi"


def test_tokenize_chat_form() -> None:
    r = tok(model="m", messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                              {"type": "text", "text": "b"}]}],
            add_generation_prompt=False, continue_final_message=True,
            chat_template_kwargs={"add_generation_prompt": True, "enable_thinking": False},
            tools=[{"type": "function", "function": {"name": "f"}}]).engine_request()
    assert r.messages == [{"role": "user", "content": "ab"}]
    assert r.add_special_tokens is False  # the template adds them
    kw = r.chat_template_kwargs
    # vLLM's merge: the request's own fields win over chat_template_kwargs
    assert kw["add_generation_prompt"] is False and kw["continue_final_message"] is True
    assert kw["enable_thinking"] is False
    assert kw["tools"] == [{"type": "function",
                            "function": {"name": "f", "description": None, "parameters": None}}]


def test_messages_win_over_prompt_as_in_vllm() -> None:
    assert tok(prompt="x", messages=[{"role": "user", "content": "y"}]).chat


@pytest.mark.parametrize("tool", [
    {"type": "function", "function": {"name": "f", "x": 1}, "extra": 2},
    {"function": {"name": "f", "parameters": {"type": "object"}, "strict": True},
     "defer_loading": False},
    {"function": {"name": "f", "description": "d", "defer_loading": True}},
])
def test_tools_reach_the_template_as_vllm_hands_them_over(tool: dict) -> None:
    assert Tool.model_validate(tool).for_template() == \
        VLLM["tool"].model_validate(tool).model_dump()


@pytest.mark.parametrize("body", [
    {"prompt": "x", "continue_final_message": True, "add_generation_prompt": True},
    {"model": "m"},
    {"messages": []},
])
def test_tokenize_refusals_as_vllm(body: dict) -> None:
    with pytest.raises(ValidationError):
        tok(**body)


@pytest.mark.parametrize("name", sorted(TOKENIZE_REFUSED))
def test_tokenize_chat_fields_rlfleet_cannot_honour_are_refused_by_name(name: str) -> None:
    value = "{{ messages }}" if name == "chat_template" else {"image": {"a": 1}}
    with pytest.raises(InvalidParam) as e:
        tok(messages=[{"role": "user", "content": "x"}], **{name: value}).refusals()
    assert e.value.param == name


def test_detokenize_takes_token_ids() -> None:
    assert DetokenizeRouteRequest.model_validate({"tokens": [1, 2], "x": 1}).tokens == [1, 2]
    for bad in ([-1], [1 << 63], "12"):
        with pytest.raises(ValidationError):
            DetokenizeRouteRequest.model_validate({"tokens": bad})


# ------------------------------------------------------------------ render


def test_render_truncates_as_the_engine_would() -> None:
    from rlfleet.frontend.vllm_native.routes import _truncated
    from rlfleet.runtime.http import HttpError

    ids = [1, 2, 3, 4, 5]
    assert _truncated(ids, None, None, 10) == ids
    assert _truncated(ids, 2, None, 10) == [4, 5]  # vLLM's default side: the left
    assert _truncated(ids, 2, "right", 10) == [1, 2]
    assert _truncated(ids, -1, None, 4) == [3, 4, 5]  # the context less one
    with pytest.raises(HttpError, match="truncate_prompt_tokens"):
        _truncated(ids, 11, None, 10)


def test_rendered_request_is_vllms_generate_request() -> None:
    from rlfleet.frontend.vllm_native.render import rendered_body as _rendered
    from rlfleet.protocol.openai import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True,
        "stream_options": {"include_usage": True}, "seed": 3, "logprobs": True,
        "top_logprobs": 2, "stop": "z"})
    s = req.sampling(7, req.engine_logprobs)
    out = _rendered(req, "chatcmpl-a", [1, 2], s)
    assert set(out) == set(VLLM["generate"].model_fields)
    assert out["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    sp = out["sampling_params"]
    assert (sp["seed"], sp["logprobs"], sp["stop"], sp["max_tokens"], sp["output_kind"]) == \
        (3, 2, ["z"], 7, 1)
    # it is a request vLLM's own model reads, with the same parameters
    parsed = VLLM["generate"].model_validate(out)
    assert parsed.token_ids == [1, 2] and parsed.sampling_params.seed == 3
    assert parsed.sampling_params.max_tokens == 7 and parsed.sampling_params.stop == ["z"]
