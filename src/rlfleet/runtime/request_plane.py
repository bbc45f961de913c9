"""The request plane: the worker's side (one core, two transports) and the frontend's client.

Messages and events: rlfleet.protocol.engine. The frontend talks to each worker over one
persistent TCP connection (the stream plane), every request a numbered stream on it:
no HTTP request per generation and no JSON line per token. The worker writes an event
per engine step and the frames of one event-loop turn in one write; the frontend reads
whole batches of frames per wake-up. The worker also serves the same requests over HTTP
(`POST /generate`, newline-delimited JSON) for direct callers.

Guarantees on the stream plane:
- the caller leaving (`WorkerStream.aclose()` before the end) aborts the request in the
  engine (a CLOSE frame; the worker cancels the request's task);
- a worker that dies (its connection closes, even between two coalesced events) ends
  every stream on it at once with a 502 error; a worker that sends nothing on a stream
  for `request_timeout` seconds ends that stream with a 504;
- back-pressure, per stream and per connection: a worker sends at most WINDOW events of
  a stream that the frontend has not taken yet (CREDIT frames move the window), and stops
  altogether while the frontend does not read its connection. The worker then stops
  pulling from the engine for that request (vLLM merges the deltas it holds; the mocker
  stops generating): a slow caller holds back its own request, not the frontend's memory.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rlfleet.protocol.engine import (
    MAGIC,
    WINDOW,
    Cancelled,
    CancelRequest,
    Done,
    EngineError,
    ErrorEvent,
    Event,
    Frame,
    GenerateRequest,
    Head,
    Step,
    TokenizeRequest,
    Tokens,
)
from rlfleet.runtime import metrics
from rlfleet.runtime.engine import BadRequest, Engine
from rlfleet.runtime.http import (
    ERROR_HANDLERS,
    ClientWatch,
    HttpError,
    StreamResponse,
    error_body,
    error_response,
    json_response,
)
from rlfleet.runtime.system_server import FaultInjector, InjectedFault

log = logging.getLogger("rlfleet.request_plane")

_HEADER = struct.Struct("<IBI")  # length of the rest, kind, stream number
_MAX_FRAME = 256 << 20
_msgpack = msgspec.msgpack.Encoder()
_json = msgspec.json.Encoder()


def check_prompt(engine: Engine, req: GenerateRequest) -> list[int]:
    """Tokenise if needed and check the prompt and budget against the model; BadRequest says what to fix."""
    info = engine.info
    if req.prompt_token_ids is not None:
        ids = req.prompt_token_ids
    else:
        ids = engine.tokenize(req.prompt, req.messages, req.add_generation_prompt,
                              req.chat_template_kwargs)
        if not ids:
            raise BadRequest("the prompt tokenises to zero tokens: send a non-empty prompt")
    vocab = info.vocab_size
    if min(ids) < 0 or max(ids) >= vocab:
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise BadRequest(f"prompt token ID {bad} is outside the vocabulary "
                         f"[0, {vocab}) of model {info.served_model_name!r}")
    bad = [t for t in req.sampling.stop_token_ids if not 0 <= t < vocab]
    if bad:
        raise BadRequest(f"stop_token_ids entry {bad[0]} is outside the vocabulary [0, {vocab})")
    room = info.max_model_len - len(ids)
    if room <= 0:
        raise BadRequest(f"the prompt has {len(ids)} tokens, but the context length of "
                         f"{info.served_model_name!r} is {info.max_model_len}: shorten the prompt")
    mt = req.sampling.max_tokens
    if mt is not None and mt > room:
        raise BadRequest(f"max_tokens is {mt}, but the prompt ({len(ids)} tokens) leaves room for "
                         f"at most {room} in the context of {info.max_model_len}: lower max_tokens")
    if req.sampling.min_tokens > room:
        raise BadRequest(f"min_tokens is {req.sampling.min_tokens}, but at most {room} tokens fit")
    return ids


def _decode_error(e: Exception) -> str:
    return str(e) or type(e).__name__


def keep_alive(transport: asyncio.BaseTransport) -> None:
    """A peer that vanishes without closing (host down, network cut) is noticed within
    about 25 s of silence, and unacknowledged writes fail after 30 s, instead of the
    connection hanging until the kernel gives up (minutes)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    opts = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3),
                        ("TCP_USER_TIMEOUT", 30_000)):
        if hasattr(socket, name):
            opts.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    for level, opt, value in opts:
        try:
            sock.setsockopt(level, opt, value)
        except OSError:  # not on this platform
            pass


