"""What a user sees of rlfleet's processes: the `rlfleet` command prints its own lines and no
library chatter (httpx's line per request) unless `--log-level debug`; a fleet started with
`--log-format json` writes JSON lines only, its ready lines included, which launchers and
`rlfleet up` still find. Mocker workers (the point is the processes' output, not the engine),
and one real vLLM worker: vLLM's own lines (its import-time ones too) and whatever its engine
prints come out as JSON as well."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.fleets import MODEL_NAME, local_fleet, vllm_worker_args

MODEL = "quiet"


def rlfleet(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlfleet.cli", *argv], capture_output=True,
                          text=True, timeout=120, env=env)


def test_the_rlfleet_command_shows_no_library_lines_unless_debug(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RLFLEET_LOG_LEVEL",
                                                             "DYN_LOGGING_JSONL")}
    state = str(tmp_path / "state")
    up = rlfleet("up", "--kind", "mocker", "--workers", "2", "--state", state, "--",
                 "--served-model-name", MODEL, env=env)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "HTTP Request" not in up.stdout + up.stderr
        quiet = rlfleet("status", "--state", state, env=env)
        assert quiet.returncode == 0, quiet.stdout + quiet.stderr
        assert quiet.stderr == "" and "HTTP Request" not in quiet.stdout
        screen = [line for line in quiet.stdout.splitlines() if line.strip()]
        assert len(screen) <= 12, quiet.stdout  # three members, their workers, the state
        loud = rlfleet("--log-level", "debug", "status", "--state", state, env=env)
        assert loud.returncode == 0 and "HTTP Request: GET" in loud.stderr, loud.stderr
    finally:
        down = rlfleet("down", "--state", state, env=env)
        assert down.returncode == 0, down.stdout + down.stderr


def holders(path: Path) -> set[int]:
    """The processes that have `path` open."""
    target, out = str(path.resolve()), set()
    for fds in Path("/proc").glob("[0-9]*/fd"):
        try:
            if any(os.readlink(f) == target for f in fds.iterdir()):
                out.add(int(fds.parent.name))
        except OSError:  # gone, or not ours to read
            continue
    return out


def json_records(log: Path) -> list[dict]:
    """Every non-empty line of a process's log (its stdout and stderr), each a JSON object."""
    records = []
    for line in log.read_text().splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise AssertionError(f"{log.name}: a line that is not JSON: {line!r}") from None
        assert isinstance(record, dict), f"{log.name}: not a JSON object: {line!r}"
        records.append(record)
    return records


def test_a_json_fleet_writes_json_lines_only(tmp_path: Path) -> None:
    flags = ("--log-format", "json")
    with local_fleet(tmp_path, [("--served-model-name", MODEL, "--enable-rl", "--system-port",
                                 "0", *flags)] * 2, model=MODEL, frontend=flags,
                     enable_rl=True) as fleet:
        # the launcher found the ready records and their fields
        assert fleet.url.startswith("http://") and fleet.rl_url.startswith("http://")
        assert all(p.ready["system_url"] and p.ready["model"] == MODEL for p in fleet.workers)
        r = httpx.post(f"{fleet.url}/v1/completions", timeout=20,
                       json={"model": MODEL, "prompt": "hello", "max_tokens": 4})
        assert r.status_code == 200, r.text
        r = httpx.post(f"{fleet.url}/v1/completions", timeout=20, content=b"{not json")
        assert r.status_code == 400
        procs = list(fleet.procs)
    for p in procs:  # stopped: every line each process wrote is in its log
        records = json_records(p.log_path)
        assert all(isinstance(x, dict) and {"time", "level", "target", "message"} <= set(x)
                   for x in records), records
        ready = [x for x in records if x["target"] == "rlfleet.ready"]
        assert len(ready) == 1 and ready[0]["ready"] == (
            "RLFLEET_FRONTEND_READY" if p is procs[0] else "RLFLEET_WORKER_READY"), ready
        assert ready[0]["message"].startswith(ready[0]["ready"] + " url=" if p is procs[0]
                                              else ready[0]["ready"] + " instance_id=")


@pytest.mark.engine
def test_a_json_vllm_worker_writes_json_lines_only(tmp_path: Path, tiny_model: Path) -> None:
    """A vLLM worker with --log-format json, from start to stop, a generation between: every
    line on its stdout and stderr (one log) is a JSON object, the ready line a record."""
    worker = vllm_worker_args(tiny_model, MODEL_NAME, "--log-format", "json")
    with local_fleet(tmp_path, [worker], kind="vllm", frontend=None) as fleet:
        p = fleet.workers[0]
        r = httpx.post(f"{p.ready['url']}/generate", timeout=120, json={
            "request_id": "json-lines", "prompt": "hello", "stream": False,
            "sampling": {"max_tokens": 4, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        events = [json.loads(line) for line in r.text.splitlines()]
        assert sum(len(c["token_ids"]) for e in events for c in e.get("choices", [])) == 4
        assert events[-1].get("done") is True, events
    assert p.popen.returncode is not None
    # its output relays (rlfleet.runtime.logs.PlainLineRelay) write what it wrote last, also
    # while its interpreter shut down, and end once nothing holds their pipes
    deadline = time.monotonic() + 10
    while holders(p.log_path) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not holders(p.log_path), "processes still hold the worker's log"
    records = json_records(p.log_path)
    assert all({"time", "level", "target", "message"} <= set(x) for x in records), records
    ready = [x for x in records if x["target"] == "rlfleet.ready"]
    assert len(ready) == 1 and ready[0]["ready"] == "RLFLEET_WORKER_READY", ready
