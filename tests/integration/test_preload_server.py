"""The fork server (rlfleet.runtime.preload) at work: a process it forks is the program an
exec'd one is (its output file, its exit code, a process group of its own, the CPUs, the
environment it was given); a process it refuses starts as usual."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from rlfleet.runtime import launch, preload

PY = sys.executable


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    run = tmp_path_factory.mktemp("preload")
    with launch.preload_server(run) as path:
        deadline = time.monotonic() + 300
        while preload.fork(path, [PY, "-m", "rlfleet.mocker", "--help"], launch.engine_env(),
                           None, run / "probe.log") is None:
            assert time.monotonic() < deadline, (run / "preload.log").read_text()
            time.sleep(0.5)
        yield path, run


def started(server, tmp_path, *args: str, **env: str) -> launch.Proc:
    path, _ = server
    old, launch.PRELOADED = launch.PRELOADED, path
    try:
        proc = launch.spawn("m", [PY, "-m", "rlfleet.mocker", *args], tmp_path,
                            env={**os.environ, **env})
    finally:
        launch.PRELOADED = old
    assert isinstance(proc.popen, preload.Forked)
    return proc


def test_a_forked_process_is_the_program_it_was_asked_for(server, tmp_path):
    _, run = server
    # a bad flag: the program's own usage error in its log, its exit code
    bad = started(server, tmp_path, "--no-such-flag")
    assert bad.popen.wait(60) == 2 and bad.popen.poll() == 2
    assert "unrecognized arguments: --no-such-flag" in bad.log_path.read_text()

    p = started(server, tmp_path, "--port", "0", "--served-model-name", "pre",
                DYN_LOGGING_JSONL="1")
    try:
        ready = p.wait_ready(60)
        assert ready["model"] == "pre"
        assert os.getpgid(p.pid) == p.pid and os.getsid(p.pid) == p.pid  # a session of its own
        assert os.sched_getaffinity(p.pid) == os.sched_getaffinity(0)  # not pinned by OpenMP
        # the environment it was given: DYN_LOGGING_JSONL, its output in JSON
        lines = p.log_path.read_text().splitlines()
        assert lines and all(json.loads(line) for line in lines), lines
        with pytest.raises(subprocess.TimeoutExpired):
            p.popen.wait(0.2)
        os.killpg(p.pid, signal.SIGKILL)
        assert p.popen.wait(30) == -signal.SIGKILL
    finally:
        p.stop(5)
    # the server's record of it (and of the CPU it used)
    assert f"{p.pid} ended -9 after" in (run / "preload.log").read_text()


def test_a_refused_process_is_started_as_usual(server, tmp_path):
    path, run = server
    old, launch.PRELOADED = launch.PRELOADED, path
    try:
        proc = launch.spawn("m", [PY, "-m", "rlfleet.mocker", "--help"], tmp_path,
                            env={**os.environ, "OMP_NUM_THREADS": "3"})
    finally:
        launch.PRELOADED = old
    assert not isinstance(proc.popen, preload.Forked)
    assert proc.popen.wait(60) == 0
    assert "OMP_NUM_THREADS" in (run / "preload.log").read_text()


def test_no_server_there_yet_starts_as_usual(tmp_path):
    assert preload.fork(str(tmp_path / "none.sock"), [PY, "-m", "rlfleet.mocker"], {}, None,
                        tmp_path / "x.log") is None
