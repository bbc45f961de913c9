"""What a canceled or aborted attempt is worth: the partial-rollout policy.

The serving side only reports that an attempt ended early (a server abort, a client
timeout, a broken stream) with the tokens it had produced; the framework decides.
`discard` (the default) throws the tokens away and retries from the original prompt.
`resume` keeps them: the next attempt's prompt is the original prompt plus the tokens so
far, and the admitted sample records, per generated token, which attempt produced it.
Override `PartialRolloutPolicy.decide` for other rules (say, resume only long prefixes).
The client offers the policy only tokens it could verify (IDs and logprobs aligned, the
right model) and whose policy the worker reported: an OpenAI stream that breaks before its
last chunk carries no `engine_data`, so its tokens are discarded; SGLang events carry it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from rlfleet.protocol.identity import PolicyIdentity, WeightSpan


class PartialAction(StrEnum):
    DISCARD = "discard"
    RESUME = "resume"


@dataclass(frozen=True)
class PartialOutput:
    """The verified tokens of an attempt that ended without a terminal result."""

    sample_id: str
    attempt: int
    reason: str  # why it ended: "aborted", "timeout", "stream_error", ...
    token_ids: list[int]
    logprobs: list[float]
    policy: PolicyIdentity  # the policy the worker reported for them
    tokens_left: int  # of the sample's max_tokens, after these


class PartialRolloutPolicy:
    """`PartialRolloutPolicy()` discards; `PartialRolloutPolicy("resume")` resumes partial
    attempts of at least `min_tokens` tokens (single-choice samples only: a sample with
    n > 1 is always retried from scratch)."""

    def __init__(self, mode: PartialAction | str = PartialAction.DISCARD, min_tokens: int = 1) -> None:
        self.mode = PartialAction(mode)
        self.min_tokens = min_tokens

    def decide(self, partial: PartialOutput) -> PartialAction:
        if self.mode is PartialAction.RESUME and len(partial.token_ids) >= self.min_tokens \
                and partial.tokens_left > 0:
            return PartialAction.RESUME
        return PartialAction.DISCARD


@dataclass
class ResumedPrefix:
    """Tokens kept from earlier attempts of one sample, with who produced them."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_attempts: list[int] = field(default_factory=list)
    spans: list[WeightSpan] = field(default_factory=list)

    def keep(self, partial: PartialOutput, spans: list[WeightSpan] | None) -> None:
        """Append a partial attempt's tokens; `spans` are its own weight spans (positions
        relative to its first token), or None to take its engine-reported identity."""
        base = len(self.token_ids)
        n = len(partial.token_ids)
        self.token_ids += partial.token_ids
        self.logprobs += partial.logprobs
        self.token_attempts += [partial.attempt] * n
        if spans is None:
            spans = [WeightSpan.of(partial.policy, 0, n)] if n else []
        self.spans += [s.moved(base) for s in spans]

    def clear(self) -> None:
        self.token_ids, self.logprobs, self.token_attempts, self.spans = [], [], [], []

    def __len__(self) -> int:
        return len(self.token_ids)
