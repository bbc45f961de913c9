"""A CPU engine of one rank pinned to the cores it is given (`rlfleet up` gives each worker of
a host its share: rlfleet.runtime.launch.cpu_shares, pinned_env), in a process of its own:
pinning is for the whole process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rlfleet.runtime.launch import CPU_BIND


def test_a_single_rank_cpu_engine_runs_on_the_cores_it_is_given():
    """`rlfleet.vllm.engine.pin_to_cores`, in a process of its own: "nobind", "auto" and a
    parallel engine's ranks are left to vLLM; a list pins every thread of the process and
    sizes its OpenMP team (the engine core it forks inherits both); a list this process may
    not use is refused by name."""
    pytest.importorskip("vllm")

    cpu = sorted(os.sched_getaffinity(0))[-1]
    script = f"""
import os, threading, torch
from rlfleet.vllm.engine import pin_to_cores
before = sorted(os.sched_getaffinity(0))
for raw, world in (("nobind", 1), ("auto", 1), ("0|1", 2), ("{cpu}", 2)):
    os.environ[{CPU_BIND!r}] = raw
    assert pin_to_cores(world) is None and sorted(os.sched_getaffinity(0)) == before
os.environ[{CPU_BIND!r}] = "99999"
try:
    pin_to_cores(1)
except ValueError as e:
    print("refused:", e)
t = threading.Thread(target=threading.Event().wait, daemon=True)
t.start()  # a thread started before: pinned too
os.environ[{CPU_BIND!r}] = "{cpu}"
print(pin_to_cores(1), sorted(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(t.native_id)),
      torch.get_num_threads(), os.environ["OMP_NUM_THREADS"])
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith(f"refused: {CPU_BIND}='99999': not a list of this host's CPUs"), lines
    assert lines[-1] == f"[{cpu}] [{cpu}] [{cpu}] 1 1", lines


def _allowed(pid: int) -> str:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no Cpus_allowed_list for {pid}")


def test_a_worker_started_on_a_core_runs_there_with_its_engine_core(tmp_path, tiny_model):
    """A vLLM worker started as `rlfleet up` starts one on its share of a CPU host
    (`LocalFleet.start_worker(cores=...)`): the worker and the engine core it forked are
    allowed that core only, and it serves."""
    import httpx

    from rlfleet.testing.fleet import LocalFleet
    from tests.fleets import vllm_worker_args

    cpu = sorted(os.sched_getaffinity(0))[-1]
    with LocalFleet(tmp_path) as fleet:
        p = fleet.start_worker(*vllm_worker_args(tiny_model), cores=str(cpu), timeout=600)
        children = [int(c) for c in open(f"/proc/{p.pid}/task/{p.pid}/children").read().split()]
        # (multiprocessing's resource tracker, started before the engine, idles unpinned)
        engines = [c for c in children
                   if "resource_tracker" not in open(f"/proc/{c}/cmdline").read()]
        assert len(engines) == 1, [open(f"/proc/{c}/cmdline").read() for c in children]
        assert [_allowed(pid) for pid in (p.pid, *engines)] == [str(cpu)] * (1 + len(engines))
        body = {"request_id": "pinned", "prompt_token_ids": [1, 2, 3], "stream": True,
                "sampling": {"max_tokens": 4, "ignore_eos": True}}
        with httpx.stream("POST", f"{p.ready['url']}/generate", json=body, timeout=60) as r:
            events = [json.loads(line) for line in r.iter_lines() if line]
        tokens = [t for ev in events for c in ev.get("choices", []) for t in c.get("token_ids") or []]
        assert len(tokens) == 4, events
