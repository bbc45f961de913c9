"""What an engine's OpenMP settings cost in CPU on a small shared box: one tiny vLLM worker
behind a frontend, started, then sent `--requests` sequential 16-token requests with
logprobs, once per setting, side by side. Prints each setting's CPU (all the fleet's
processes) for the start and for the requests, and the ratio against the default.

    python bench/engine_threads.py [--requests 60] [--only suite ...]

The settings: the default (a thread per core; Intel OpenMP, which the CPU engine preloads,
spins 200 ms after each parallel region; the engine core forked from the worker,
rlfleet/vllm/engine.py START_METHOD), the same with the engine core spawned (vLLM's CPU
platform's choice: it imports vLLM and torch again), `KMP_BLOCKTIME=0`, and
`KMP_BLOCKTIME=0 OMP_NUM_THREADS=1`, and those with `TORCH_COMPILE_DISABLE=1` (vLLM's sampler
compiles one op with inductor in every engine process, --enforce-eager or not, and the
worker's warm-up request pays for it: what tests/conftest.py sets for every process of the
suite), and those with the frontend and the worker forked from a preload server, as the
suite starts them."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETTINGS = {
    "engine core spawned": {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"},  # vLLM CPU's choice
    "default": {},
    "KMP_BLOCKTIME=0": {"KMP_BLOCKTIME": "0"},
    "KMP_BLOCKTIME=0 OMP_NUM_THREADS=1": {"KMP_BLOCKTIME": "0", "OMP_NUM_THREADS": "1"},
    "the suite's (also TORCH_COMPILE_DISABLE=1)": {"KMP_BLOCKTIME": "0", "OMP_NUM_THREADS": "1",
                                                  "TORCH_COMPILE_DISABLE": "1"},
}
# the suite's, with the frontend and the worker forked from a preload server (tests/conftest.py
# `preloaded`, rlfleet.runtime.preload); the server's own imports are not counted
PRELOADED = "the suite's, forked from a preload server"
SETTINGS[PRELOADED] = SETTINGS["the suite's (also TORCH_COMPILE_DISABLE=1)"]


def one(model: Path, requests: int, preloaded: bool) -> dict:
    """Run in a process of its own (the settings must be in place before torch loads)."""
    import httpx
    import psutil

    from rlfleet.runtime import launch, preload
    from rlfleet.testing.fleet import LocalFleet

    def cpu(procs) -> float:
        total = 0.0
        for p in procs:
            try:
                total += sum(p.cpu_times()[:2])
            except psutil.NoSuchProcess:
                pass
        return total

    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        server = set()
        if preloaded:
            launch.PRELOADED = stack.enter_context(launch.preload_server(Path(tmp) / "preload"))
            if not preload.wait_ready(launch.PRELOADED, 300):
                raise RuntimeError("the preload server did not start")
            server = {p.pid for p in psutil.Process().children()}
        fleet = stack.enter_context(LocalFleet(Path(tmp) / "fleet"))
        t0 = time.monotonic()
        fleet.start_frontend()
        fleet.start_worker("--model", str(model), "--served-model-name", "tiny",
                           "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager")
        t1 = time.monotonic()
        procs = [p for p in psutil.Process().children(recursive=True) if p.pid not in server]
        c1 = cpu(procs)
        with httpx.Client(timeout=60) as client:
            for i in range(requests):
                r = client.post(f"{fleet.url}/v1/completions", json={
                    "model": "tiny", "prompt": [5, 6, 7, 10 + i], "max_tokens": 16,
                    "logprobs": 1, "temperature": 1.0})
                r.raise_for_status()
        t2 = time.monotonic()
        c2 = cpu(procs)
    return {"start_s": t1 - t0, "start_cpu_s": c1, "requests_s": t2 - t1,
            "requests_cpu_s": c2 - c1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--only", action="append", default=[], metavar="TEXT",
                    help="run only the settings whose name contains TEXT (repeatable; the "
                         "default setting, the baseline, always runs)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one setting
    ap.add_argument("--preloaded", action="store_true", help=argparse.SUPPRESS)  # internal
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(Path(a.one), a.requests, a.preloaded)))
        return
    from rlfleet.models import make_model
    from rlfleet.runtime.launch import engine_env

    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "tiny", size="tiny", seed=1)
        rows = {}
        for name, env in SETTINGS.items():
            if a.only and name != "default" and not any(t in name for t in a.only):
                continue
            base = {k: v for k, v in os.environ.items()
                    if k not in ("KMP_BLOCKTIME", "OMP_NUM_THREADS", "TORCH_COMPILE_DISABLE",
                                 "VLLM_WORKER_MULTIPROC_METHOD")}
            out = subprocess.run([sys.executable, __file__, "--one", str(model), "--requests",
                                  str(a.requests), *(["--preloaded"] if name == PRELOADED else [])],
                                 env={**engine_env(base), **env},
                                 capture_output=True, text=True, timeout=600, check=True)
            rows[name] = json.loads(out.stdout.strip().splitlines()[-1])
    ref = rows["default"]
    for name, r in rows.items():
        print(f"{name:44s} start {r['start_s']:5.1f} s wall {r['start_cpu_s']:5.1f} CPU-s | "
              f"{a.requests} requests {r['requests_s']:5.1f} s wall {r['requests_cpu_s']:5.1f} "
              f"CPU-s | CPU vs default: start {r['start_cpu_s'] / ref['start_cpu_s']:.2f}, "
              f"requests {r['requests_cpu_s'] / ref['requests_cpu_s']:.2f}")


if __name__ == "__main__":
    main()
