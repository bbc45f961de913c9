"""The sample checks: what a response must prove before its sample goes to training (and
is admitted in the ledger).

Each check is a function of the parsed response (`Generation`) and what was asked
(`Expectation`); it returns None or raises its own `CheckFailed` subclass, which
carries the check's name. `verify` runs the five checks of the integration reference in
order (`identity` also asks that the policy the worker reports be the LoRA adapter, or the
base model, the request named); `span_adapters` and `single_policy` judge the weight-version
spans of the (possibly resumed) sample. Only a sample that passes all of them is admitted.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlfleet.protocol.engine import RoutedExperts
from rlfleet.protocol.identity import UNKNOWN, PolicyIdentity, WeightSpan
from rlfleet.protocol.nvext import PolicyBound
from rlfleet.rollout.response import GeneratedChoice, Generation
from rlfleet.runtime.routed_experts import from_npy_b64

LOGPROB_TOLERANCE = 1e-3  # a log-probability is <= 0; allow float rounding above it


@dataclass(frozen=True)
class SampleRules:
    """What the trainer accepts. `model`: the served model name responses must carry;
    `expected`: the policy the worker must report (each field that is None: no expectation
    of it); `finish_reasons`: terminal states the framework recognises ("abort" is
    left to the partial-rollout policy); `allow_mixed_versions`: admit samples whose
    tokens come from more than one policy version (their spans come with the sample);
    `policy`: the staleness bound requests carry (nvext.policy) and admitted samples' spans
    must satisfy; `adapter`: whether `model` names a LoRA adapter (a request's `model`
    names the adapter it runs on): True, only samples from that adapter are admitted;
    False, only the base model's (no adapter); None (not said), either, but never another
    adapter's (its engine data and every span say which)."""

    model: str
    expected: PolicyIdentity = UNKNOWN
    finish_reasons: frozenset[str] = frozenset({"length", "stop"})
    allow_mixed_versions: bool = False
    policy: PolicyBound | None = None
    adapter: bool | None = None


@dataclass(frozen=True)
class Expectation:
    """What one attempt asked for."""

    request_id: str
    prompt_ids: list[int]
    n: int
    rules: SampleRules
    prompt_logprobs: bool = False


class CheckFailed(Exception):
    """A response failed the sample check `check`; `message` says how."""

    check = "sample_check"

    def __init__(self, message: str) -> None:
        super().__init__(f"{self.check}: {message}")
        self.message = message

    @property
    def reason(self) -> str:
        return self.check


def _all_token_ids(ids: list[Any]) -> bool:
    """Every entry a non-negative int (bool is not a token ID)."""
    return all(type(t) is int for t in ids) and (not ids or min(ids) >= 0)


class TokenIdsMissing(CheckFailed):
    """A choice lacks its generated token IDs, or the engine's prompt is not the one sent."""

    check = "token_ids_present"


def token_ids_present(gen: Generation, exp: Expectation) -> None:
    """Generated token IDs are present for each of the n choices (and the prompt the
    engine reports, when it reports one, is the prompt that was sent)."""
    if len(gen.choices) != exp.n:
        raise TokenIdsMissing(f"expected {exp.n} choice(s), got {len(gen.choices)}")
    for i, c in enumerate(gen.choices):
        if c.index != i:
            raise TokenIdsMissing(f"choice indices are not 0..{exp.n - 1}: position {i} has {c.index!r}")
        if c.token_ids is None:
            raise TokenIdsMissing(f"choice {i} carries no completion_token_ids")
        if not _all_token_ids(c.token_ids):
            raise TokenIdsMissing(f"choice {i} has a completion token ID that is not a "
                                  f"non-negative integer")
    if gen.prompt_token_ids is not None and gen.prompt_token_ids != exp.prompt_ids:
        raise TokenIdsMissing(f"the engine reports a prompt of {len(gen.prompt_token_ids)} tokens "
                              f"that differs from the {len(exp.prompt_ids)} sent")


