"""RolloutClient against a scripted in-process frontend (an httpx transport that renders
responses with the frontend's own renderers): admission, retries, timeouts with request-ID
reuse, server aborts with discard or resume, cancellation, duplicates, telemetry."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from prometheus_client import REGISTRY

from rlfleet.frontend.result import Result
from rlfleet.protocol.openai import CompletionRequest
from rlfleet.protocol.sglang import SglangGenerateRequest
from rlfleet.rl import (
    AlreadyAdmitted,
    AttemptState,
    PartialRolloutPolicy,
    PolicyBound,
    PolicyIdentity,
    RetryPolicy,
    RolloutClient,
    SampleFailed,
    SampleLedger,
    SampleRequest,
    SamplingSpec,
    WeightSpan,
)
from rlfleet.rollout.checks import CHECKS
from rlfleet.rollout.telemetry import KINDS, trace_id
from tests import render
from tests.render import event

MODEL = "tiny"
PROMPT = [1000, 1001, 1002]
FAST = RetryPolicy(max_attempts=3, backoff_initial=0.001, backoff_max=0.002, attempt_timeout=5.0)


def wspan(version: str, digest: str, start: int, end: int) -> WeightSpan:
    return WeightSpan(version=version, digest=digest, start=start, end=end)


def tokens_for(prompt: list[int], choice: int, count: int) -> list[int]:
    return [2000 + (sum(prompt) * 7 + i * 13 + choice * 101) % 5000 for i in range(count)]


class Action(dict):
    """What the fake frontend does with one request: keys `status`, `hang` (seconds before
    answering), `abort` / `break_` (after k tokens), `version`, `adapter` (the LoRA adapter
    the worker says served it), `spans`, `tamper`, `delay` (seconds between stream
    chunks)."""


class FakeFrontend:
    def __init__(self, script: Callable[[int, dict], Action] | None = None,
                 idempotent: bool = False) -> None:
        self.script = script or (lambda i, body: Action())
        self.idempotent = idempotent
        self.requests: list[tuple[str, dict[str, str], dict]] = []
        self.closed_streams = 0
        self.cancelled: list[str] = []
        self.remembered: dict[str, httpx.Response] = {}

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if m := re.fullmatch(r"/v1/requests/(.+)/cancel", request.url.path):
            self.cancelled.append(m.group(1))
            return httpx.Response(200, json={"request_id": m.group(1), "cancelled": True})
        body = json.loads(request.content)
        self.requests.append((request.url.path, dict(request.headers), body))
        rid = request.headers["x-request-id"]
        act = self.script(len(self.requests) - 1, body)
        if act.get("hang"):
            await asyncio.sleep(act["hang"])
        if act.get("status"):
            return httpx.Response(act["status"], json={"error": {"message": "scripted failure",
                                                                  "code": act["status"]}})
        if self.idempotent and rid in self.remembered:
            return self.remembered[rid]
        resp = self.render(request.url.path, body, rid, act)
        if self.idempotent:
            self.remembered[rid] = resp
        return resp

    def render(self, path: str, body: dict, rid: str, act: Action) -> httpx.Response:
        openai = path == "/v1/completions"
        if openai:
            req: Any = CompletionRequest.model_validate(body)
            prompt, n, max_tokens = req.prompt, req.n, req.max_tokens
        else:
            req = SglangGenerateRequest.model_validate(body)
            prompt, n, max_tokens = req.input_ids, 1, req.sampling_params.max_new_tokens
        res = Result(rid, n)
        res.apply(event({"prompt_token_ids": prompt, "worker_id": 7,
                         "weight_version": act.get("version", "v1"), "weight_digest": "d1",
                         **({"weight_adapter": act["adapter"]} if "adapter" in act else {})}))
        stop_at = act.get("abort", act.get("break_"))
        deltas = []
        for c in range(n):
            ids = tokens_for(prompt, c, max_tokens)[:stop_at]
            for k, t in enumerate(ids):
                last = k == len(ids) - 1
                finish = ("abort" if "abort" in act else "length") if last else None
                if last and "break_" in act:
                    finish = None
                deltas += res.apply(event({"choices": [{
                    "index": c, "token_ids": [t], "text": f"<{t}>", "finish_reason": finish,
                    "logprobs": [{"token_id": t, "logprob": -0.1 * (1 + t % 5),
                                  "decoded": f"<{t}>", "top": []}]}]}))
        res.apply(event({"done": True, "prompt_logprobs": [None] + [
            {str(t): {"logprob": -2.0, "rank": 1, "decoded_token": "x"}} for t in prompt[1:]]}))
        model = body["model"]  # echoed, as the frontend does
        if openai and not req.stream:
            events = [render.completion_response(req, res, model)]
        elif openai:
            events = [render.completion_chunk(req, res, model, d, 0) for d in deltas]
            events.append(render.final_chunk(req, res, model, "text_completion"))
        else:
            full = render.sglang_body(req, res)
            events = [full] if not req.stream else [
                {**full, "output_ids": full["output_ids"][:k + 1]} for k in range(len(deltas))]
        if "spans" in act:
            holder = events[-1].setdefault("nvext", {}) if openai else events[-1]["meta_info"]
            holder["weight_versions"] = act["spans"]
        if act.get("tamper"):
            act["tamper"](events[-1])
        headers = {"x-request-id": rid}
        if not req.stream:
            return httpx.Response(200, json=events[0], headers=headers)
        lines = [f"data: {json.dumps(e)}\n\n".encode() for e in events]
        if "break_" in act:
            lines.append(b'data: {"error": {"message": "worker died", "code": 502}}\n\n')
        else:
            lines.append(b"data: [DONE]\n\n")
        return httpx.Response(200, headers={**headers, "content-type": "text/event-stream"},
                              stream=_Stream(lines, act.get("delay", 0.0), self))


class _Stream(httpx.AsyncByteStream):
    def __init__(self, parts: list[bytes], delay: float, fe: FakeFrontend) -> None:
        self.parts, self.delay, self.fe = parts, delay, fe

    async def __aiter__(self):
        for p in self.parts:
            if self.delay:
                await asyncio.sleep(self.delay)
            yield p

    async def aclose(self) -> None:
        self.fe.closed_streams += 1


def client(fe: FakeFrontend, **kw) -> RolloutClient:
    kw.setdefault("retry", FAST)
    return RolloutClient("http://frontend", MODEL, transport=fe.transport(), **kw)


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


# ---------------------------------------------------------------- admitted samples

@pytest.mark.parametrize("stream", [False, True])
async def test_a_sample_is_verified_admitted_and_recorded(stream):
    fe = FakeFrontend()
    before = metric("rlfleet_rollout_samples_total", outcome="admitted")
    async with client(fe, stream=stream) as c:
        s = await c.generate("s-1", PROMPT, SamplingSpec(max_tokens=5, prompt_logprobs=True))
        assert s.sample_id == "s-1" and s.attempt == 1 and s.model == MODEL
        assert s.completion.token_ids == tokens_for(PROMPT, 0, 5)
        assert len(s.completion.logprobs) == 5 and s.completion.finish_reason == "length"
        assert s.completion.token_attempts == [1] * 5
        assert s.completion.weight_spans == [wspan("v1", "d1", 0, 5)]
        assert s.prompt_logprobs == [None, -2.0, -2.0]
        assert (s.policy.version, s.policy.digest, s.worker_id) == ("v1", "d1", 7)
        rec = c.ledger.attempt("s-1", 1)
        assert rec.admitted and rec.state is AttemptState.SUCCEEDED
        assert (rec.first_token_at is not None) == stream
        assert c.ledger.admitted() == {"s-1": (1, s.request_id)}
    path, headers, body = fe.requests[0]
    assert path == "/v1/completions" and headers["x-request-id"] == s.request_id
    assert re.fullmatch(f"00-{trace_id('s-1')}-[0-9a-f]{{16}}-01", headers["traceparent"])
    assert body["prompt"] == PROMPT and body["logprobs"] == 0 and body["stream"] is stream
    assert body["return_tokens_as_token_ids"] is True and body["prompt_logprobs"] == 0
    assert {"completion_token_ids", "prompt_token_ids", "worker_id", "detailed_finish_reason",
            "engine_data", "prompt_logprobs"} <= set(body["nvext"]["extra_fields"])
    assert metric("rlfleet_rollout_samples_total", outcome="admitted") == before + 1


async def test_several_choices_stream_in():
    async with client(FakeFrontend(), stream=True) as c:
        s = await c.generate("s", PROMPT, SamplingSpec(max_tokens=4), n=3)
    assert [x.token_ids for x in s.completions] == [tokens_for(PROMPT, i, 4) for i in range(3)]


@pytest.mark.parametrize("stream", [False, True])
async def test_the_sglang_route(stream):
    fe = FakeFrontend()
    async with client(fe, route="sglang", stream=stream) as c:
        s = await c.generate("s", PROMPT, SamplingSpec(max_tokens=4, prompt_logprobs=True))
        with pytest.raises(ValueError):
            await c.generate("t", PROMPT, n=2)
    assert s.completion.token_ids == tokens_for(PROMPT, 0, 4)
    assert s.prompt_logprobs == [None, -2.0, -2.0]
    path, headers, body = fe.requests[0]
    assert path == "/generate" and body["rid"] == headers["x-request-id"] == s.request_id
    assert body["input_ids"] == PROMPT and body["return_logprob"] is True
    assert body["logprob_start_len"] == 0


# ---------------------------------------------------------------- retries

async def test_a_server_error_is_retried_with_a_new_request_id():
    fe = FakeFrontend(lambda i, b: Action(status=503) if i == 0 else Action())
    async with client(fe) as c:
        s = await c.generate("s", PROMPT)
        recs = c.ledger.attempts("s")
    assert s.attempt == 2
    assert [(r.state, r.reason[:8] if r.reason else None) for r in recs] == [
        (AttemptState.FAILED, "http: 50"), (AttemptState.SUCCEEDED, None)]
    (_, h1, _), (_, h2, _) = fe.requests
    assert h1["x-request-id"] != h2["x-request-id"] == s.request_id
    # one trace per sample, one span per attempt
    assert h1["traceparent"][:36] == h2["traceparent"][:36] and h1["traceparent"] != h2["traceparent"]


async def test_a_bad_request_is_not_retried():
    fe = FakeFrontend(lambda i, b: Action(status=400))
    async with client(fe) as c:
        with pytest.raises(SampleFailed) as info:
            await c.generate("s", PROMPT)
    assert len(fe.requests) == 1 and info.value.reason.startswith("http: 400")


async def test_a_tampered_response_is_rejected_and_retried():
    def tamper(body):
        body["choices"][0]["logprobs"]["tokens"].reverse()
    fe = FakeFrontend(lambda i, b: Action(tamper=tamper) if i == 0 else Action())
    before = metric("rlfleet_rollout_rejections_total", check="logprobs_aligned")
    async with client(fe) as c:
        s = await c.generate("s", PROMPT)
        assert c.ledger.attempt("s", 1).reason == "logprobs_aligned"
    assert s.attempt == 2
    assert metric("rlfleet_rollout_rejections_total", check="logprobs_aligned") == before + 1


async def test_a_sample_that_never_passes_fails_with_its_reasons():
    fe = FakeFrontend(lambda i, b: Action(version="v0"))
    async with client(fe, expected_version="v1") as c:
        with pytest.raises(SampleFailed) as info:
            await c.generate("s", PROMPT)
        assert [r.reason for r in c.ledger.attempts("s")] == ["identity"] * 3
        assert c.ledger.admitted() == {}
    assert info.value.reasons == ["identity"] * 3 and info.value.reason == "identity"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_sample_from_another_adapter_or_the_base_is_not_admitted(stream):
    """A client of adapter `a` refuses what the worker says came from adapter `b` or from
    the base model (the frontend echoes `model` either way), naming both; a client of the
    base model refuses an adapter's sample; the adapter's own sample is admitted."""
    served = iter(["b", None, "a"])
    fe = FakeFrontend(lambda i, b: Action(**({"adapter": a} if (a := next(served)) else {})))
    async with RolloutClient("http://frontend", "a", adapter=True, transport=fe.transport(),
                             retry=FAST, stream=stream) as c:
        s = await c.generate("s", PROMPT)
        assert s.attempt == 3 and s.policy.adapter == "a"
        assert [r.reason for r in c.ledger.attempts("s")][:2] == [
            "adapter: the worker's engine data names adapter 'b'; the request named "
            "adapter 'a'", "adapter: the worker's engine data names no adapter (the base "
            "model); the request named adapter 'a'"]
    fe = FakeFrontend(lambda i, b: Action(adapter="a"))
    async with client(fe) as c:
        with pytest.raises(SampleFailed) as info:
            await c.generate("s", PROMPT)
    assert "names adapter 'a'; the request named 'tiny'" in info.value.reason
    spans = [{**wspan("a-v1", "d1", 0, 2).to_dict(), "adapter": "a"},
             {**wspan("b-v1", "d2", 2, 4).to_dict(), "adapter": "b"}]
    fe = FakeFrontend(lambda i, b: Action(adapter="a", spans=spans))
    async with RolloutClient("http://frontend", "a", adapter=True, transport=fe.transport(),
                             retry=FAST, allow_mixed_versions=True) as c:
        with pytest.raises(SampleFailed) as info:
            await c.generate("s", PROMPT, SamplingSpec(max_tokens=4))
    assert "span [2, 4) names adapter 'b'; the request named adapter 'a'" in info.value.reason


async def test_expect_switches_the_admitted_policy():
    fe = FakeFrontend(lambda i, b: Action(version="v2"))
    async with client(fe, expected_version="v1", retry=RetryPolicy(1)) as c:
        with pytest.raises(SampleFailed):
            await c.generate("a", PROMPT)
        c.expect(version="v2")
        assert (await c.generate("b", PROMPT)).policy.version == "v2"


async def test_a_timed_out_attempt_is_retried_under_the_same_request_id():
    """The frontend remembers request IDs: the retry gets the first attempt's result."""
    fe = FakeFrontend(lambda i, b: Action(hang=0.5) if i == 0 else Action(), idempotent=True)
    async with client(fe, retry=RetryPolicy(3, 0.001, 0.002, attempt_timeout=0.1)) as c:
        s = await c.generate("s", PROMPT)
        recs = c.ledger.attempts("s")
    assert [(r.state, r.reason) for r in recs] == [(AttemptState.CANCELED, "timeout"),
                                                   (AttemptState.SUCCEEDED, None)]
    assert recs[0].request_id == recs[1].request_id == s.request_id
    assert fe.requests[0][1]["x-request-id"] == fe.requests[1][1]["x-request-id"]
    assert fe.cancelled == []  # the retry rejoins the first request: it must keep running


