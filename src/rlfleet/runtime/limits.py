"""What one HTTP client may hold of a server: the size of a request body, the time its head
and body may take to arrive, how long an idle connection stays open, and how many
connections are open at once. Every rlfleet HTTP server (frontend, RL listener, a worker's
request plane) runs under these limits (`AppServer(..., limits=)`).

- A body larger than `max_body_bytes` is refused with 413 in the error shape, before it is
  read (by its Content-Length) or as soon as the bytes received pass the limit (chunked).
- A request whose head has not arrived `read_timeout` seconds after its connection opened
  (or after its first byte, on a kept-alive connection), or whose body has not arrived in
  `read_timeout` seconds, loses its connection: slow and idle sockets cannot pile up.
- An idle kept-alive connection is closed after `idle_timeout` seconds.
- At `max_connections` open connections (by default the descriptor limit less 256, kept
  for the process's own links), a new connection takes the place of the one idle longest
  (no request under way: a kept-alive or a silent socket), which is closed; when none is
  idle, the new one is answered 503 and closed. A flood of idle sockets cannot use up the
  process's file descriptors, and a good request on a new connection is still served.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import resource
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from rlfleet.runtime.flags import Flag, add_flags
from rlfleet.runtime.http import HttpError, json_response

log = logging.getLogger("rlfleet.limits")

MiB = 1 << 20


def raise_fd_limit() -> int:
    """Raise the soft file-descriptor limit to the hard one (a process that talks to, or
    simulates, a thousand workers needs thousands); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 65536
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return 65536 if soft == resource.RLIM_INFINITY else soft


def _default_max_connections() -> int:
    """What the process's file-descriptor limit allows, leaving room for everything else it
    opens (its links to workers, discovery, logs). The soft limit is raised to the hard one
    first."""
    return max(64, min(16384, raise_fd_limit() - 256))


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int | None = 32 * MiB  # None: no limit
    read_timeout: float | None = 30.0  # seconds for a request's head, and for its body
    idle_timeout: float = 30.0  # seconds a kept-alive connection may stay idle
    max_connections: int | None = None  # None: what the descriptor limit allows

    def connections(self) -> int:
        return self.max_connections or _default_max_connections()

    @classmethod
    def add_args(cls, p: argparse.ArgumentParser) -> None:
        d = cls()
        add_flags(p, (
            Flag("--max-body-bytes", d.max_body_bytes,
                 "largest request body accepted, in bytes; larger ones get 413 (default "
                 "%(default)s, 32 MiB; 0: no limit)"),
            Flag("--read-timeout", d.read_timeout,
                 "seconds a client has to send a request's head, and again its body; then its "
                 "connection is closed (default %(default)g; 0: no limit)"),
            Flag("--idle-timeout", d.idle_timeout,
                 "seconds an idle kept-alive connection stays open (default %(default)g)"),
            Flag("--max-connections", None,
                 "open connections accepted at once; beyond it a new connection is closed at "
                 "once (default: the file-descriptor limit less 256, at most 16384)", type=int),
        ))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerLimits:
        return cls(max_body_bytes=args.max_body_bytes or None,
                   read_timeout=args.read_timeout or None,
                   idle_timeout=args.idle_timeout,
                   max_connections=args.max_connections or None)


class BodyLimit:
    """ASGI middleware: refuse bodies over the limit (413) and bodies that take too long
    (408), whatever route reads them."""

    def __init__(self, app: Any, limits: ServerLimits) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, timeout = self.limits.max_body_bytes, self.limits.read_timeout
        if limit is not None:
            for name, value in scope["headers"]:
                if name == b"content-length":
                    try:
                        size = int(value)
                    except ValueError:
                        size = 0  # the HTTP parser refuses a malformed length itself
                    if size > limit:  # answered at once; the connection then closes
                        err = HttpError(413, _too_large(limit))
                        await json_response(err.body, 413, {"connection": "close"})(
                            scope, receive, send)
                        return
                    break
        received = 0
        complete = False

        async def guarded():
            nonlocal received, complete
            if complete:  # the body is in: what follows is the disconnect watch
                return await receive()
            try:
                message = await (asyncio.wait_for(receive(), timeout) if timeout else receive())
            except TimeoutError:
                raise HttpError(408, f"the request body did not arrive within {timeout:g}s"
                                ) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if limit is not None and received > limit:
                    raise HttpError(413, _too_large(limit))
                complete = not message.get("more_body", False)
            return message

        await self.app(scope, guarded, send)


def _too_large(limit: int) -> str:
    return (f"the request body is larger than this server accepts ({limit} bytes); send "
            "less per request (the operator sets --max-body-bytes)")


_FULL = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
         b"connection: close\r\nretry-after: 1\r\ncontent-length: %d\r\n\r\n%s")


def _full_response(cap: int) -> bytes:
    body = (b'{"error": {"message": "this server holds as many connections as it may (%d), '
            b'each with a request under way; retry shortly", "code": 503}}' % cap)
    return _FULL % (len(body), body)


def guarded_protocol(limits: ServerLimits) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with a deadline on each request head and a cap on open
    connections (the module doc)."""
    read_timeout, cap = limits.read_timeout, limits.connections()
    full = _full_response(cap)

    class GuardedHttpProtocol(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None
        _busy = False  # a request is under way (its head begun, its response not complete)
        _idle_since = 0.0

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._idle_since = self.loop.time()
            if len(self.connections) > cap and not self._shed():
                log.warning("%d open connections, each with a request under way: a new one "
                            "is answered 503", cap)
                transport.write(full)
                transport.close()
                return
            self._arm()

        def _shed(self) -> bool:
            """Close the connection idle longest to make room; whether there was one."""
            idle = [c for c in self.connections
                    if c is not self and not getattr(c, "_busy", True)
                    and not c.transport.is_closing()]
            if not idle:
                return False
            oldest = min(idle, key=lambda c: c._idle_since)
            log.info("at %d open connections: closing one idle for %.1f s to make room", cap,
                     self.loop.time() - oldest._idle_since)
            self.connections.discard(oldest)  # its place is this one's from now on
            oldest.transport.close()
            return True

        def _arm(self) -> None:
            self._disarm()
            if read_timeout:
                self._head_timer = self.loop.call_later(read_timeout, self._head_late)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def on_message_begin(self) -> None:
            self._busy = True
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            self._busy, self._idle_since = False, self.loop.time()
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedHttpProtocol
