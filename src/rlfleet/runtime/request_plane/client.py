"""The frontend's side of the request plane: one persistent stream-plane connection per
worker (`WorkerLink`), every request a `WorkerStream` on it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec

from rlfleet.protocol import engine as wire
from rlfleet.protocol.engine import (
    Detokenized,
    Done,
    Frame,
    GenerateRequest,
    Head,
    Step,
    Tokens,
)
from rlfleet.runtime.http import HttpError
from rlfleet.runtime.request_plane.frames import FrameReader, FrameWriter, keep_alive, split_address

log = logging.getLogger("rlfleet.request_plane")


class WorkerError(HttpError):
    """A worker could not serve a request. `status` is the HTTP status to report;
    `retryable` is true when the request never reached the engine; `broken` when the
    worker itself looks unhealthy (it is then avoided for a while)."""

    def __init__(self, message: str, status: int = 502, retryable: bool = False,
                 body: dict[str, Any] | None = None, broken: bool = False,
                 type_: str | None = None, stalled: bool = False) -> None:
        super().__init__(status, message, type_, body=body)
        self.retryable = retryable
        self.broken = broken or retryable or stalled
        # the worker answered nothing at all (not even a PING) for the stall deadline
        self.stalled = stalled


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
        if self._taken >= wire.WINDOW // 2 and not self.ended and self.link.open:
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

    async def first(self) -> None:
        """Until the stream's first event is there (not taken); raises the WorkerError
        that ended it before any."""
        q = self._queue
        while not q:
            self._waiter = self.link.loop.create_future()
            await self._waiter
        if q[0] is _END and self._error is not None:
            raise self._error

    def __aiter__(self) -> WorkerStream:
        return self

    async def __anext__(self) -> wire.Event:
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
_error = msgspec.msgpack.Decoder(wire.EngineError)


#: seconds a worker has to say whether it keeps a run under a request ID (an attach-only
#: request, StreamClient.attach) before it counts as keeping none
ATTACH_DEADLINE = 1.5

#: seconds a worker with requests in flight may answer nothing at all, not even a PING,
#: before it counts as stalled (python -m rlfleet.frontend --stall-timeout)
STALL_TIMEOUT = 3.0


@dataclass(frozen=True)
class Heartbeat:
    """The stream plane's heartbeat on one link: while requests are in flight, a worker
    quiet for a third of `timeout` is PINGed (again every third of it), and one that has
    answered nothing at all for `timeout` seconds (stopped, hung, cut off) is stalled. The
    worker answers a PING on its event loop, so a busy engine does not look silent."""

    timeout: float

    @property
    def interval(self) -> float:
        """How often the link looks (a stall is noticed within timeout + interval)."""
        return max(0.05, self.timeout / 8)

    def due(self, now: float, heard: float, pinged: float) -> str | None:
        """"stalled", "ping" or None, for a link last heard from at `heard` and last
        PINGed at `pinged` (monotonic seconds)."""
        quiet = now - heard
        if quiet > self.timeout:
            return "stalled"
        third = self.timeout / 3
        if quiet > third and now - pinged > third:
            return "ping"
        return None


class WorkerLink(asyncio.Protocol):
    """The frontend's persistent stream-plane connection to one worker."""

    def __init__(self, address: str, request_timeout: float, stall_timeout: float | None = None,
                 admin_token: str | None = None) -> None:
        self.address = address
        self.request_timeout = request_timeout
        self.stall_timeout = stall_timeout
        self.heartbeat = Heartbeat(stall_timeout) if stall_timeout else None
        self.admin_token = admin_token
        self.heard = time.monotonic()  # when the worker last sent anything
        self._pinged = 0.0
        self._refused: str | None = None  # the worker's reason for closing the link
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
        transport.write(wire.MAGIC)
        if self.admin_token:
            self.writer.put(Frame.AUTH, 0, self.admin_token)
        keep_alive(transport)
        self.open = True
        self._sweeper = asyncio.ensure_future(self._sweep())

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        if self._sweeper is not None:
            self._sweeper.cancel()
        why = f" ({exc!r})" if exc is not None else ""
        for item in self.streams.values():
            if self._refused:
                err = WorkerError(f"worker at {self.address} refused this frontend: "
                                  f"{self._refused}", 502, broken=True)
            else:
                err = WorkerError(f"worker at {self.address} failed mid-request: the "
                                  f"connection was lost{why}", 502, broken=True)
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
        self.heard = now
        streams = self.streams
        for kind, sid, body in frames:
            item = streams.get(sid)
            if item is None:
                if sid == 0 and kind == Frame.ERROR:  # about the link itself
                    with contextlib.suppress(msgspec.DecodeError, ValueError):
                        self._refused = _error.decode(body).message
                continue  # a PONG, or a stream we closed already
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
                    _fail(item, WorkerError(e.message, e.code, type_=e.type,
                                            retryable=e.code == 503))
                    continue
                elif kind == Frame.REPLY:
                    del streams[sid]
                    if not item.future.done():  # type: ignore[union-attr]
                        item.future.set_result(item.decoder.decode(body))  # type: ignore[union-attr]
                    continue
                else:
                    raise ValueError(f"unknown frame kind {kind}")
            except (msgspec.DecodeError, ValueError, TypeError, AttributeError) as e:
                log.error("worker at %s sent an event this frontend cannot read: %s",
                          self.address, e)
                streams.pop(sid, None)
                _fail(item, WorkerError(f"worker at {self.address} sent a malformed event: {e}",
                                        502))
                continue
            item.last = now  # type: ignore[union-attr]

    # ---------------------------------------------------------------- streams

    def _sid(self) -> int:
        self._next = (self._next + 1) & 0xFFFFFFFF
        while self._next in self.streams or self._next == 0:
            self._next = (self._next + 1) & 0xFFFFFFFF
        return self._next

    def _quiet_until_now(self) -> None:
        """Silence while nothing was asked of the worker is no stall."""
        if not self.streams:
            self.heard = time.monotonic()

    def generate(self, req: GenerateRequest, paced: bool = False) -> WorkerStream:
        self._quiet_until_now()
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
        self._quiet_until_now()
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
        """End streams the worker has sent nothing on for `request_timeout` seconds; and
        while anything is outstanding, PING a worker that has been quiet for a third of
        `stall_timeout`: one that answers nothing at all for `stall_timeout` (stopped,
        hung, cut off) fails every stream as stalled and loses the link."""
        timeout, beat = self.request_timeout, self.heartbeat
        interval = min(1.0, max(0.05, timeout / 8), *((beat.interval,) if beat else ()))
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            if beat is not None and self.streams:
                due = beat.due(now, self.heard, self._pinged)
                if due == "stalled":
                    self._stalled(now - self.heard)
                    return
                if due == "ping" and self.open:
                    self._pinged = now
                    self.writer.put(Frame.PING, 0, None)
            stale = [s for s in self.streams.values()
                     if isinstance(s, WorkerStream) and now - s.last > timeout]
            for s in stale:
                self.streams.pop(s.sid, None)
                if self.open:
                    self.writer.put(Frame.CLOSE, s.sid, None)
                s.ended = True
                s._fail(WorkerError(f"worker at {self.address} timed out: no event for "
                                    f"{timeout:g} s", 504, broken=True))

    def _stalled(self, quiet: float) -> None:
        log.warning("worker at %s stalled: nothing from it for %.1f s; failing its %d "
                    "requests", self.address, quiet, len(self.streams))
        err = WorkerError(f"worker at {self.address} stalled: it answered nothing for "
                          f"{quiet:.0f} s (the stall deadline is {self.stall_timeout:g} s)",
                          504, stalled=True)
        streams, self.streams = list(self.streams.values()), {}
        for item in streams:
            if isinstance(item, WorkerStream):
                item.ended = True
                item._fail(err)
            elif not item.future.done():
                item.future.set_exception(err)
        self.open = False
        self.transport.abort()

    def close(self) -> None:
        self.transport.close()