async def test_request_id_reuse_can_be_turned_off():
    fe = FakeFrontend(lambda i, b: Action(hang=0.5) if i == 0 else Action())
    retry = RetryPolicy(3, 0.001, 0.002, attempt_timeout=0.1, reuse_request_id_on_timeout=False)
    async with client(fe, retry=retry) as c:
        await c.generate("s", PROMPT)
    first, second = (h["x-request-id"] for _, h, _ in fe.requests)
    assert first != second and fe.cancelled == [first]  # abandoned: aborted on the server


async def test_a_reused_request_id_that_is_still_running_gets_a_new_one():
    def script(i, b):
        return [Action(hang=0.5), Action(status=400), Action()][i]
    fe = FakeFrontend(script)
    async with client(fe, retry=RetryPolicy(3, 0.001, 0.002, attempt_timeout=0.1)) as c:
        s = await c.generate("s", PROMPT)
    ids = [h["x-request-id"] for _, h, _ in fe.requests]
    assert ids[0] == ids[1] != ids[2] == s.request_id


async def test_the_deadline_bounds_the_whole_sample():
    fe = FakeFrontend(lambda i, b: Action(hang=0.3))
    async with client(fe, retry=RetryPolicy(10, 0.05, 0.05, attempt_timeout=5)) as c:
        t0 = time.monotonic()
        with pytest.raises(SampleFailed) as info:
            await c.generate("s", PROMPT, deadline=time.monotonic() + 0.2)
    assert time.monotonic() - t0 < 1.0
    assert info.value.reasons[0] == "timeout" and info.value.reason == "deadline"
    assert fe.cancelled == [fe.requests[0][1]["x-request-id"]]  # nobody will rejoin it


