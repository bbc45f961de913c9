"""The simulated engine (rlfleet.mocker): determinism, sampling options, logprobs, abort,
pause modes and weight switches, driven directly and through the request-plane app (as a
`python -m rlfleet.mocker` process: tests/integration/test_worker_commands.py)."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from typing import Any

import httpx
import msgspec
import pytest

from rlfleet.mocker.engine import MockEngine, write_mock_checkpoint
from rlfleet.protocol.engine import Done, GenerateRequest, Step
from rlfleet.runtime import metrics
from rlfleet.worker.stream_server import WorkerPlane

PROMPT = [1101, 1102, 1103, 1104]
_ids = iter(range(1 << 30))


def request(prompt: list[int] | None = None, stream: bool = False, **sampling: Any
            ) -> GenerateRequest:
    return GenerateRequest(request_id=f"r{next(_ids)}", prompt_token_ids=prompt or PROMPT,
                           stream=stream, sampling=sampling)


async def collect(engine: MockEngine, req: GenerateRequest,
                  events: list[dict] | None = None) -> tuple[list[dict], dict]:
    """Run a request; merge its choice deltas by index. Returns (choices, done event). The
    engine yields the request plane's typed frames; they are read here as the JSON the
    worker's HTTP plane sends for them."""
    merged: dict[int, dict] = {}
    done = None
    async for frame in engine.generate(req, req.prompt_token_ids):
        assert type(frame) in (Step, Done), frame
        ev = msgspec.json.decode(msgspec.json.encode(frame))
        if events is not None:
            events.append(ev)
        if ev.get("done"):
            done = ev
            continue
        for d in ev["choices"]:
            m = merged.setdefault(d["index"], {"index": d["index"], "token_ids": [], "text": "",
                                               "logprobs": None})
            m["token_ids"] += d["token_ids"]
            m["text"] += d["text"]
            if d["logprobs"] is not None:
                m["logprobs"] = (m["logprobs"] or []) + d["logprobs"]
            m["finish_reason"], m["stop_reason"] = d["finish_reason"], d["stop_reason"]
    assert done is not None
    return [merged[i] for i in sorted(merged)], done


async def one(engine: MockEngine, **kw: Any) -> dict:
    choices, _ = await collect(engine, request(**kw))
    assert len(choices) == 1
    return choices[0]


