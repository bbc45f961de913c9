"""Stream-plane framing, both ends: a frame is a 4-byte little-endian length of the
rest, a 1-byte kind (rlfleet.protocol.engine.Frame), a 4-byte little-endian stream
number and a msgpack body. Frames written during one event-loop turn leave in one write."""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

import msgspec

_HEADER = struct.Struct("<IBI")  # length of the rest, kind, stream number
_MAX_FRAME = 256 << 20
_msgpack = msgspec.msgpack.Encoder()


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


def split_address(address: str) -> tuple[str, int]:
    """"host:port" or "[v6]:port" → (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"bad stream-plane address {address!r}; expected host:port")
    return host.strip("[]"), int(port)
