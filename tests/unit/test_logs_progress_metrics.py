"""Logs (text and json), progress lines, and the metrics collectors, without a fleet (the
fleet-level checks are in tests/integration/test_observability.py)."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import threading
import time
from types import SimpleNamespace

import pytest

from rlfleet.frontend.app import Accounting
from rlfleet.frontend.status import render_page, render_text
from rlfleet.protocol.identity import PolicyIdentity
from rlfleet.runtime import metrics
from rlfleet.runtime.logs import (
    LIBRARY_LOGGERS,
    announce_ready,
    chosen_level,
    default_format,
    parse_ready,
    relay_lines,
    requested_format,
    setup_logging,
)
from rlfleet.runtime.progress import Progress


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def test_json_lines_carry_the_request_fields(restore_logging):
    out = io.StringIO()
    setup_logging("debug", "json", stream=out)
    log = logging.getLogger("rlfleet.test")
    log.debug("request %s ended", "r-1", extra={"request_id": "r-1", "trace_id": "ab" * 16,
                                                "sample_id": "s-9"})
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed", extra={"request_id": "r-2"})
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert lines[0]["message"] == "request r-1 ended" and lines[0]["level"] == "DEBUG"
    assert (lines[0]["request_id"], lines[0]["trace_id"], lines[0]["sample_id"]) == \
        ("r-1", "ab" * 16, "s-9")
    assert lines[0]["target"] == "rlfleet.test" and lines[0]["time"].endswith("Z")
    assert lines[1]["request_id"] == "r-2" and "ValueError: boom" in lines[1]["exc_info"]


def test_text_lines_show_the_fields(restore_logging):
    out = io.StringIO()
    setup_logging("info", "text", stream=out)
    logging.getLogger("rlfleet.test").info("hello", extra={"request_id": "r-1"})
    logging.getLogger("rlfleet.test").debug("not shown at info")
    text = out.getvalue()
    assert "INFO rlfleet.test: hello request_id=r-1" in text and "not shown" not in text


def test_format_from_flag_and_environment(monkeypatch):
    monkeypatch.delenv("DYN_LOGGING_JSONL", raising=False)
    assert default_format() == "text"
    monkeypatch.setenv("DYN_LOGGING_JSONL", "1")
    assert default_format() == "json"
    assert requested_format(["--model", "x", "--log-format", "text"]) == "text"
    assert requested_format(["--model", "x"]) == "json"
    with pytest.raises(ValueError, match="log format"):
        setup_logging("info", "yaml")


def test_progress_reports_bytes_and_rate(caplog):
    caplog.set_level(logging.INFO, "rlfleet.progress")
    with Progress("staging v1", 4 << 20, every=0) as p:
        p.add(1 << 20)
        p.add(3 << 20)
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs[0] == "staging v1 (4.0 MiB) ..."
    assert "1.0 MiB of 4.0 MiB (25%)" in msgs[1] and "/s" in msgs[1]
    assert msgs[-1].startswith("staging v1 done in ") and "4.0 MiB at" in msgs[-1]
    assert [r.progress for r in caplog.records] == ["start", "running", "running", "done"]
    caplog.clear()
    with pytest.raises(OSError), Progress("publishing v2", 10, every=60) as p:
        p.add(4)
        raise OSError("disk full")
    assert caplog.records[-1].levelname == "WARNING"
    assert "publishing v2 failed after" in caplog.records[-1].getMessage()
    assert "disk full" in caplog.records[-1].getMessage()


def test_progress_heartbeat_for_silent_work(caplog):
    caplog.set_level(logging.INFO, "rlfleet.progress")
    p = Progress("loading m into vLLM", 10, every=0.01, heartbeat=True)
    deadline = time.monotonic() + 10
    while not any("still running" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, "no heartbeat line"
        time.sleep(0.01)
    p.finish()
    n = len(caplog.records)
    time.sleep(0.05)
    assert len(caplog.records) == n  # the heartbeat stops with the work
    assert caplog.records[-1].progress == "done"


def _sample(registry, name, **labels):
    return registry.get_sample_value(name, labels)


class Pool:
    workers: dict


def test_fleet_gated_follows_the_pools_workers():
    pool = Pool()
    pool.workers = {
        1: SimpleNamespace(model="m-obs", entry={}),
        2: SimpleNamespace(model="m-obs", entry={"gated": True})}
    metrics.FLEET.watch(pool)
    R = metrics.FRONTEND
    assert _sample(R, "rlfleet_frontend_workers", model="m-obs") == 2
    assert _sample(R, "rlfleet_frontend_gated_workers", model="m-obs") == 1
    assert _sample(R, "rlfleet_fleet_gated", model="m-obs") == 0
    pool.workers[1].entry = {"gated": True}
    assert _sample(R, "rlfleet_fleet_gated", model="m-obs") == 1
    del pool  # a frontend that went away stops being counted
    import gc

    gc.collect()
    assert _sample(R, "rlfleet_frontend_workers", model="m-obs") is None


def test_worker_policy_info_and_latency_buckets():
    ident = [PolicyIdentity(version="v7", digest="blake3:ab")]
    gated = [False]
    key = metrics.WORKER_STATE.add("m-info", lambda: ident[0], lambda: gated[0])
    try:
        R = metrics.WORKER
        assert _sample(R, "rlfleet_worker_policy_info", model="m-info", version="v7",
                       digest="blake3:ab") == 1
        assert _sample(R, "rlfleet_worker_gated", model="m-info") == 0
        gated[0] = True
        ident[0] = PolicyIdentity(version="v8", digest="blake3:ab")
        assert _sample(R, "rlfleet_worker_gated", model="m-info") == 1
        assert _sample(R, "rlfleet_worker_policy_info", model="m-info", version="v8",
                       digest="blake3:ab") == 1
    finally:
        metrics.WORKER_STATE.remove(key)
    assert _sample(metrics.WORKER, "rlfleet_worker_gated", model="m-info") is None
    # an RL generation takes minutes: end-to-end latency is bucketed up to hours
    assert max(metrics.LATENCY_BUCKETS) >= 3600
    series = metrics.WorkerSeries("m-buckets")
    series.seconds.observe(1800)
    assert _sample(metrics.WORKER, "rlfleet_worker_request_seconds_bucket", model="m-buckets",
                   le="3600.0") == 1
    assert _sample(metrics.WORKER, "rlfleet_worker_request_seconds_bucket", model="m-buckets",
                   le="1200.0") == 0


def test_status_renderings_escape_and_show_the_fleet():
    snap = {"namespace": "ns", "time": 0, "journal": None, "error": None,
            "models": [{"model": "m", "workers": 1, "gated": 1, "gate": "gated",
                        "reasons": ["policy refresh to v2"]}],
            "workers": [{"instance_id": 5, "model": "m", "address": "http://h:1",
                         "system_url": "http://h:2", "gated": True,
                         "gate_reason": "</script><b>x", "weight_version": "v1",
                         "weight_digest": "blake3:00", "running": 3, "tokens_per_s": 12.5,
                         "error": None}],
            "refreshes": [{"id": 1, "target_version": "v2", "decision": "held",
                           "reason": "r", "steps": [{"name": "apply", "seconds": 1.5}]}]}
    page = render_page(snap)
    assert "</script><b>" not in page and "<\\/script><b>x" in page
    text = render_text(snap)
    assert "model m: 1 worker(s), gated: policy refresh to v2" in text
    assert "v1" in text and "gated" in text and "12.5" in text and "apply=1.50s" in text


def test_tracing_is_on_only_with_an_endpoint(monkeypatch):
    from rlfleet.runtime import tracing

    for var in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        monkeypatch.delenv(var, raising=False)
    assert tracing.endpoint() is None and tracing.setup("t") is False
    assert not tracing.enabled() and tracing.outgoing("00-x") == "00-x"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318/")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    assert tracing.endpoint() == "http://127.0.0.1:4318/v1/traces"
    assert tracing.endpoint("http://collector:4317") == "http://collector:4317"
    try:
        assert tracing.setup("t") is True and tracing.enabled()  # (no span: nothing sent)
    finally:
        tracing.shutdown()
    assert not tracing.enabled()


def test_spans_hand_on_their_context():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from rlfleet.runtime import tracing

    exp = InMemorySpanExporter()
    tracing.setup("t", exporter=exp)
    try:
        parent = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
        with tracing.span("outer", parent) as s:
            tp = tracing.outgoing()
            assert tp == tracing.traceparent(s)
            assert tracing.trace_id_of(tp) == "ab" * 16
        (done,) = exp.get_finished_spans()
        assert done.parent.span_id == int("cd" * 8, 16)
    finally:
        tracing.shutdown()


@pytest.fixture
def restore_library_levels(restore_logging, monkeypatch):
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    monkeypatch.delenv("RLFLEET_LOG_LEVEL", raising=False)
    levels = {n: logging.getLogger(n).level for n in LIBRARY_LOGGERS}
    yield
    for n, level in levels.items():
        logging.getLogger(n).setLevel(level)


def test_library_loggers_show_warnings_only_unless_debug(restore_library_levels):
    out = io.StringIO()
    setup_logging("info", "text", stream=out)
    logging.getLogger("httpx").info('HTTP Request: POST http://w/v1/completions "200 OK"')
    logging.getLogger("uvicorn.access").info("GET /health 200")
    logging.getLogger("vllm.engine").info("engine started")
    logging.getLogger("httpx").warning("connection reset")
    logging.getLogger("rlfleet.test").info("ours")
    assert out.getvalue().count("\n") == 2
    assert "connection reset" in out.getvalue() and "ours" in out.getvalue()
    out = io.StringIO()
    setup_logging("debug", "text", stream=out)
    logging.getLogger("httpx").info("HTTP Request: GET http://w/health")
    logging.getLogger("vllm.engine").debug("step")
    assert "HTTP Request" in out.getvalue() and "step" in out.getvalue()


def test_the_level_is_the_flag_else_the_environment_else_the_commands_default(monkeypatch):
    monkeypatch.delenv("RLFLEET_LOG_LEVEL", raising=False)
    assert chosen_level(None) == logging.INFO
    assert chosen_level(None, "warning") == logging.WARNING  # `rlfleet demo`
    monkeypatch.setenv("RLFLEET_LOG_LEVEL", "debug")
    assert chosen_level(None, "warning") == logging.DEBUG
    assert chosen_level("error", "warning") == logging.ERROR
    with pytest.raises(ValueError, match="log level"):
        chosen_level("loud")


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_the_ready_line_in_either_format_is_found_with_its_fields(fmt):
    out = io.StringIO()
    fields = {"instance_id": 7, "url": "http://h:1", "system_url": None, "model": "m"}
    announce_ready("worker", fields, fmt, stream=out)
    line = out.getvalue()
    assert line.endswith("\n") and line.count("\n") == 1
    if fmt == "json":
        record = json.loads(line)
        assert record["target"] == "rlfleet.ready" and record["ready"] == "RLFLEET_WORKER_READY"
        assert record["message"] == "RLFLEET_WORKER_READY instance_id=7 url=http://h:1 " \
                                    "system_url= model=m"
    else:
        assert line.startswith("RLFLEET_WORKER_READY instance_id=7 ")
    assert parse_ready(line) == {"instance_id": "7", "url": "http://h:1", "system_url": "",
                                 "model": "m"}
    assert parse_ready(line, "RLFLEET_FRONTEND") is None


def test_other_lines_are_not_ready_lines():
    for line in ("", "RLFLEET_WORKER starting", "worker RLFLEET_WORKER_READY url=x",
                 '{"message": "hello"}', '{"message": 3}', "{broken", "[1, 2]"):
        assert parse_ready(line) is None, line
    with pytest.raises(ValueError, match="names of a log record"):
        announce_ready("worker", {"module": "x"}, "json", stream=io.StringIO())


def test_plain_lines_on_a_relayed_descriptor_become_json_records(tmp_path):
    """What a PlainLineRelay's process does (relay_lines), here in a thread."""
    path = tmp_path / "out.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    read_end, write_end = os.pipe()
    relay = threading.Thread(target=relay_lines, args=(read_end, fd, "stderr", logging.WARNING))
    relay.start()
    try:
        os.write(write_end, b'a plain line\n{"level": "INFO", "message": "already json"}\n\n')
        os.write(write_end, b"{not json\nTraceback (most recent call last):\n  File \"x\"\n"
                 b"no newline")
        os.close(write_end)
        relay.join(5)
    finally:
        os.close(fd)
        os.close(read_end)
    records = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["message"] for r in records] == [
        "a plain line", "already json", "{not json", "Traceback (most recent call last):",
        '  File "x"', "no newline"]
    assert records[1] == {"level": "INFO", "message": "already json"}  # passed as it was
    assert all(r["target"] == "stderr" and r["level"] == "WARNING"
               for r in records if r is not records[1])