async def until(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


class Progress:
    """Consume a streaming request in a task, counting tokens as they arrive."""

    def __init__(self, engine: MockEngine, req: GenerateRequest) -> None:
        assert req.stream
        self.req = req
        self.events: list[dict] = []
        self.task = asyncio.create_task(collect(engine, req, self.events))

    @property
    def tokens(self) -> int:
        return sum(len(d["token_ids"]) for ev in self.events for d in ev.get("choices", ()))

    async def result(self) -> tuple[list[dict], dict]:
        return await asyncio.wait_for(self.task, 10)


# ---------------------------------------------------------------- determinism, sampling


async def test_deterministic_and_independent_of_concurrency() -> None:
    engine = MockEngine()
    kw = {"max_tokens": 40, "logprobs": 3, "n": 3}
    first, _ = await collect(engine, request(**kw))
    again, _ = await collect(MockEngine(), request(**kw))
    assert first == again
    together = await asyncio.gather(*(collect(engine, request(**kw)) for _ in range(20)))
    assert all(choices == first for choices, _ in together)
    streamed, _ = await collect(engine, request(stream=True, **kw))
    assert streamed == first
    other = await one(MockEngine(seed=1), max_tokens=40)
    assert other["token_ids"] != first[0]["token_ids"]
    seeded = [await one(engine, max_tokens=20, seed=s) for s in (7, 7, 8)]
    assert seeded[0] == seeded[1] != seeded[2]
    assert (await one(engine, prompt=[1200, 1201], max_tokens=20))["token_ids"] \
        != (await one(engine, max_tokens=20))["token_ids"]


async def test_n_choices_are_independent() -> None:
    choices, _ = await collect(MockEngine(), request(n=4, max_tokens=30, ignore_eos=True))
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert len({tuple(c["token_ids"]) for c in choices}) == 4
    assert all(c["finish_reason"] == "length" for c in choices)


def generated_tokens() -> float:
    return metrics.WORKER.get_sample_value("rlfleet_worker_generated_tokens_total",
                                           {"model": "mock-model"}) or 0.0


async def test_max_tokens_and_context_room() -> None:
    engine = MockEngine(max_model_len=64)
    counted = generated_tokens()
    c = await one(engine, max_tokens=25, ignore_eos=True)
    assert generated_tokens() - counted == 25
    assert len(c["token_ids"]) == 25 and c["finish_reason"] == "length"
    assert c["stop_reason"] is None and engine.eos not in c["token_ids"]
    c = await one(engine, ignore_eos=True)  # no max_tokens: up to the context length
    assert len(c["token_ids"]) == 64 - len(PROMPT) and c["finish_reason"] == "length"
    ids = c["token_ids"]
    assert all(0 <= t < engine.info.vocab_size for t in ids)
    assert c["text"] == "".join(engine.decode(t) for t in ids)


async def test_eos_ends_with_stop_and_ignore_eos_continues() -> None:
    engine = MockEngine(eos_prob=0.2)
    ended = await one(engine, max_tokens=200)
    assert ended["finish_reason"] == "stop" and ended["stop_reason"] is None
    assert ended["token_ids"][-1] == engine.eos and engine.eos not in ended["token_ids"][:-1]
    assert "im_end" not in ended["text"]
    full = await one(engine, max_tokens=200, ignore_eos=True)
    assert full["finish_reason"] == "length" and len(full["token_ids"]) == 200
    assert engine.eos not in full["token_ids"]
    # the same draws up to the point where the first run chose to end
    assert full["token_ids"][:len(ended["token_ids"]) - 1] == ended["token_ids"][:-1]


async def test_min_tokens() -> None:
    engine = MockEngine(eos_prob=0.5)
    lengths = [len((await one(engine, max_tokens=100, seed=s))["token_ids"]) for s in range(10)]
    assert min(lengths) < 10
    for s in range(10):
        c = await one(engine, max_tokens=100, min_tokens=10, seed=s)
        assert engine.eos not in c["token_ids"][:10] and len(c["token_ids"]) > 10
        assert c["finish_reason"] == "stop"
    # a stop token is not generated before min_tokens either
    ref = await one(engine, max_tokens=30, ignore_eos=True)
    stop_id = ref["token_ids"][2]
    c = await one(engine, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id], min_tokens=8)
    assert stop_id not in c["token_ids"][:8]


def first_unique(ids: list[int], start: int = 2) -> int:
    """A position whose token does not occur before it."""
    return next(i for i in range(start, len(ids)) if ids[i] not in ids[:i])


async def test_stop_token_ids() -> None:
    engine = MockEngine()
    ref = await one(engine, max_tokens=30, ignore_eos=True)
    i = first_unique(ref["token_ids"])
    stop_id = ref["token_ids"][i]
    c = await one(engine, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id])
    assert c["token_ids"] == ref["token_ids"][:i + 1]
    assert c["finish_reason"] == "stop" and c["stop_reason"] == stop_id
    assert c["text"] == "".join(engine.decode(t) for t in ref["token_ids"][:i])
    c = await one(engine, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id],
                  include_stop_str_in_output=True)
    assert c["text"].endswith(engine.decode(stop_id))


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_strings(stream: bool) -> None:
    engine = MockEngine()
    ref = await one(engine, max_tokens=30, ignore_eos=True)
    i = first_unique(ref["token_ids"], 3)
    word = engine.decode(ref["token_ids"][i])  # e.g. "<12345>"
    stop = word[1:-1]  # spans no token boundary, starts mid-token
    before = "".join(engine.decode(t) for t in ref["token_ids"][:i])
    c = await one(engine, max_tokens=30, ignore_eos=True, stop=["never", stop], stream=stream)
    assert c["finish_reason"] == "stop" and c["stop_reason"] == stop
    assert c["token_ids"] == ref["token_ids"][:i + 1]
    assert c["text"] == before + "<"
    c = await one(engine, max_tokens=30, ignore_eos=True, stop=[stop], stream=stream,
                  include_stop_str_in_output=True)
    assert c["text"] == before + word[:-1]
    # a stop string across two tokens
    two = engine.decode(ref["token_ids"][i])[-2:] + engine.decode(ref["token_ids"][i + 1])[:2]
    c = await one(engine, max_tokens=30, ignore_eos=True, stop=[two], stream=stream)
    if two not in before + word:
        assert c["token_ids"] == ref["token_ids"][:i + 2]
        assert c["text"] == before + word[:-2]


