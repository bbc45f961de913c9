"""The trainer-facing API without an engine: SamplingSpec checks and wire fields, prompts as
text / chat / next turn against an in-process frontend (the frontend's own renderers and a
byte tokenizer), the ledger from many threads, Fleet from threads and event loops, a held
fleet, and TRL's rollout_func contract (order, groups, retries, clear failures)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from rlfleet.frontend.result import Result
from rlfleet.protocol.openai import ChatCompletionRequest, CompletionRequest
from rlfleet.protocol.sglang import SglangGenerateRequest
from rlfleet.protocol.vllm_native import TokenizeRouteRequest
from rlfleet.rl import (
    AdmittedSample,
    Chat,
    Completion,
    Fleet,
    FleetHeld,
    NextTurn,
    PartialRolloutPolicy,
    RetryPolicy,
    RolloutClient,
    SampleFailed,
    SampleLedger,
    SampleRequest,
    SamplingSpec,
)
from rlfleet.rollout.client import request_body
from rlfleet.rollout.sample import prompt_kind
from tests import render
from tests.render import event

MODEL = "tiny"
FAST = RetryPolicy(max_attempts=3, backoff_initial=0.001, backoff_max=0.002, attempt_timeout=5.0)
CHATML_END = "<|im_end|>\n"


def tokenize(text: str) -> list[int]:
    """The fake worker's tokenizer: one token per byte."""
    return [1000 + b for b in text.encode()]


def chatml(messages: list[dict], add_generation_prompt: bool) -> str:
    out = "".join(f"<|im_start|>{m['role']}\n{m.get('content') or ''}{CHATML_END}"
                  for m in messages)
    return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")


class Frontend:
    """An in-process frontend: /v1/completions (token IDs or text), /v1/chat/completions and
    /tokenize, rendered with the frontend's own renderers. `fail(body)` may return an HTTP
    status to answer instead; `omit_prompt_ids` drops nvext.prompt_token_ids (and engine_data's)."""

    def __init__(self, fail=None, omit_prompt_ids: bool = False,
                 abort_first_after: int | None = None) -> None:
        self.fail = fail or (lambda body: None)
        self.omit_prompt_ids = omit_prompt_ids
        self.abort_first_after = abort_first_after  # the first generation ends aborted
        self.requests: list[tuple[str, dict]] = []
        self.lock = threading.Lock()

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        with self.lock:
            self.requests.append((request.url.path, body))
        if request.url.path == "/tokenize":
            req = TokenizeRouteRequest.model_validate(body)
            w = req.engine_request()
            ids = tokenize(w.prompt) if w.prompt is not None else \
                tokenize(chatml(w.messages, w.add_generation_prompt))
            return httpx.Response(200, json={"count": len(ids), "tokens": ids})
        if request.url.path.endswith("/cancel"):
            return httpx.Response(200, json={})
        status = self.fail(body)
        if status:
            return httpx.Response(status, json={"error": {"message": "scripted", "code": status}})
        rid = request.headers["x-request-id"]
        chat = request.url.path == "/v1/chat/completions"
        req: Any = (ChatCompletionRequest if chat else CompletionRequest).model_validate(body)
        if chat:
            prompt = tokenize(chatml([m.plain() for m in req.messages], req.add_generation_prompt))
            budget = req.token_budget
        else:
            prompt = req.prompt if isinstance(req.prompt, list) else tokenize(req.prompt)
            budget = req.max_tokens
        res = Result(rid, req.n)
        res.apply(event({"prompt_token_ids": prompt, "worker_id": 1, "weight_version": "v1",
                         "weight_digest": "d1"}))
        abort, self.abort_first_after = self.abort_first_after, None
        for c in range(req.n):
            ids = [2000 + (sum(prompt) + 7 * k + 31 * c) % 900 for k in range(budget)][:abort]
            res.apply(event({"choices": [{"index": c, "token_ids": ids, "text": "x" * len(ids),
                                    "finish_reason": "abort" if abort else "length",
                                    "logprobs": [{"token_id": t, "logprob": -0.5, "decoded": "x",
                                                  "top": []} for t in ids]}]}))
        res.apply(event({"done": True, "prompt_logprobs": None}))
        out = render.chat_response(req, res, MODEL) if chat else \
            render.completion_response(req, res, MODEL)
        if self.omit_prompt_ids:
            out["nvext"].pop("prompt_token_ids", None)
            out["nvext"]["engine_data"].pop("prompt_token_ids", None)
        return httpx.Response(200, json=out, headers={"x-request-id": rid})