_tokens = msgspec.msgpack.Decoder(Tokens)
_detokenized = msgspec.msgpack.Decoder(Detokenized)
_cancelled = msgspec.msgpack.Decoder(wire.Cancelled)


class StreamClient:
    """The frontend's side of the request plane: one stream-plane connection per worker,
    opened on first use and kept."""

    def __init__(self, connect_timeout: float = 5.0, request_timeout: float = 600.0,
                 stall_timeout: float | None = STALL_TIMEOUT, admin_token: str | None = None
                 ) -> None:
        self.connect_timeout = connect_timeout
        self.request_timeout = request_timeout
        self.stall_timeout = stall_timeout
        self.admin_token = admin_token
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
                lambda: WorkerLink(address, self.request_timeout, self.stall_timeout,
                                   self.admin_token), host, port),
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

    async def attach(self, address: str, req: GenerateRequest, deadline: float,
                     paced: bool = False) -> WorkerStream | None:
        """An attach-only request (`req.attach_only`): the stream of the run the worker
        keeps under the request's ID, its Head there to read; None when the worker keeps
        none, is unreachable, or answers nothing within `deadline` seconds. Raises
        WorkerError 409 when the worker keeps that ID for another request."""
        connecting = asyncio.ensure_future(self.link(address))
        connecting.add_done_callback(lambda t: t.cancelled() or t.exception())
        stream = None
        try:
            async with asyncio.timeout(deadline):
                # a connect outlives the deadline: it is the link every request shares
                stream = (await asyncio.shield(connecting)).generate(req, paced)
                await stream.first()
            return stream
        except WorkerError as e:
            if e.status == 409:
                raise
        except TimeoutError:
            log.warning("worker at %s did not say within %g s whether it keeps request %s; "
                        "taken as not", address, deadline, req.request_id)
        except BaseException:
            if stream is not None:
                await stream.aclose()
            raise
        if stream is not None:
            await stream.aclose()
        return None

    async def cancel(self, address: str, request_id: str) -> bool:
        """The engine's abort: the request ends now with its partial output."""
        return await self.cancel_as(address, request_id) == wire.CANCEL_OK

    async def cancel_as(self, address: str, request_id: str, owner: str | None = None) -> str:
        """The engine's abort, relayed for a caller who presented the cancel token whose
        SHA-256 (hex) is `owner` (None: vouched for by this frontend); the worker's answer
        (CANCEL_OK, CANCEL_FORBIDDEN, CANCEL_UNKNOWN), CANCEL_UNKNOWN when unreachable."""
        try:
            link = await self.link(address)
            out = await link.call(Frame.CANCEL, wire.CancelRequest(request_id=request_id, owner=owner),
                                  _cancelled, 10.0)
        except WorkerError:
            return wire.CANCEL_UNKNOWN
        return out.status

    async def tokenize(self, address: str, req: wire.TokenizeRequest) -> Tokens:
        link = await self.link(address)
        return await link.call(Frame.TOKENIZE, req, _tokens, 30.0)

    async def detokenize(self, address: str, req: wire.DetokenizeRequest) -> Detokenized:
        link = await self.link(address)
        return await link.call(Frame.DETOKENIZE, req, _detokenized, 30.0)

    async def close(self) -> None:
        for link in self._links.values():
            if link.open:
                link.close()
        self._links.clear()


def _fail(item, err: WorkerError) -> None:
    """End a stream, or a one-reply call, with `err`."""
    if isinstance(item, WorkerStream):
        item.ended = True
        item._fail(err)
    elif not item.future.done():
        item.future.set_exception(err)
