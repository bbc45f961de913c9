"""RolloutClient: rollouts through the frontend, admitted exactly once.

    async with RolloutClient(url, "tiny", ledger=SampleLedger("ledger.db")) as client:
        sample = await client.generate("s-1", prompt_ids, SamplingSpec(max_tokens=64))
        chat = await client.generate("s-2", [{"role": "user", "content": "Hi"}])
        outcomes = await client.rollout(requests, concurrency=64)

A prompt is token IDs, text, chat messages (`Chat`) or a `NextTurn` (sample.py). Token IDs
go to /v1/completions (or SGLang /generate) as they are; text goes to /v1/completions and
chat to /v1/chat/completions, where the worker tokenises (and renders the chat template);
the engine reports the prompt IDs it used (nvext.prompt_token_ids) and those are the
sample's `prompt_ids`: a text or chat response without them is not admitted. A `NextTurn`
is made into token IDs before the first attempt: the earlier sample's tokens verbatim plus
the new messages as the worker's tokenizer renders them (POST /tokenize on the frontend).

`generate` returns an `AdmittedSample` or raises: `SampleFailed` when no attempt was
admitted (its `reason` says why: a sample check's name, "timeout", "http: 503 ...",
...), `AlreadyAdmitted` when the ledger already holds an admitted attempt of the sample
(nothing is sent then; `RetryWindowPassed`, one of them, when the sample is older than the
ledger's retry window, whose records may have been pruned), `ValueError` for a request the
client cannot send, and `asyncio.CancelledError` when the caller cancels it (the HTTP
stream is closed and the frontend is asked to abort the request, POST
/v1/requests/{id}/cancel, since it keeps a request with an X-Request-Id running for a while
for retries; the attempt is recorded as canceled).
`rollout` runs many samples with bounded concurrency and returns one `RolloutOutcome`
per sample, in input order, never raising for a sample that merely failed.

Each attempt: recorded in the ledger (accepted) before it is sent; sent with X-Request-Id
(its request ID) and a W3C `traceparent` (trace per sample, span per attempt); its response
parsed (`response.py`), verified (`checks.py`) and admitted in one ledger transaction.
Transport errors, 5xx/429, stream errors, timeouts, server aborts and failed checks are
retried under `RetryPolicy` with the same sample ID and the next attempt number; a timed-
out attempt is retried under the same request ID when the policy says so. What a partial
attempt's tokens are worth is the `PartialRolloutPolicy`'s call.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import httpx

from rlfleet.protocol.engine import STALE_POLICY, RoutedExperts
from rlfleet.protocol.identity import UNKNOWN, PolicyIdentity, WeightSpan
from rlfleet.protocol.nvext import PolicyBound
from rlfleet.rollout import telemetry
from rlfleet.rollout.attempt import Attempt, AttemptState, new_request_id
from rlfleet.rollout.checks import (
    CheckFailed,
    Expectation,
    NotTerminal,
    SampleRules,
    TokenIdsMissing,
    identity,
    logprobs_aligned,
    policy_bound,
    routed_experts,
    single_policy,
    span_adapters,
    token_ids_present,
    verify,
    weight_spans,
)
from rlfleet.rollout.ledger import AlreadyAdmitted, AttemptClosed, SampleLedger
from rlfleet.rollout.partial import PartialAction, PartialOutput, PartialRolloutPolicy, ResumedPrefix
from rlfleet.rollout.response import (
    Generation,
    OpenAIStream,
    SglangStream,
    StreamError,
    parse_openai,
    parse_sglang,
)
from rlfleet.rollout.retry import RetryPolicy
from rlfleet.rollout.sample import (
    AdmittedSample,
    Chat,
    Completion,
    NextTurn,
    RolloutOutcome,
    SampleFailed,
    SampleRequest,
    SamplingSpec,
    prompt_kind,
)
from rlfleet.runtime import tracing

if TYPE_CHECKING:
    from rlfleet.rollout.gate import RolloutGate

ROUTES = ("openai", "sglang")
REQUESTED_EXTRA_FIELDS = ("completion_token_ids", "prompt_token_ids", "worker_id", "detailed_finish_reason",
                          "engine_data", "weight_versions")
# statuses worth another attempt: the frontend or a worker may do better next time
RETRYABLE_STATUS = frozenset({408, 409, 425, 429, 499, 500, 502, 503, 504})
CANCEL_PATH = "/v1/requests/{}/cancel"  # the frontend's abort for a kept X-Request-Id run
CANCEL_TIMEOUT = 5.0
TOKENIZE_PATH = "/tokenize"  # the frontend's vLLM-style tokenizer route (a worker's tokenizer)
TOKENIZE_TIMEOUT = 30.0
#: two one-turn conversations that differ only in the assistant's content: what their
#: renderings share at the end is what the template puts after an assistant message
_PLACEHOLDER = [{"role": "user", "content": "u"}]

log = telemetry.log


def request_body(route: str, prompt: list[int] | str | Chat, spec: SamplingSpec, n: int,
                 stream: bool, model: str, request_id: str,
                 policy: PolicyBound | None = None) -> tuple[str, bytes]:
    """(path, JSON body) of one attempt: OpenAI completions (token IDs or text) or chat
    completions (`Chat`), with the generated token IDs, sampled-token logprobs as
    `token_id:<id>` and the nvext fields the checks need; or native SGLang /generate (token
    IDs only) with logprobs and `rid`. A staleness bound goes as `nvext.policy` (SGLang:
    `policy`)."""
    if route == "openai":
        fields = list(REQUESTED_EXTRA_FIELDS) + (["prompt_logprobs"] if spec.prompt_logprobs else []) \
            + (["routed_experts"] if spec.routed_experts else [])
        nvext: dict[str, Any] = {"extra_fields": fields}
        if policy is not None:
            nvext["policy"] = policy.nvext()
        common = {"model": model, "n": n, "stream": stream, "return_tokens_as_token_ids": True,
                  **spec.openai_fields(), "nvext": nvext}
        if isinstance(prompt, Chat):
            body = {"messages": prompt.messages, "add_generation_prompt": prompt.add_generation_prompt,
                    "logprobs": True, "top_logprobs": 0, **common}
            if prompt.chat_template_kwargs:
                body["chat_template_kwargs"] = prompt.chat_template_kwargs
            return "/v1/chat/completions", json.dumps(body, separators=(",", ":")).encode()
        body = {"prompt": prompt, "logprobs": 0, **common}
        return "/v1/completions", json.dumps(body, separators=(",", ":")).encode()
    if not isinstance(prompt, list):
        raise ValueError("the SGLang route takes token IDs only: send text and chat prompts "
                         "with route='openai'")
    body = {"input_ids": prompt, "model": model, "sampling_params": spec.sglang_params(),
            "stream": stream, "return_logprob": True, "rid": request_id,
            "logprob_start_len": 0 if spec.prompt_logprobs else -1}
    if policy is not None:
        body["policy"] = policy.nvext()
    return "/generate", json.dumps(body, separators=(",", ":")).encode()


class TokenizeFailed(Exception):
    """The frontend could not tokenise a prompt (its message says why)."""

    reason = "tokenize"


@dataclass
class _End:
    """How an attempt ended, for the retry loop."""

    reason: str
    retry: bool = True
    reuse_request_id: bool = False
    partial: Generation | None = None  # output to offer the partial-rollout policy
    unreachable: bool = False  # the frontend could not be reached: nothing was sent


@dataclass
class _Prompt:
    """One sample's prompt as sent (`sent`: token IDs, text or Chat) and its token IDs once
    known: from the start for token IDs, else from the engine's report of an attempt."""

    sent: list[int] | str | Chat
    ids: list[int] | None
    experts: tuple[RoutedExperts, ...] = ()  # a NextTurn's: its earlier turns' experts