# ---------------------------------------------------------------- partial rollouts

@pytest.mark.parametrize("stream", [False, True])
async def test_an_aborted_attempt_is_discarded_by_default(stream):
    fe = FakeFrontend(lambda i, b: Action(abort=2) if i == 0 else Action())
    async with client(fe, stream=stream) as c:
        s = await c.generate("s", PROMPT, SamplingSpec(max_tokens=5))
        assert c.ledger.attempt("s", 1).state is AttemptState.CANCELED
        assert c.ledger.attempt("s", 1).reason == "aborted"
    assert fe.requests[1][2]["prompt"] == PROMPT and fe.requests[1][2]["max_tokens"] == 5
    assert s.completion.token_attempts == [2] * 5


@pytest.mark.parametrize("route", ["openai", "sglang"])
async def test_an_aborted_attempt_is_resumed_when_the_policy_says_so(route):
    fe = FakeFrontend(lambda i, b: Action(abort=2) if i == 0 else Action())
    async with client(fe, partial=PartialRolloutPolicy("resume"), route=route) as c:
        s = await c.generate("s", PROMPT, SamplingSpec(max_tokens=5))
    kept = tokens_for(PROMPT, 0, 2)
    body = fe.requests[1][2]
    if route == "openai":
        assert body["prompt"] == PROMPT + kept and body["max_tokens"] == 3
    else:
        assert body["input_ids"] == PROMPT + kept
        assert body["sampling_params"]["max_new_tokens"] == 3
    assert s.prompt_ids == PROMPT
    assert s.completion.token_ids == kept + tokens_for(PROMPT + kept, 0, 3)
    assert s.completion.token_attempts == [1, 1, 2, 2, 2]
    assert len(s.completion.logprobs) == 5
    assert s.completion.weight_spans == [wspan("v1", "d1", 0, 2), wspan("v1", "d1", 2, 5)]


