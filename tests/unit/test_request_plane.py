"""The stream plane between a frontend and a worker: typed events over one connection,
many streams multiplexed, a worker that dies between two coalesced events, a stalled
worker, a slow reader, back-pressure, a caller that leaves, cancellation and refusals.
The worker side is the real WorkerPlane over the mocker engine (the declared simulator)
or, where a broken worker is the point, a scripted server speaking the frame format."""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from rlfleet.mocker.engine import MockEngine
from rlfleet.protocol.engine import (
    MAGIC,
    Done,
    Frame,
    GenerateRequest,
    Head,
    Step,
    TokenizeRequest,
)
from rlfleet.runtime import metrics
from rlfleet.runtime.request_plane import FrameReader, Heartbeat, StreamClient, WorkerError
from rlfleet.runtime.server import bind_socket
from rlfleet.worker.stream_server import WorkerPlane

PROMPT = [1101, 1102, 1103, 1104]
_ids = iter(range(1 << 30))


def request(stream: bool = True, **sampling: Any) -> GenerateRequest:
    return GenerateRequest(request_id=f"p{next(_ids)}", prompt_token_ids=PROMPT, stream=stream,
                           sampling={"ignore_eos": True, **sampling})


def frame(kind: int, sid: int, body: Any = None) -> bytes:
    payload = b"" if body is None else msgspec.msgpack.encode(body)
    return struct.pack("<IBI", len(payload) + 5, kind, sid) + payload


def metric(name: str, **labels: str) -> float:
    """A worker series summed over the labels not given (the model)."""
    return sum(s.value for m in metrics.WORKER.collect() for s in m.samples
               if s.name == name and labels.items() <= s.labels.items())


@contextlib.asynccontextmanager
async def worker(request_timeout: float = 30.0, **mock: Any
                 ) -> AsyncIterator[tuple[MockEngine, str, StreamClient]]:
    """An in-process worker (the mocker behind the real stream plane) and a client."""
    engine = MockEngine(**mock)
    server = await WorkerPlane(engine).serve(bind_socket("127.0.0.1", 0))
    client = StreamClient(request_timeout=request_timeout)
    try:
        yield engine, f"127.0.0.1:{server.port}", client
    finally:
        await client.close()
        await server.stop(grace=0)


async def tokens_of(engine: MockEngine, req: GenerateRequest) -> list[list[int]]:
    """The engine's own output for `req`, per choice (the reference)."""
    out: dict[int, list[int]] = {}
    async for ev in engine.generate(msgspec.structs.replace(req, request_id="ref-" + req.request_id),
                                    PROMPT):
        for d in ev.choices if type(ev) is Step else ():
            out.setdefault(d.index, []).extend(d.token_ids)
    return [out[i] for i in sorted(out)]


def merged(events: list) -> list[list[int]]:
    out: dict[int, list[int]] = {}
    for ev in events:
        if type(ev) is Step:
            for d in ev.choices:
                out.setdefault(d.index, []).extend(d.token_ids)
    return [out[i] for i in sorted(out)]


