"""Nothing of a vLLM worker outlives it: SIGKILL the worker process alone (not its group),
and its engine core, the engine's own workers and multiprocessing's resource tracker are
gone within seconds, with the engine core in the worker process's child (the CPU set-up)
and in a process of its own (multiprocessing on, the GPU default). The worker whose engines
run as the session fleet's is one of that fleet's (killed after the other modules on it)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from rlfleet.runtime.launch import Proc, engine_env
from tests.fleets import VLLM_FLAGS

pytestmark = [pytest.mark.engine, pytest.mark.kills_session_worker]


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state) of every process."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[int(d.name)] = (int(fields[1]), fields[0])
    return out


def descendants(pid: int) -> set[int]:
    procs = _processes()
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, (ppid, _) in procs.items() if ppid in frontier} - found
        found |= frontier
    return found


def living(pids: set[int]) -> set[int]:
    """Those still running (a zombie holds no memory: it only waits to be reaped)."""
    procs = _processes()
    return {p for p in pids if p in procs and procs[p][1] != "Z"}


@pytest.fixture(params=["0", "1"], ids=["engine-in-child", "mp-on"])
def worker(request, start_fleet, tiny_model) -> Proc:
    """A vLLM worker with its engine core in the worker process's child (multiprocessing
    off, the CPU set-up) or in a process of its own (multiprocessing on, the GPU default):
    a worker of the session fleet where that fleet's engines run so, else one of its own."""
    multiprocessing = request.param
    if engine_env().get("VLLM_ENABLE_V1_MULTIPROCESSING") == multiprocessing:
        return request.getfixturevalue("session_vllm_worker")
    fleet = start_fleet([("--model", str(tiny_model), *VLLM_FLAGS, "--no-warmup")],
                        kind="vllm", frontend=None, lease_ttl=3,
                        worker_env={"VLLM_ENABLE_V1_MULTIPROCESSING": multiprocessing})
    return fleet.workers[0]


def test_sigkill_of_a_worker_leaves_no_process_behind(worker):
    w = worker
    children = descendants(w.pid)
    assert children, "a vLLM worker starts an engine-core process"
    os.kill(w.pid, signal.SIGKILL)  # the worker alone: its group is left to the kernel
    w.popen.wait(10)
    deadline = time.monotonic() + 10
    while living(children) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {p: Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:120]
            for p in living(children)}
    assert not left, f"processes of the killed worker still alive: {left}"


FORK_AFFINITY = """
import os, sys, torch
from rlfleet.runtime.launch import keep_cpus_in_forked_children
x = torch.randn(256, 256)
x @ x  # OpenMP started, as in a worker that has loaded vLLM
if sys.argv[1] == "keep":
    keep_cpus_in_forked_children()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(w, repr(sorted(os.sched_getaffinity(0))).encode())
    os._exit(0)
os.waitpid(pid, 0)
print(sorted(os.sched_getaffinity(0)))
print(os.read(r, 1000).decode())
"""


def test_a_forked_engine_core_keeps_the_cpus_of_its_worker() -> None:
    """Intel OpenMP, which the CPU engine preloads, pins a child forked after torch has run
    to the first CPU of its mask: every worker's forked engine core ran on one core, the
    others idle (rlfleet.vllm.engine START_METHOD). The worker gives its forked children
    its own CPUs back."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", FORK_AFFINITY, "keep"], env=engine_env(),
                         capture_output=True, text=True, timeout=120, check=True).stdout
    parent, child = out.split("\n")[:2]
    assert child == parent, (parent, child)
