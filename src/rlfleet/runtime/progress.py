"""Progress of long work (loading a model, digesting a checkpoint, publishing or staging a
version, ...) as log lines, which reach a terminal and a log file alike: one when it
starts, one every few seconds while it runs (how much of how much, the rate, the time
left), one when it ends (the total and the mean rate). Cheap enough to call per chunk:
a line is formatted only when one is due."""

from __future__ import annotations

import logging
import sys
import threading
import time

log = logging.getLogger("rlfleet.progress")


def _every() -> float:
    """Seconds between lines: 2 on a terminal, 10 in a log file."""
    try:
        return 2.0 if sys.stderr.isatty() else 10.0
    except (AttributeError, ValueError):
        return 10.0


def human(n: float, unit: str) -> str:
    if unit != "bytes":
        return f"{n:,.0f} {unit}"
    for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or suffix == "TiB":
            return f"{n:.0f} {suffix}" if suffix == "B" else f"{n:.1f} {suffix}"
        n /= 1024
    return f"{n:.1f} TiB"  # unreachable


class Progress:
    """One operation's progress; `add(n)` from any thread, then `finish()` (or use it as a
    context manager: an exception is reported as a failure after so much work)."""

    def __init__(self, what: str, total: float | None = None, unit: str = "bytes",
                 logger: logging.Logger | None = None, every: float | None = None,
                 heartbeat: bool = False) -> None:
        """`heartbeat`: for work that reports nothing while it runs (one blocking call, such
        as vLLM loading a model), a line every few seconds that it is still running."""
        self.what, self.total, self.unit = what, total, unit
        self.log = logger or log
        self.every = _every() if every is None else every
        self.done = 0.0
        self.started = time.monotonic()
        self._next = self.started + self.every
        self._lock = threading.Lock()
        self._ended = False
        size = f" ({human(total, unit)})" if total else ""
        self.log.info("%s%s ...", what, size, extra={"progress": "start"})
        self._stop = threading.Event()
        if heartbeat:
            threading.Thread(target=self._beat, name=f"progress {what}", daemon=True).start()

    def _beat(self) -> None:
        while not self._stop.wait(self.every):
            with self._lock:  # never after the end line
                if self._ended:
                    return
                self.log.info("%s: still running after %.0f s", self.what,
                              time.monotonic() - self.started, extra={"progress": "running"})

    def add(self, n: float) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if now < self._next:
                return
            self._next = now + self.every
        self.log.info("%s: %s", self.what, self._status(now), extra={"progress": "running"})

    def _status(self, now: float) -> str:
        secs = max(now - self.started, 1e-9)
        rate = self.done / secs
        out = human(self.done, self.unit)
        if self.total:
            out += f" of {human(self.total, self.unit)} ({100 * self.done / self.total:.0f}%)"
        out += f", {human(rate, self.unit)}/s"
        if self.total and rate > 0 and self.done < self.total:
            out += f", ~{(self.total - self.done) / rate:.0f} s left"
        return out

    def finish(self, note: str = "") -> float:
        """Log the end line; returns the seconds it took."""
        secs = time.monotonic() - self.started
        self._stop.set()
        with self._lock:
            ended, self._ended = self._ended, True
        if not ended:
            moved = f": {human(self.done, self.unit)} at {human(self.done / max(secs, 1e-9), self.unit)}/s" \
                if self.done else ""
            self.log.info("%s done in %.2f s%s%s", self.what, secs, moved,
                          f" ({note})" if note else "", extra={"progress": "done"})
        return secs

    def fail(self, why: object) -> None:
        self._stop.set()
        with self._lock:
            ended, self._ended = self._ended, True
        if not ended:
            self.log.warning("%s failed after %.2f s (%s done): %s", self.what,
                             time.monotonic() - self.started, human(self.done, self.unit), why,
                             extra={"progress": "failed"})

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, typ, exc, tb) -> None:
        if exc is None:
            self.finish()
        else:
            self.fail(repr(exc))