def client(fe: Frontend, **kw) -> RolloutClient:
    return RolloutClient("http://frontend", MODEL, transport=fe.transport(),
                         retry=kw.pop("retry", FAST), **kw)


# ---------------------------------------------------------------- SamplingSpec

@pytest.mark.parametrize("bad,field", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 3.0}, "presence_penalty"), ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"stop": ("",)}, "stop"),
    ({"stop_token_ids": (-1,)}, "stop_token_ids"), ({"logit_bias": {5: 101.0}}, "logit_bias"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"), ({"min_tokens": 20}, "min_tokens"),
    ({"max_tokens": 0}, "max_tokens"), ({"seed": 2 ** 70}, "seed"), ({"top_k": -2}, "top_k"),
])
def test_sampling_spec_refuses_what_the_engine_would(bad, field):
    with pytest.raises(ValueError, match=field):
        SamplingSpec(**bad)


def test_sampling_spec_sends_every_parameter_it_holds():
    spec = SamplingSpec(max_tokens=9, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, seed=3,
                        min_tokens=2, stop="END", stop_token_ids=[7], ignore_eos=True,
                        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                        logit_bias={42: -100}, prompt_logprobs=True)
    assert spec.stop == ("END",) and spec.stop_token_ids == (7,)
    sent = spec.openai_fields()
    assert sent == {"max_tokens": 9, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05,
                    "seed": 3, "min_tokens": 2, "stop": ["END"], "stop_token_ids": [7],
                    "ignore_eos": True, "presence_penalty": 0.5, "frequency_penalty": -0.5,
                    "repetition_penalty": 1.2, "logit_bias": {"42": -100.0}, "prompt_logprobs": 0}
    # the frontend's request model takes each one into the engine's sampling options
    opts = CompletionRequest.model_validate({"model": MODEL, "prompt": [1], **sent}).sampling(9, 0)
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "min_tokens",
                 "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        assert getattr(opts, name) == sent[name], name
    assert opts.stop == ["END"] and opts.logit_bias == {42: -100.0}
    with pytest.raises(ValueError, match="logit_bias is sent on the OpenAI route only"):
        spec.sglang_params()
    sg_spec = replace(spec, logit_bias=None)
    sg = SglangGenerateRequest.model_validate({"input_ids": [1], "sampling_params":
                                               sg_spec.sglang_params()}).sampling()
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens",
                 "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        assert getattr(sg, name) == getattr(opts, name), name
    assert sg.stop == ["END"]


def test_prompt_kinds():
    assert prompt_kind([1, 2]) == "ids" and prompt_kind("hi") == "text"
    assert prompt_kind([{"role": "user", "content": "hi"}]) == "chat"
    assert prompt_kind(Chat([{"role": "user", "content": "hi"}])) == "chat"
    for bad in ([], "", [1, "a"], [-1], [{"content": "no role"}], 5, None):
        with pytest.raises(ValueError):
            prompt_kind(bad)


async def test_the_sglang_route_refuses_text_chat_and_logit_bias_before_sending():
    fe = Frontend()
    async with client(fe, route="sglang") as c:
        with pytest.raises(ValueError, match="token IDs only"):
            await c.generate("s", "some text")
        with pytest.raises(ValueError, match="OpenAI route only"):
            await c.generate("s", [1, 2], SamplingSpec(logit_bias={1: 1.0}))
        assert fe.requests == [] and c.ledger.attempts() == []
    with pytest.raises(ValueError, match="token IDs only"):
        request_body("sglang", "text", SamplingSpec(), 1, False, MODEL, "r")