async def test_a_broken_stream_with_known_weights_is_resumed():
    fe = FakeFrontend(lambda i, b: Action(break_=3) if i == 0 else Action())
    async with client(fe, partial=PartialRolloutPolicy("resume"), route="sglang",
                      stream=True) as c:
        s = await c.generate("s", PROMPT, SamplingSpec(max_tokens=5))
        assert c.ledger.attempt("s", 1).reason.startswith("stream_error")
    assert s.completion.token_attempts == [1, 1, 1, 2, 2]


async def test_a_resumed_sample_across_a_policy_change_is_not_single_policy():
    def script(i, b):
        return Action(abort=2, version="v1") if i == 0 else Action(version="v2")
    fe = FakeFrontend(script)
    async with client(fe, partial=PartialRolloutPolicy("resume")) as c:
        s = await c.generate("s", PROMPT, SamplingSpec(max_tokens=4))
        assert [r.reason for r in c.ledger.attempts("s")] == ["aborted", "single_policy", None]
    assert fe.requests[2][2]["prompt"] == PROMPT  # after the rejection: from scratch
    assert s.completion.token_attempts == [3] * 4 and s.policy.version == "v2"

    fe = FakeFrontend(script)
    async with client(fe, partial=PartialRolloutPolicy("resume"), allow_mixed_versions=True) as c:
        s = await c.generate("s", PROMPT, SamplingSpec(max_tokens=4))
    assert s.completion.weight_spans == [wspan("v1", "d1", 0, 2), wspan("v2", "d1", 2, 4)]


