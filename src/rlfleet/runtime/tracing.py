"""Traces (OpenTelemetry), off unless an OTLP endpoint is given: `--otlp-traces-endpoint URL`
(vLLM's flag of the same name on vLLM workers), else $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
else $OTEL_EXPORTER_OTLP_ENDPOINT. The protocol follows vLLM's rule:
$OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (or $OTEL_EXPORTER_OTLP_PROTOCOL) `grpc` (default) or
`http/protobuf`; a worker's spans and its engine's then go to the same collector.

The W3C context (`traceparent`) is carried: rollout client → frontend (HTTP header) →
worker (`GenerateRequest.traceparent` on the request plane) → engine (vLLM's
`trace_headers`), and coordinator → worker system server (HTTP header) through a policy
refresh. Every hop that traces starts its span under the caller's, and hands its own on.

Off, nothing is created: callers test `enabled()` (a global read) before doing any work,
and pass an incoming `traceparent` on untouched, so a worker's log lines still name the
caller's trace.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

log = logging.getLogger("rlfleet.tracing")

_tracer: Any = None  # the rlfleet tracer while tracing is on
_provider: Any = None


def enabled() -> bool:
    return _tracer is not None


def protocol() -> str:
    return (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")


def endpoint(flag: str | None = None) -> str | None:
    """The OTLP traces endpoint: the flag, else the environment; None: tracing stays off."""
    if flag:
        return flag
    if os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    base = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not base:
        return None
    # the general endpoint names the collector; over HTTP the traces path is added to it
    return base.rstrip("/") + "/v1/traces" if protocol() == "http/protobuf" else base


def add_tracing_args(p: argparse.ArgumentParser | Any) -> None:
    if "--otlp-traces-endpoint" not in getattr(p, "_option_string_actions", {}):
        p.add_argument("--otlp-traces-endpoint", default=None,
                       help="send OpenTelemetry traces here (OTLP; default: "
                            "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or $OTEL_EXPORTER_OTLP_ENDPOINT;"
                            " none: tracing off)")


def _exporter(url: str):
    proto = protocol()
    if proto == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=url, insecure=not url.startswith("https://"))
    if proto == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=url)
    raise ValueError(f"OTLP protocol {proto!r} is not supported; use grpc or http/protobuf")


def setup(service: str, url: str | None = None, exporter: Any = None) -> bool:
    """Turn tracing on for this process when there is an endpoint (`url`, or the
    environment) or an `exporter` (tests: the SDK's in-memory exporter, spans exported as
    they end). Returns whether tracing is on. Calling it again replaces the set-up."""
    global _tracer, _provider
    url = endpoint(url)
    if url is None and exporter is None:
        return False
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    shutdown()
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        provider.add_span_processor(BatchSpanProcessor(_exporter(url)))
        # vLLM reads the traces protocol from this variable only: the same rule for both
        os.environ.setdefault("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol())
    # spans that other libraries in this process make (vLLM's) join the same provider; the
    # API allows setting the global provider once
    if type(trace.get_tracer_provider()).__name__ == "ProxyTracerProvider":
        trace.set_tracer_provider(provider)
    _provider = provider
    _tracer = provider.get_tracer("rlfleet")
    atexit.register(shutdown)
    if url is not None:
        log.info("tracing on: spans of %s go to %s (%s)", service, url, protocol())
    return True


def shutdown() -> None:
    """Flush and stop (tracing is off afterwards)."""
    global _tracer, _provider
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        with contextlib.suppress(Exception):
            provider.shutdown()


def _parent(traceparent: str | None):
    """The context of a W3C traceparent (None or malformed: the current context)."""
    if not traceparent:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    ctx = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
    from opentelemetry import trace

    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def start_span(name: str, parent: str | None = None, kind: str = "internal",
               attributes: Mapping[str, Any] | None = None):
    """A span under `parent` (a traceparent; default: the current span). Only while
    enabled(); the caller ends it."""
    from opentelemetry.trace import SpanKind

    return _tracer.start_span(name, context=_parent(parent), kind=SpanKind[kind.upper()],
                              attributes={k: v for k, v in (attributes or {}).items()
                                          if v is not None})


@contextlib.contextmanager
def span(name: str, parent: str | None = None, kind: str = "internal",
         attributes: Mapping[str, Any] | None = None) -> Iterator[Any]:
    """A current span for the block (an exception marks it failed); None when tracing is
    off (for code off the hot path: a hot path tests enabled() itself)."""
    if _tracer is None:
        yield None
        return
    from opentelemetry import trace

    s = start_span(name, parent, kind, attributes)
    with trace.use_span(s, end_on_exit=True, record_exception=True, set_status_on_exception=True):
        yield s


@contextlib.contextmanager
def current(s: Any) -> Iterator[None]:
    """Make `s` the current span for the block (it is not ended here)."""
    if s is None:
        yield
        return
    from opentelemetry import trace

    with trace.use_span(s, end_on_exit=False):
        yield


def fail(s: Any, message: str) -> None:
    """Mark span `s` failed."""
    if s is not None:
        from opentelemetry.trace import Status, StatusCode

        s.set_status(Status(StatusCode.ERROR, message))


def traceparent(s: Any) -> str:
    """The W3C traceparent naming span `s` (what a callee starts its span under)."""
    c = s.get_span_context()
    return f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"


def outgoing(incoming: str | None = None) -> str | None:
    """The traceparent to hand on: the current span's while tracing, else `incoming`."""
    if _tracer is None:
        return incoming
    from opentelemetry import trace

    c = trace.get_current_span().get_span_context()
    if not c.is_valid:
        return incoming
    return f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"


def current_ids() -> tuple[str, str] | None:
    """(trace_id, span_id) of the current span, hex, or None."""
    from opentelemetry import trace

    c = trace.get_current_span().get_span_context()
    return (f"{c.trace_id:032x}", f"{c.span_id:016x}") if c.is_valid else None


def trace_id_of(traceparent: str | None) -> str | None:
    """The trace ID in a W3C traceparent (`00-<trace>-<span>-<flags>`), or None."""
    if traceparent and len(traceparent) >= 55 and traceparent[2] == "-":
        return traceparent[3:35]
    return None


class ServerSpans:
    """ASGI middleware: a server span for each HTTP request whose path `match`es, under
    the caller's `traceparent` header (the span is current while the route runs). Off, the
    request passes straight through."""

    def __init__(self, app: Any, match: Any = lambda path: True) -> None:
        self.app, self.match = app, match

    async def __call__(self, scope, receive, send) -> None:
        if _tracer is None or scope["type"] != "http" or not self.match(scope["path"]):
            await self.app(scope, receive, send)
            return
        parent = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"traceparent"),
                      None)
        status = 500

        async def send_and_note(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        with span(f"{scope['method']} {scope['path']}", parent, "server",
                  {"http.route": scope["path"]}) as s:
            await self.app(scope, receive, send_and_note)
            s.set_attribute("http.status_code", status)
            if status >= 500:
                fail(s, f"HTTP {status}")
