"""The OpenAI request models against vLLM's own: every field vLLM's completions and chat
routes accept is known (honoured, refused by name, or of no effect on these routes), and
what the engine would refuse is refused before it reaches a worker, naming the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rlfleet.protocol.engine import InvalidParam
from rlfleet.protocol.openai import (
    NO_EFFECT,
    REFUSED,
    ChatCompletionRequest,
    CompletionRequest,
)
from rlfleet.runtime.request_checks import check_sampling


def cmpl(**kw) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **kw})


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw})


def _vllm_requests() -> tuple[type, type]:
    """vLLM's own request models, imported when the module is collected: vLLM's first import
    starts a process (its platform probe), which a unit test may not."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest as VllmCompletion

    return VllmCompletion, ChatCompletionRequest


_VLLM_REQUESTS = _vllm_requests()


def test_every_vllm_field_is_known() -> None:
    """Finding 1: an unknown field is ignored (as vLLM ignores it), so every field vLLM
    reads must be one of ours, or a sampler the caller set would be silently dropped."""
    VCmpl, VChat = _VLLM_REQUESTS
    assert set(VCmpl.model_fields) <= set(CompletionRequest.model_fields)
    assert set(VChat.model_fields) <= set(ChatCompletionRequest.model_fields)
    for name in [*REFUSED, *NO_EFFECT]:
        assert name in CompletionRequest.model_fields or name in ChatCompletionRequest.model_fields


def test_samplers_reach_the_engine_options() -> None:
    req = cmpl(logit_bias={"151645": 100, "7": -300}, allowed_token_ids=[1, 2],
               bad_words=["x"], stream=True,
               stream_options={"include_usage": True, "continuous_usage_stats": True},
               return_token_ids=True, spaces_between_special_tokens=False,
               stream_interval=3, min_tokens=2, seed=-1)
    s = check_sampling(req.sampling(req.max_tokens, req.logprobs))
    assert s.logit_bias == {151645: 100.0, 7: -100.0}  # clamped as vLLM clamps
    assert s.allowed_token_ids == [1, 2] and s.bad_words == ["x"]
    assert s.spaces_between_special_tokens is False and s.stream_interval == 3
    assert s.min_tokens == 2 and s.seed is None  # -1: no seed (vLLM's convention)
    assert req.include_usage and req.continuous_usage and req.return_token_ids


@pytest.mark.parametrize("name, value", [
    ("use_beam_search", True), ("suffix", "x"), ("prompt_embeds", "AAAA"),
    ("kv_transfer_params", {"a": 1}), ("vllm_xargs", {"a": 1}), ("logprob_token_ids", [1]),
])
def test_refused_fields_are_named(name: str, value) -> None:
    req = cmpl(**{name: value})
    with pytest.raises(InvalidParam) as e:
        req.refusals()
    assert e.value.param == name


def test_chat_refusals_name_the_field() -> None:
    with pytest.raises(InvalidParam) as e:
        chat(chat_template="{{ x }}").refusals()
    assert e.value.param == "chat_template"
    with pytest.raises(InvalidParam) as e:
        chat(tools=[{"type": "function", "function": {"name": "f"}}]).refusals()
    assert e.value.param == "tool_choice"  # "auto" needs a tool parser
    chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="none").refusals()


@pytest.mark.parametrize("kw, param", [
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"seed": 1 << 70}, "seed"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"n": 0}, "n"),
    ({"n": 2, "temperature": 0}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"stop_token_ids": [1 << 64]}, "stop_token_ids"),
])
def test_engine_refusals_before_the_engine(kw: dict, param: str) -> None:
    """Finding 2: what vLLM's engine would refuse is a 400 naming the field (before, a
    500 that broke the connection)."""
    req = cmpl(**kw)
    with pytest.raises(InvalidParam) as e:
        check_sampling(req.sampling(req.max_tokens, req.logprobs))
    assert e.value.param == param


def test_vllm_acceptances() -> None:
    """Finding 3: batch prompts, no model, numeric strings; and stream_options only with
    stream."""
    assert cmpl(prompt=["a", "b"]).prompts == ["a", "b"]
    assert cmpl(prompt=[[1, 2], [3]]).prompts == [[1, 2], [3]]
    assert cmpl(prompt=[1, 2]).prompts == [[1, 2]]
    assert CompletionRequest.model_validate({"prompt": "x"}).model is None
    req = cmpl(max_tokens="5", temperature="0.5", n="2")
    assert (req.max_tokens, req.temperature, req.n) == (5, 0.5, 2)
    with pytest.raises(ValidationError, match="must be an integer"):  # as vLLM: not these
        cmpl(logprobs="1")
    with pytest.raises(ValidationError, match="stream=True"):
        cmpl(stream_options={"include_usage": True})
    cmpl(stream=True, stream_options={"include_usage": True})


def test_echo_asks_for_prompt_logprobs() -> None:
    """Finding 4: echo with logprobs keeps the prompt's logprobs (vLLM's rule)."""
    assert cmpl(echo=True, logprobs=2).engine_prompt_logprobs == 2
    assert cmpl(echo=True, logprobs=2, prompt_logprobs=0).engine_prompt_logprobs == 0
    assert cmpl(logprobs=2).engine_prompt_logprobs is None


@pytest.mark.parametrize("content", [
    [{"type": "text", "text": 5}], [{"type": "text", "text": None}], [{"type": "image_url"}],
    ["just a string"], 7,
])
def test_non_text_content_parts_are_a_validation_error(content) -> None:
    """Issue 10, finding 10: non-string text parts are refused (a 400), not a 500."""
    with pytest.raises(ValidationError):
        chat(messages=[{"role": "user", "content": content}])