async def test_server_reported_weight_spans():
    mixed = [{"version": "v1", "digest": "a", "start": 0, "end": 1},
             {"version": "v2", "digest": "b", "start": 1, "end": 3}]
    fe = FakeFrontend(lambda i, b: Action(spans=mixed))
    async with client(fe, retry=RetryPolicy(1)) as c:
        with pytest.raises(SampleFailed) as info:
            await c.generate("s", PROMPT, SamplingSpec(max_tokens=3))
    assert info.value.reason == "single_policy"
    async with client(fe, allow_mixed_versions=True) as c:
        s = await c.generate("s", PROMPT, SamplingSpec(max_tokens=3))
    assert s.completion.weight_spans == [wspan("v1", "a", 0, 1), wspan("v2", "b", 1, 3)]


# ---------------------------------------------------------------- cancellation, duplicates

async def test_cancelling_closes_the_stream_and_records_the_attempt():
    fe = FakeFrontend(lambda i, b: Action(delay=0.05) if i == 0 else Action())
    async with client(fe, stream=True) as c:
        task = asyncio.create_task(c.generate("s", PROMPT, SamplingSpec(max_tokens=20)))
        await asyncio.sleep(0.2)
        assert c.ledger.attempt("s", 1).state is AttemptState.STREAMING
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert fe.closed_streams == 1
        await asyncio.sleep(0)
        assert fe.cancelled == [c.ledger.attempt("s", 1).request_id]
        rec = c.ledger.attempt("s", 1)
        assert (rec.state, rec.reason, rec.admitted) == (AttemptState.CANCELED, "cancelled", False)
        s = await c.generate("s", PROMPT)  # the trainer asks again: the next attempt
        assert s.attempt == 2