# ---------------------------------------------------------------- text and chat prompts

async def test_text_and_chat_prompts_carry_the_engine_prompt_ids():
    fe = Frontend()
    async with client(fe) as c:
        text = await c.generate("t", "Hello", SamplingSpec(max_tokens=3))
        chat = await c.generate("c", Chat([{"role": "user", "content": "Hi"}],
                                          {"enable_thinking": False}), SamplingSpec(max_tokens=3),
                                n=2)
        plain = await c.generate("p", [{"role": "user", "content": "Hi"}], SamplingSpec(max_tokens=3))
    assert text.prompt_ids == tokenize("Hello")
    assert chat.prompt_ids == plain.prompt_ids == tokenize(chatml([{"role": "user", "content": "Hi"}],
                                                                   True))
    assert [len(x.token_ids) for x in chat.completions] == [3, 3]
    assert chat.completion.logprobs == [-0.5] * 3
    (p1, b1), (p2, b2) = fe.requests[0], fe.requests[1]
    assert p1 == "/v1/completions" and b1["prompt"] == "Hello"
    assert "prompt_token_ids" in b1["nvext"]["extra_fields"]
    assert p2 == "/v1/chat/completions" and b2["messages"] == [{"role": "user", "content": "Hi"}]
    assert b2["chat_template_kwargs"] == {"enable_thinking": False}
    assert b2["logprobs"] is True and b2["top_logprobs"] == 0 and b2["n"] == 2


async def test_a_text_prompt_without_the_engine_prompt_ids_is_not_admitted():
    """Token authority: a text prompt's IDs come from the engine or the sample is refused."""
    async with client(Frontend(omit_prompt_ids=True)) as c:
        with pytest.raises(SampleFailed) as info:
            await c.generate("t", "Hello", SamplingSpec(max_tokens=3))
        assert c.ledger.admitted() == {}
    assert info.value.reason == "token_ids_present"


async def test_a_text_prompt_resumes_from_the_engine_prompt_ids():
    """A partial attempt of a text prompt is resumed as token IDs: the engine's prompt IDs
    (from the aborted response) plus the tokens kept."""
    fe = Frontend(abort_first_after=2)
    async with client(fe, partial=PartialRolloutPolicy("resume")) as c:
        s = await c.generate("t", "Hello", SamplingSpec(max_tokens=5))
    assert s.prompt_ids == tokenize("Hello")
    assert len(s.completion.token_ids) == 5 and s.completion.token_attempts == [1, 1, 2, 2, 2]
    (_, first), (_, second) = fe.requests
    assert first["prompt"] == "Hello"
    assert second["prompt"] == tokenize("Hello") + s.completion.token_ids[:2]
    assert second["max_tokens"] == 3


def sample_with(prompt_ids: list[int], tokens: list[int]) -> AdmittedSample:
    return AdmittedSample("earlier", 1, "r", prompt_ids,
                          [Completion(tokens, [-1.0] * len(tokens), "stop", [1] * len(tokens))],
                          MODEL)


@pytest.mark.parametrize("ending", ["", "<|im_end|>", "<|im_end|>\n"])
async def test_a_next_turn_appends_new_messages_to_the_engine_tokens(ending):
    fe = Frontend()
    engine_tokens = [5, 6, 7] + tokenize(ending)  # what the engine generated, kept verbatim
    earlier = sample_with([1, 2, 3], engine_tokens)
    new = [{"role": "user", "content": "more"}]
    async with client(fe) as c:
        ids = await c.next_turn_ids(NextTurn(earlier, new))
        again = await c.next_turn_ids(NextTurn(earlier, new))
        s = await c.generate("next", NextTurn(earlier, new), SamplingSpec(max_tokens=2))
    closing = tokenize(CHATML_END)[len(tokenize(ending)):]  # what the completion lacks
    assert ids == [1, 2, 3] + engine_tokens + closing + tokenize(chatml(new, True)) == again
    assert s.prompt_ids == ids
    tokenize_calls = [b for p, b in fe.requests if p == "/tokenize"]
    assert len(tokenize_calls) == 2 + 2 + 1  # the template frame once, one call per turn
    with pytest.raises(ValueError, match="no completion 1"):
        NextTurn(earlier, new, completion=1)


