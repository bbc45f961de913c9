"""`rlfleet up --processes K`: the fleet's frontend serves its port from K processes. Mocker
workers (the declared simulator): the point is the frontend `up` starts, not an engine."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.fleets import pinned_clients, wait_for_workers

MODEL = "mock-up-procs"


def rlfleet(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlfleet.cli", *argv], capture_output=True,
                          text=True, timeout=180)


def requests_ok(text: str) -> float:
    pat = (r'^rlfleet_frontend_requests_total\{model="' + MODEL
           + r'",route="/v1/completions",status="200"\} (\S+)$')
    return sum(float(v) for v in re.findall(pat, text, re.M))


def routes_both(c: httpx.Client, timeout: float = 30.0) -> None:
    """Until the process behind `c` routes to both workers (each follows discovery)."""
    deadline = time.monotonic() + timeout
    while len([w for w in c.get("/health").json()["workers"]
               if w["model"] == MODEL and w["usable"]]) < 2:
        assert time.monotonic() < deadline, c.get("/health").text
        time.sleep(0.1)


def test_up_starts_a_frontend_of_two_processes_whose_metrics_sum_both(tmp_path: Path) -> None:
    config = tmp_path / "fleet.yaml"
    config.write_text("frontend: {http-port: 0}\n")  # a free port (the default is 8000)
    state = tmp_path / "state"
    up = rlfleet("up", "--config", str(config), "--kind", "mocker", "--workers", "2",
                 "--processes", "2", "--state", str(state), "--",
                 "--served-model-name", MODEL, "--token-delay", "0.001")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        members = json.loads((state / "fleet.json").read_text())["members"]
        url = members[0]["ready"]["url"]
        wait_for_workers(url, MODEL, 2)
        clients = pinned_clients(url, 2)  # two processes answer on the one port
        try:
            for c in clients:
                routes_both(c)
            start = [requests_ok(c.get("/metrics").text) for c in clients]
            assert start[0] == start[1]
            body = {"model": MODEL, "prompt": [3, 4, 5], "max_tokens": 4}
            for c, n in zip(clients, (3, 2), strict=True):
                for _ in range(n):
                    r = c.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    assert len(r.json()["choices"][0]["text"]) > 0
            for c in clients:  # either process's /metrics counts both processes' requests
                assert requests_ok(c.get("/metrics").text) - start[0] == 5
        finally:
            for c in clients:
                c.close()
        bad = rlfleet("up", "--kind", "mocker", "--processes", "0",
                      "--state", str(tmp_path / "other"))
        assert bad.returncode != 0 and "--processes must be at least 1" in bad.stderr, \
            bad.stdout + bad.stderr
    finally:
        down = rlfleet("down", "--state", str(state))
        assert down.returncode == 0, down.stdout + down.stderr