def _good_logprob(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and not math.isnan(x) \
        and x <= LOGPROB_TOLERANCE


class LogprobsMisaligned(CheckFailed):
    """The sampled tokens' logprobs are missing, or do not line up with the token IDs."""

    check = "logprobs_aligned"


def logprobs_aligned(gen: Generation, exp: Expectation) -> None:
    """The sampled tokens' logprobs match the generated IDs in length and order: one real
    logprob <= 0 per token, and the token each logprob names is the generated one."""
    for c in gen.choices:
        ids = c.token_ids or []
        if c.logprobs is None or c.logprob_token_ids is None:
            raise LogprobsMisaligned(f"choice {c.index} carries no per-token logprobs")
        if len(c.logprobs) != len(ids) or len(c.logprob_token_ids) != len(ids):
            raise LogprobsMisaligned(f"choice {c.index}: {len(ids)} token IDs but "
                                     f"{len(c.logprobs)} logprobs for {len(c.logprob_token_ids)} "
                                     f"tokens")
        if c.logprob_token_ids != ids:
            at = next(i for i, (a, b) in enumerate(zip(c.logprob_token_ids, ids, strict=True))
                      if a != b)
            raise LogprobsMisaligned(f"choice {c.index}: logprob {at} is for token "
                                     f"{c.logprob_token_ids[at]!r}, the engine generated {ids[at]}")
        bad = next((i for i, x in enumerate(c.logprobs) if not _good_logprob(x)), None)
        if bad is not None:
            raise LogprobsMisaligned(f"choice {c.index}: logprob {bad} is {c.logprobs[bad]!r}, "
                                     f"not a log-probability")


class PromptLogprobsShifted(CheckFailed):
    """Prompt logprobs were asked for and are missing or shifted by a position."""

    check = "prompt_logprobs_unshifted"


def prompt_logprobs_unshifted(gen: Generation, exp: Expectation) -> None:
    """When prompt logprobs were asked for: one entry per prompt token, the first null
    (nothing predicts it), entry i holding prompt token i (no shift by one)."""
    if not exp.prompt_logprobs:
        return
    lps, ids = gen.prompt_logprobs, exp.prompt_ids
    if lps is None:
        raise PromptLogprobsShifted("prompt logprobs were requested but not returned")
    if len(lps) != len(ids):
        raise PromptLogprobsShifted(f"{len(lps)} prompt logprob entries for {len(ids)} prompt tokens")
    if lps[0] is not None:
        raise PromptLogprobsShifted("entry 0 is not null: the first prompt token has no logprob")
    for i in range(1, len(ids)):
        entry = lps[i]
        hit = entry.get(str(ids[i])) if isinstance(entry, dict) else None
        if not isinstance(hit, dict) or not _good_logprob(hit.get("logprob")):
            raise PromptLogprobsShifted(f"entry {i} has no logprob for prompt token {ids[i]}")


class NotTerminal(CheckFailed):
    """A choice did not end in a finish reason the trainer accepts (`finish_reason`)."""

    check = "terminal_state"

    def __init__(self, message: str, finish_reason: Any = None) -> None:
        super().__init__(message)
        self.finish_reason = finish_reason


def terminal_state(gen: Generation, exp: Expectation) -> None:
    """Every choice ended with a finish reason the framework recognises."""
    for c in gen.choices:
        if c.finish_reason not in exp.rules.finish_reasons:
            raise NotTerminal(f"choice {c.index} ended with finish_reason {c.finish_reason!r}; "
                              f"admitted: {', '.join(sorted(exp.rules.finish_reasons))}",
                              c.finish_reason)


class IdentityMismatch(CheckFailed):
    """The response answers another request, model or policy than the one expected."""

    check = "identity"


class WrongAdapter(IdentityMismatch):
    """The sample came from another LoRA adapter than the one its request named, from the
    base model when it named an adapter, or from an adapter when it named the base model.
    Its reason names both."""

    check = "adapter"

    @property
    def reason(self) -> str:
        return str(self)


def from_named_adapter(policy: PolicyIdentity | None, rules: SampleRules, where: str) -> None:
    """The policy `where` reports is the one the request named: the adapter `rules.model`
    (unless `rules.adapter` is False), or the base model, which names no adapter (unless
    `rules.adapter` is True). The response's `model` proves nothing: the frontend echoes it."""
    got = policy.adapter_name if policy is not None else None
    if got is None and not rules.adapter:
        return
    if got == rules.model and rules.adapter is not False:
        return
    asked = {True: f"adapter {rules.model!r}", False: f"the base model {rules.model!r}",
             None: f"{rules.model!r}"}[rules.adapter]
    served = (f"adapter {got!r}" if got is not None else
              "no adapter (the base model)" if policy is not None else "no policy at all")
    raise WrongAdapter(f"{where} names {served}; the request named {asked}")


def span_adapters(spans: list[WeightSpan] | None, rules: SampleRules) -> None:
    """Every weight span of a choice comes from the adapter (or base model) the request
    named."""
    for s in spans or ():
        from_named_adapter(s, rules, f"the weight span [{s.start}, {s.end})")


def identity(gen: Generation, exp: Expectation) -> None:
    """The response answers this attempt (X-Request-Id echoed; SGLang's meta_info.id), comes
    from the expected served model (OpenAI `model`; a native /generate response names none),
    from the adapter (or base model) it named as the worker reports its policy
    (nvext.engine_data / SGLang meta_info: `weight_adapter`) and, when the trainer set an
    expectation, from the expected policy: the weight version and digest the worker
    reports."""
    if gen.echoed_request_id != exp.request_id:
        raise IdentityMismatch(f"X-Request-Id {exp.request_id!r} came back as "
                               f"{gen.echoed_request_id!r}")
    if gen.route == "sglang" and gen.response_id is not None and gen.response_id != exp.request_id:
        raise IdentityMismatch(f"meta_info.id is {gen.response_id!r}, the request's rid is "
                               f"{exp.request_id!r}")
    rules = exp.rules
    if gen.route == "openai" or gen.model is not None:
        if gen.model != rules.model:
            raise IdentityMismatch(f"served by model {gen.model!r}, expected {rules.model!r}")
    from_named_adapter(gen.policy, rules, "the worker's engine data")
    reported = gen.policy.to_dict() if gen.policy is not None else {}
    for name, want in rules.expected.to_dict().items():
        if want is None:
            continue
        if reported.get(name) is None:
            raise IdentityMismatch(f"the worker did not report its policy {name} "
                                   f"(expected {want!r})")
        if reported[name] != want:
            raise IdentityMismatch(f"the worker reports policy {name} {reported[name]!r}, "
                                   f"expected {want!r}")


CHECKS: tuple[Callable[[Generation, Expectation], None], ...] = (
    token_ids_present, logprobs_aligned, prompt_logprobs_unshifted, terminal_state, identity)


def verify(gen: Generation, exp: Expectation) -> None:
    """Run the five checks in order; the first failure raises."""
    for check in CHECKS:
        check(gen, exp)


class MixedPolicy(CheckFailed):
    """A choice's tokens come from more than one policy (or its spans are malformed)."""

    check = "single_policy"


def weight_spans(raw: Any, length: int) -> list[WeightSpan]:
    """nvext.weight_versions ([{"version","digest","step","start","end"}, ...]) as WeightSpans,
    checked to cover the generated positions [0, length) in order without gaps."""
    if not isinstance(raw, list):
        raise MixedPolicy(f"weight_versions is {type(raw).__name__}, not a list")
    spans, pos = [], 0
    for i, s in enumerate(raw):
        if not isinstance(s, dict) or not {"start", "end"} <= s.keys():
            raise MixedPolicy(f"weight_versions[{i}] is not a span with start and end")
        start, end = s["start"], s["end"]
        if not (isinstance(start, int) and isinstance(end, int)) or start != pos or end < start:
            raise MixedPolicy(f"weight_versions[{i}] covers [{start!r}, {end!r}); expected a span "
                              f"starting at {pos}")
        spans.append(WeightSpan.of(PolicyIdentity.from_dict(s), start, end))
        pos = end
    if pos != length:
        raise MixedPolicy(f"weight_versions cover {pos} of {length} generated tokens")
    return spans


def single_policy(spans: list[WeightSpan] | None, rules: SampleRules) -> None:
    """Unless mixed versions are allowed, all tokens of a choice come from one policy."""
    if rules.allow_mixed_versions or not spans:
        return
    policies = {(s.version, s.digest) for s in spans}
    if len(policies) > 1:
        names = ", ".join(f"{v!r}/{d!r}" for v, d in sorted(policies, key=repr))
        raise MixedPolicy(f"tokens come from {len(policies)} policies ({names}); "
                          f"set allow_mixed_versions=True to admit such samples")


class StalePolicy(CheckFailed):
    """A choice's tokens come from outside the request's staleness bound."""

    check = "policy_bound"


def policy_bound(gen: Generation, spans: list[list[WeightSpan]], rules: SampleRules) -> None:
    """With a staleness bound, every token's policy is within it, as its spans say (every
    span names a step at or above `min_step`; the steps of one choice are at most `max_lag`
    apart), and the server did not mark the sample stale (its worker left the bound while
    it ran, under on_stale "finish")."""
    bound = rules.policy
    if bound is None:
        return
    for c, choice_spans in zip(gen.choices, spans, strict=True):
        if c.stale_policy:
            raise StalePolicy(f"choice {c.index}: the server marked it stale: its worker left "
                              f"the bound {bound.nvext()} while it was generated")
        steps = [s.step for s in choice_spans]
        if any(type(t) is not int for t in steps):
            raise StalePolicy(f"choice {c.index}: a span names no fleet step ({steps}); the "
                              f"bound {bound.nvext()} cannot be checked")
        if not bound.allows(steps):
            raise StalePolicy(f"choice {c.index}: tokens from steps {min(steps)} to "
                              f"{max(steps)}, outside the bound {bound.describe()}")


class RoutedExpertsMisaligned(CheckFailed):
    check = "routed_experts"


def routed_experts(c: GeneratedChoice, start: int) -> RoutedExperts | None:
    """A choice's routed experts (None: the engine returned none), checked: one row per
    completion token, from the last prompt position `start`."""
    if c.routed_experts is None:
        return None
    if not isinstance(c.routed_experts, str):
        raise RoutedExpertsMisaligned("routed_experts is not a base64 string")
    try:
        r = from_npy_b64(c.routed_experts, start)
    except ValueError as e:
        raise RoutedExpertsMisaligned(str(e)) from e
    if r.tokens != len(c.token_ids or ()):
        raise RoutedExpertsMisaligned(f"{r.tokens} rows of routed experts for "
                                      f"{len(c.token_ids or ())} completion tokens")
    return r
