"""Logging for every rlfleet process (frontend, workers, the `rlfleet` command): one set-up,
two formats.

- text (default): `time LEVEL logger: message key=value ...`: the structured fields a line
  was logged with (`extra=`: request_id, sample_id, attempt, trace_id, ...) follow the
  message, so a line about a request names it;
- json (`--log-format json`, or `DYN_LOGGING_JSONL=1` as Dynamo reads it): one JSON object
  per line on stderr: time, level, target (the logger), message, the same fields, and
  `exc_info` for a traceback.

While tracing is on (rlfleet.runtime.tracing), a line logged inside a span also carries
`trace_id` and `span_id`. Lines about single requests are logged at DEBUG. The libraries'
own loggers (LIBRARY_LOGGERS: httpx's line per request, uvicorn's, vLLM's start-up
chatter, ...) log WARNING and up unless the level is debug ($VLLM_LOGGING_LEVEL, when set,
still decides vLLM's). In json format vLLM's and uvicorn's lines go through the same
handler (vLLM is told not to configure logging).

In json format a worker or frontend process writes nothing but JSON lines on stdout and
stderr (`keep_output_json`): whatever reaches them without going through logging (a
library's print, C code's output, a traceback, a child process sharing them, what an
extension module prints while the interpreter shuts down) is relayed, by a small process
per descriptor, as a record of target `stdout` / `stderr`.

The ready line: a launcher (rlfleet.runtime.launch, `rlfleet up`, tests) waits for one line
on a process's stdout, `RLFLEET_WORKER_READY key=value ...` or `RLFLEET_FRONTEND_READY
key=value ...` (`announce_ready`). In json format it is a record of target `rlfleet.ready`
whose message is that same text and whose fields are its keys and `ready` (the marker);
`parse_ready` reads either form.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rlfleet.runtime import tracing

FORMATS = ("text", "json")
#: libraries whose INFO lines are about their own plumbing (a line per HTTP request, per
#: connection, per start-up step): WARNING and up unless the process logs at debug
LIBRARY_LOGGERS = ("httpx", "httpcore", "httpx2", "uvicorn", "uvicorn.error", "uvicorn.access",
                   "vllm", "urllib3", "asyncio", "filelock", "matplotlib", "PIL", "torch",
                   "transformers", "huggingface_hub", "ray", "opentelemetry")
#: the first word of a ready line starts with this and ends with _READY
READY_PREFIX = "RLFLEET_"
READY_TARGET = "rlfleet.ready"

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
        p.add_argument("--log-level", default=None,
                       help="debug, info, warning, error (default: $RLFLEET_LOG_LEVEL, else "
                            "info); below debug the libraries' loggers (httpx, uvicorn, vLLM, "
                            "...) show only warnings")
    if "--log-format" not in have:
        p.add_argument("--log-format", choices=FORMATS, default=default_format(),
                       help="text, or json: one JSON object per line (default: json when "
                            "$DYN_LOGGING_JSONL is set, else text)")


def _requested(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(add_help=False)
    add_log_args(p)
    known, _ = p.parse_known_args(list(argv))
    return known


def requested_format(argv: Sequence[str]) -> str:
    """The --log-format an argument list asks for, read before the full parser runs (the
    engine's logging must be decided before vLLM is imported)."""
    return _requested(argv).log_format


def chosen_level(level: str | int | None, default: str = "info") -> int:
    """The level a process logs at: `level` (a flag), else $RLFLEET_LOG_LEVEL, else
    `default`."""
    chosen = level or os.environ.get("RLFLEET_LOG_LEVEL") or default
    if isinstance(chosen, int):
        return chosen
    number = logging.getLevelName(chosen.upper())
    if not isinstance(number, int):
        raise ValueError(f"log level must be debug, info, warning or error, not {chosen!r}")
    return number


def library_level(level: int) -> int:
    """The level of LIBRARY_LOGGERS in a process that logs at `level`."""
    return level if level <= logging.DEBUG else max(level, logging.WARNING)


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
                  stream=None, default_level: str = "info") -> None:
    """Configure the root logger of this process (replacing any handler set before):
    `level` (else $RLFLEET_LOG_LEVEL, else `default_level`) and `fmt` text or json (default:
    json when $DYN_LOGGING_JSONL is set). LIBRARY_LOGGERS get library_level(level)."""
    fmt = fmt or default_format()
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, not {fmt!r}")
    number = chosen_level(level, default_level)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(_TraceFields())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(number)
    logging.captureWarnings(True)
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(library_level(number))
    if os.environ.get("VLLM_LOGGING_LEVEL"):
        logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
    if fmt == "json":
        # vLLM's and uvicorn's own handlers would write text lines: theirs go through ours
        for name in ("vllm", "uvicorn", "uvicorn.error", "uvicorn.access"):
            lg = logging.getLogger(name)
            for h in list(lg.handlers):
                lg.removeHandler(h)
            lg.propagate = True


def quiet_engine_logging(argv: Sequence[str]) -> None:
    """Before vLLM is imported, from the process's arguments: vLLM (and the engine
    processes it starts, which read the same environment) logs at library_level unless
    $VLLM_LOGGING_LEVEL says otherwise; in json format vLLM installs no handler of its own,
    its import-time lines already go through ours, and the process's output stays JSON
    (keep_output_json)."""
    for key, value in engine_logging_env(argv).items():
        os.environ.setdefault(key, value)
    asked = _requested(argv)
    if asked.log_format == "json":
        keep_output_json("json")
        setup_logging(chosen_level(asked.log_level), "json")