async def test_stream_sends_one_event_per_step() -> None:
    engine = MockEngine()
    events: list[dict] = []
    choices, done = await collect(engine, request(stream=True, n=2, max_tokens=5,
                                                  ignore_eos=True), events)
    steps = [ev for ev in events if "choices" in ev]
    assert len(steps) == 5 and all(len(ev["choices"]) == 2 for ev in steps)
    assert all(len(d["token_ids"]) == 1 for ev in steps for d in ev["choices"])
    assert [d["finish_reason"] for d in steps[-1]["choices"]] == ["length", "length"]
    assert events[-1] == done == {"done": True, "prompt_logprobs": None}


# ---------------------------------------------------------------- logprobs


async def test_logprobs() -> None:
    engine = MockEngine()
    choices, _ = await collect(engine, request(n=2, max_tokens=50, logprobs=5))
    for c in choices:
        assert len(c["logprobs"]) == len(c["token_ids"])
        for tid, lp in zip(c["token_ids"], c["logprobs"], strict=True):
            assert lp["token_id"] == tid and lp["logprob"] < 0 and lp["rank"] >= 1
            assert lp["decoded"] == engine.decode(tid)
            top = lp["top"]
            assert len(top) == 5 and len({t for t, _, _ in top}) == 5
            assert [x[1] for x in top] == sorted((x[1] for x in top), reverse=True)
            assert all(x[2] == engine.decode(x[0]) for x in top)
            if lp["rank"] <= 5:
                assert top[lp["rank"] - 1][:2] == [tid, lp["logprob"]]
            else:
                assert lp["logprob"] <= top[-1][1] and tid not in [x[0] for x in top]
    # the sampled token's logprob does not depend on how many alternatives are asked for
    zero = await one(engine, max_tokens=50, logprobs=0)
    assert all(z["top"] == [] for z in zero["logprobs"])
    assert zero["token_ids"] == choices[0]["token_ids"]
    assert [z["logprob"] for z in zero["logprobs"]] == [x["logprob"] for x in choices[0]["logprobs"]]
    assert (await one(engine, max_tokens=5))["logprobs"] is None


async def test_prompt_logprobs() -> None:
    engine = MockEngine()
    prompt = engine.tokenize("hello mock")
    _, done = await collect(engine, request(prompt=prompt, max_tokens=2, prompt_logprobs=3))
    lps = done["prompt_logprobs"]
    assert len(lps) == len(prompt) and lps[0] is None
    for tid, pos in zip(prompt[1:], lps[1:], strict=True):
        assert str(tid) in pos and 3 <= len(pos) <= 4
        assert all(e["logprob"] < 0 and e["rank"] >= 1 for e in pos.values())
        assert pos[str(tid)]["decoded_token"] == engine.decode(tid)
        assert sorted(e["rank"] for e in pos.values())[:3] == [1, 2, 3]
    _, again = await collect(engine, request(prompt=prompt, max_tokens=2, prompt_logprobs=0))
    assert [list(p) for p in again["prompt_logprobs"][1:]] == [[str(t)] for t in prompt[1:]]


def test_tokenize() -> None:
    engine = MockEngine(vocab_size=600)
    ids = engine.tokenize("héllo")
    assert len(ids) == len("héllo".encode()) and all(0 <= t < 600 for t in ids)
    assert "".join(engine.decode(t) for t in engine.tokenize("plain text")) == "plain text"
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chat = engine.tokenize(messages=msgs)
    assert chat == engine.tokenize(engine.render_chat(msgs))
    assert "".join(map(engine.decode, chat)).endswith("<|im_start|>assistant\n")
    assert len(engine.tokenize(messages=msgs, add_generation_prompt=False)) < len(chat)


# ---------------------------------------------------------------- abort, pause, weights


async def test_abort_gives_partial_output() -> None:
    engine = MockEngine(token_delay=0.01)
    req = request(stream=True, n=2, max_tokens=1000, ignore_eos=True)
    run = Progress(engine, req)
    await until(lambda: run.tokens >= 6)
    assert engine.num_running() == 1
    await engine.abort(req.request_id)
    choices, done = await run.result()
    assert all(c["finish_reason"] == "abort" and 3 <= len(c["token_ids"]) < 1000 for c in choices)
    assert run.events[-2]["choices"][0]["finish_reason"] == "abort" and done["done"]
    assert engine.num_running() == 0
    ref = await one(MockEngine(), max_tokens=len(choices[0]["token_ids"]), ignore_eos=True)
    assert ref["token_ids"] == choices[0]["token_ids"]
    await engine.abort("no-such-request")


