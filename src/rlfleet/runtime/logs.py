"""Logging for every rlfleet process (frontend, workers, the `rlfleet` command): one set-up,
two formats.

- text (default): `time LEVEL logger: message key=value ...`: the structured fields a line
  was logged with (`extra=`: request_id, sample_id, attempt, trace_id, ...) follow the
  message, so a line about a request names it;
- json (`--log-format json`, or `DYN_LOGGING_JSONL=1` as Dynamo reads it): one JSON object
  per line on stderr: time, level, target (the logger), message, the same fields, and
  `exc_info` for a traceback.

While tracing is on (rlfleet.runtime.tracing), a line logged inside a span also carries
`trace_id` and `span_id`. Lines about single requests are logged at DEBUG. In json format
vLLM's own lines go through the same handler (vLLM is told not to configure logging; its
level is still $VLLM_LOGGING_LEVEL, default INFO), and so do uvicorn's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from rlfleet.runtime import tracing

FORMATS = ("text", "json")

# attributes every LogRecord has: anything else on a record came from `extra=`
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message", "asctime", "taskName", "vllm_process_name"}


def _truthy(v: str | None) -> bool:
    return (v or "").strip().lower() in ("1", "true", "yes", "on")


def default_format() -> str:
    return "json" if _truthy(os.environ.get("DYN_LOGGING_JSONL")) else "text"


def add_log_args(p: argparse.ArgumentParser | Any, *, level: bool = True) -> None:
    """--log-format (and --log-level unless `level` is false or the parser has one)."""
    have = getattr(p, "_option_string_actions", {})
    if level and "--log-level" not in have:
        p.add_argument("--log-level", default=os.environ.get("RLFLEET_LOG_LEVEL", "info"),
                       help="debug, info, warning, error (default: $RLFLEET_LOG_LEVEL, else info)")
    if "--log-format" not in have:
        p.add_argument("--log-format", choices=FORMATS, default=default_format(),
                       help="text, or json: one JSON object per line (default: json when "
                            "$DYN_LOGGING_JSONL is set, else text)")


def requested_format(argv: Sequence[str]) -> str:
    """The --log-format an argument list asks for, read before the full parser runs (the
    engine's logging must be decided before vLLM is imported)."""
    p = argparse.ArgumentParser(add_help=False)
    add_log_args(p, level=False)
    known, _ = p.parse_known_args(list(argv))
    return known.log_format


def extras(record: logging.LogRecord) -> dict[str, Any]:
    """The structured fields a record was logged with."""
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: message key=value ...`."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = extras(record)
        if not fields:
            return line
        tail = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
        head, sep, rest = line.partition("\n")  # a traceback stays below the fields
        return f"{head} {tail}{sep}{rest}" if tail else line


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, target, message, the
    record's fields, and exc_info (the traceback as text) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "target": record.name,
            "message": record.getMessage(),
        }
        for k, v in extras(record).items():
            out.setdefault(k, v)
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc_info"] = record.exc_text
        if record.stack_info:
            out["stack_info"] = record.stack_info
        return json.dumps(out, default=str, ensure_ascii=False)


class _TraceFields(logging.Filter):
    """Adds trace_id and span_id of the current span to a record that has none (only
    while tracing is on: otherwise there is no span to name)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if tracing.enabled() and getattr(record, "trace_id", None) is None:
            ids = tracing.current_ids()
            if ids is not None:
                record.trace_id, record.span_id = ids
        return True


def setup_logging(level: str | int | None = None, fmt: str | None = None,
                  stream=None) -> None:
    """Configure the root logger of this process (replacing any handler set before):
    `level` (default $RLFLEET_LOG_LEVEL, else info) and `fmt` text or json (default:
    json when $DYN_LOGGING_JSONL is set)."""
    fmt = fmt or default_format()
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, not {fmt!r}")
    level = level or os.environ.get("RLFLEET_LOG_LEVEL", "info")
    if isinstance(level, str):
        level = level.upper()
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(_TraceFields())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)
    if fmt == "json":
        # vLLM's and uvicorn's own handlers would write text lines: theirs go through ours
        vllm = logging.getLogger("vllm")
        for h in list(vllm.handlers):
            vllm.removeHandler(h)
        vllm.propagate = True
        vllm.setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
            lg = logging.getLogger(name)
            for h in list(lg.handlers):
                lg.removeHandler(h)
            lg.propagate = True


def quiet_engine_logging(argv: Sequence[str]) -> None:
    """Before vLLM is imported: in json format vLLM must not install its own text handler
    (its lines then reach ours)."""
    if requested_format(argv) == "json":
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
