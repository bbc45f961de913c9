"""What an engine would refuse of a generation request, checked before it reaches one:
vLLM's rules for sampling parameters (`SamplingParams._verify_args` and the engine's limits)
and for the request's own values (prompt, truncation, priority, cache salt, routed experts),
in vLLM's words. `InvalidParam` (rlfleet.protocol.engine) says what is wrong and names the
parameter.

One owner, called where a request is built or decoded: the frontends check what they build
(rlfleet.frontend.generation.engine_request), and a worker checks what its request plane
decodes (rlfleet.worker.stream_server, and a commit's probe in rlfleet.worker.admin), so a
caller that reaches a worker directly is held to the same rules. The checks also put two
values in vLLM's normal form: a seed of -1 becomes none, a logit bias is clamped to
[-100, 100]."""

from __future__ import annotations

import math

from rlfleet.protocol.engine import MAX_LOGPROBS, MAX_N, GenerateRequest, InvalidParam, SamplingOptions

MAX_STOP_STRINGS = 4  # vLLM's default VLLM_MAX_STOP_STRINGS
INT64 = (-(1 << 63), (1 << 63) - 1)
GREEDY = 1e-5  # below this temperature vLLM samples greedily


def check_request(req: GenerateRequest) -> GenerateRequest:
    """`req`, its sampling options and its own values checked (InvalidParam: the first
    refused)."""
    check_sampling(req.sampling)
    _check_prompt(req)
    t = req.truncate_prompt_tokens
    if t is not None and not -1 <= t <= INT64[1]:
        raise InvalidParam(f"truncate_prompt_tokens must be -1 or at least 0, got {t}",
                           "truncate_prompt_tokens")
    _int64("priority", req.priority)
    r = req.routed_experts_start
    if r is not None and not -1 <= r <= INT64[1]:
        raise InvalidParam(f"routed_experts_prompt_start must be at least 0, got {r}",
                           "routed_experts_prompt_start")
    salt = req.cache_salt
    if salt is not None and (not salt or len(salt) > 128
                             or any(c in "@/\\\x00" for c in salt)):
        raise InvalidParam("Parameter 'cache_salt' must be a non-empty string of at most 128 "
                           "characters and must not contain '@', '/', '\\\\', or NUL.",
                           "cache_salt")
    return req


def _check_prompt(req: GenerateRequest) -> None:
    """A prompt that is not empty, of token IDs where given as IDs."""
    if req.prompt is not None and not req.prompt:
        raise InvalidParam("prompt is empty: send at least one character or token ID", "prompt")
    if req.prompt_token_ids is not None:
        ids = req.prompt_token_ids
        if not ids:
            raise InvalidParam("prompt is empty: send at least one token ID", "prompt")
        if min(ids) < 0 or max(ids) > INT64[1]:
            bad = next(t for t in ids if not 0 <= t <= INT64[1])
            raise InvalidParam(f"prompt token ID {bad} is not a token ID", "prompt")
    if req.messages is not None and not req.messages:
        raise InvalidParam("messages is empty: send at least one message", "messages")


def check_sampling(s: SamplingOptions) -> SamplingOptions:
    """`s` checked by vLLM's own rules for sampling parameters, with vLLM's wording, and
    put in vLLM's normal form (InvalidParam: the first refused)."""
    _check_numbers(s)
    _check_lengths(s)
    _check_token_lists(s)
    if s.stream_interval is not None and s.stream_interval < 1:
        raise InvalidParam(f"stream_interval must be at least 1, got {s.stream_interval}.",
                           "stream_interval")
    if s.temperature < GREEDY and s.n > 1:
        raise InvalidParam(f"n must be 1 when using greedy sampling, got {s.n}.", "n")
    return s


def _finite(name: str, v: float) -> None:
    if not math.isfinite(v):
        raise InvalidParam(f"{name} must be a finite number, got {v}.", name)


def _int64(name: str, v: int | None) -> None:
    if v is not None and not INT64[0] <= v <= INT64[1]:
        raise InvalidParam(f"{name}: {v} does not fit in a signed 64-bit integer", name)