@pytest.mark.parametrize("streamed", [False, True])
def test_a_request_is_accounted_before_its_last_byte_leaves(streamed):
    """A request leaves the in-flight gauge and is counted before the response's last
    message reaches the server: a client holding the whole response (and scraping another
    process next) finds it counted and out of flight; a request that breaks before its
    last byte is accounted when it ends."""
    route = "/v1/completions"
    gauge = metrics.FRONTEND_INFLIGHT.labels(route)
    count = metrics.FRONTEND_REQUESTS.labels("", route, "200")
    base = (gauge._value.get(), count._value.get())
    seen = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if streamed:
            await send({"type": "http.response.body", "body": b"a", "more_body": True})
        await send({"type": "http.response.body", "body": b"b"})

    async def failing(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("broken mid-response")

    async def send(message):
        seen.append((gauge._value.get() - base[0], count._value.get() - base[1]))

    scope = {"type": "http", "path": route, "headers": [], "method": "POST"}
    asyncio.run(Accounting(app)(dict(scope), None, send))
    # in flight and not counted at the start (and each chunk); done for the last message
    assert seen == [(1, 0)] + [(1, 0)] * streamed + [(0, 1)]
    with pytest.raises(RuntimeError):
        asyncio.run(Accounting(failing)(dict(scope), None, send))
    assert (gauge._value.get(), count._value.get()) == (base[0], base[1] + 2)
