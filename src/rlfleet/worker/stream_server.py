"""The worker's side of the request plane: one core (`WorkerPlane.open` / `rest`) served
over two transports, the stream plane for frontends and HTTP `POST /generate`
(newline-delimited JSON events) for direct callers."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
from msgspec import UNSET
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rlfleet.protocol.engine import (
    CANCEL_FORBIDDEN,
    CANCEL_OK,
    CANCEL_UNKNOWN,
    MAGIC,
    WINDOW,
    Cancelled,
    CancelRequest,
    Detokenized,
    DetokenizeRequest,
    Done,
    EngineError,
    ErrorEvent,
    Frame,
    GenerateRequest,
    Head,
    Step,
    TokenizeRequest,
    Tokens,
)
from rlfleet.runtime import metrics, tracing
from rlfleet.runtime.http import (
    ERROR_HANDLERS,
    ClientWatch,
    HttpError,
    StreamResponse,
    bad_json_message,
    error_body,
    error_response,
    json_response,
)
from rlfleet.runtime.request_checks import check_request
from rlfleet.runtime.request_plane import (
    ATTACH_DEADLINE,
    StreamClient,
    WorkerError,
    WorkerStream,
)
from rlfleet.runtime.request_plane.frames import FrameReader, FrameWriter, keep_alive
from rlfleet.worker.engine import BadRequest, Engine, UnknownAdapter
from rlfleet.worker.kept import KeptRun, KeptRuns
from rlfleet.worker.prompt_checks import check_prompt, tokenize_off_loop
from rlfleet.worker.system_server import FaultInjector, InjectedFault

log = logging.getLogger("rlfleet.request_plane")

_json = msgspec.json.Encoder()


def _decode_error(e: Exception, raw: bytes = b"") -> str:
    return bad_json_message(e, raw)


class Opened:
    """A request the engine accepted: its Head, the first engine event (None when the
    engine ended it without one), and the rest. Whoever opened it closes it (`aclose`),
    which aborts the request in the engine if it has not ended, and counts it."""

    __slots__ = ("head", "first", "events", "started", "outcome", "closed", "series", "req",
                 "span")

    def __init__(self, head: Head, first: Step | Done | None,
                 events: AsyncIterator[Step | Done],
                 series: metrics.WorkerSeries, req: GenerateRequest, span: Any = None) -> None:
        self.head, self.first, self.events = head, first, events
        self.series, self.req, self.span = series, req, span
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
            secs = time.monotonic() - self.started
            self.series.requests[self.outcome].inc()
            self.series.seconds.observe(secs)
            if self.span is not None:
                self.span.set_attribute("rlfleet.outcome", self.outcome)
                if self.outcome == "error":
                    tracing.fail(self.span, "the request failed")
                self.span.end()
            if log.isEnabledFor(logging.DEBUG):
                req = self.req
                log.debug("request %s ended: %s in %.3fs", req.request_id, self.outcome, secs,
                          extra={"request_id": req.request_id, "outcome": self.outcome,
                                 "trace_id": tracing.trace_id_of(req.traceparent)})


async def _http_metrics(request: Request) -> Response:
    return metrics.metrics_response(metrics.WORKER)


class WorkerPlane:
    """A worker's request plane: one engine, served on the stream plane (`serve`) and over
    HTTP (`http_app`). Both go through `open` and `rest`, so they behave the same."""

    def __init__(self, engine: Engine, faults: FaultInjector | None = None,
                 trust_request_chat_template: bool = False,
                 admin_token: str | None = None) -> None:
        self.engine, self.faults = engine, faults
        # with a token, the request plane (stream plane and HTTP) serves only its holders
        self.admin_token = admin_token
        self.trust_request_chat_template = trust_request_chat_template
        # one thread renders templates and tokenises, off the event loop (a tokeniser is
        # not safe to share between threads)
        self.tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        # runs kept by request ID for retries through any frontend (GenerateRequest.retain)
        self.kept = KeptRuns(self.open, self.rest, attached=engine.series.attaches.inc,
                             peer=self.from_peer)
        # other workers' stream planes, to follow a run a pointer says is kept there
        self.peers = StreamClient(admin_token=admin_token)

    async def from_peer(self, address: str, req: GenerateRequest
                        ) -> AsyncIterator[tuple[Frame, Any]] | None:
        """The run the worker at `address` keeps under `req`'s ID (an attach-only
        request), as (kind, event) pairs; None where it keeps none (or keeps the ID for
        another request, is unreachable or says nothing within ATTACH_DEADLINE s)."""
        probe = msgspec.structs.replace(req, attach_only=True, placed_at=None)
        try:
            stream = await self.peers.attach(address, probe, ATTACH_DEADLINE)
        except WorkerError:
            return None
        return None if stream is None else _relayed(stream)

    async def open(self, req: GenerateRequest) -> Opened:
        """Check the request, start it and pull its first event, so that a request the
        engine refuses gets an error status instead of a stream that breaks. Raises
        HttpError (400: refused as given, 500: injected or engine failure). While tracing,
        the request gets a span under its caller's (ended with the request), and the
        engine is handed that span as the request's parent."""
        if not tracing.enabled():
            return await self._open(req, None)
        span = tracing.start_span("worker generate", req.traceparent, "server",
                                  {"rlfleet.request_id": req.request_id,
                                   "rlfleet.model": self.engine.info.served_model_name})
        req.traceparent = tracing.traceparent(span)
        try:
            return await self._open(req, span)
        except BaseException as e:
            tracing.fail(span, f"{type(e).__name__}: {e}")
            span.end()
            raise

    async def _open(self, req: GenerateRequest, span: Any) -> Opened:
        series = self.engine.series
        if self.faults is not None:
            try:
                injected = await self.faults.check("generate")
            except InjectedFault as e:
                raise HttpError(500, str(e)) from e
            if injected is not None:  # an error reply, or the body armed with mode respond
                message = (injected.get("message") if isinstance(injected, dict)
                           else getattr(injected, "message", None))
                raise HttpError(500, message or "injected failure of generate")
        engine = self.engine
        try:
            ids = await check_prompt(self, req)
        except BadRequest as e:
            series.requests["rejected"].inc()
            raise HttpError(400, str(e)) from e
        events = engine.generate(req, ids)
        try:
            first = await anext(events)
        except StopAsyncIteration:
            first = None
        except BadRequest as e:
            series.requests["rejected"].inc()
            raise HttpError(404 if isinstance(e, UnknownAdapter) else 400, str(e)) from e
        except asyncio.CancelledError:  # the caller left before the first event
            await events.aclose()
            series.requests["abandoned"].inc()
            raise
        except Exception as e:  # the engine failed on this request: say so, keep serving
            series.requests["error"].inc()
            raise HttpError(500, f"engine failed: {type(e).__name__}: {e}") from e
        # the weights that produced the first token (a pause may have swapped them)
        head = Head.of(ids, engine.request_policy(req))
        if type(first) is Step and first.prompt_logprobs is not UNSET:  # echo and stream
            plps, first.prompt_logprobs = first.prompt_logprobs, UNSET
            if plps is not None:
                head.prompt_logprobs = plps
        if req.echo:
            head.prompt_text = req.prompt if req.prompt is not None else engine.detokenize(ids)
            head.prompt_token_strs = engine.token_strs(ids)
        return Opened(head, first, events, series, req, span)

    @staticmethod
    async def rest(opened: Opened) -> AsyncIterator[tuple[Frame, Any]]:
        """(kind, event) after the Head, to the end; an engine failure becomes an ERROR
        event. The caller closes `opened` when it stops, whether or not this ended."""
        events = opened.events
        try:
            ev = opened.first
            while ev is not None:
                if type(ev) is Done:
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
        checked = self._authenticated
        return Starlette(routes=[
            Route("/generate", checked(self._http_generate), methods=["POST"]),
            Route("/abort", checked(self._http_abort), methods=["POST"]),
            Route("/tokenize", checked(self._http_tokenize), methods=["POST"]),
            Route("/health", self._http_health, methods=["GET"]),
            Route("/metrics", _http_metrics, methods=["GET"]),
        ], exception_handlers=ERROR_HANDLERS)

    def _authenticated(self, route: Callable[[Request], Awaitable[Response]]
                       ) -> Callable[[Request], Awaitable[Response]]:
        """`route`, refused with 401 without this worker's admin token (when it has one)."""
        if not self.admin_token:
            return route

        async def checked(request: Request) -> Response:
            auth = request.headers.get("authorization", "")
            if not (auth[:7].lower() == "bearer " and _same(auth[7:], self.admin_token)):
                return error_response(401, "this worker's request plane requires "
                                           "Authorization: Bearer <its admin token>")
            return await route(request)
        return checked

    async def _http_generate(self, request: Request) -> Response:
        raw = await request.body()
        try:
            req = check_request(msgspec.json.decode(raw, type=GenerateRequest))
        except (msgspec.DecodeError, ValueError, RecursionError) as e:
            self.engine.series.requests["rejected"].inc()
            return error_response(400, _decode_error(e, raw))
        if req.retain is not None:
            return await self._http_kept(req, request)
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
        return StreamResponse(self._ndjson(opened), watch, "application/x-ndjson")

    async def _ndjson(self, opened: Opened) -> AsyncIterator[bytes]:
        """The head and every event of an opened request, one JSON line each."""
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

    async def _http_kept(self, req: GenerateRequest, request: Request) -> Response:
        """A request this worker keeps by its ID (rlfleet.worker.kept), over HTTP: the
        run's events from its Head, one JSON line each; refused: the error's status.
        Leaving detaches from the run."""
        kept = self.kept
        try:
            run = kept.start(req)
        except HttpError as e:
            return e.response()
        kept.attach(run)
        try:
            await run.wait_past(0)  # its Head, or the error that refused it
        except BaseException:
            kept.detach(run)
            raise
        if not run.events:
            kept.detach(run)
            return (run.error or HttpError(500, "the request ended before its first event")
                    ).response()

        async def lines() -> AsyncIterator[bytes]:
            try:
                async for kind, ev in kept.follow(run):
                    yield _json.encode(ErrorEvent(error=ev) if kind is Frame.ERROR else ev) \
                        + b"\n"
            finally:
                kept.detach(run)
        return StreamResponse(lines(), ClientWatch(request), "application/x-ndjson")

    async def _http_abort(self, request: Request) -> Response:
        """End a running request now; its stream finishes with its partial output and
        finish reason `abort`."""
        try:
            rid = msgspec.json.decode(await request.body(), type=CancelRequest).request_id
        except (msgspec.DecodeError, ValueError, RecursionError):
            return error_response(400, "request_id is required")
        await self.engine.abort(rid)
        return json_response(Cancelled(status="ok", request_id=rid))

    async def _http_tokenize(self, request: Request) -> Response:
        raw = await request.body()
        try:
            req = msgspec.json.decode(raw, type=TokenizeRequest)
            return json_response(await self.tokenize(req))
        except (msgspec.DecodeError, ValueError, RecursionError) as e:
            return error_response(400, _decode_error(e, raw))

    async def _http_health(self, request: Request) -> Response:
        return json_response({"status": "ok", "model": self.engine.info.served_model_name})

    async def tokenize(self, req: TokenizeRequest) -> Tokens:
        """Raises BadRequest (a ValueError) for messages the template cannot render."""
        ids = await tokenize_off_loop(self, req, self.engine.info.max_model_len)
        out = Tokens(token_ids=ids, count=len(ids))
        if req.return_token_strs:
            out.token_strs = await asyncio.get_running_loop().run_in_executor(
                self.tokenizer_thread, self.engine.token_pieces, ids)
        return out

    async def detokenize(self, req: DetokenizeRequest) -> Detokenized:
        """The text of token IDs (in the tokeniser thread); BadRequest for an ID outside the
        vocabulary."""
        ids = req.token_ids
        vocab = self.engine.info.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise BadRequest(f"token ID {bad} is outside the vocabulary [0, {vocab}) of model "
                             f"{self.engine.info.served_model_name!r}")
        text = await asyncio.get_running_loop().run_in_executor(
            self.tokenizer_thread, self.engine.decode_text, ids)
        return Detokenized(text=text)

    # ---------------------------------------------------------------- stream transport

    async def serve(self, sock) -> StreamServer:
        """Serve the stream plane on a bound, listening socket."""
        loop = asyncio.get_running_loop()
        server = StreamServer(self)
        server.server = await loop.create_server(lambda: _FrontendLink(server), sock=sock)
        return server