def engine_logging_env(argv: Sequence[str], environ: Mapping[str, str] | None = None
                       ) -> dict[str, str]:
    """The variables quiet_engine_logging sets (where `environ`, default os.environ, has none
    of its own) for a process with these arguments."""
    environ = os.environ if environ is None else environ
    asked = _requested(argv)
    level = library_level(chosen_level(asked.log_level or environ.get("RLFLEET_LOG_LEVEL")))
    out = {"VLLM_LOGGING_LEVEL": logging.getLevelName(level)}
    if asked.log_format == "json":
        out["VLLM_CONFIGURE_LOGGING"] = "0"
    return out


# ---------------------------------------------------------------------- the ready line


def ready_line(what: str, fields: Mapping[str, object]) -> str:
    """`RLFLEET_<WHAT>_READY key=value ...` (a value must not contain whitespace)."""
    return " ".join([f"{READY_PREFIX}{what.upper()}_READY",
                     *(f"{k}={'' if v is None else v}" for k, v in fields.items())])


def announce_ready(what: str, fields: Mapping[str, object], fmt: str | None = None,
                   stream=None) -> None:
    """Write the ready line on stdout (`stream`) at once, whatever the log level: the text
    line, or in json format a record of target READY_TARGET with that text as its message
    and `fields` (and `ready`, the marker) beside it."""
    text = ready_line(what, fields)
    stream = stream or sys.stdout
    if (fmt or default_format()) == "json":
        record = logging.LogRecord(READY_TARGET, logging.INFO, __file__, 0, text, None, None)
        clash = set(fields) & _STANDARD
        if clash:
            raise ValueError(f"ready fields {sorted(clash)} are names of a log record's own")
        record.__dict__.update({k: "" if v is None else str(v) for k, v in fields.items()},
                               ready=text.split()[0])
        text = JsonFormatter().format(record)
    stream.write(text + "\n")
    stream.flush()


def parse_ready(line: str, prefix: str = READY_PREFIX) -> dict[str, str] | None:
    """The fields of a ready line (either format) whose marker starts with `prefix`; None
    for any other line."""
    text = line.strip()
    if text.startswith("{"):
        try:
            record = json.loads(text)
        except ValueError:
            return None
        text = record.get("message", "") if isinstance(record, dict) else ""
        if not isinstance(text, str):
            return None
    words = text.split()
    if not words or not words[0].startswith(prefix) or not words[0].endswith("_READY"):
        return None
    return dict(w.split("=", 1) for w in words[1:] if "=" in w)


# ---------------------------------------------------------------------- json-only output


def json_line(line: bytes, target: str, level: int) -> bytes | None:
    """One line of output (no newline) as a JSON line: a JSON object as it is, any other
    line as a record of target `target` at `level`; None for an empty line."""
    text = line.decode(errors="replace").rstrip("\r")
    if not text.strip():
        return None
    if text.lstrip().startswith("{"):
        try:
            if isinstance(json.loads(text), dict):
                return text.encode()
        except ValueError:
            pass
    record = logging.LogRecord(target, level, "", 0, text, None, None)
    return JsonFormatter().format(record).encode()


def relay_lines(read_fd: int, write_fd: int, target: str, level: int) -> None:
    """Until `read_fd` ends, write each line read from it to `write_fd` as a JSON line
    (json_line); a last line without its newline too."""
    def write(data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(write_fd, view):]

    pending = b""
    while chunk := os.read(read_fd, 1 << 16):
        *lines, pending = (pending + chunk).split(b"\n")
        out = [j for j in (json_line(x, target, level) for x in lines) if j is not None]
        if out:
            write(b"\n".join(out) + b"\n")
    last = json_line(pending, target, level)
    if last is not None:
        write(last + b"\n")


class PlainLineRelay:
    """Keeps a file descriptor's output JSON: the descriptor is replaced by a pipe, and a
    relay process (`python -m rlfleet.runtime.logs TARGET LEVEL`: relay_lines) writes each
    line that arrives to the original file, as JSON. Whatever writes to the descriptor
    (print, C code, a child process that inherited it) goes through it, to the end: being a
    process, not a thread, it also relays what is written while the interpreter shuts down
    (an extension module's finalizer) and what children write after this process has gone.
    It runs in a session of its own (a signal to this process's group does not cut it
    short) and ends when no process holds the pipe. It stays in place to this process's
    end (nothing gives the descriptor its file back)."""

    def __init__(self, fd: int, target: str, level: int) -> None:
        original = os.dup(fd)
        read_end, write_end = os.pipe()  # neither is inherited by a child
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", __name__, target, logging.getLevelName(level)],
                stdin=read_end, stdout=original, stderr=original, start_new_session=True)
        finally:
            os.close(read_end)
            os.close(original)  # the relay has its own copy
        os.dup2(write_end, fd)
        os.close(write_end)


_relays: list[PlainLineRelay] = []


def keep_output_json(fmt: str | None) -> None:
    """In json format, from now on this process's stdout (fd 1, records at INFO) and stderr
    (fd 2, at WARNING) carry JSON lines only (PlainLineRelay), to its very end: the relays
    are left in place when it exits, for what the interpreter's shutdown writes. For the
    worker and frontend processes, whose output is a log; once per process."""
    if (fmt or default_format()) != "json" or _relays:
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    _relays.extend([PlainLineRelay(1, "stdout", logging.INFO),
                    PlainLineRelay(2, "stderr", logging.WARNING)])


if __name__ == "__main__":  # a PlainLineRelay's process: stdin to stdout, as JSON lines
    relay_lines(0, 1, sys.argv[1], logging.getLevelName(sys.argv[2]))