async def test_an_admitted_sample_is_not_generated_again(tmp_path):
    fe = FakeFrontend()
    path = tmp_path / "ledger.db"
    with SampleLedger(path) as led:
        async with client(fe, ledger=led) as c:
            await c.generate("s", PROMPT)
            with pytest.raises(AlreadyAdmitted):
                await c.generate("s", PROMPT)
    with SampleLedger(path) as led:  # after a restart
        async with client(fe, ledger=led) as c:
            with pytest.raises(AlreadyAdmitted):
                await c.generate("s", PROMPT)
    assert len(fe.requests) == 1


async def test_rollout_returns_one_outcome_per_sample_in_order():
    def script(i, body):
        return Action(status=400) if body["prompt"][0] == 7 else Action()
    fe = FakeFrontend(script)
    reqs = [SampleRequest(f"s{i}", [7 if i % 5 == 0 else 1000 + i, 1, 2]) for i in range(40)]
    async with client(fe) as c:
        out = await c.rollout(reqs + [reqs[1]], concurrency=8)
    assert [o.sample_id for o in out] == [r.sample_id for r in reqs] + ["s1"]
    assert [o.admitted for o in out[:40]] == [i % 5 != 0 for i in range(40)]
    assert out[0].reason.startswith("http: 400")
    assert not out[40].admitted and out[40].reason == "already_admitted"


async def test_log_records_carry_the_attempt_identity(caplog):
    fe = FakeFrontend(lambda i, b: Action(status=503) if i == 0 else Action())
    with caplog.at_level(logging.INFO, logger="rlfleet.rl.rollout"):
        async with client(fe) as c:
            await c.generate("s", PROMPT)
    rec = next(r for r in caplog.records if "http: 503" in r.getMessage())
    assert (rec.sample_id, rec.attempt, rec.trace_id) == ("s", 1, trace_id("s"))
    assert rec.request_id == fe.requests[0][1]["x-request-id"]


def test_metric_labels_are_bounded_sets():
    labels: dict[str, set[str]] = {}
    for family in REGISTRY.collect():
        if family.name.startswith("rlfleet_rollout_"):
            for sample in family.samples:
                for k, v in sample.labels.items():
                    if k != "le":
                        labels.setdefault(k, set()).add(v)
    assert set(labels) <= {"state", "kind", "outcome", "check"}
    assert labels.get("state", set()) <= {"succeeded", "canceled", "failed"}
    assert labels.get("outcome", set()) <= {"admitted", "failed", "cancelled", "already_admitted"}
    assert labels.get("kind", set()) <= KINDS | {"other"}
    assert labels.get("check", set()) <= {c.__name__ for c in CHECKS} | {
        "single_policy", "policy_bound", "adapter"}