# ---------------------------------------------------------------- the ledger from threads

def test_the_ledger_admits_each_sample_once_from_many_threads(tmp_path):
    ledger = SampleLedger(tmp_path / "ledger.sqlite")
    results: list[tuple[str, str]] = []
    lock = threading.Lock()

    def worker(k: int) -> None:
        for i in range(40):
            sid = f"s{i}"
            try:
                n = ledger.start(sid, f"r{k}-{i}")
                ledger.admit(sid, n)
                outcome = "admitted"
            except Exception as e:  # noqa: BLE001  (AlreadyAdmitted / AttemptClosed)
                outcome = type(e).__name__
            with lock:
                results.append((sid, outcome))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 320
    assert sorted(s for s, o in results if o == "admitted") == sorted(f"s{i}" for i in range(40))
    assert {o for _, o in results} <= {"admitted", "AlreadyAdmitted", "AttemptClosed"}
    assert len(ledger.admitted()) == 40
    ledger.close()


# ---------------------------------------------------------------- Fleet

def test_fleet_from_threads_and_from_event_loops():
    fe = Frontend()
    spec = SamplingSpec(max_tokens=2)
    with Fleet("http://frontend", MODEL, transport=fe.transport(), retry=FAST) as fleet:
        out: dict[int, list] = {}

        def work(t: int) -> None:
            out[t] = fleet.rollout([SampleRequest(f"t{t}-{i}", [t, i, 1], spec) for i in range(10)])

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(o.admitted for t in range(4) for o in out[t])

        async def from_a_loop():  # another thread's event loop
            a = await fleet.agenerate("loop-1", "hi", spec)
            b = await fleet.arollout([SampleRequest("loop-2", [9, 9], spec)])
            return a, b
        a, b = asyncio.run(from_a_loop())
        assert a.prompt_ids == tokenize("hi") and b[0].admitted
        assert fleet.tokenize("hi") == tokenize("hi")
        assert len(fleet.ledger.admitted()) == 42
        fleet.expect("v2", "d2")  # samples of another policy are refused from now on
        assert fleet.expected == ("v2", "d2")
        with pytest.raises(SampleFailed) as info:
            fleet.generate("stale", [1, 2], spec)
        assert info.value.reason == "identity"
        with pytest.raises(RuntimeError, match="no rl_url"):
            fleet.refresh(None, "v3", digest="d3")
    with pytest.raises(RuntimeError, match="closed"):
        fleet.generate("after", [1], spec)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_held_refresh_stops_rollouts_with_a_clear_error():
    fe = Frontend()
    # the disk path closes the gate first (the default stages first: a failure there leaves
    # the fleet open, tests/integration/test_refresh_staged.py)
    with Fleet("http://frontend", MODEL, rl_url=f"http://127.0.0.1:{closed_port()}",
               transport=fe.transport(), retry=FAST, timeout=2, path="vllm-disk") as fleet:
        result = fleet.refresh(None, "v2", digest="d2")
        assert result.decision == "held" and not result.fleet_moved and not result.ok
        assert fleet.held is result and not fleet.rollout_gate.is_open
        with pytest.raises(FleetHeld, match="held by refresh"):
            fleet.rollout([SampleRequest("s", [1, 2], SamplingSpec(max_tokens=2))])
    assert fe.requests == []


# ---------------------------------------------------------------- TRL's rollout_func

def fake_trainer(g: int = 2, **args) -> Any:
    defaults = dict(max_completion_length=3, temperature=1.0, top_p=1.0, top_k=0, min_p=None,
                    repetition_penalty=1.0, generation_kwargs=None, chat_template_kwargs=None)
    return SimpleNamespace(accelerator=SimpleNamespace(num_processes=1),
                           model=SimpleNamespace(training=True), num_generations=g,
                           num_generations_eval=g, temperature=1.0,
                           state=SimpleNamespace(global_step=0),
                           args=SimpleNamespace(**{**defaults, **args}))


def trl_rollout(fe: Frontend, **kw):
    pytest.importorskip("transformers")
    from rlfleet.integrations.trl import FleetRollout

    fleet = Fleet("http://frontend", MODEL, rl_url="http://127.0.0.1:1", transport=fe.transport(),
                  retry=RetryPolicy(1, backoff_initial=0.001))
    return fleet, FleetRollout(fleet, "/tmp/unused", check_logprobs=False, **kw)


def test_rollout_func_returns_one_entry_per_prompt_and_generation_in_order():
    fe = Frontend()
    fleet, rollout = trl_rollout(fe)
    with fleet:
        prompts = ["a", "a", [{"role": "user", "content": "b"}], [{"role": "user", "content": "b"}]]
        out = rollout(prompts, fake_trainer(g=2))
    assert len(out["completion_ids"]) == len(out["logprobs"]) == len(out["prompt_ids"]) == 4
    assert out["prompt_ids"][:2] == [tokenize("a")] * 2
    assert out["prompt_ids"][2] == tokenize(chatml([{"role": "user", "content": "b"}], True))
    assert [len(c) for c in out["completion_ids"]] == [3] * 4
    assert out["completion_ids"][0] != out["completion_ids"][1]  # the group's two sequences
    assert [s.split("#")[1] for s in out["rlfleet_sample_id"]] == ["0", "1", "0", "1"]
    assert out["rlfleet_policy"] == ["v1"] * 4
    assert [b["n"] for _, b in fe.requests] == [2, 2]  # one sample per GRPO group
    assert rollout.stats.samples_admitted == 4


def test_rollout_func_retries_a_sample_then_fails_clearly_never_with_a_gap():
    tries: dict[str, int] = {}

    def flaky(body):  # prompt "b" fails on its first request
        key = json.dumps(body.get("prompt"))
        tries[key] = tries.get(key, 0) + 1
        return 503 if body.get("prompt") == "b" and tries[key] == 1 else None

    fleet, rollout = trl_rollout(Frontend(fail=flaky), retries=1)
    with fleet:
        out = rollout(["a", "a", "b", "b"], fake_trainer(g=2))
        assert len(out["completion_ids"]) == 4  # round 2 admitted it
        sid = out["rlfleet_sample_id"][2].split("#")[0]
        assert [a.state.value for a in fleet.ledger.attempts(sid)] == ["failed", "succeeded"]

    from rlfleet.integrations.trl import RolloutFailed

    fleet, rollout = trl_rollout(Frontend(fail=lambda body: 503 if body.get("prompt") == "b"
                                          else None), retries=1)
    with fleet, pytest.raises(RolloutFailed, match="could not be admitted") as info:
        rollout(["a", "a", "b", "b"], fake_trainer(g=2))
    assert list(info.value.failures.values()) == ["http: 503 scripted"]


def test_rollout_func_refuses_generation_kwargs_it_cannot_honour():
    fleet, rollout = trl_rollout(Frontend())
    with fleet:
        with pytest.raises(ValueError, match="num_beams"):
            rollout(["a", "a"], fake_trainer(generation_kwargs={"num_beams": 2}))
        out = rollout(["a", "a"], fake_trainer(generation_kwargs={"stop": ["x"], "seed": 1}))
    assert len(out["completion_ids"]) == 2