def _check_numbers(s: SamplingOptions) -> None:
    """The scalar parameters: 64-bit, finite, in vLLM's ranges (a seed of -1 is none)."""
    for name in ("top_k", "max_tokens", "min_tokens", "stream_interval"):
        _int64(name, getattr(s, name))
    for name in ("stop_token_ids", "allowed_token_ids"):
        for t in getattr(s, name) or ():
            _int64(name, t)
    for t in s.logit_bias or ():
        _int64("logit_bias", t)
    if not 1 <= s.n <= MAX_N:
        raise InvalidParam(f"n must be between 1 and {MAX_N}, got {s.n}.", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(s, name)
        _finite(name, v)
        if not -2.0 <= v <= 2.0:
            raise InvalidParam(f"{name} must be in [-2, 2], got {v}.", name)
    _finite("repetition_penalty", s.repetition_penalty)
    if s.repetition_penalty <= 0.0:
        raise InvalidParam(f"repetition_penalty must be greater than zero, got "
                           f"{s.repetition_penalty}.", "repetition_penalty")
    _finite("temperature", s.temperature)
    if not 0.0 <= s.temperature <= 2.0:
        raise InvalidParam(f"temperature must be in [0, 2], got {s.temperature}.", "temperature")
    _finite("top_p", s.top_p)
    if not 0.0 < s.top_p <= 1.0:
        raise InvalidParam(f"top_p must be in (0, 1], got {s.top_p}.", "top_p")
    if s.top_k < -1:
        raise InvalidParam(f"top_k must be 0 (disable), or at least 1, got {s.top_k}.", "top_k")
    _finite("min_p", s.min_p)
    if not 0.0 <= s.min_p <= 1.0:
        raise InvalidParam(f"min_p must be in [0, 1], got {s.min_p}.", "min_p")
    if s.seed is not None:
        if not INT64[0] <= s.seed <= INT64[1]:
            raise InvalidParam("seed must fit in a signed 64-bit integer "
                               f"[{INT64[0]}, {INT64[1]}]", "seed")
        if s.seed == -1:
            s.seed = None


def _check_lengths(s: SamplingOptions) -> None:
    """Token counts and logprob counts."""
    if s.max_tokens is not None and s.max_tokens < 1:
        raise InvalidParam(f"max_tokens must be at least 1, got {s.max_tokens}.", "max_tokens")
    if s.min_tokens < 0:
        raise InvalidParam(f"min_tokens must be greater than or equal to 0, got {s.min_tokens}.",
                           "min_tokens")
    if s.max_tokens is not None and s.min_tokens > s.max_tokens:
        raise InvalidParam(f"min_tokens must be less than or equal to max_tokens={s.max_tokens}, "
                           f"got {s.min_tokens}.", "min_tokens")
    for name in ("logprobs", "prompt_logprobs"):
        v = getattr(s, name)
        if v is None:
            continue
        if v < -1:
            raise InvalidParam(f"{name} must be non-negative or -1, got {v}.", name)
        if v == -1 or v > MAX_LOGPROBS:
            what = "the whole vocabulary (-1)" if v == -1 else str(v)
            kind = "sample" if name == "logprobs" else "prompt"
            raise InvalidParam(f"Requested {kind} logprobs of {what}, which is greater than max "
                               f"allowed: {MAX_LOGPROBS}", name)


def _check_token_lists(s: SamplingOptions) -> None:
    """Stop strings, token ID lists and the logit bias (clamped to [-100, 100])."""
    if len(s.stop) > MAX_STOP_STRINGS:
        raise InvalidParam(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(s.stop)}",
                           "stop")
    if any(not x for x in s.stop):
        raise InvalidParam("stop cannot contain an empty string.", "stop")
    if any(t < 0 for t in s.stop_token_ids):
        raise InvalidParam("stop_token_ids must be token IDs (>= 0)", "stop_token_ids")
    if any(not w for w in s.bad_words):
        raise InvalidParam(f"bad_words cannot contain an empty string. Got bad_words={s.bad_words}",
                           "bad_words")
    if s.allowed_token_ids is not None:
        if not s.allowed_token_ids:
            raise InvalidParam("allowed_token_ids is not None and empty!", "allowed_token_ids")
        if any(t < 0 for t in s.allowed_token_ids):
            raise InvalidParam("allowed_token_ids contains out-of-vocab token id!",
                               "allowed_token_ids")
    if s.logit_bias:
        if any(t < 0 for t in s.logit_bias):
            raise InvalidParam("logit_bias keys are token IDs (>= 0)", "logit_bias")
        for t, b in s.logit_bias.items():
            _finite(f"logit_bias[{t}]", b)
        s.logit_bias = {t: min(100.0, max(-100.0, b)) for t, b in s.logit_bias.items()}