async def _relayed(stream: WorkerStream) -> AsyncIterator[tuple[Frame, Any]]:
    """A peer's stream of a run as (kind, event) pairs; its failure an ERROR event."""
    try:
        async for ev in stream:
            kind = type(ev)
            yield (Frame.HEAD if kind is Head else Frame.DONE if kind is Done else Frame.STEP), ev
    except WorkerError as e:
        yield Frame.ERROR, EngineError(message=f"the worker that ran it failed: {e.message}",
                                       code=e.status)
    finally:
        await stream.aclose()


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
            # a request that ended in this turn has frames queued for the next one: send
            # them before closing, or the client reads "connection lost" for a finished answer
            link.writer.flush()
            link.transport.close()
            for task in list(link.tasks.values()):
                task.cancel()
        await self.plane.kept.close()
        await self.plane.peers.close()


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
_detokenize = msgspec.msgpack.Decoder(DetokenizeRequest)
_cancel = msgspec.msgpack.Decoder(CancelRequest)
_auth = msgspec.msgpack.Decoder(str)
#: frames answered by one call each: (the body's decoder, the connection's method)
# the calls besides generation: their decoder, and the plane's method that answers them
# (None: a cancel, which the connection answers itself)
_CALLS = {Frame.TOKENIZE: (_tokenize, "tokenize"), Frame.DETOKENIZE: (_detokenize, "detokenize"),
          Frame.CANCEL: (_cancel, None)}