# ================================================================== worker side


class Opened:
    """A request the engine accepted: its Head, the first engine event (None when the
    engine ended it without one), and the rest. Whoever opened it closes it (`aclose`),
    which aborts the request in the engine if it has not ended."""

    __slots__ = ("head", "first", "events", "started", "outcome", "closed")

    def __init__(self, head: Head, first: dict | None, events: AsyncIterator[dict]) -> None:
        self.head, self.first, self.events = head, first, events
        self.started = time.monotonic()
        self.outcome = "error"
        self.closed = False

    def left(self) -> None:
        """The caller went away before the end (counted as `abandoned`)."""
        if self.outcome == "error":
            self.outcome = "abandoned"

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            await self.events.aclose()  # type: ignore[attr-defined]
            metrics.WORKER_REQUESTS.labels(self.outcome).inc()
            metrics.WORKER_REQUEST_SECONDS.observe(time.monotonic() - self.started)


class WorkerPlane:
    """A worker's request plane: one engine, served on the stream plane (`serve`) and over
    HTTP (`http_app`). Both go through `open` and `rest`, so they behave the same."""

    def __init__(self, engine: Engine, faults: FaultInjector | None = None) -> None:
        self.engine, self.faults = engine, faults

    async def open(self, req: GenerateRequest) -> Opened:
        """Check the request, start it and pull its first event, so that a request the
        engine refuses gets an error status instead of a stream that breaks. Raises
        HttpError (400: refused as given, 500: injected or engine failure)."""
        if self.faults is not None:
            try:
                injected = await self.faults.check("generate")
            except InjectedFault as e:
                raise HttpError(500, str(e)) from e
            if injected is not None:
                raise HttpError(500, injected.get("message", "injected failure"))
        engine = self.engine
        try:
            ids = check_prompt(engine, req)
        except BadRequest as e:
            metrics.WORKER_REQUESTS.labels("rejected").inc()
            raise HttpError(400, str(e)) from e
        events = engine.generate(req, ids)
        try:
            first = await anext(events)
        except StopAsyncIteration:
            first = None
        except BadRequest as e:
            metrics.WORKER_REQUESTS.labels("rejected").inc()
            raise HttpError(400, str(e)) from e
        except asyncio.CancelledError:  # the caller left before the first event
            await events.aclose()
            metrics.WORKER_REQUESTS.labels("abandoned").inc()
            raise
        except Exception as e:  # the engine failed on this request: say so, keep serving
            metrics.WORKER_REQUESTS.labels("error").inc()
            raise HttpError(500, f"engine failed: {type(e).__name__}: {e}") from e
        # the weights that produced the first token (a pause may have swapped them)
        wid = engine.weight_identity()
        head = Head(prompt_token_ids=ids, weight_version=wid.get("weight_version"),
                    weight_digest=wid.get("weight_digest"))
        if req.echo:
            head.prompt_text = req.prompt if req.prompt is not None else engine.detokenize(ids)
            head.prompt_token_strs = engine.token_strs(ids)
        return Opened(head, first, events)

    @staticmethod
    async def rest(opened: Opened) -> AsyncIterator[tuple[Frame, Any]]:
        """(kind, event) after the Head, to the end; an engine failure becomes an ERROR
        event. The caller closes `opened` when it stops, whether or not this ended."""
        events = opened.events
        try:
            ev = opened.first
            while ev is not None:
                if "done" in ev:
                    opened.outcome = "ok"
                    yield Frame.DONE, ev
                    return
                yield Frame.STEP, ev
                ev = await anext(events, None)
        except Exception as e:  # the engine failed mid-request: tell the caller, keep serving
            yield Frame.ERROR, EngineError(message=f"engine failed: {type(e).__name__}: {e}")

    # ---------------------------------------------------------------- HTTP transport

    def http_app(self) -> Starlette:
        """POST /generate (NDJSON events), POST /abort, POST /tokenize, GET /health, /metrics."""

        async def generate(request: Request) -> Response:
            try:
                req = msgspec.json.decode(await request.body(), type=GenerateRequest)
            except (msgspec.DecodeError, ValueError) as e:
                metrics.WORKER_REQUESTS.labels("rejected").inc()
                return error_response(400, _decode_error(e))
            watch = ClientWatch(request)
            try:
                opened = await self.open(req)
            except HttpError as e:
                watch.finish()
                return e.response()
            except asyncio.CancelledError as e:
                watch.finish()
                if watch.gone_on(e):
                    return error_response(499, "the caller went away before the first token")
                raise

            async def lines() -> AsyncIterator[bytes]:
                try:
                    yield _json.encode(opened.head) + b"\n"
                    async for kind, ev in self.rest(opened):
                        if kind is Frame.ERROR:
                            ev = ErrorEvent(error=ev)
                        yield _json.encode(ev) + b"\n"
                except (GeneratorExit, asyncio.CancelledError):
                    opened.left()
                    raise
                finally:
                    await opened.aclose()

            return StreamResponse(lines(), watch, "application/x-ndjson")

        async def abort(request: Request) -> Response:
            """End a running request now; its stream finishes with its partial output and
            finish reason `abort`."""
            try:
                rid = msgspec.json.decode(await request.body(), type=CancelRequest).request_id
            except (msgspec.DecodeError, ValueError):
                return error_response(400, "request_id is required")
            await self.engine.abort(rid)
            return json_response(Cancelled(status="ok", request_id=rid))

        async def tokenize(request: Request) -> Response:
            try:
                req = msgspec.json.decode(await request.body(), type=TokenizeRequest)
                return json_response(self.tokenize(req))
            except (msgspec.DecodeError, ValueError) as e:
                return error_response(400, _decode_error(e))

        async def health(request: Request) -> Response:
            return json_response({"status": "ok", "model": self.engine.info.served_model_name})

        async def metrics_route(request: Request) -> Response:
            return metrics.metrics_response()

        return Starlette(routes=[
            Route("/generate", generate, methods=["POST"]),
            Route("/abort", abort, methods=["POST"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics_route, methods=["GET"]),
        ], exception_handlers=ERROR_HANDLERS)

    def tokenize(self, req: TokenizeRequest) -> Tokens:
        """Raises BadRequest (a ValueError) for messages the template cannot render."""
        ids = self.engine.tokenize(req.prompt, req.messages, req.add_generation_prompt,
                                   req.chat_template_kwargs)
        return Tokens(token_ids=ids, count=len(ids))

    # ---------------------------------------------------------------- stream transport

    async def serve(self, sock) -> StreamServer:
        """Serve the stream plane on a bound, listening socket."""
        loop = asyncio.get_running_loop()
        server = StreamServer(self)
        server.server = await loop.create_server(lambda: _FrontendLink(server), sock=sock)
        return server


def request_plane_app(engine: Engine, faults: FaultInjector | None = None) -> Starlette:
    """The worker's HTTP request plane for `engine` (see WorkerPlane.http_app)."""
    return WorkerPlane(engine, faults).http_app()


class StreamServer:
    """The worker's listener for frontends' stream-plane connections."""

    def __init__(self, plane: WorkerPlane) -> None:
        self.plane = plane
        self.server: asyncio.Server | None = None
        self.links: set[_FrontendLink] = set()
        self.closing = False

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.sockets[0].getsockname()[1]

    async def stop(self, grace: float = 5.0) -> None:
        """Stop accepting (new requests are refused as retryable elsewhere), give running
        requests `grace` seconds, then abort the rest."""
        self.closing = True
        if self.server is not None:
            self.server.close()
        deadline = time.monotonic() + grace
        while any(link.tasks for link in self.links) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for link in list(self.links):
            link.transport.close()
            for task in list(link.tasks.values()):
                task.cancel()


class FrameWriter:
    """Frames queued during one event-loop turn leave in one write."""

    __slots__ = ("transport", "_out", "_queued", "_loop")

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self._out = bytearray()
        self._queued = False
        self._loop = asyncio.get_running_loop()

    def put(self, kind: int, sid: int, body: Any) -> None:
        out = self._out
        start = len(out)
        out += b"\0\0\0\0\0\0\0\0\0"
        if body is not None:
            try:
                _msgpack.encode_into(body, out, -1)
            except BaseException:
                del out[start:]  # nothing of a frame that cannot be encoded is sent
                raise
        _HEADER.pack_into(out, start, len(out) - start - 4, kind, sid)
        if not self._queued:
            self._queued = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        self._queued = False
        if self._out and not self.transport.is_closing():
            out, self._out = self._out, bytearray()  # the transport may keep a view of it
            self.transport.write(out)


class FrameReader:
    """Splits a byte stream into (kind, stream number, body) frames."""

    __slots__ = ("_rest",)

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, data: bytes) -> list[tuple[int, int, memoryview]]:
        if self._rest:
            data = self._rest + data
        view = memoryview(data)
        frames = []
        pos, end = 0, len(data)
        while end - pos >= 9:
            size, kind, sid = _HEADER.unpack_from(data, pos)
            if size > _MAX_FRAME:
                raise ValueError(f"frame of {size} bytes is larger than allowed")
            if end - pos - 4 < size:
                break
            frames.append((kind, sid, view[pos + 9:pos + 4 + size]))
            pos += 4 + size
        self._rest = data[pos:] if pos < end else b""
        return frames


