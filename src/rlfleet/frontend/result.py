"""The response accumulator: a request's events (Head, Step..., Done, as the request plane
carries them) folded into per-choice results that the route renderers read, and the
merging of several steps' deltas into one chunk per choice for a slow reader."""

from __future__ import annotations

import time
from typing import Any

from msgspec import UNSET

from rlfleet.protocol.engine import Delta, Done, Event, Head, RoutedExperts, Step
from rlfleet.protocol.identity import UNKNOWN, PolicyIdentity, WeightSpan
from rlfleet.protocol.openai import Usage
from rlfleet.runtime import metrics

# model -> its series of FRONTEND_GENERATED_TOKENS (labels() on every step takes a lock)
_GENERATED: dict[str, Any] = {}


class Choice:
    """One choice's output so far (with `keep` false, only how many tokens: a stream that
    has rendered each delta needs no copy of them)."""

    __slots__ = ("index", "keep", "count", "token_ids", "_text", "logprobs", "finish_reason",
                 "stop_reason", "weight_versions", "stale_policy", "routed_experts")

    def __init__(self, index: int, keep: bool = True) -> None:
        self.index = index
        self.keep = keep
        self.count = 0
        self.token_ids: list[int] = []
        self._text: list[str] = []
        self.logprobs: list | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.weight_versions: list[WeightSpan] | None = None
        self.stale_policy = False  # it left the request's staleness bound (nvext.policy)
        self.routed_experts: RoutedExperts | None = None  # with the final delta, when asked

    @property
    def text(self) -> str:
        parts = self._text
        if len(parts) > 1:
            parts[:] = ["".join(parts)]
        return parts[0] if parts else ""

    def add(self, d: Delta) -> None:
        self.count += len(d.token_ids)
        if self.keep:
            self.token_ids += d.token_ids
            if d.text:
                self._text.append(d.text)
            if d.logprobs is not None:
                if self.logprobs is None:
                    self.logprobs = []
                self.logprobs += d.logprobs
        carry_marks(self, d)


class Result:
    """Everything a request produced, filled as events arrive."""

    __slots__ = ("request_id", "n", "received", "first_token", "finished", "worker_id",
                 "prompt_token_ids", "prompt_logprobs", "prompt_text", "prompt_token_strs",
                 "policy", "choices", "model", "cached_tokens")

    def __init__(self, request_id: str, n: int, keep_output: bool = True) -> None:
        self.request_id, self.n = request_id, n
        self.received = time.time()
        self.first_token: float | None = None
        self.finished: float | None = None
        self.worker_id: int | None = None
        self.prompt_token_ids: list[int] = []
        self.prompt_logprobs: list | None = None
        self.prompt_text = ""  # with echo
        self.prompt_token_strs: list[str] | None = None  # with echo
        self.policy: PolicyIdentity = UNKNOWN  # what produced the first token (the Head's)
        self.choices = [Choice(i, keep_output) for i in range(n)]
        self.model = ""  # the model a worker serves it for (metrics label)
        self.cached_tokens: int | None = None  # prompt tokens found in the prefix cache

    def apply(self, ev: Event) -> list[Delta]:
        """Fold one worker event in; return its choice deltas (for streaming)."""
        kind = type(ev)
        if kind is Step:
            deltas = ev.choices  # type: ignore[union-attr]
            if self.first_token is None and deltas:
                self.first_token = time.time()
                metrics.FRONTEND_TTFT.labels(self.model).observe(self.first_token - self.received)
            tokens = 0
            for d in deltas:
                self.choices[d.index].add(d)
                tokens += len(d.token_ids)
            if tokens:
                counter = _GENERATED.get(self.model)
                if counter is None:
                    counter = _GENERATED[self.model] = \
                        metrics.FRONTEND_GENERATED_TOKENS.labels(self.model)
                counter.inc(tokens)
            return deltas
        if kind is Head:
            h: Head = ev  # type: ignore[assignment]
            self.prompt_token_ids = h.prompt_token_ids
            self.worker_id = h.worker_id or None
            self.policy = h.policy
            if h.prompt_text:
                self.prompt_text = h.prompt_text
            if h.prompt_token_strs:
                self.prompt_token_strs = h.prompt_token_strs
            if h.prompt_logprobs:
                self.prompt_logprobs = h.prompt_logprobs
        elif kind is Done:
            done: Done = ev  # type: ignore[assignment]
            # an engine that says [] has nothing to add to what the head brought
            if done.prompt_logprobs:
                self.prompt_logprobs = done.prompt_logprobs
            if type(done.cached_tokens) is int:  # unset or None: the engine does not say
                self.cached_tokens = done.cached_tokens
            self.finished = time.time()
        return []

    def spans(self, choice: Choice) -> list[WeightSpan]:
        """The weight-version spans of a finished choice; from an engine that does not
        track versions per token, one span from the weights the worker reported."""
        return choice.weight_versions or [WeightSpan.of(self.policy, 0, choice.count)]

    @property
    def completion_tokens(self) -> int:
        return sum(c.count for c in self.choices)

    def usage(self) -> Usage:
        p = len(self.prompt_token_ids)
        c = self.completion_tokens
        return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)

    def timing(self) -> dict[str, float]:
        end = self.finished or time.time()
        out = {"request_received_ms": round(self.received * 1000, 3),
               "total_time_ms": round((end - self.received) * 1000, 3)}
        if self.first_token is not None:
            out["ttft_ms"] = round((self.first_token - self.received) * 1000, 3)
        return out


def merge_deltas(deltas: list[Delta]) -> list[Delta]:
    """Deltas of several steps as one delta per choice, in first-seen order (what a
    client that reads slower than the engine writes gets: fewer, larger chunks)."""
    if len(deltas) < 2:
        return deltas
    by: dict[int, Delta] = {}
    copied: set[int] = set()
    for d in deltas:
        i = d.index
        m = by.get(i)
        if m is None:
            by[i] = d
            continue
        if i not in copied:  # never change an event: it may be replayed to another caller
            copied.add(i)
            m = by[i] = Delta(index=i, token_ids=list(m.token_ids), text=m.text,
                              logprobs=None if m.logprobs is None else list(m.logprobs),
                              finish_reason=m.finish_reason, stop_reason=m.stop_reason,
                              weight_versions=m.weight_versions,
                              stale_policy=m.stale_policy, routed_experts=m.routed_experts)
        m.token_ids += d.token_ids
        m.text += d.text
        if d.logprobs is not None:
            if m.logprobs is None:
                m.logprobs = []
            m.logprobs += d.logprobs
        carry_marks(m, d)
    return list(by.values())


def carry_marks(into: Delta | Choice, d: Delta) -> None:
    """What a delta says once per choice (its finish, its spans so far, a staleness mark,
    the routed experts), carried onto what collects the choice's deltas; what the delta
    leaves unset (or None) is not carried."""
    if d.finish_reason is not None:
        into.finish_reason, into.stop_reason = d.finish_reason, d.stop_reason
    spans = d.weight_versions
    if spans is not None and spans is not UNSET:
        into.weight_versions = spans  # type: ignore[assignment]
    if d.stale_policy is True:
        into.stale_policy = True
    experts = d.routed_experts
    if experts is not None and experts is not UNSET:
        into.routed_experts = experts  # type: ignore[assignment]