def _same(given: str | None, token: str) -> bool:
    return given is not None and hmac.compare_digest(
        given.encode("utf-8", "surrogatepass"), token.encode("utf-8", "surrogatepass"))


class _FrontendLink(asyncio.Protocol):
    """One frontend's connection to this worker: a task per running request."""

    def __init__(self, server: StreamServer) -> None:
        self.server, self.plane = server, server.plane
        self.tasks: dict[int, asyncio.Task] = {}
        self.windows: dict[int, _Window] = {}
        self.reader = FrameReader()
        self._greeted = False
        self._authed = False
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
            if self.transport.is_closing():
                return
            try:
                self._on_frame(kind, sid, body)
            except Exception as e:  # one bad request never takes the connection down
                log.exception("stream-plane frame %s on stream %s failed", kind, sid)
                self._error(sid, 500, f"worker failed: {type(e).__name__}: {e}")

    def _refuse(self, message: str) -> None:
        log.warning("closing a stream-plane connection: %s", message)
        self._error(0, 401, message)
        self.writer.flush()
        self.transport.close()

    def _error(self, sid: int, status: int, message: str) -> None:
        self.writer.put(Frame.ERROR, sid, EngineError(
            message=message, type=error_body(status, message)["error"]["type"], code=status))

    def _on_frame(self, kind: int, sid: int, body: memoryview) -> None:
        token = self.plane.admin_token
        if kind == Frame.PING:
            self.writer.put(Frame.PONG, 0, None)
            return
        if kind == Frame.AUTH:
            try:
                given = _auth.decode(body)
            except (msgspec.DecodeError, ValueError):
                given = ""
            if token and not _same(given, token):
                self._refuse("the admin token sent on the stream plane is wrong")
            self._authed = True
            return
        if token and not self._authed:
            self._refuse("this worker requires its admin token on the stream plane "
                         "(start the frontend with the same --admin-token)")
            return
        if kind == Frame.GENERATE:
            try:
                req = check_request(_generate.decode(body))
            except (msgspec.DecodeError, ValueError, RecursionError) as e:
                self.plane.engine.series.requests["rejected"].inc()
                self._error(sid, 400, _decode_error(e))
                return
            if self.server.closing:  # nothing reached the engine: the frontend tries another
                self._error(sid, 503, "this worker is shutting down")
                return
            if sid in self.tasks:
                self._error(sid, 400, f"stream {sid} is already running on this connection")
                return
            self.windows[sid] = _Window()
            self.tasks[sid] = asyncio.ensure_future(
                self._generate(sid, req) if req.retain is None else self._follow_kept(sid, req))
        elif kind == Frame.CREDIT:
            window = self.windows.get(sid)
            if window is not None:
                try:
                    window.grant(_credit.decode(body))
                except (msgspec.DecodeError, ValueError, RecursionError) as e:
                    self._error(sid, 400, _decode_error(e))
        elif kind == Frame.CLOSE:
            task = self.tasks.get(sid)
            if task is not None:
                task.cancel()
        elif kind in _CALLS:
            decoder, method = _CALLS[kind]
            try:
                call = decoder.decode(body)
            except (msgspec.DecodeError, ValueError, RecursionError) as e:
                self._error(sid, 400, _decode_error(e))
                return
            asyncio.ensure_future(self._cancel(sid, call) if method is None
                                  else self._answer(sid, method, call))
        else:
            self._error(sid, 400, f"unknown frame kind {kind}")

    async def _answer(self, sid: int, method: str, req: TokenizeRequest | DetokenizeRequest
                      ) -> None:
        """Reply to a tokenize or detokenize call with what the plane's `method` answers."""
        try:
            self.writer.put(Frame.REPLY, sid, await getattr(self.plane, method)(req))
        except ValueError as e:
            self._error(sid, 400, _decode_error(e))
        except Exception as e:  # noqa: BLE001 - the caller hears of it
            self._error(sid, 500, f"{method} failed: {type(e).__name__}: {e}")

    async def _cancel(self, sid: int, req: CancelRequest) -> None:
        rid = req.request_id
        run = self.plane.kept.runs.get(rid)
        if req.owner is not None:  # relayed for a caller: only the owner of a kept run
            status = CANCEL_UNKNOWN if run is None or run.done else \
                CANCEL_OK if run.may_cancel(req.owner) else CANCEL_FORBIDDEN
            if status != CANCEL_OK:
                self.writer.put(Frame.REPLY, sid, Cancelled(status=status, request_id=rid))
                return
        if run is not None and run.relayed_from is not None and not run.done:
            # the run is another worker's: so is the abort (it checks the owner again)
            status = await self.plane.peers.cancel_as(run.relayed_from, rid, req.owner)
            self.writer.put(Frame.REPLY, sid, Cancelled(status=status, request_id=rid))
            return
        try:
            await self.plane.engine.abort(rid)
        except Exception as e:  # noqa: BLE001 - the caller hears of it
            self._error(sid, 500, f"abort failed: {type(e).__name__}: {e}")
            return
        self.writer.put(Frame.REPLY, sid, Cancelled(status=CANCEL_OK, request_id=rid))

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
                    await self._send(sid, window, kind, ev, counted=kind is Frame.STEP)
            except asyncio.CancelledError:
                opened.left()
                raise
            finally:
                await opened.aclose()
        except asyncio.CancelledError:
            pass  # CLOSE, or the frontend went away: the engine has aborted the request
        except Exception as e:  # e.g. an engine event that cannot be encoded: say so
            log.exception("request %s failed on the stream plane", req.request_id,
                          extra={"request_id": req.request_id,
                                 "trace_id": tracing.trace_id_of(req.traceparent)})
            self._error(sid, 500, f"worker failed: {type(e).__name__}: {e}")
        finally:
            del self.tasks[sid]
            del self.windows[sid]

    async def _send(self, sid: int, window: _Window, kind: Frame, ev: Any,
                    counted: bool) -> None:
        """One event of stream `sid`: a counted one waits for the stream's window, and
        every one waits while the frontend does not read this connection."""
        if counted:
            if window.credit <= 0:
                await window.opened()
            window.credit -= 1
        if self._paused:
            await self._writable()
        self.writer.put(kind, sid, ev)

    async def _stream_run(self, sid: int, window: _Window, run: KeptRun) -> None:
        """Every event of a kept run on stream `sid`, from its Head; raises the HttpError
        that refused it. While the stream's window is open and the frontend reads, the
        run's pump sends each event as it comes (Run.pour); this task waits only when one
        cannot go at once."""
        put = self.writer.put

        def send_now(item: tuple[Frame, Any]) -> bool:
            if window.credit <= 0 or self._paused:
                return False
            put(item[0], sid, item[1])
            window.credit -= 1
            return True

        i = 0
        while True:
            i = await run.pour(i, send_now)
            if i == run.produced:  # the run ended and all of it is sent
                if run.error is not None:
                    raise run.error
                return
            kind, ev = run.events[i - run.base]
            await self._send(sid, window, kind, ev, counted=True)
            i += 1

    async def _follow_kept(self, sid: int, req: GenerateRequest) -> None:
        """A request the worker keeps by its ID (rlfleet.worker.kept): start its run, or
        follow the one already kept, from its Head. Leaving (CLOSE, a lost connection)
        detaches from the run; it is not aborted while a retry may still come for it."""
        window = self.windows[sid]
        kept = self.plane.kept
        try:
            try:
                run = kept.start(req)
            except HttpError as e:
                self._error(sid, e.status, e.message)
                return
            kept.attach(run)
            try:
                await self._stream_run(sid, window, run)
            except HttpError as e:
                self._error(sid, e.status, e.message)
            finally:
                kept.detach(run)
        except asyncio.CancelledError:
            pass
        finally:
            del self.tasks[sid]
            del self.windows[sid]
