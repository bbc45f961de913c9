"""`python -m rlfleet.mocker` and `python -m rlfleet.vllm` as processes: a mocker worker
started, registered, serving and stopped; the vLLM worker's --help. (Moved from
tests/unit/test_mocker.py and tests/unit/test_worker_args.py: unit tests start no process.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest


def ndjson(resp: httpx.Response) -> list[dict]:
    assert resp.status_code == 200, resp.text
    return [json.loads(line) for line in resp.text.splitlines() if line]


def test_worker_process(tmp_path: Path) -> None:
    try:
        import rlfleet.worker.serve  # noqa: F401 - needs rlfleet.runtime.discovery
    except ImportError as e:
        pytest.skip(f"the worker runtime is not importable yet: {e}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlfleet.mocker", "--discovery", f"file://{tmp_path}",
         "--port", "0", "--served-model-name", "sim", "--token-delay", "0.001"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 30
        line = ""
        while not line.startswith("RLFLEET_WORKER_READY"):
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
            line = proc.stdout.readline()
        fields = dict(f.split("=", 1) for f in line.split()[1:])
        assert fields["model"] == "sim"
        resp = httpx.post(f"{fields['url']}/generate", timeout=10, json={
            "request_id": "p1", "prompt": "hello", "sampling": {"max_tokens": 6, "ignore_eos": True}})
        events = ndjson(resp)
        assert events[0]["weight_digest"] == "mock:0" and events[-1]["done"]
        assert sum(len(ev["choices"][0]["token_ids"]) for ev in events[1:-1]) == 6
        assert list(tmp_path.rglob("*")), "the worker did not register in discovery"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_help_lists_engine_arguments_and_rlfleet_flags() -> None:
    out = subprocess.run([sys.executable, "-m", "rlfleet.vllm", "--help"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    for flag in ("--tensor-parallel-size", "--pipeline-parallel-size", "--data-parallel-size",
                 "--gpu-memory-utilization", "--max-num-seqs", "--quantization", "--config",
                 "--trust-remote-code", "--enable-prefix-caching", "--advertise-host",
                 "--enable-rl", "--discovery", "--system-port", "--start-gated"):
        assert f"  {flag}" in out, flag
