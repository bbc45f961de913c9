"""The request plane: the frontend's client and the frames both sides speak (the worker's
side, one core and two transports, is rlfleet.worker.stream_server).

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
- heartbeats (`Heartbeat`): while requests are in flight, a worker that answers nothing,
  not even a PING, for `stall_timeout` seconds (default STALL_TIMEOUT, 3 s: a stopped or
  hung process, a cut link) ends every stream on it at once as stalled (504), so that the
  frontend fails them over or fails them in seconds, and its link is dropped;
- back-pressure, per stream and per connection: a worker sends at most WINDOW events of
  a stream that the frontend has not taken yet (CREDIT frames move the window), and stops
  altogether while the frontend does not read its connection. The worker then stops
  pulling from the engine for that request (vLLM merges the deltas it holds; the mocker
  stops generating): a slow caller holds back its own request, not the frontend's memory.
"""

from rlfleet.runtime.request_plane.client import (
    ATTACH_DEADLINE,
    STALL_TIMEOUT,
    Heartbeat,
    StreamClient,
    WorkerError,
    WorkerLink,
    WorkerStream,
)
from rlfleet.runtime.request_plane.frames import FrameReader, FrameWriter, split_address

__all__ = ["ATTACH_DEADLINE", "STALL_TIMEOUT", "FrameReader", "FrameWriter", "Heartbeat",
           "StreamClient", "WorkerError", "WorkerLink", "WorkerStream", "split_address"]