async def test_abort_during_ttft_and_closing_the_stream() -> None:
    engine = MockEngine(ttft=30)
    req = request(stream=True, max_tokens=10)
    run = Progress(engine, req)
    await until(lambda: engine.num_running() == 1)
    await engine.abort(req.request_id)
    choices, _ = await run.result()
    assert choices[0]["token_ids"] == [] and choices[0]["finish_reason"] == "abort"

    engine = MockEngine(token_delay=0.001)
    events = engine.generate(request(stream=True, max_tokens=1000), PROMPT)
    await anext(events)
    assert engine.num_running() == 1
    await events.aclose()  # the client went away
    assert engine.num_running() == 0


async def test_duplicate_request_id_is_refused() -> None:
    engine = MockEngine(token_delay=0.01)
    req = request(stream=True, max_tokens=100)
    run = Progress(engine, req)
    await until(lambda: run.tokens > 0)
    with pytest.raises(ValueError, match="already running"):
        await anext(engine.generate(req, PROMPT))
    await engine.abort(req.request_id)
    await run.result()


async def test_max_batch_queues_requests() -> None:
    engine = MockEngine(token_delay=0.005, max_batch=2)
    runs = [Progress(engine, request(stream=True, max_tokens=20, ignore_eos=True))
            for _ in range(4)]
    await until(lambda: runs[0].tokens >= 5)
    assert [r.tokens > 0 for r in runs] == [True, True, False, False]
    assert engine.num_running() == 4
    await engine.abort(runs[3].req.request_id)  # a queued request ends at once
    assert (await runs[3].result())[0][0] == {
        "index": 0, "token_ids": [], "text": "", "logprobs": None,
        "finish_reason": "abort", "stop_reason": None}
    assert runs[2].tokens == 0
    results = [await r.result() for r in runs[:3]]
    assert [len(c[0]["token_ids"]) for c, _ in results] == [20, 20, 20]


async def test_pause_keep_continues_as_if_uninterrupted() -> None:
    kw = {"n": 2, "max_tokens": 40, "logprobs": 2, "ignore_eos": True}
    ref, _ = await collect(MockEngine(), request(**kw))
    engine = MockEngine(token_delay=0.005)
    run = Progress(engine, request(stream=True, **kw))
    await until(lambda: run.tokens >= 10)
    await engine.pause("keep")
    assert await engine.is_paused()
    frozen = run.tokens
    late = Progress(engine, request(stream=True, max_tokens=3))
    await asyncio.sleep(0.1)
    assert run.tokens == frozen < 80 and late.tokens == 0 and not run.task.done()
    await engine.resume()
    assert not await engine.is_paused()
    choices, _ = await run.result()
    assert choices == ref
    assert len((await late.result())[0][0]["token_ids"]) == 3


async def test_spans_name_the_policy_of_every_token_across_a_keep_pause_swap() -> None:
    """A request frozen by a keep-pause while the weights change continues on the new
    ones; its final delta says which tokens came from which policy (version, digest, step)."""
    engine = MockEngine(token_delay=0.005)
    await engine.set_version("A", digest="mock:0", step=3)
    run = Progress(engine, request(stream=True, max_tokens=30, ignore_eos=True))
    await until(lambda: run.tokens >= 5)
    await engine.pause("keep")
    cut = run.tokens
    digest = await engine.load_path(write_mock_checkpoint(tempfile.mkdtemp(), 9))
    await engine.set_version("B", digest=digest, step=4)
    await engine.set_version("B2")  # a relabel keeps the step
    await engine.resume()
    await run.result()
    [final] = [d for ev in run.events for d in ev.get("choices", ()) if d["finish_reason"]]
    assert final["weight_versions"] == [
        {"version": "A", "digest": "mock:0", "step": 3, "start": 0, "end": cut},
        {"version": "B2", "digest": "mock:9", "step": 4, "start": cut, "end": 30}]
    assert all(d["weight_versions"] is None for ev in run.events
               for d in ev.get("choices", ()) if not d["finish_reason"])


async def test_pause_wait_lets_running_requests_finish() -> None:
    engine = MockEngine(token_delay=0.005)
    run = Progress(engine, request(stream=True, max_tokens=30, ignore_eos=True))
    await until(lambda: run.tokens >= 3)
    await asyncio.wait_for(engine.pause("wait"), 5)
    assert run.task.done() and run.tokens == 30
    assert (await run.result())[0][0]["finish_reason"] == "length"
    late = Progress(engine, request(stream=True, max_tokens=5))
    await asyncio.sleep(0.05)
    assert late.tokens == 0 and engine.num_running() == 1
    await engine.resume()
    assert (await late.result())[0][0]["finish_reason"] == "length"
    await asyncio.wait_for(engine.pause("wait"), 1)  # nothing running: returns at once
    await engine.resume()


