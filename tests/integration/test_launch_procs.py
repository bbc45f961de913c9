"""rlfleet.runtime.launch's one readiness wait and stop, on small Python children: a ready
line in a log (`spawn`), a ready line in relayed output (`spawn_relayed`, the frontend's
`--processes`), or a probe for a process that prints none (`vllm_serve`'s)."""

from __future__ import annotations

import io
import os
import sys
import threading
import time

import httpx
import pytest

from rlfleet.runtime.launch import free_port, spawn, spawn_relayed, stop_all

READY = ("from rlfleet.runtime.logs import announce_ready; "
         "announce_ready('worker', {'url': 'http://x', 'n': 3}, 'text')")


def child(*lines: str) -> list[str]:
    return [sys.executable, "-c", "; ".join(lines)]


class Sink(io.BytesIO):
    """What a relay writes, readable while it writes."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def write(self, b) -> int:  # type: ignore[override]
        with self.lock:
            return super().write(b)


def test_a_relayed_child_is_ready_at_its_ready_line_which_is_not_relayed():
    out = Sink()
    p = spawn_relayed("relayed", child("print('before', flush=True)", READY,
                                       "print('after', flush=True)",
                                       "import time; time.sleep(30)"),
                      dict(os.environ), out=out)
    try:
        assert p.wait_ready(30) == {"url": "http://x", "n": "3"}
        deadline = time.monotonic() + 10
        while b"after" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.05)
        text = out.getvalue().decode()
        assert text.splitlines() == ["before", "after"], text
        assert p.log_path is None and p.tail() == ""
    finally:
        stop_all([p], timeout=5)
    assert p.popen.poll() is not None


def test_a_child_that_exits_or_stalls_before_it_is_ready_is_an_error(tmp_path):
    p = spawn_relayed("quitter", child("import sys; sys.exit(3)"), dict(os.environ),
                      out=Sink())
    with pytest.raises(RuntimeError, match="quitter exited with code 3 before it was ready"):
        p.wait_ready(30)
    p = spawn("logged", child("print('no ready line here', flush=True)", "import sys; "
                              "sys.exit(4)"), tmp_path)
    with pytest.raises(RuntimeError, match="(?s)code 4 before.*logged.log.*no ready line"):
        p.wait_ready(30)
    p = spawn("stalled", child("import time; time.sleep(30)"), tmp_path)
    try:
        with pytest.raises(TimeoutError, match="stalled not ready after 1s"):
            p.wait_ready(1)
    finally:
        p.stop(5)


def test_a_process_without_a_ready_line_is_ready_when_its_probe_says_so(tmp_path):
    port = free_port()
    p = spawn("http", [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
              tmp_path, ready_marker=None)
    url = f"http://127.0.0.1:{port}/"

    def answers() -> bool:
        try:
            return httpx.get(url, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        assert p.wait_ready(30, answers) == {}
        assert answers()
    finally:
        stop_all([p], timeout=5)
    assert p.popen.poll() is not None and not answers()