def test_retry_backoff_is_bounded():
    p = RetryPolicy(max_attempts=5, backoff_initial=0.1, backoff_max=0.3, jitter=0.5)
    for k in range(1, 10):
        base = min(0.3, 0.1 * 2 ** (k - 1))
        assert base <= p.backoff(k) <= base * 1.5
    assert RetryPolicy(jitter=0).backoff(1) == RetryPolicy().backoff_initial
    for bad in ({"max_attempts": 0}, {"backoff_max": -1}, {"attempt_timeout": 0}):
        with pytest.raises(ValueError):
            RetryPolicy(**bad)


async def test_no_attempt_starts_while_the_gate_is_closed():
    from rlfleet.rollout.gate import RolloutGate

    gate = RolloutGate()
    gate.close("policy refresh")
    fe = FakeFrontend(lambda i, b: Action(version="v2"))
    async with client(fe, gate=gate, expected_version="v1") as c:
        task = asyncio.create_task(c.generate("s", PROMPT))
        await asyncio.sleep(0.1)
        assert fe.requests == [] and c.ledger.attempts() == []
        c.expect(version="v2")  # the refresh published v2, then reopens
        gate.open()
        assert (await task).policy.version == "v2"
        gate.close("another refresh")
        with pytest.raises(SampleFailed) as info:
            await c.generate("t", PROMPT, deadline=time.monotonic() + 0.1)
    assert info.value.reason == "deadline" and len(fe.requests) == 1


# ---------------------------------------------------------------- staleness bounds

def stepped(*parts: tuple[int, int, int]) -> list[dict]:
    """Spans (step, start, end) of one policy per step."""
    return [{"version": f"s{st}", "digest": f"d{st}", "step": st, "start": s, "end": e}
            for st, s, e in parts]


async def test_a_bound_is_sent_and_checked_from_the_spans():
    """The bound goes out as nvext.policy on every attempt; a sample whose spans name a step
    below min_step is not admitted (outcome policy_bound) and is retried; one within the
    bound is admitted with the steps of its spans."""
    fe = FakeFrontend(lambda i, b: Action(spans=stepped((4, 0, 3), (5, 3, 5)) if i else
                                          stepped((2, 0, 5))))
    bound = PolicyBound(min_step=4, max_lag=1)
    async with client(fe, policy=bound, allow_mixed_versions=True) as c:
        s = await c.generate("s", PROMPT, SamplingSpec(max_tokens=5))
        assert [r[2]["nvext"]["policy"] for r in fe.requests] == [
            {"min_step": 4, "max_lag": 1, "on_stale": "abort"}] * 2
        assert c.ledger.attempt("s", 1).reason == "policy_bound"
        assert [(w.step, w.start, w.end) for w in s.completion.weight_spans] == [(4, 0, 3),
                                                                                  (5, 3, 5)]
        c.bound(PolicyBound(max_lag=0, on_stale="finish"))  # steps 4 and 5 are 1 apart
        fe.script = lambda i, b: Action(spans=stepped((4, 0, 3), (5, 3, 5)))
        with pytest.raises(SampleFailed) as info:
            await c.generate("t", PROMPT, SamplingSpec(max_tokens=5))
        assert info.value.reason == "policy_bound"
        assert fe.requests[-1][2]["nvext"]["policy"] == {"max_lag": 0, "on_stale": "finish"}
        c.bound(None)
        await c.generate("u", PROMPT, SamplingSpec(max_tokens=5))
        assert "policy" not in fe.requests[-1][2]["nvext"]