class _Window:
    """How many more events of one stream the worker may send (see WINDOW)."""

    __slots__ = ("credit", "_waiter")

    def __init__(self) -> None:
        self.credit = WINDOW
        self._waiter: asyncio.Future | None = None

    def grant(self, n: int) -> None:
        if not 0 < n <= 1 << 20:
            raise ValueError(f"a credit of {n} events is out of range")
        self.credit += n
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def opened(self) -> None:
        while self.credit <= 0:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter


_generate = msgspec.msgpack.Decoder(GenerateRequest)
_credit = msgspec.msgpack.Decoder(int)
_tokenize = msgspec.msgpack.Decoder(TokenizeRequest)
_cancel = msgspec.msgpack.Decoder(CancelRequest)


class _FrontendLink(asyncio.Protocol):
    """One frontend's connection to this worker: a task per running request."""

    def __init__(self, server: StreamServer) -> None:
        self.server, self.plane = server, server.plane
        self.tasks: dict[int, asyncio.Task] = {}
        self.windows: dict[int, _Window] = {}
        self.reader = FrameReader()
        self._greeted = False
        self._paused = False
        self._resumed: asyncio.Future | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.transport = transport
        self.writer = FrameWriter(transport)
        self.server.links.add(self)
        keep_alive(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.links.discard(self)
        for task in self.tasks.values():  # nobody reads these any more: abort them
            task.cancel()
        self.resume_writing()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._resumed is not None and not self._resumed.done():
            self._resumed.set_result(None)
        self._resumed = None

    async def _writable(self) -> None:
        """Until the frontend has read enough of what was sent (back-pressure)."""
        while self._paused:
            if self._resumed is None:
                self._resumed = asyncio.get_running_loop().create_future()
            await self._resumed

    def data_received(self, data: bytes) -> None:
        if not self._greeted:
            data = self.reader._rest + data
            if len(data) < len(MAGIC):
                self.reader._rest = data
                return
            if not data.startswith(MAGIC):
                log.warning("closing a connection that does not speak the stream plane")
                self.transport.close()
                return
            self._greeted = True
            self.reader._rest = b""
            data = data[len(MAGIC):]
        try:
            frames = self.reader.feed(data)
        except ValueError as e:
            log.warning("closing a stream-plane connection: %s", e)
            self.transport.close()
            return
        for kind, sid, body in frames:
            self._on_frame(kind, sid, body)

    def _error(self, sid: int, status: int, message: str) -> None:
        self.writer.put(Frame.ERROR, sid, EngineError(
            message=message, type=error_body(status, message)["error"]["type"], code=status))

    def _on_frame(self, kind: int, sid: int, body: memoryview) -> None:
        if kind == Frame.GENERATE:
            try:
                req = _generate.decode(body)
            except (msgspec.DecodeError, ValueError) as e:
                metrics.WORKER_REQUESTS.labels("rejected").inc()
                self._error(sid, 400, _decode_error(e))
                return
            if self.server.closing:  # nothing reached the engine: the frontend tries another
                self._error(sid, 503, "this worker is shutting down")
                return
            self.windows[sid] = _Window()
            self.tasks[sid] = asyncio.ensure_future(self._generate(sid, req))
        elif kind == Frame.CREDIT:
            window = self.windows.get(sid)
            if window is not None:
                try:
                    window.grant(_credit.decode(body))
                except (msgspec.DecodeError, ValueError) as e:
                    self._error(sid, 400, _decode_error(e))
        elif kind == Frame.CLOSE:
            task = self.tasks.get(sid)
            if task is not None:
                task.cancel()
        elif kind == Frame.TOKENIZE:
            try:
                self.writer.put(Frame.REPLY, sid, self.plane.tokenize(_tokenize.decode(body)))
            except (msgspec.DecodeError, ValueError) as e:
                self._error(sid, 400, _decode_error(e))
        elif kind == Frame.CANCEL:
            try:
                rid = _cancel.decode(body).request_id
            except (msgspec.DecodeError, ValueError) as e:
                self._error(sid, 400, _decode_error(e))
                return
            asyncio.ensure_future(self._cancel(sid, rid))
        else:
            self._error(sid, 400, f"unknown frame kind {kind}")

    async def _cancel(self, sid: int, rid: str) -> None:
        await self.plane.engine.abort(rid)
        self.writer.put(Frame.REPLY, sid, Cancelled(status="ok", request_id=rid))

    async def _generate(self, sid: int, req: GenerateRequest) -> None:
        put = self.writer.put
        window = self.windows[sid]
        try:
            try:
                opened = await self.plane.open(req)
            except HttpError as e:
                self._error(sid, e.status, e.message)
                return
            try:
                put(Frame.HEAD, sid, opened.head)
                window.credit -= 1
                async for kind, ev in self.plane.rest(opened):
                    if kind is Frame.STEP:
                        if window.credit <= 0:
                            await window.opened()
                        window.credit -= 1
                    if self._paused:
                        await self._writable()
                    put(kind, sid, ev)
            except asyncio.CancelledError:
                opened.left()
                raise
            finally:
                await opened.aclose()
        except asyncio.CancelledError:
            pass  # CLOSE, or the frontend went away: the engine has aborted the request
        finally:
            del self.tasks[sid]
            del self.windows[sid]


# ================================================================== frontend side


class WorkerError(HttpError):
    """A worker could not serve a request. `status` is the HTTP status to report;
    `retryable` is true when the request never reached the engine; `broken` when the
    worker itself looks unhealthy (it is then avoided for a while)."""

    def __init__(self, message: str, status: int = 502, retryable: bool = False,
                 body: dict[str, Any] | None = None, broken: bool = False,
                 type_: str | None = None) -> None:
        super().__init__(status, message, type_, body=body)
        self.retryable = retryable
        self.broken = broken or retryable


_END = object()  # a stream's end marker in its queue


class WorkerStream:
    """The events of one request from one worker, in order: Head, Step..., Done. Raises
    WorkerError for an error event, a lost connection or a stalled stream. Closing it
    before the end aborts the request in the worker's engine."""

    __slots__ = ("link", "sid", "_queue", "_waiter", "_error", "last", "ended", "paced",
                 "_taken")

    def __init__(self, link: WorkerLink, sid: int, paced: bool = False) -> None:
        self.link, self.sid = link, sid
        self._queue: deque = deque()
        self._waiter: asyncio.Future | None = None
        self._error: WorkerError | None = None
        self.last = time.monotonic()  # when the worker last sent something for it
        self.ended = False
        # paced: the caller reports what it has passed on (`taken`), which moves the
        # worker's window; otherwise every event read from here counts as taken
        self.paced = paced
        self._taken = 0

    def taken(self, n: int) -> None:
        """The caller has passed on `n` more events: let the worker send as many more."""
        self._taken += n
        if self._taken >= WINDOW // 2 and not self.ended and self.link.open:
            self.link.writer.put(Frame.CREDIT, self.sid, self._taken)
            self._taken = 0

    def _push(self, item: Any) -> None:
        self._queue.append(item)
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    def _fail(self, error: WorkerError) -> None:
        self._error = error
        self._push(_END)

    def __aiter__(self) -> WorkerStream:
        return self

    async def __anext__(self) -> Event:
        q = self._queue
        while not q:
            self._waiter = self.link.loop.create_future()
            await self._waiter
        item = q.popleft()
        if item is _END:
            q.appendleft(item)
            if self._error is not None:
                raise self._error
            raise StopAsyncIteration
        if not self.paced:
            self.taken(1)
        return item

    async def aclose(self) -> None:
        if not self.ended:
            self.link.close_stream(self.sid)


class _Reply:
    """A pending unary call (tokenize, cancel)."""

    __slots__ = ("future", "decoder")

    def __init__(self, future: asyncio.Future, decoder: msgspec.msgpack.Decoder) -> None:
        self.future, self.decoder = future, decoder


_head = msgspec.msgpack.Decoder(Head)
_step = msgspec.msgpack.Decoder(Step)
_done = msgspec.msgpack.Decoder(Done)
_error = msgspec.msgpack.Decoder(EngineError)


class WorkerLink(asyncio.Protocol):
    """The frontend's persistent stream-plane connection to one worker."""

    def __init__(self, address: str, request_timeout: float) -> None:
        self.address = address
        self.request_timeout = request_timeout
        self.loop = asyncio.get_running_loop()
        self.streams: dict[int, WorkerStream | _Reply] = {}
        self.reader = FrameReader()
        self.open = False
        self._next = 0
        self._sweeper: asyncio.Task | None = None

    # ---------------------------------------------------------------- asyncio.Protocol

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.transport = transport
        self.writer = FrameWriter(transport)
        transport.write(MAGIC)
        keep_alive(transport)
        self.open = True
        self._sweeper = asyncio.ensure_future(self._sweep())

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        if self._sweeper is not None:
            self._sweeper.cancel()
        why = f" ({exc!r})" if exc is not None else ""
        for item in self.streams.values():
            err = WorkerError(f"worker at {self.address} failed mid-request: the connection "
                              f"was lost{why}", 502, broken=True)
            if isinstance(item, WorkerStream):
                item._fail(err)
            elif not item.future.done():
                item.future.set_exception(err)
        self.streams.clear()

    def data_received(self, data: bytes) -> None:
        try:
            frames = self.reader.feed(data)
        except ValueError as e:
            log.error("worker at %s sent a bad frame: %s", self.address, e)
            self.transport.close()
            return
        now = time.monotonic()
        streams = self.streams
        for kind, sid, body in frames:
            item = streams.get(sid)
            if item is None:
                continue  # a stream we closed already
            if kind <= Frame.DONE and not isinstance(item, WorkerStream):
                kind = 0  # an event on a unary call: malformed
            try:
                if kind == Frame.STEP:
                    item._push(_step.decode(body))  # type: ignore[union-attr]
                elif kind == Frame.HEAD:
                    item._push(_head.decode(body))  # type: ignore[union-attr]
                elif kind == Frame.DONE:
                    del streams[sid]
                    item.ended = True  # type: ignore[union-attr]
                    item._push(_done.decode(body))  # type: ignore[union-attr]
                    item._push(_END)  # type: ignore[union-attr]
                elif kind == Frame.ERROR:
                    del streams[sid]
                    e = _error.decode(body)
                    # 503: the worker refused it before it reached the engine (shutting down)
                    err = WorkerError(e.message, e.code, type_=e.type, retryable=e.code == 503)
                    if isinstance(item, WorkerStream):
                        item.ended = True
                        item._fail(err)
                    elif not item.future.done():
                        item.future.set_exception(err)
                    continue
                elif kind == Frame.REPLY:
                    del streams[sid]
                    if not item.future.done():  # type: ignore[union-attr]
                        item.future.set_result(item.decoder.decode(body))  # type: ignore[union-attr]
                    continue
                else:
                    raise ValueError(f"unknown frame kind {kind}")
            except (msgspec.DecodeError, ValueError) as e:
                log.error("worker at %s sent an event this frontend cannot read: %s",
                          self.address, e)
                streams.pop(sid, None)
                err = WorkerError(f"worker at {self.address} sent a malformed event: {e}", 502)
                if isinstance(item, WorkerStream):
                    item.ended = True
                    item._fail(err)
                elif not item.future.done():
                    item.future.set_exception(err)
                continue
            item.last = now  # type: ignore[union-attr]

    # ---------------------------------------------------------------- streams

    def _sid(self) -> int:
        self._next = (self._next + 1) & 0xFFFFFFFF
        while self._next in self.streams or self._next == 0:
            self._next = (self._next + 1) & 0xFFFFFFFF
        return self._next

    def generate(self, req: GenerateRequest, paced: bool = False) -> WorkerStream:
        sid = self._sid()
        stream = WorkerStream(self, sid, paced)
        try:
            self.writer.put(Frame.GENERATE, sid, req)
        except (OverflowError, msgspec.EncodeError) as e:  # e.g. an integer beyond 64 bits
            raise WorkerError(f"the request cannot be sent as given: {e}", 400) from e
        self.streams[sid] = stream
        return stream

    def close_stream(self, sid: int) -> None:
        """The caller left: the worker aborts the request."""
        item = self.streams.pop(sid, None)
        if item is not None and self.open:
            self.writer.put(Frame.CLOSE, sid, None)

    async def call(self, kind: Frame, body: Any, reply: msgspec.msgpack.Decoder,
                   timeout: float) -> Any:
        sid = self._sid()
        fut = self.loop.create_future()
        self.streams[sid] = _Reply(fut, reply)
        self.writer.put(kind, sid, body)
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError as e:
            raise WorkerError(f"worker at {self.address} timed out after {timeout:g} s", 504,
                              broken=True) from e
        finally:
            self.streams.pop(sid, None)

    async def _sweep(self) -> None:
        """End streams the worker has sent nothing on for `request_timeout` seconds."""
        timeout = self.request_timeout
        interval = min(1.0, max(0.05, timeout / 8))
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            stale = [s for s in self.streams.values()
                     if isinstance(s, WorkerStream) and now - s.last > timeout]
            for s in stale:
                self.streams.pop(s.sid, None)
                if self.open:
                    self.writer.put(Frame.CLOSE, s.sid, None)
                s.ended = True
                s._fail(WorkerError(f"worker at {self.address} timed out: no event for "
                                    f"{timeout:g} s", 504, broken=True))

    def close(self) -> None:
        self.transport.close()


def split_address(address: str) -> tuple[str, int]:
    """"host:port" or "[v6]:port" → (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"bad stream-plane address {address!r}; expected host:port")
    return host.strip("[]"), int(port)


_tokens = msgspec.msgpack.Decoder(Tokens)
_cancelled = msgspec.msgpack.Decoder(Cancelled)


class WorkerClient:
    """The frontend's side of the request plane: one stream-plane connection per worker,
    opened on first use and kept."""

    def __init__(self, connect_timeout: float = 5.0, request_timeout: float = 600.0) -> None:
        self.connect_timeout = connect_timeout
        self.request_timeout = request_timeout
        self._links: dict[str, WorkerLink] = {}
        self._connecting: dict[str, asyncio.Future] = {}

    async def link(self, address: str) -> WorkerLink:
        link = self._links.get(address)
        if link is not None and link.open:
            return link
        pending = self._connecting.get(address)
        if pending is not None:  # another request is connecting already
            return await asyncio.shield(pending)
        fut = asyncio.get_running_loop().create_future()
        self._connecting[address] = fut
        try:
            link = await self._connect(address)
            self._links[address] = link
            fut.set_result(link)
            return link
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: no "never retrieved" warning when nobody waits
            raise
        finally:
            del self._connecting[address]

    async def _connect(self, address: str) -> WorkerLink:
        loop = asyncio.get_running_loop()
        try:
            host, port = split_address(address)
            _, link = await asyncio.wait_for(loop.create_connection(
                lambda: WorkerLink(address, self.request_timeout), host, port),
                self.connect_timeout)
        except (OSError, TimeoutError, ValueError) as e:
            raise WorkerError(f"worker at {address} is unreachable: {e!r}", 503,
                              retryable=True) from e
        return link

    async def generate(self, address: str, req: GenerateRequest, paced: bool = False
                       ) -> WorkerStream:
        """Start `req` on the worker; iterate the returned stream for its events. With
        `paced`, the caller moves the worker's window itself (`WorkerStream.taken`)."""
        return (await self.link(address)).generate(req, paced)

    async def cancel(self, address: str, request_id: str) -> bool:
        """The engine's abort: the request ends now with its partial output."""
        try:
            link = await self.link(address)
            out = await link.call(Frame.CANCEL, CancelRequest(request_id=request_id), _cancelled,
                                  10.0)
        except WorkerError:
            return False
        return out.status == "ok"

    async def tokenize(self, address: str, req: TokenizeRequest) -> Tokens:
        link = await self.link(address)
        return await link.call(Frame.TOKENIZE, req, _tokens, 30.0)

    async def close(self) -> None:
        for link in self._links.values():
            if link.open:
                link.close()
        self._links.clear()
