"""A frontend at a hard descriptor limit (issue 43: `prlimit --nofile=1024:1024`, both limits
1,024, so raising the soft one cannot help): 1,100 idle connections, and a good request on
a new connection is still served (the connection idle longest makes room for it)."""

from __future__ import annotations

import socket
import sys

import httpx

from rlfleet.runtime.launch import spawn
from rlfleet.runtime.limits import raise_fd_limit

IDLE = 1100


def test_a_good_request_is_served_past_1100_idle_connections(tmp_path):
    assert raise_fd_limit() > IDLE + 64  # this process holds the idle sockets
    proc = spawn("frontend", ["prlimit", "--nofile=1024:1024", sys.executable, "-m",
                              "rlfleet.frontend", "--http-port", "0", "--discovery",
                              f"file://{tmp_path / 'discovery'}", "--read-timeout", "0"],
                 tmp_path)
    idle: list[socket.socket] = []
    try:
        url = proc.wait_ready(60)["url"]
        port = httpx.URL(url).port
        for _ in range(IDLE):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        r = httpx.get(f"{url}/v1/models", timeout=10)
        assert r.status_code == 200 and r.json()["object"] == "list", r.text
        shed = 0
        for s in idle[:400]:  # the oldest made room: closed by the frontend
            s.settimeout(0.05)
            try:
                shed += s.recv(1) == b""
            except TimeoutError:
                pass
        assert shed > 300, shed
        assert proc.popen.poll() is None
        assert "Too many open files" not in proc.log_path.read_text()
    finally:
        for s in idle:
            s.close()
        proc.stop()
