"""The serving stacks bench/rl_routing.py replays its traces through, each a context manager
that starts its processes on 127.0.0.1 (free ports) and stops them on exit, also on errors:

- `rlfleet_stack`: rlfleet's frontend (one router mode) over rlfleet workers: mockers with
  the shared timing model (`Timing`), or vLLM workers of a given model;
- `dynamo_stack`: NVIDIA Dynamo 1.6.1's frontend over `dynamo.mocker --num-workers N` on the
  ZMQ event plane (a broker on loopback, as ../shared/bench/peer-dynamo/run.sh runs it), its
  mocker timed by a profile (`--planner-profile-data`) written from the same `Timing`;
- `sglang_stack`: sglang-router 0.3.2 (installed for the tests in <venv>/clients) in front of
  one rlfleet frontend per worker, each worker a mocker of the same `Timing`.

Each yields a `Stack`: the URL to send to, and how to read what its engines counted (prefix
cache hits and queries; seconds of requests per worker)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from rlfleet.runtime.launch import Proc, free_port, spawn, stop_all
from rlfleet.testing.fleet import LocalFleet

MODEL = "rl-bench"
DYNAMO_MODEL = "tiny"
SGLANG_ROUTER_DIR = Path(sys.prefix) / "clients" / "sglang-router"
# the engine counters of each worker kind: prefix-cache hits and queries (tokens)
COUNTERS = {"vllm": ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
            "mocker": ("rlfleet_mocker_prefix_cache_hits_total",
                       "rlfleet_mocker_prefix_cache_queries_total")}
BUSY = "rlfleet_worker_request_seconds_sum"


@dataclass(frozen=True)
class Timing:
    """The simulated engines' timing model, given to both simulators: rlfleet's mocker
    (`--engine-steps`) and Dynamo's (`--planner-profile-data`, a linear prefill profile and a
    constant decode one)."""

    workers: int = 2
    block_size: int = 16
    kv_blocks: int = 2048  # per worker (32,768 tokens)
    prefill_ms: float = 1.0  # per uncached prompt token
    decode_ms: float = 100.0  # per iteration that decodes
    max_seqs: int = 256
    max_batched: int = 8192
    max_model_len: int = 32768

    def rlfleet_args(self) -> list[str]:
        return ["--engine-steps", "--prefill-delay", str(self.prefill_ms / 1000),
                "--token-delay", str(self.decode_ms / 1000), "--kv-blocks", str(self.kv_blocks),
                "--block-size", str(self.block_size), "--max-batch", str(self.max_seqs),
                "--max-num-batched-tokens", str(self.max_batched), "--uncached-completions",
                "--max-model-len", str(self.max_model_len), "--vocab-size", "151936"]

    def dynamo_profile(self, path: Path) -> Path:
        """Dynamo's mocker profile: prefill time linear in the iteration's new tokens,
        decode time constant (its interpolation over active KV tokens and context)."""
        big = 1e7
        np.savez(path, prefill_isl=np.array([0.0, big]),
                 prefill_ttft_ms=np.array([0.0, big * self.prefill_ms]),
                 decode_active_kv_tokens=np.array([0.0, big]),
                 decode_context_length=np.array([0.0, big]),
                 decode_itl=np.full((2, 2), self.decode_ms))
        return path

    def dynamo_args(self, profile: Path) -> list[str]:
        return ["--num-workers", str(self.workers), "--block-size", str(self.block_size),
                "--num-gpu-blocks-override", str(self.kv_blocks), "--max-num-seqs",
                str(self.max_seqs), "--max-num-batched-tokens", str(self.max_batched),
                "--max-model-len", str(self.max_model_len), "--planner-profile-data",
                str(profile)]


@dataclass
class Stack:
    url: str
    # (hits, queries) summed over the engines now (None: the engines' answers carry them)
    counters: Callable[[], tuple[float, float]] | None = None
    # seconds of requests per worker so far (None: from the answers' worker IDs)
    busy: Callable[[], dict[str, float]] | None = None
    procs: list[Proc] = field(default_factory=list)


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:]+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m and m.group(1) == name:
            total += float(m.group(3))
    return total


def _worker_reader(workers: list[Proc], kind: str) -> tuple[Callable, Callable]:
    hits, queries = COUNTERS[kind]

    def texts() -> list[tuple[str, str]]:
        return [(p.ready["instance_id"], httpx.get(f"{p.ready['system_url']}/metrics",
                                                   timeout=30).text) for p in workers]

    def counters() -> tuple[float, float]:
        got = texts()
        return sum(_metric(t, hits) for _, t in got), sum(_metric(t, queries) for _, t in got)

    def busy() -> dict[str, float]:
        return {iid: _metric(t, BUSY) for iid, t in texts()}
    return counters, busy


def events_config() -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": f"tcp://127.0.0.1:{free_port()}"})


def wait_workers(url: str, count: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError):
            got = httpx.get(f"{url}/health", timeout=5).json()["workers"]
            if sum(1 for w in got if w.get("usable")) >= count:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} does not see {count} usable workers")
        time.sleep(0.2)


def start_workers(fleet: LocalFleet, count: int, args: list[str], kind: str,
                  env: dict[str, str] | None = None) -> list[Proc]:
    procs = [fleet.start_worker("--served-model-name", MODEL, "--system-port", "0",
                                "--kv-events-config", events_config(), *args, kind=kind,
                                wait=False, env=env) for _ in range(count)]
    for p in procs:
        p.wait_ready(900)
    return procs


@contextlib.contextmanager
def rlfleet_stack(work: Path, mode: str, frontend_args: list[str], workers: list[Proc] | None
                  = None, fleet: LocalFleet | None = None, timing: Timing | None = None,
                  kind: str = "mocker") -> Iterator[Stack]:
    """A frontend in `mode` over `workers` of `fleet` (given: kept running after), or over
    new mockers of `timing` (stopped on exit)."""
    own = fleet is None
    with contextlib.ExitStack() as stack:
        if own:
            fleet = stack.enter_context(LocalFleet(work, lease_ttl=5))
            workers = start_workers(fleet, timing.workers, timing.rlfleet_args(), kind)
        fe = spawn(f"frontend-{mode}-{free_port()}", [
            sys.executable, "-m", "rlfleet.frontend", "--http-port", "0", "--discovery",
            fleet.discovery, "--namespace", fleet.namespace, "--router-mode", mode,
            "--log-level", "warning", *frontend_args], work / "logs")
        stack.callback(fe.stop)
        fe.wait_ready(60)
        wait_workers(fe.ready["url"], len(workers))
        counters, busy = _worker_reader(workers, kind)
        yield Stack(fe.ready["url"], counters, busy, [fe])


def _dynamo_env(work: Path, ports: dict[str, int]) -> dict[str, str]:
    return {**os.environ, "DYN_DISCOVERY_BACKEND": "file", "DYN_REQUEST_PLANE": "tcp",
            "DYN_EVENT_PLANE": "zmq", "DYN_TCP_RPC_HOST": "127.0.0.1",
            "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1", "DYN_EVENT_PLANE_HOST": "127.0.0.1",
            "DYN_SYSTEM_HOST": "127.0.0.1", "DYN_NAMESPACE": "dynamo", "DYN_ZMQ_BROKER_ENABLED": "true",
            "DYN_ZMQ_BROKER_URL": f"xsub=tcp://127.0.0.1:{ports['xsub']},"
                                  f"xpub=tcp://127.0.0.1:{ports['xpub']}",
            "DYN_FILE_KV": str(work / "kv"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "LD_PRELOAD": "", "DYN_LOG": "warn"}


BROKER = """import sys, zmq
ctx = zmq.Context(); xsub = ctx.socket(zmq.XSUB); xpub = ctx.socket(zmq.XPUB)
xsub.bind(f"tcp://127.0.0.1:{sys.argv[1]}"); xpub.bind(f"tcp://127.0.0.1:{sys.argv[2]}")
zmq.proxy(xsub, xpub)"""


def _low_port() -> int:
    """A free port below 32768 (Dynamo reads DYN_SYSTEM_PORT as a 16-bit signed integer)."""
    for _ in range(200):
        port = random.randrange(20000, 32768)
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            return port
    raise RuntimeError("no free port below 32768")


def _dynamo_ready(url: str, workers: int, timeout: float) -> None:
    """Until a completion succeeds and `workers` distinct workers have answered."""
    deadline, seen, i = time.monotonic() + timeout, set(), 0
    while len(seen) < workers:
        if time.monotonic() > deadline:
            raise TimeoutError(f"Dynamo at {url}: {len(seen)} of {workers} workers answered")
        i += 1
        body = {"model": DYNAMO_MODEL, "prompt": [7, i, 11, 13], "max_tokens": 1,
                "nvext": {"extra_fields": ["worker_id"]}}
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=10)
            if r.status_code == 200:
                seen.add(r.json()["nvext"]["worker_id"]["decode_worker_id"])
                continue
        time.sleep(0.3)


@contextlib.contextmanager
def dynamo_stack(venv: Path, work: Path, timing: Timing, model_dir: Path,
                 router_args: list[str]) -> Iterator[Stack]:
    """Dynamo 1.6.1: broker, `dynamo.mocker`, `dynamo.frontend` with `router_args`."""
    shutil.rmtree(work / "kv", ignore_errors=True)  # a discovery store of its own, empty
    work.mkdir(parents=True, exist_ok=True)
    py = str(venv / "bin" / "python")
    ports = {k: free_port() for k in ("http", "xsub", "xpub")}
    ports["system"] = _low_port()
    env = _dynamo_env(work, ports)
    profile = timing.dynamo_profile(work / "profile.npz")
    logs = work / "logs"
    procs: list[Proc] = []
    try:
        procs.append(spawn("broker", [py, "-c", BROKER, str(ports["xsub"]), str(ports["xpub"])],
                           logs, env=env, ready_marker=None))
        time.sleep(0.5)
        common = ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]
        procs.append(spawn("dynamo-mocker", [
            py, "-m", "dynamo.mocker", "--model-path", str(model_dir), "--model-name",
            DYNAMO_MODEL, *common, *timing.dynamo_args(profile)], logs,
            env={**env, "DYN_SYSTEM_PORT": str(ports["system"])}, ready_marker=None))
        procs.append(spawn("dynamo-frontend", [
            py, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port",
            str(ports["http"]), *common, "--kv-cache-block-size", str(timing.block_size),
            *router_args], logs, env=env, ready_marker=None))
        url = f"http://127.0.0.1:{ports['http']}"
        _dynamo_ready(url, timing.workers, 180)
        yield Stack(url, None, None, procs)
    finally:
        stop_all(list(reversed(procs)))


@contextlib.contextmanager
def sglang_stack(work: Path, timing: Timing, policy: str,
                 router_flags: list[str] = ()) -> Iterator[Stack]:
    """sglang-router (`policy`) over one rlfleet frontend per mocker worker."""
    if not (SGLANG_ROUTER_DIR / ".installed").exists():
        raise FileNotFoundError(f"sglang-router 0.3.2 is not installed in {SGLANG_ROUTER_DIR} "
                                "(scripts/setup.sh installs it for the tests)")
    with contextlib.ExitStack() as stack:
        urls, workers = [], []
        for i in range(timing.workers):
            fleet = stack.enter_context(LocalFleet(work / f"w{i}", lease_ttl=5))
            workers += start_workers(fleet, 1, timing.rlfleet_args(), "mocker")
            urls.append(fleet.start_frontend("--log-level", "warning").ready["url"])
            wait_workers(urls[-1], 1)
        port = free_port()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (os.environ.get("PYTHONPATH"), str(SGLANG_ROUTER_DIR)) if p)}
        router = spawn(f"sglang-router-{port}", [
            sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
            "--port", str(port), "--worker-urls", *urls, "--policy", policy,
            "--log-level", "warn", *router_flags], work / "logs", env=env, ready_marker=None)
        stack.callback(router.stop, 10)
        url = f"http://127.0.0.1:{port}"
        _sglang_ready(router, url, len(urls))
        counters, busy = _worker_reader(workers, "mocker")
        yield Stack(url, counters, busy, [router])


def _sglang_ready(router: Proc, url: str, count: int, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            got = httpx.get(f"{url}/workers", timeout=5).json()
            listed = got.get("workers", got) if isinstance(got, dict) else got
            if len([w for w in listed if w.get("is_healthy", True)]) >= count:
                return
        if router.popen.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"sglang-router at {url} never listed {count} workers:\n"
                               f"{router.tail()}")
        time.sleep(0.3)