async def test_a_sample_the_server_marked_or_aborted_as_stale_is_not_admitted():
    def mark(event: dict) -> None:
        event["nvext"]["stale_policy"] = True

    def stale_abort(event: dict) -> None:
        event["nvext"]["detailed_finish_reason"] = "stale_policy"

    script = [Action(spans=stepped((4, 0, 5)), tamper=mark),
              Action(abort=2, tamper=stale_abort), Action(spans=stepped((4, 0, 5)))]
    fe = FakeFrontend(lambda i, b: script[i])
    async with client(fe, policy=PolicyBound(max_lag=1)) as c:
        s = await c.generate("s", PROMPT, SamplingSpec(max_tokens=5))
        assert s.attempt == 3
        assert [c.ledger.attempt("s", k).reason for k in (1, 2)] == ["policy_bound",
                                                                       "stale_policy"]
        assert c.ledger.attempt("s", 2).state is AttemptState.CANCELED


def test_policy_bound_is_checked_when_made():
    assert PolicyBound(min_step=3).nvext() == {"min_step": 3, "on_stale": "abort"}
    for bad in ({}, {"min_step": -1}, {"max_lag": 1.5}, {"max_lag": 1, "on_stale": "x"}):
        with pytest.raises(ValueError, match="PolicyBound"):
            PolicyBound(**bad)


async def test_a_reopen_hands_the_new_policy_to_waiting_attempts():
    """PolicyRefresh reopens the gate on the policy it verified: attempts waiting at the
    gate expect it at once, with nobody calling `expect` (issue 10 finding 11)."""
    from rlfleet.rollout.gate import RolloutGate

    gate = RolloutGate()
    gate.close("policy refresh")
    fe = FakeFrontend(lambda i, b: Action(version="v2"))
    async with client(fe, gate=gate, expected_version="v1") as c:
        waiting = [asyncio.create_task(c.generate(f"s{k}", PROMPT)) for k in range(4)]
        await asyncio.sleep(0.1)
        gate.open(("v2", "d1"))  # what the refresh does once the fleet serves v2
        samples = await asyncio.gather(*waiting)
        assert {s.policy.version for s in samples} == {"v2"}
        assert len(fe.requests) == 4  # no attempt wasted on the old expectation
        assert c.rules.expected == PolicyIdentity(version="v2", digest="d1")


class Restarting(httpx.AsyncBaseTransport):
    """A frontend that refuses connections for its first `refusals` requests (it is
    restarting), then serves as `fe`."""

    def __init__(self, fe: FakeFrontend, refusals: int) -> None:
        self.inner, self.refusals, self.refused = fe.transport(), refusals, 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.refused < self.refusals:
            self.refused += 1
            raise httpx.ConnectError("connection refused", request=request)
        return await self.inner.handle_async_request(request)


async def test_an_unreachable_frontend_is_ridden_out_without_spending_attempts():
    """Six refused connections in a row (a frontend restarting) do not use up a policy of
    two attempts: nothing was sent, and the sample is admitted once the frontend is back."""
    fe = FakeFrontend()
    restarting = Restarting(fe, 6)
    retry = RetryPolicy(2, 0.001, 0.002, attempt_timeout=5.0)
    async with RolloutClient("http://frontend", MODEL, transport=restarting,
                             retry=retry) as c:
        s = await c.generate("s", PROMPT)
    assert restarting.refused == 6 and len(fe.requests) == 1
    assert s.attempt == 7 and fe.cancelled == []  # nothing to cancel: nothing was sent


async def test_an_unreachable_frontend_counts_once_its_budget_is_spent():
    fe = FakeFrontend()
    for budget, tries in ((0.0, 2), (0.05, None)):
        restarting = Restarting(fe, 10_000)
        retry = RetryPolicy(2, 0.01, 0.01, jitter=0, unreachable_for=budget)
        async with RolloutClient("http://frontend", MODEL, transport=restarting,
                                 retry=retry) as c:
            with pytest.raises(SampleFailed) as info:
                await c.generate("s", PROMPT)
        assert info.value.reason.startswith("transport: ConnectError")
        if tries is not None:  # no budget: a refusal is an attempt like any other
            assert restarting.refused == tries
        else:  # refusals are free for 0.05 s, then each one counts
            assert 2 < restarting.refused < 100
    with pytest.raises(ValueError):
        RetryPolicy(unreachable_for=-1)