async def test_pause_abort_ends_running_requests_and_holds_new_ones() -> None:
    engine = MockEngine(token_delay=0.005)
    run = Progress(engine, request(stream=True, n=2, max_tokens=1000))
    await until(lambda: run.tokens >= 4)
    await engine.pause("abort", clear_cache=True)
    choices, _ = await run.result()
    assert all(c["finish_reason"] == "abort" for c in choices)
    late = Progress(engine, request(stream=True, max_tokens=5, ignore_eos=True))
    await asyncio.sleep(0.05)
    assert late.tokens == 0 and not late.task.done()
    await engine.resume()
    assert (await late.result())[0][0]["finish_reason"] == "length"
    assert await engine.reset_cache() is True
    with pytest.raises(ValueError, match="pause mode"):
        await engine.pause("later")


async def test_set_weights_switches_output_and_needs_pause() -> None:
    engine = MockEngine(seed=3)
    assert engine.serving_policy().stamped() == {"weight_version": None, "weight_digest": "mock:3",
                                        "weight_step": None}
    before = await one(engine, max_tokens=20, ignore_eos=True)
    with pytest.raises(RuntimeError, match="pause generation first"):
        await engine.set_weights(4, "v1")
    await engine.pause("wait")
    await engine.set_weights(4, "v1")
    await engine.resume()
    assert engine.serving_policy().stamped() == {"weight_version": "v1", "weight_digest": "mock:4",
                                        "weight_step": None}
    after = await one(engine, max_tokens=20, ignore_eos=True)
    assert after["token_ids"] != before["token_ids"]
    assert after == await one(MockEngine(seed=4), max_tokens=20, ignore_eos=True)


# ---------------------------------------------------------------- the request plane


@pytest.fixture
async def client():
    engine = MockEngine(max_model_len=128)
    transport = httpx.ASGITransport(app=WorkerPlane(engine).http_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://worker") as c:
        yield c


def ndjson(resp: httpx.Response) -> list[dict]:
    assert resp.status_code == 200, resp.text
    return [json.loads(line) for line in resp.text.splitlines() if line]


async def test_request_plane_generate(client: httpx.AsyncClient) -> None:
    body = {"request_id": "x1", "prompt": "hi there", "stream": False,
            "sampling": {"max_tokens": 8, "n": 2, "logprobs": 1, "ignore_eos": True}}
    events = ndjson(await client.post("/generate", json=body))
    head, result, done = events
    assert head["prompt_token_ids"] == MockEngine().tokenize("hi there")
    assert head["weight_digest"] == "mock:0" and head["weight_version"] is None
    assert [len(c["token_ids"]) for c in result["choices"]] == [8, 8]
    assert done == {"done": True, "prompt_logprobs": None}
    again = ndjson(await client.post("/generate", json={**body, "request_id": "x2"}))
    assert again == events
    chat = ndjson(await client.post("/generate", json={
        "request_id": "x3", "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "sampling": {"max_tokens": 4, "ignore_eos": True}}))
    assert len(chat) == 6 and chat[-1]["done"]
    tok = (await client.post("/tokenize", json={"prompt": "abc"})).json()
    assert tok == {"token_ids": [1097, 1098, 1099], "count": 3}
    assert (await client.get("/health")).json() == {"status": "ok", "model": "mock-model"}


@pytest.mark.parametrize("body, words", [
    ({"prompt_token_ids": [1, 151936]}, "outside the vocabulary"),
    ({"prompt_token_ids": [1, 2], "sampling": {"max_tokens": 129}}, "cannot be greater than max_model_len"),
    ({"prompt_token_ids": [1, 2], "sampling": {"max_tokens": 128, "min_tokens": 127}},
     "min_tokens must be less than or equal to max_tokens=126"),
    ({"prompt_token_ids": list(range(128))}, "shorten the prompt"),
])
async def test_request_plane_refuses_bad_prompts(client: httpx.AsyncClient, body: dict,
                                                 words: str) -> None:
    resp = await client.post("/generate", json={"request_id": "bad", **body})
    assert resp.status_code == 400 and words in resp.json()["error"]["message"]