def _earlier_experts(turn: NextTurn) -> tuple[RoutedExperts, ...]:
    """What a NextTurn keeps of its earlier sample's experts: those of its prompt, then of
    the completion it continues (the prefix it re-sends verbatim)."""
    e = turn.earlier
    done = e.completions[turn.completion].routed_experts
    return e.prompt_routed_experts + ((done,) if done is not None else ())


def _engine_prompt_ids(gen: Generation) -> list[int] | None:
    """The prompt IDs the engine reports, if they are a non-empty list of token IDs."""
    ids = gen.prompt_token_ids
    if isinstance(ids, list) and ids and all(type(t) is int and t >= 0 for t in ids):
        return ids
    return None


class RolloutClient:
    """One pooled HTTP client to the frontend at `base_url`, verifying responses against
    `model` (and `expected_version` / `expected_digest` when set) and recording attempts
    in `ledger` (default: in memory). `adapter`: whether `model` names a LoRA adapter
    (True: only that adapter's samples are admitted; False: only the base model's; None:
    either, never another adapter's; SampleRules). `route` ("openai" or "sglang") and
    `stream` are defaults that each `generate` call may override. With a `gate` (the policy refresh's
    RolloutGate), no attempt starts while the gate is closed, and a reopen on a policy makes
    it the expected one before any attempt starts. `transport` is for tests."""

    def __init__(self, base_url: str, model: str, *, ledger: SampleLedger | None = None,
                 retry: RetryPolicy | None = None, partial: PartialRolloutPolicy | None = None,
                 expected_version: Any = None, expected_digest: Any = None,
                 allow_mixed_versions: bool = False,
                 finish_reasons: Iterable[str] = ("length", "stop"),
                 adapter: bool | None = None,
                 route: str = "openai", stream: bool = False, gate: RolloutGate | None = None,
                 policy: PolicyBound | None = None,
                 max_connections: int = 1024, connect_timeout: float = 10.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        if route not in ROUTES:
            raise ValueError(f"route must be one of {ROUTES}, not {route!r}")
        self.base_url = base_url.rstrip("/")
        self.rules = SampleRules(model, PolicyIdentity(version=expected_version,
                                                       digest=expected_digest),
                                 frozenset(finish_reasons), allow_mixed_versions, policy,
                                 adapter)
        self._own_ledger = ledger is None  # the caller closes a ledger it passed in
        self.ledger = ledger if ledger is not None else SampleLedger()
        self.retry = retry or RetryPolicy()
        self.partial = partial or PartialRolloutPolicy()
        self.route, self.stream, self.gate = route, stream, gate
        if gate is not None:  # a refresh that reopens the gate names the policy to expect
            gate.subscribe(self.expect)
        self._background: set[asyncio.Task] = set()  # remote cancels in flight
        # sent with every request: the frontend lets only its holder cancel those runs
        self._cancel_token = secrets.token_urlsafe(24)
        self._frames: dict[str, tuple[list[int], list[int]]] = {}  # see _turn_frame
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=connect_timeout, read=None, write=30.0, pool=None),
            limits=httpx.Limits(max_connections=max_connections,
                                max_keepalive_connections=max_connections),
            transport=transport)

    async def aclose(self) -> None:
        if self._background:
            await asyncio.wait(self._background, timeout=CANCEL_TIMEOUT)
        await self._http.aclose()
        if self._own_ledger:
            self.ledger.close()

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def expect(self, version: Any = None, digest: Any = None) -> None:
        """Admit only samples from this policy from now on (after a policy refresh)."""
        self.rules = replace(self.rules, expected=PolicyIdentity(version=version, digest=digest))

    def bound(self, policy: PolicyBound | None) -> None:
        """From now on, ask for this staleness bound (nvext.policy) and admit only samples
        whose spans satisfy it (None: no bound)."""
        self.rules = replace(self.rules, policy=policy)

    # ------------------------------------------------------------ one sample

    async def generate(self, sample_id: str, prompt: Any,
                       sampling: SamplingSpec | None = None, n: int = 1, *,
                       route: str | None = None, stream: bool | None = None,
                       deadline: float | None = None, attempt_timeout: float | None = None,
                       rules: SampleRules | None = None,
                       origin: float | None = None) -> AdmittedSample:
        """Generate, verify and admit one sample. `deadline` is a `time.monotonic()` value
        after which no attempt is started or continued; `attempt_timeout` overrides the
        retry policy's for this call; `rules` override the client's (which each attempt
        reads afresh, so that an `expect` after a policy refresh applies to retries);
        `origin`: the sample's step or first issue time, for a ledger with a retry window
        (rlfleet.rollout.ledger; a retry from a restarted trainer gives it).
        `prompt`: token IDs, text, chat messages, `Chat` or `NextTurn` (module doc).
        See the module doc for what it raises."""
        sampling = sampling or SamplingSpec()
        route = route or self.route
        stream = self.stream if stream is None else stream
        p = await self._prepare(sample_id, prompt, sampling, n, route)
        trace = telemetry.trace_id(sample_id)
        t0 = time.monotonic()
        prefix = ResumedPrefix()
        reasons: list[str] = []
        reuse: str | None = None  # a timed-out request to rejoin (in the end: to cancel)
        timeout = attempt_timeout if attempt_timeout is not None else self.retry.attempt_timeout
        tries = counted = 0
        unreachable_since: float | None = None  # the frontend unreachable since (in a row)
        try:
            while counted < self.retry.max_attempts:
                if tries:
                    pause = self.retry.backoff(tries)
                    if deadline is not None and time.monotonic() + pause >= deadline:
                        reasons.append("deadline")
                        break
                    await asyncio.sleep(pause)
                if self.gate is not None and not self.gate.is_open:
                    try:
                        await self.gate.wait_open(None if deadline is None else
                                                  max(0.0, deadline - time.monotonic()))
                    except TimeoutError:
                        reasons.append("deadline")  # the gate stayed closed
                        break
                current = rules or self.rules  # `expect` may have moved on meanwhile
                rid = reuse or new_request_id()
                a = Attempt(sample_id, self.ledger.start(sample_id, rid, origin), rid)
                reused, reuse = reuse is not None, None  # the attempt owns the request now
                budget = timeout
                if deadline is not None:
                    left = deadline - time.monotonic()
                    budget = left if budget is None else min(budget, left)
                result = await self._attempt(a, trace, p, sampling, n, route, stream,
                                             current, prefix, budget, reused)
                if isinstance(result, AdmittedSample):
                    telemetry.SAMPLES.labels("admitted").inc()
                    telemetry.SAMPLE_SECONDS.observe(time.monotonic() - t0)
                    return result
                tries += 1
                reasons.append(result.reason)
                if not result.unreachable:
                    counted, unreachable_since = counted + 1, None
                elif unreachable_since is None:
                    unreachable_since = time.monotonic()
                    counted += self.retry.unreachable_for <= 0
                elif time.monotonic() - unreachable_since >= self.retry.unreachable_for:
                    counted += 1  # unreachable for longer than the policy rides out
                reuse = rid if result.reuse_request_id else None
                if not result.retry:
                    break
                self._offer_partial(a, result, sampling, n, current, prefix, p)
        except (asyncio.CancelledError, AlreadyAdmitted) as e:
            if reuse is not None:
                self._cancel_remotely(reuse)
            telemetry.SAMPLES.labels("cancelled" if isinstance(e, asyncio.CancelledError)
                                     else "already_admitted").inc()
            raise
        if reuse is not None:  # nobody comes back for the timed-out request
            self._cancel_remotely(reuse)
        telemetry.SAMPLES.labels("failed").inc()
        err = SampleFailed(sample_id, reasons[-1] if reasons else "no attempt", reasons)
        log.warning("sample failed: %s", err, extra={"sample_id": sample_id, "trace_id": trace})
        raise err

    async def _prepare(self, sample_id: str, prompt: Any, sampling: SamplingSpec, n: int,
                       route: str) -> _Prompt:
        """Refuse what cannot be sent (ValueError) before any attempt; the prompt as it is
        sent (a `NextTurn` made into token IDs)."""
        if route not in ROUTES:
            raise ValueError(f"route must be one of {ROUTES}, not {route!r}")
        if route == "sglang" and n != 1:
            raise ValueError("the SGLang route generates one sequence per request: use n=1")
        if type(n) is not int or n < 1:
            raise ValueError(f"n must be an integer >= 1, not {n!r}")
        kind = prompt_kind(prompt)
        if route == "sglang":
            sampling.sglang_params()  # refuses what the route cannot take, before any attempt
            if kind in ("text", "chat"):
                raise ValueError("the SGLang route takes token IDs only: send text and chat "
                                 "prompts with route='openai'")
        if kind == "next_turn":
            try:
                ids = await self.next_turn_ids(prompt)
            except TokenizeFailed as e:  # nothing was sent: no attempt in the ledger
                raise SampleFailed(sample_id, f"tokenize: {e}", [f"tokenize: {e}"]) from e
            return _Prompt(ids, ids, _earlier_experts(prompt))
        if kind == "chat":
            return _Prompt(prompt if isinstance(prompt, Chat) else Chat(list(prompt)), None)
        if kind == "text":
            return _Prompt(prompt, None)
        return _Prompt(list(prompt), list(prompt))

    def _offer_partial(self, a: Attempt, end: _End, sampling: SamplingSpec, n: int,
                       rules: SampleRules, prefix: ResumedPrefix, prompt: _Prompt) -> None:
        """Keep a partial attempt's verified tokens if the policy resumes; else start over.
        A text or chat prompt resumes only once the engine has reported its token IDs."""
        gen = end.partial
        action = PartialAction.DISCARD
        if sampling.routed_experts:
            gen = None  # a partial attempt's experts are not returned: start over
        if gen is not None and prompt.ids is None:
            prompt.ids = _engine_prompt_ids(gen)
        if gen is not None and n == 1 and not end.reuse_request_id and prompt.ids is not None:
            exp = Expectation(a.request_id, [], 1, rules)
            try:
                token_ids_present(replace(gen, prompt_token_ids=None), exp)
                logprobs_aligned(gen, exp)
                identity(gen, exp)
            except CheckFailed:
                gen = None
            if gen is not None and gen.policy is not None:
                c = gen.choices[0]
                out = PartialOutput(a.sample_id, a.number, end.reason, list(c.token_ids or ()),
                                    list(c.logprobs or ()), gen.policy,
                                    sampling.max_tokens - len(prefix) - len(c.token_ids or ()))
                action = self.partial.decide(out)
                if action is PartialAction.RESUME:
                    spans = None
                    if c.weight_spans is not None:
                        try:
                            spans = weight_spans(c.weight_spans, len(out.token_ids))
                        except CheckFailed:
                            action = PartialAction.DISCARD
                    if action is PartialAction.RESUME:
                        prefix.keep(out, spans)
        if action is PartialAction.DISCARD and not end.reuse_request_id:
            prefix.clear()  # retry from the original prompt

    # ------------------------------------------------------------ one attempt

    async def _attempt(self, a: Attempt, trace: str, *rest) -> AdmittedSample | _End:
        """One attempt; while tracing (rlfleet.runtime.tracing), in a client span of the
        sample's trace that the frontend's, worker's and engine's spans join."""
        with tracing.span("rollout attempt", telemetry.traceparent(trace, a.span_id), "client",
                          {"rlfleet.sample_id": a.sample_id, "rlfleet.attempt": a.number,
                           "rlfleet.request_id": a.request_id}):
            return await self._attempt_sent(a, trace, *rest)

    async def _attempt_sent(self, a: Attempt, trace: str, prompt: _Prompt,
                            sampling: SamplingSpec, n: int, route: str, stream: bool,
                            rules: SampleRules, prefix: ResumedPrefix, timeout: float | None,
                            reused: bool) -> AdmittedSample | _End:
        spec = sampling
        sent: list[int] | str | Chat = prompt.sent
        if prefix.token_ids:  # resumed: the prompt's token IDs (known by then) + kept tokens
            assert prompt.ids is not None
            sent = prompt.ids + prefix.token_ids
            spec = replace(sampling, max_tokens=sampling.max_tokens - len(prefix),
                           min_tokens=max(0, sampling.min_tokens - len(prefix)))
        path, body = request_body(route, sent, spec, n, stream, rules.model, a.request_id,
                                  rules.policy)
        url = self.base_url + path
        headers = {"content-type": "application/json", "x-request-id": a.request_id,
                   "x-cancel-token": self._cancel_token,
                   "traceparent": tracing.outgoing(telemetry.traceparent(trace, a.span_id))}
        if log.isEnabledFor(logging.DEBUG):
            log.debug("attempt sent", extra=telemetry.fields(a, trace))
        acc: OpenAIStream | SglangStream | None = None
        try:
            async with asyncio.timeout(timeout):
                if stream:
                    acc = OpenAIStream(n) if route == "openai" else SglangStream()
                    gen_or_end = await self._streamed(a, url, body, headers, acc)
                else:
                    gen_or_end = await self._unary(url, body, headers, route)
        except TimeoutError:
            reuse = self.retry.reuse_request_id_on_timeout
            if not reuse:
                self._cancel_remotely(a.request_id)
            end = _End("timeout", reuse_request_id=reuse,
                       partial=acc.result() if acc is not None else None)
            return self._close(a, trace, AttemptState.CANCELED, end)
        except asyncio.CancelledError:
            self._cancel_remotely(a.request_id)
            self._close(a, trace, AttemptState.CANCELED, _End("cancelled", retry=False))
            raise
        except StreamError as e:
            end = _End(f"stream_error: {e}", partial=acc.result() if acc is not None else None)
            return self._close(a, trace, AttemptState.FAILED, end)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # nothing reached it
            end = _End(f"transport: {type(e).__name__}: {e}", unreachable=True)
            return self._close(a, trace, AttemptState.FAILED, end)
        except httpx.HTTPError as e:
            self._cancel_remotely(a.request_id)  # the frontend may keep running it
            end = _End(f"transport: {type(e).__name__}: {e}",
                       partial=acc.result() if acc is not None else None)
            return self._close(a, trace, AttemptState.FAILED, end)
        if isinstance(gen_or_end, _End):
            if reused and gen_or_end.reason.startswith("http: 400"):
                gen_or_end.retry = True  # the first request may still be running: use a new ID
            return self._close(a, trace, AttemptState.FAILED, gen_or_end)
        return self._judge(a, trace, gen_or_end, prompt, sent, sampling, n, rules, prefix)

    def _judge(self, a: Attempt, trace: str, gen: Generation, prompt: _Prompt,
               sent: list[int] | str | Chat, sampling: SamplingSpec, n: int,
               rules: SampleRules, prefix: ResumedPrefix) -> AdmittedSample | _End:
        """Verify a complete response and admit it in the ledger. For a text or chat prompt
        the engine's report of the prompt IDs it used is required: they are the sample's."""
        prompt_ids = prompt.ids
        sent_ids = sent if isinstance(sent, list) else _engine_prompt_ids(gen)
        try:
            if sent_ids is None:
                raise TokenIdsMissing("the engine did not report the token IDs of the text or "
                                      "chat prompt it was given (nvext.prompt_token_ids)")
            if prompt_ids is None:
                prompt_ids = sent_ids
            exp = Expectation(a.request_id, sent_ids, n, rules, sampling.prompt_logprobs)
            verify(gen, exp)
            spans = [self._spans(c.weight_spans, len(c.token_ids), gen, prefix)
                     for c in gen.choices]
            for s in spans:
                span_adapters(s, rules)
                single_policy(s, rules)
            policy_bound(gen, spans, rules)
            experts = [routed_experts(c, len(sent_ids) - 1) if sampling.routed_experts else None
                       for c in gen.choices]
        except NotTerminal as e:
            telemetry.REJECTIONS.labels(e.check).inc()
            if e.finish_reason == "abort":  # the server canceled it: a partial attempt
                stale = any(c.detailed_finish_reason == STALE_POLICY for c in gen.choices)
                return self._close(a, trace, AttemptState.CANCELED,
                                   _End(STALE_POLICY if stale else "aborted", partial=gen))
            prefix.clear()
            return self._close(a, trace, AttemptState.FAILED, _End(e.check))
        except CheckFailed as e:
            telemetry.REJECTIONS.labels(e.check).inc()
            log.info("response rejected: %s", e, extra=telemetry.fields(a, trace))
            prefix.clear()  # a resumed sample that fails starts over
            return self._close(a, trace, AttemptState.FAILED, _End(e.reason))
        try:
            self.ledger.admit(a.sample_id, a.number)
        except AlreadyAdmitted:
            a.move(AttemptState.FAILED, AlreadyAdmitted.reason)
            telemetry.attempt_ended(a)
            raise
        except AttemptClosed as e:  # someone else (a newer call) took the sample over
            a.move(AttemptState.FAILED, e.reason)
            telemetry.attempt_ended(a)
            return _End(e.reason, retry=False)
        a.move(AttemptState.SUCCEEDED, "admitted")
        telemetry.attempt_ended(a)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("attempt admitted", extra=telemetry.fields(a, trace))
        completions = []
        for c, s, e in zip(gen.choices, spans, experts, strict=True):
            ids = c.token_ids or []
            completions.append(Completion(
                prefix.token_ids + ids, prefix.logprobs + list(c.logprobs or ()), c.finish_reason,
                prefix.token_attempts + [a.number] * len(ids), s, e))
        plps = None
        if sampling.prompt_logprobs and gen.prompt_logprobs is not None:
            plps = [None] + [gen.prompt_logprobs[i][str(prompt_ids[i])]["logprob"]
                             for i in range(1, len(prompt_ids))]
        return AdmittedSample(a.sample_id, a.number, a.request_id, list(prompt_ids), completions,
                              rules.model, gen.policy or UNKNOWN, plps,
                              gen.worker_id, prompt.experts)

    # ------------------------------------------------------------ the worker's tokenizer

    async def tokenize(self, prompt: str | Chat | list[dict[str, Any]], *,
                       add_generation_prompt: bool | None = None,
                       chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The token IDs a worker's tokenizer makes of text, or of chat messages rendered
        with the served model's chat template (POST /tokenize on the frontend)."""
        body: dict[str, Any] = {"model": self.rules.model}
        if isinstance(prompt, str):
            body["prompt"] = prompt
        else:
            chat = prompt if isinstance(prompt, Chat) else Chat(list(prompt))
            body["messages"] = chat.messages
            body["add_generation_prompt"] = chat.add_generation_prompt \
                if add_generation_prompt is None else add_generation_prompt
            kwargs = chat_template_kwargs or chat.chat_template_kwargs
            if kwargs:
                body["chat_template_kwargs"] = kwargs
        try:
            r = await self._http.post(self.base_url + TOKENIZE_PATH, json=body,
                                      timeout=TOKENIZE_TIMEOUT)
        except httpx.HTTPError as e:
            raise TokenizeFailed(f"POST {TOKENIZE_PATH} failed: {type(e).__name__}: {e}") from e
        if r.status_code != 200:
            end = self._http_end(r.status_code, r.content)
            raise TokenizeFailed(f"POST {TOKENIZE_PATH}: {end.reason}")
        tokens = r.json().get("tokens")
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise TokenizeFailed(f"POST {TOKENIZE_PATH} answered without token IDs: {r.text[:200]}")
        return tokens

    async def next_turn_ids(self, turn: NextTurn) -> list[int]:
        """The prompt IDs of a `NextTurn`: the earlier sample's prompt and completion tokens
        verbatim, the turn-closing tokens the template puts after an assistant message (less
        those the completion already ends with, such as its EOS), then the new messages and
        the generation prompt as the worker's template renders them after an assistant
        turn. ValueError if the template does not render a conversation as the rendering of
        its first turns followed by the rest (nothing can then be appended verbatim)."""
        kwargs = turn.chat_template_kwargs
        closing, base = await self._turn_frame(kwargs)
        first = _PLACEHOLDER + [{"role": "assistant", "content": "a"}]
        full = await self.tokenize(first + list(turn.messages), add_generation_prompt=True,
                                   chat_template_kwargs=kwargs)
        if full[:len(base)] != base:
            raise ValueError("the chat template renders a conversation differently from its "
                             "first turns followed by the new messages, so an earlier sample "
                             "cannot be continued token for token; send the whole conversation "
                             "as a Chat instead")
        done = list(turn.earlier.completions[turn.completion].token_ids)
        have = next(k for k in range(len(closing), -1, -1)
                    if k == 0 or done[-k:] == closing[:k])
        return list(turn.earlier.prompt_ids) + done + closing[have:] + full[len(base):]

    async def _turn_frame(self, kwargs: dict[str, Any] | None) -> tuple[list[int], list[int]]:
        """(the tokens a template puts after an assistant message, the rendering of the
        placeholder conversation ending with one), cached per chat_template_kwargs."""
        key = json.dumps(kwargs or {}, sort_keys=True, default=str)
        if key not in self._frames:
            a, b = [await self.tokenize(_PLACEHOLDER + [{"role": "assistant", "content": c}],
                                        add_generation_prompt=False, chat_template_kwargs=kwargs)
                    for c in ("a", "b")]
            same = 0
            while same < min(len(a), len(b)) and a[len(a) - 1 - same] == b[len(b) - 1 - same]:
                same += 1
            self._frames[key] = (a[len(a) - same:], a)
        return self._frames[key]

    @staticmethod
    def _spans(raw: Any, length: int, gen: Generation, prefix: ResumedPrefix) -> list[WeightSpan]:
        """The choice's weight spans, prefix included: the server's nvext.weight_versions
        when it sends them, else one span per attempt from its engine_data."""
        own = weight_spans(raw, length) if raw is not None else \
            [WeightSpan.of(gen.policy or UNKNOWN, 0, length)]
        base = len(prefix)
        return prefix.spans + [s.moved(base) for s in own]

    def _close(self, a: Attempt, trace: str, state: AttemptState, end: _End) -> _End:
        a.move(state, end.reason)
        self.ledger.close_attempt(a.sample_id, a.number, state, end.reason)
        telemetry.attempt_ended(a)
        log.info("attempt %s: %s", state, end.reason, extra=telemetry.fields(a, trace))
        return end

    # ------------------------------------------------------------ the wire

    def _cancel_remotely(self, request_id: str) -> None:
        """Abort an abandoned request on the serving side, in the background. Closing the
        connection is not enough: the frontend keeps a run that has an X-Request-Id for
        a while, so that a retry can rejoin it."""
        task = asyncio.get_running_loop().create_task(self._post_cancel(request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _post_cancel(self, request_id: str) -> None:
        try:
            await self._http.post(self.base_url + CANCEL_PATH.format(request_id),
                                  headers={"x-cancel-token": self._cancel_token},
                                  timeout=CANCEL_TIMEOUT)
        except httpx.HTTPError as e:
            log.info("could not cancel request %s: %r", request_id, e,
                     extra={"request_id": request_id})

    @staticmethod
    def _http_end(status: int, raw: bytes) -> _End:
        try:
            msg = json.loads(raw)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            msg = raw[:300].decode(errors="replace")
        return _End(f"http: {status} {msg}", retry=status in RETRYABLE_STATUS)

    async def _unary(self, url: str, body: bytes, headers: dict[str, str], route: str
                     ) -> Generation | _End:
        resp = await self._http.post(url, content=body, headers=headers)
        if resp.status_code != 200:
            return self._http_end(resp.status_code, resp.content)
        echoed = resp.headers.get("x-request-id")
        try:
            data = resp.json()
        except ValueError as e:
            return _End(f"stream_error: the response is not JSON: {e}")
        return parse_openai(data, echoed) if route == "openai" else parse_sglang(data, echoed)

    async def _streamed(self, a: Attempt, url: str, body: bytes, headers: dict[str, str],
                        acc: OpenAIStream | SglangStream) -> Generation | _End:
        async with self._http.stream("POST", url, content=body, headers=headers) as resp:
            if resp.status_code != 200:
                return self._http_end(resp.status_code, await resp.aread())
            echoed = resp.headers.get("x-request-id")
            if isinstance(acc, OpenAIStream):
                acc.gen.echoed_request_id = echoed
            else:
                acc.echoed = echoed
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return acc.result()
                try:
                    event = json.loads(data)
                except ValueError as e:
                    raise StreamError(f"an event is not JSON: {e}") from e
                if acc.feed(event) and a.state is AttemptState.ACCEPTED:
                    a.move(AttemptState.STREAMING)
                    self.ledger.streaming(a.sample_id, a.number)
        raise StreamError("the stream ended before [DONE]")

    # ------------------------------------------------------------ many samples

    async def rollout(self, samples: Iterable[SampleRequest], concurrency: int = 64,
                      **options: Any) -> list[RolloutOutcome]:
        """Generate every sample, at most `concurrency` at a time; one outcome per sample in
        input order. `options` go to `generate` (route, stream, deadline, ...)."""
        items = list(samples)
        out: list[RolloutOutcome | None] = [None] * len(items)
        queue = iter(enumerate(items))

        async def work() -> None:
            for i, s in queue:
                try:
                    got = await self.generate(s.sample_id, s.prompt, s.sampling, s.n, **options)
                    out[i] = RolloutOutcome(s.sample_id, sample=got)
                except (SampleFailed, AlreadyAdmitted) as e:
                    out[i] = RolloutOutcome(s.sample_id, error=e)

        async with asyncio.TaskGroup() as tg:
            for _ in range(max(1, min(concurrency, len(items)))):
                tg.create_task(work())
        return [o for o in out if o is not None]
