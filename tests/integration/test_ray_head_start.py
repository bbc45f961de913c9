"""The test Ray head's start (rlfleet.testing.ray.run_ray_head) on a loaded machine: `ray
start` gives its raylet a fixed 30 s to register and then exits "timed out during
startup"; the head is started again, and another failure is reported with its output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlfleet.testing import ray as ray_testing

TIMED_OUT = "Exception: The current node timed out during startup. This could happen..."
# a stand-in head that comes up: listens on its port and says what `ray start` says
UP = ("import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); "
      "s.listen(); print('Ray runtime started.', flush=True); time.sleep(60)")


def heads(monkeypatch, *scripts: str) -> list[int]:
    """`ray start` replaced by these scripts, one per start, in turn."""
    started = []

    def start(port: int, tmp: Path, num_cpus: int):
        log = open(tmp / "head.log", "wb")
        script = scripts[len(started)]
        started.append(port)
        argv = ([sys.executable, "-c", UP, str(port)] if script == "up" else
                ["sh", "-c", f"echo '{script}'; exit 1"])
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True), log

    monkeypatch.setattr(ray_testing, "_start_head", start)
    return started


def test_a_start_that_timed_out_is_tried_again(monkeypatch):
    started = heads(monkeypatch, TIMED_OUT, TIMED_OUT, "up")
    with ray_testing.run_ray_head(timeout=60) as address:
        assert address == f"127.0.0.1:{started[-1]}" and len(started) == 3


def test_other_failures_and_the_last_attempt_are_reported(monkeypatch):
    heads(monkeypatch, "raylet: bad flag")
    with pytest.raises(RuntimeError, match="attempt 1.*bad flag"), \
            ray_testing.run_ray_head(timeout=60):
        pass
    heads(monkeypatch, TIMED_OUT, TIMED_OUT)
    with pytest.raises(RuntimeError, match="attempt 2.*timed out during startup"), \
            ray_testing.run_ray_head(timeout=60, attempts=2):
        pass