@contextlib.asynccontextmanager
async def scripted_worker(script) -> AsyncIterator[str]:
    """A fake worker: `script(reader, writer)` speaks the frame format by hand."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert await reader.readexactly(len(MAGIC)) == MAGIC
        try:
            await script(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, int, bytes]:
    size, kind, sid = struct.unpack("<IBI", await reader.readexactly(9))
    return kind, sid, await reader.readexactly(size - 5)


# ---------------------------------------------------------------- the happy path


async def test_events_are_typed_in_order_and_match_the_engine() -> None:
    async with worker() as (engine, addr, client):
        req = request(max_tokens=7, n=2, logprobs=2)
        events = [ev async for ev in await client.generate(addr, req)]
        assert type(events[0]) is Head and type(events[-1]) is Done
        assert all(type(ev) is Step for ev in events[1:-1])
        assert events[0].prompt_token_ids == PROMPT and events[0].weight_digest == "mock:0"
        assert merged(events) == await tokens_of(engine, req)
        for ev in events[1:-1]:
            for d in ev.choices:  # logprobs 1:1 with the tokens, typed
                assert [lp.token_id for lp in d.logprobs] == d.token_ids
                assert all(len(lp.top) == 2 for lp in d.logprobs)
        unary = [ev async for ev in await client.generate(addr, request(stream=False, max_tokens=7))]
        assert [type(ev) for ev in unary] == [Head, Step, Done]  # all tokens in one event


async def test_many_streams_share_one_connection() -> None:
    async with worker(token_delay=0.001) as (engine, addr, client):
        reqs = [request(max_tokens=20 + i % 5, seed=i) for i in range(200)]

        async def run(req: GenerateRequest) -> list[list[int]]:
            return merged([ev async for ev in await client.generate(addr, req)])

        got = await asyncio.gather(*(run(r) for r in reqs))
        assert len(client._links) == 1
        for req, tokens in zip(reqs[:20], got[:20], strict=True):
            assert tokens == await tokens_of(engine, req)
        assert [len(t[0]) for t in got] == [20 + i % 5 for i in range(200)]
        assert engine.num_running() == 0


async def test_tokenize_and_refusals() -> None:
    async with worker(max_model_len=64) as (engine, addr, client):
        out = await client.tokenize(addr, TokenizeRequest(prompt="abc"))
        assert out.token_ids == [1097, 1098, 1099] and out.count == 3
        bad = GenerateRequest(request_id="bad", prompt_token_ids=[1, 151936])
        with pytest.raises(WorkerError) as e:
            async for _ in await client.generate(addr, bad):
                pass
        assert e.value.status == 400 and "outside the vocabulary" in e.value.message
        assert not e.value.broken
        with pytest.raises(WorkerError, match="cannot be greater than max_model_len"):
            async for _ in await client.generate(addr, request(max_tokens=65)):
                pass
        # as vLLM's server: a budget beyond the room the prompt leaves is lowered to it
        room = 64 - len(PROMPT)
        got = [ev async for ev in await client.generate(addr, request(max_tokens=room + 1))]
        assert len(merged(got)[0]) == room
        big = GenerateRequest(request_id="big", prompt_token_ids=[1])
        big.prompt_token_ids = [1 << 70]  # past the constructor's check, as a foreign client
        with pytest.raises(WorkerError) as e:  # a number that cannot even be encoded
            await client.generate(addr, big)
        assert e.value.status == 400
        # the connection still serves
        assert len(merged([ev async for ev in await client.generate(addr, request(max_tokens=3))])[0]) == 3


async def test_a_malformed_request_frame_is_refused_not_fatal() -> None:
    async with worker() as (engine, addr, client):
        host, port = addr.split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(MAGIC + frame(Frame.GENERATE, 7, {"request_id": "x", "prompt_token_ids": [1],
                                                        "sampling": {"max_tokens": 0}}))
        kind, sid, body = await asyncio.wait_for(read_frame(reader), 5)
        assert (kind, sid) == (Frame.ERROR, 7)
        err = msgspec.msgpack.decode(body)
        assert err["code"] == 400 and "max_tokens" in err["message"]
        writer.write(frame(Frame.GENERATE, 8, {"request_id": "y", "prompt_token_ids": [1],
                                               "stream": False, "sampling": {"max_tokens": 2}}))
        kinds = [(await asyncio.wait_for(read_frame(reader), 5))[0] for _ in range(3)]
        assert kinds == [Frame.HEAD, Frame.STEP, Frame.DONE]
        writer.close()


async def test_a_connection_that_does_not_speak_the_plane_is_closed() -> None:
    async with worker() as (_, addr, _client):
        host, port = addr.split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, nothing sent
        writer.close()


async def test_unreachable_worker_is_retryable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here
    client = StreamClient(connect_timeout=2)
    with pytest.raises(WorkerError) as e:
        await client.generate(f"127.0.0.1:{port}", request())
    assert e.value.status == 503 and e.value.retryable and "unreachable" in e.value.message


def test_frames_split_anywhere_are_reassembled() -> None:
    rng = random.Random(5)
    frames = [(rng.choice([Frame.HEAD, Frame.STEP, Frame.DONE]), rng.randrange(1 << 32),
               None if rng.random() < 0.2 else {"x": list(range(rng.randrange(200)))})
              for _ in range(300)]
    data = b"".join(frame(k, s, b) for k, s, b in frames)
    for _ in range(20):
        reader = FrameReader()
        got = []
        pos = 0
        while pos < len(data):
            step = rng.choice([1, 2, 7, 9, 50, 1000, 70000])
            for kind, sid, body in reader.feed(data[pos:pos + step]):
                got.append((kind, sid, msgspec.msgpack.decode(body) if len(body) else None))
            pos += step
        assert got == frames


# ---------------------------------------------------------------- worker faults


async def test_a_worker_that_dies_between_two_coalesced_events() -> None:
    """Head and a step arrive in one write, then half a frame, then the connection ends:
    the caller gets both events and then a 502, at once."""
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        kind, sid, _ = await read_frame(reader)
        assert kind == Frame.GENERATE
        step = {"choices": [{"index": 0, "token_ids": [5, 6], "text": "ab", "logprobs": None,
                             "finish_reason": None, "stop_reason": None}]}
        writer.write(frame(Frame.HEAD, sid, {"prompt_token_ids": [1], "weight_version": None,
                                             "weight_digest": "d"})
                     + frame(Frame.STEP, sid, step) + frame(Frame.STEP, sid, step)[:11])
        await writer.drain()
        writer.transport.abort()  # as a killed process: no goodbye

    async with scripted_worker(script) as addr:
        client = StreamClient()
        stream = await client.generate(addr, request())
        got = []
        t0 = time.monotonic()
        with pytest.raises(WorkerError) as e:
            async for ev in stream:
                got.append(ev)
        assert time.monotonic() - t0 < 2
        assert [type(ev) for ev in got] == [Head, Step] and got[1].choices[0].token_ids == [5, 6]
        assert e.value.status == 502 and e.value.broken and "failed mid-request" in e.value.message
        # the next request on that address finds the link gone and connects anew
        assert not client._links[addr].open
        await client.close()


async def test_a_stalled_worker_times_out_and_is_told_to_stop() -> None:
    closed = asyncio.get_running_loop().create_future()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _, sid, _ = await read_frame(reader)
        writer.write(frame(Frame.HEAD, sid, {"prompt_token_ids": [1], "weight_version": None,
                                             "weight_digest": None}))
        kind, closed_sid, _ = await read_frame(reader)  # then silence, until told to stop
        closed.set_result((kind, closed_sid == sid))

    async with scripted_worker(script) as addr:
        client = StreamClient(request_timeout=0.3)
        stream = await client.generate(addr, request())
        t0 = time.monotonic()
        with pytest.raises(WorkerError) as e:
            async for _ in stream:
                pass
        assert 0.25 < time.monotonic() - t0 < 3
        assert e.value.status == 504 and e.value.broken and "timed out" in e.value.message
        assert await asyncio.wait_for(closed, 5) == (Frame.CLOSE, True)
        await client.close()


# ---------------------------------------------------------------- readers and callers


async def test_a_slow_reader_does_not_hold_up_other_streams() -> None:
    async with worker(token_delay=0.001) as (engine, addr, client):
        slow_req, fast_req = request(max_tokens=300, seed=1), request(max_tokens=300, seed=2)
        slow = await client.generate(addr, slow_req)
        fast = await client.generate(addr, fast_req)
        first = [await anext(slow)]
        fast_events = [ev async for ev in fast]  # the other stream on the link runs to the end
        assert merged(fast_events) == await tokens_of(engine, fast_req)
        await asyncio.sleep(0.2)
        assert len(slow._queue) > 10  # the slow reader's events wait for it, in order
        rest = [ev async for ev in slow]
        assert merged(first + rest) == await tokens_of(engine, slow_req)
        assert type(rest[-1]) is Done


async def test_back_pressure_stops_the_engine_while_the_frontend_does_not_read() -> None:
    async with worker(max_model_len=1 << 22) as (engine, addr, _client):
        host, port = addr.split(":")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, int(port)))
        sock.sendall(MAGIC + frame(Frame.GENERATE, 1, msgspec.to_builtins(
            request(max_tokens=2_000_000))))
        before = metric("rlfleet_worker_generated_tokens_total")

        async def generated_when_still() -> float:
            last = -1.0
            while True:  # until two looks 0.3 s apart agree: the engine is held
                await asyncio.sleep(0.3)
                now = metric("rlfleet_worker_generated_tokens_total") - before
                if now == last:
                    return now
                last = now

        held = await asyncio.wait_for(generated_when_still(), 30)
        assert 0 < held < 500_000 and engine.num_running() == 1
        sock.close()  # the frontend goes away: the request is aborted
        deadline = time.monotonic() + 5
        while engine.num_running():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)


async def test_a_caller_that_leaves_aborts_the_request_in_the_engine() -> None:
    async with worker(token_delay=0.005) as (engine, addr, client):
        left = metric("rlfleet_worker_requests_total", outcome="abandoned")
        stream = await client.generate(addr, request(max_tokens=4000))
        for _ in range(3):
            await anext(stream)
        assert engine.num_running() == 1
        await stream.aclose()
        deadline = time.monotonic() + 5
        while engine.num_running():
            assert time.monotonic() < deadline, "the engine kept generating"
            await asyncio.sleep(0.01)
        assert metric("rlfleet_worker_requests_total", outcome="abandoned") == left + 1


async def test_cancel_ends_the_stream_with_its_partial_output() -> None:
    async with worker(token_delay=0.005) as (engine, addr, client):
        req = request(max_tokens=4000)
        stream = await client.generate(addr, req)
        events = [await anext(stream), await anext(stream)]
        assert await client.cancel(addr, req.request_id) is True
        events += [ev async for ev in stream]
        last_step = events[-2]
        assert last_step.choices[-1].finish_reason == "abort" and type(events[-1]) is Done
        assert 0 < len(merged(events)[0]) < 4000


def test_deltas_of_several_steps_merge_per_choice_without_changing_events() -> None:
    from rlfleet.frontend.result import merge_deltas
    from rlfleet.protocol.engine import Delta, TokenLogprob

    def lp(t: int) -> TokenLogprob:
        return TokenLogprob(token_id=t, logprob=-float(t))

    steps = [Delta(index=0, token_ids=[1], text="a", logprobs=[lp(1)]),
             Delta(index=1, token_ids=[7], text="x", logprobs=[lp(7)]),
             Delta(index=0, token_ids=[2], text="b", logprobs=[lp(2)]),
             Delta(index=0, token_ids=[3], text="c", logprobs=[lp(3)], finish_reason="stop",
                   stop_reason=3)]
    before = msgspec.json.encode(steps)
    out = merge_deltas(steps)
    assert [(d.index, d.token_ids, d.text, [x.token_id for x in d.logprobs], d.finish_reason,
             d.stop_reason) for d in out] == [(0, [1, 2, 3], "abc", [1, 2, 3], "stop", 3),
                                             (1, [7], "x", [7], None, None)]
    assert msgspec.json.encode(steps) == before  # events may be replayed to another caller
    assert merge_deltas(steps[:1]) == steps[:1]


async def test_a_paced_stream_holds_its_request_in_the_engine_until_taken() -> None:
    """Per-stream window: a caller that does not pass events on stops its own request in
    the engine after WINDOW events; other streams on the connection run on; taking the
    events lets it finish, every token in order."""
    from rlfleet.protocol.engine import WINDOW

    async with worker(token_delay=0.001) as (engine, addr, client):
        held_req, other_req = request(max_tokens=1000, seed=3), request(max_tokens=300, seed=4)
        held = await client.generate(addr, held_req, paced=True)
        other = await client.generate(addr, other_req)
        assert merged([ev async for ev in other]) == await tokens_of(engine, other_req)
        await asyncio.sleep(0.3)
        got = []
        while held._queue:  # what arrived, without passing it on
            got.append(await anext(held))
        assert len(got) == WINDOW and engine.num_running() == 1
        await asyncio.sleep(0.2)
        assert not held._queue  # nothing more while the caller takes nothing
        held.taken(len(got))
        async for ev in held:
            got.append(ev)
            held.taken(1)
        assert merged(got) == await tokens_of(engine, held_req) and type(got[-1]) is Done


async def test_a_worker_shutting_down_refuses_new_requests_as_retryable() -> None:
    engine = MockEngine(token_delay=0.005)
    server = await WorkerPlane(engine).serve(bind_socket("127.0.0.1", 0))
    addr = f"127.0.0.1:{server.port}"
    client = StreamClient()
    try:
        running = await client.generate(addr, request(max_tokens=30))
        await anext(running)
        stopping = asyncio.ensure_future(server.stop(grace=60))
        await asyncio.sleep(0.05)
        with pytest.raises(WorkerError) as e:  # refused before it reached the engine
            async for _ in await client.generate(addr, request(max_tokens=3)):
                pass
        assert e.value.status == 503 and e.value.retryable
        assert len(merged([ev async for ev in running])[0]) == 30  # the running one finishes
        await stopping
    finally:
        await client.close()


async def test_a_stop_sends_the_frames_queued_in_its_own_turn_before_closing() -> None:
    """A request that ends in the turn the stop looks for running requests has its last
    frames queued for the next turn: the stop sends them before it closes the connection."""
    server = await WorkerPlane(MockEngine()).serve(bind_socket("127.0.0.1", 0))
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(MAGIC + frame(Frame.PING, 0))
        assert FrameReader().feed(await reader.read(64))[0][0] == Frame.PONG
        (link,) = server.links
        link.writer.put(Frame.PONG, 7, None)  # queued in this turn, as a last Done would be
        await server.stop(grace=0)
        data = await asyncio.wait_for(reader.read(), 5)  # until the worker closes
        assert [(kind, sid) for kind, sid, _ in FrameReader().feed(data)] == [(Frame.PONG, 7)]
    finally:
        writer.close()


async def test_an_event_that_cannot_be_sent_fails_its_stream_only() -> None:
    async with worker() as (engine, addr, client):
        real = engine.generate

        async def broken(req: GenerateRequest, ids: list[int]):
            if req.request_id.startswith("bad"):
                yield {"choices": [{"index": 0, "token_ids": [1], "text": object()}]}
            else:
                async for ev in real(req, ids):
                    yield ev

        engine.generate = broken  # type: ignore[method-assign]
        other = await client.generate(addr, request(max_tokens=3))
        with pytest.raises(WorkerError) as e:
            async for _ in await client.generate(addr, GenerateRequest(
                    request_id="bad-1", prompt_token_ids=PROMPT)):
                pass
        assert e.value.status == 500 and "worker failed" in e.value.message
        assert len(merged([ev async for ev in other])[0]) == 3  # the connection serves on


# ---------------------------------------------------------------- heartbeats


def test_the_heartbeat_pings_a_quiet_worker_and_calls_a_silent_one_stalled() -> None:
    """Timeout 3 s: quiet for a third of it, a PING (again each third while still quiet);
    nothing at all for the whole of it, stalled; anything heard starts it over."""
    beat = Heartbeat(3.0)
    assert beat.interval < 1.0  # looked at often enough to notice within about the timeout
    heard = pinged = 100.0
    assert beat.due(100.5, heard, pinged) is None
    assert beat.due(101.1, heard, pinged) == "ping"
    pinged = 101.1
    assert beat.due(101.5, heard, pinged) is None  # pinged a moment ago
    assert beat.due(102.2, heard, pinged) == "ping"
    pinged = 102.2
    assert beat.due(102.9, heard, pinged) is None
    assert beat.due(103.1, heard, pinged) == "stalled"
    assert beat.due(103.1, 102.5, pinged) is None  # it answered at 102.5: alive
    assert Heartbeat(0.1).interval >= 0.05


async def test_a_worker_that_answers_pings_is_not_stalled_while_its_engine_is_slow() -> None:
    """A worker whose engine takes longer than the heartbeat to produce anything, but that
    answers every PING, keeps its requests: they end with its events, not as stalled."""
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _, sid, _ = await read_frame(reader)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.8:  # four heartbeat timeouts of silence on the stream
            kind, _, _ = await asyncio.wait_for(read_frame(reader), 1.0)
            if kind == Frame.PING:
                writer.write(frame(Frame.PONG, 0))
        writer.write(frame(Frame.HEAD, sid, {"prompt_token_ids": [1], "weight_version": None,
                                             "weight_digest": None}))
        writer.write(frame(Frame.DONE, sid, {}))
        await writer.drain()
        await reader.read()

    async with scripted_worker(script) as addr:
        client = StreamClient(stall_timeout=0.2)
        events = [ev async for ev in await client.generate(addr, request())]
        assert [type(ev).__name__ for ev in events] == ["Head", "Done"]
        await client.close()


async def test_a_silent_worker_fails_every_request_on_it_at_once_as_stalled() -> None:
    pings = 0

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal pings
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:  # reads everything, answers nothing (a stopped process's kernel)
                kind, _, _ = await read_frame(reader)
                pings += kind == Frame.PING

    async with scripted_worker(script) as addr:
        client = StreamClient(stall_timeout=0.3)
        streams = [await client.generate(addr, request()) for _ in range(3)]

        async def end(stream) -> WorkerError:
            with pytest.raises(WorkerError) as e:
                async for _ in stream:
                    pass
            return e.value

        errors = await asyncio.wait_for(asyncio.gather(*(end(s) for s in streams)), 10)
        assert all(e.stalled and e.broken and e.status == 504 for e in errors)
        assert "stalled" in errors[0].message and pings >= 1  # it was asked before
        await client.close()


# ---------------------------------------------------------------- attach-only requests


async def test_an_attach_only_request_follows_a_kept_run_or_finds_none_within_its_deadline(
        ) -> None:
    async with worker(token_delay=0.005) as (engine, addr, client):
        kept = msgspec.structs.replace(request(max_tokens=20), retain="body-1")
        probe = msgspec.structs.replace(kept, attach_only=True)
        ran = metric("rlfleet_worker_requests_total")
        assert await client.attach(addr, probe, 5.0) is None  # nothing kept: nothing run
        assert metric("rlfleet_worker_requests_total") == ran
        first = [ev async for ev in await client.generate(addr, kept)]
        stream = await client.attach(addr, probe, 5.0)
        assert stream is not None
        assert [ev async for ev in stream] == first and type(first[-1]) is Done
        with pytest.raises(WorkerError) as e:  # the ID kept for another request
            await client.attach(addr, msgspec.structs.replace(probe, retain="body-2"), 5.0)
        assert e.value.status == 409
    # unreachable, or silent past the deadline: none there
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    client = StreamClient()
    assert await client.attach(closed, probe, 5.0) is None

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                await read_frame(reader)
    async with scripted_worker(silent) as addr:
        started = time.monotonic()
        assert await client.attach(addr, probe, 0.3) is None
        assert time.monotonic() - started < 5
    await client.close()
