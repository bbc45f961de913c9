"""Binding a listening socket and serving an ASGI app on it, under the server limits
(`rlfleet.runtime.limits`): every rlfleet HTTP server (frontend, RL listener, a worker's
request plane and system server) runs as an `AppServer`, several in one process. One
`AppServer` may also serve several apps, each on its own socket (`AppServer.shared`): one
uvicorn server, so one housekeeping tick, however many listeners (a worker's request plane
and system server; the N workers a replicated mocker simulates)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
from collections.abc import Sequence
from typing import Any

import uvicorn

from rlfleet.runtime.limits import BodyLimit, ServerLimits, guarded_protocol

#: the youngest generation's threshold while serving (Python's default: 700 allocations)
SERVING_GEN0_THRESHOLD = 10_000


def freeze_heap() -> None:
    """Once a process has started and is about to serve: move everything it holds now
    (modules, the engine, tables) out of the garbage collector's sight (gc.freeze, as vLLM's
    own API server does after its start). A full collection then walks only what serving
    made, not the whole start-up heap: in a frontend under load those collections took
    about a quarter of its time (a vLLM worker's heap, torch included, is larger still).

    And collect the youngest generation after SERVING_GEN0_THRESHOLD allocations instead
    of 700: a streamed token allocates a few containers on each side of the stream plane,
    and runs kept for retries (X-Request-Id) hold their events for minutes, so at the
    default a worker and a frontend collected every few steps and moved the kept events
    into the oldest generation fast enough for a full collection every few seconds (a
    quarter of the stream plane's CPU per token); most of what a request allocates is
    freed by reference counting long before 10,000 allocations, and the older generations
    keep Python's thresholds."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(SERVING_GEN0_THRESHOLD, gen1, gen2)


def bind_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A listening TCP socket; port 0 picks a free one (read it back with getsockname).
    Connections accepted on it send small writes at once (TCP_NODELAY): a response head
    and its body in two writes must not wait for the client's delayed ACK (~40 ms).
    `reuse_port`: SO_REUSEPORT, so that several processes listen on the port and the
    kernel spreads connections over them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(4096)
    sock.setblocking(False)
    return sock


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signal handling to the process that runs it."""

    def capture_signals(self):  # type: ignore[override]
        return contextlib.nullcontext()


class _ByPort:
    """ASGI: the app whose socket the connection came in on (its local port)."""

    def __init__(self, apps: dict[int, Any]) -> None:
        self.apps = apps

    async def __call__(self, scope, receive, send) -> None:
        server = scope.get("server")
        app = self.apps.get(server[1]) if server else None
        if app is None:  # not one of ours (uvicorn always sets the local address)
            raise RuntimeError(f"no app listens on {server!r}")
        await app(scope, receive, send)


class AppServer:
    """One ASGI app on one bound socket (or, built by `shared`, one app per socket), started
    and stopped as an asyncio task."""

    def __init__(self, app: Any, sock: socket.socket, log_level: str = "warning",
                 limits: ServerLimits | None = None,
                 more: Sequence[tuple[Any, socket.socket]] = ()) -> None:
        limits = limits or ServerLimits()
        self.sock = sock
        host, port = sock.getsockname()[:2]
        self.host, self.port = host, port
        self.socks = [sock, *(s for _, s in more)]
        if more:
            apps: dict[int, Any] = {}
            for a, s in [(app, sock), *more]:
                p = s.getsockname()[1]
                if p in apps:
                    raise ValueError(f"two listeners of one server on port {p}: give each its "
                                     "own port")
                apps[p] = BodyLimit(a, limits)
            served: Any = _ByPort(apps)
        else:
            served = BodyLimit(app, limits)
        self._server = _Server(uvicorn.Config(served, log_level=log_level,
                                              lifespan="off", access_log=False,
                                              log_config=None,  # its lines reach ours
                                              timeout_keep_alive=limits.idle_timeout,
                                              timeout_graceful_shutdown=5,
                                              http=guarded_protocol(limits)))
        self._task: asyncio.Task | None = None

    @classmethod
    def shared(cls, pairs: Sequence[tuple[Any, socket.socket]], log_level: str = "warning",
               limits: ServerLimits | None = None) -> AppServer:
        """One server for several (app, bound socket) pairs, each app answering on its own
        socket (ports must differ)."""
        if not pairs:
            raise ValueError("a shared server needs at least one (app, socket)")
        (app, sock), *more = pairs
        return cls(app, sock, log_level, limits, more)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=self.socks))
        while not self._server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
