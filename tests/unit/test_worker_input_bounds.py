"""What a worker's request plane refuses before it spends anything (issue 10 findings 5 and
6): a client's chat template unless the operator trusts them, a text prompt too long to fit
the context (refused before it is tokenised); and templates are rendered off the event
loop, so a slow one holds up no other request. The real WorkerPlane over the mocker engine
(the declared simulator: the point here is the plane, not the engine)."""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import pytest

from rlfleet.mocker.engine import MockEngine
from rlfleet.protocol.engine import GenerateRequest, TokenizeRequest
from rlfleet.runtime.request_plane import StreamClient, WorkerError
from rlfleet.runtime.server import bind_socket
from rlfleet.worker.admin import EngineAdmin
from rlfleet.worker.prompt_checks import MAX_BYTES_PER_TOKEN
from rlfleet.worker.stream_server import WorkerPlane


class CountingEngine(MockEngine):
    """The mocker, counting tokenisations; `gate` (when set) holds each until released."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.tokenized = 0
        self.gate: threading.Event | None = None
        self.entered = threading.Event()

    def tokenize(self, *a: Any, **kw: Any) -> list[int]:
        self.tokenized += 1
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(30)
        return super().tokenize(*a, **kw)


@contextlib.asynccontextmanager
async def plane(trust: bool = False, **mock: Any
                ) -> AsyncIterator[tuple[CountingEngine, str, StreamClient]]:
    engine = CountingEngine(**mock)
    await engine.start()
    server = await WorkerPlane(engine, trust_request_chat_template=trust).serve(
        bind_socket("127.0.0.1", 0))
    client = StreamClient(request_timeout=30)
    try:
        yield engine, f"127.0.0.1:{server.port}", client
    finally:
        await client.close()
        await server.stop(grace=0)


MESSAGES = [{"role": "user", "content": "hi"}]
TEMPLATE = {"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}


async def run(client: StreamClient, addr: str, req: GenerateRequest) -> list:
    return [ev async for ev in await client.generate(addr, req)]


async def test_a_client_chat_template_is_refused_unless_the_operator_trusts_them() -> None:
    async with plane() as (engine, addr, client):
        with pytest.raises(WorkerError) as e:
            await run(client, addr, GenerateRequest(
                request_id="t1", messages=MESSAGES, chat_template_kwargs=TEMPLATE))
        assert e.value.status == 400 and "--trust-request-chat-template" in e.value.message
        with pytest.raises(WorkerError) as e:
            await client.tokenize(addr, TokenizeRequest(messages=MESSAGES,
                                                        chat_template_kwargs=TEMPLATE))
        assert e.value.status == 400
        assert engine.tokenized == 0
        # other template variables are fine
        ok = await run(client, addr, GenerateRequest(
            request_id="t2", messages=MESSAGES, chat_template_kwargs={"enable_thinking": False},
            sampling={"max_tokens": 2}))
        assert ok[0].prompt_token_ids
    async with plane(trust=True) as (engine, addr, client):
        ok = await run(client, addr, GenerateRequest(
            request_id="t3", messages=MESSAGES, chat_template_kwargs=TEMPLATE,
            sampling={"max_tokens": 2}))
        assert ok[0].prompt_token_ids and engine.tokenized == 1


async def test_a_prompt_too_long_for_the_context_is_refused_before_it_is_tokenised() -> None:
    async with plane(max_model_len=64) as (engine, addr, client):
        huge = "x" * (64 * MAX_BYTES_PER_TOKEN + 1)
        for req in (GenerateRequest(request_id="h1", prompt=huge),
                    GenerateRequest(request_id="h2", messages=[{"role": "user", "content": huge}])):
            with pytest.raises(WorkerError) as e:
                await run(client, addr, req)
            assert e.value.status == 400 and "shorten the prompt" in e.value.message
        with pytest.raises(WorkerError):
            await client.tokenize(addr, TokenizeRequest(prompt=huge))
        assert engine.tokenized == 0
        # a long prompt that may fit is tokenised, then measured exactly
        with pytest.raises(WorkerError, match="context length"):
            await run(client, addr, GenerateRequest(request_id="h3", prompt="y" * 100))
        assert engine.tokenized == 1


async def test_rendering_runs_off_the_event_loop() -> None:
    """A template render that does not end holds up no other request on the worker."""
    async with plane() as (engine, addr, client):
        engine.gate = threading.Event()
        import asyncio

        slow = asyncio.ensure_future(run(client, addr, GenerateRequest(
            request_id="slow", messages=MESSAGES, sampling={"max_tokens": 2})))
        try:
            await asyncio.to_thread(engine.entered.wait, 10)
            # the render is stuck in its thread; token-ID requests are served meanwhile
            done = await asyncio.wait_for(run(client, addr, GenerateRequest(
                request_id="fast", prompt_token_ids=[1101, 1102], sampling={"max_tokens": 3})),
                20)
            assert len(done) >= 2 and not slow.done()
        finally:
            engine.gate.set()
        assert (await asyncio.wait_for(slow, 20))[0].prompt_token_ids


# what a frontend would refuse, sent by a caller that reaches the worker directly: the
# request (as built, unchecked), the words of vLLM's refusal
REFUSED = [
    (GenerateRequest(request_id="v1", prompt_token_ids=[1101], sampling={"temperature": math.nan}),
     "temperature must be a finite number"),
    (GenerateRequest(request_id="v2", prompt_token_ids=[1101],
                     sampling={"n": 2, "temperature": 0.0}), "when using greedy sampling"),
    (GenerateRequest(request_id="v3", prompt_token_ids=[1101], cache_salt="a/b"), "cache_salt"),
]


async def test_values_an_engine_would_refuse_are_refused_where_the_worker_decodes() -> None:
    """The request plane checks what it decodes (rlfleet.runtime.request_checks), not only
    the frontends what they build: on the stream plane, on HTTP POST /generate and in a
    commit's probe, a 400 in vLLM's words before anything is spent."""
    async with plane() as (engine, addr, client):
        for req, words in REFUSED:
            with pytest.raises(WorkerError) as e:
                await run(client, addr, req)
            assert e.value.status == 400 and words in e.value.message
        worker = WorkerPlane(engine)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=worker.http_app()),
                                 base_url="http://worker")
        async with http:
            for req, words in REFUSED[1:]:  # (JSON has no NaN)
                r = await http.post("/generate", content=msgspec.json.encode(req))
                assert r.status_code == 400 and words in r.json()["error"]["message"]
        for req, words in REFUSED:
            probe = await EngineAdmin._commit_probe(worker, msgspec.to_builtins(req), 5)
            assert probe.http_status == 400 and words in (probe.message or "")
        assert engine.tokenized == 0
