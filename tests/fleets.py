"""Fleets for tests, started one way: a frontend and its workers (mocker or vLLM) as local
processes (rlfleet.runtime.launch). The fixtures in tests/conftest.py start them; a module
that needs other settings passes them to the `start_fleet` / `start_module_fleet`
factories there instead of copying the start-up."""

from __future__ import annotations

import contextlib
import random
import re
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import httpx

from rlfleet.mocker.engine import write_mock_checkpoint
from rlfleet.runtime.launch import Proc
from rlfleet.testing.fleet import LocalFleet
from rlfleet.testing.fleet import vllm_serve as launch_vllm_serve

T = TypeVar("T")

# float32 so logprobs can be compared with transformers; eager for a quick start
VLLM_FLAGS = ("--dtype", "float32", "--max-model-len", "2048", "--enforce-eager")
MODEL_NAME = "tiny"  # what the session's vLLM fleet serves tiny_model as
# the session vLLM fleet's lease TTL (seconds). A worker whose lease lapses re-joins gated
# (the safety rule for a worker that may have missed a refresh), which would leave every
# later module of the fleet a worker short: on a loaded 2-core box the whole machine has
# stalled for ~12 s (etcd keep-alives of both workers and the frontend's reads timed out at
# once), so the lease leaves room for that
VLLM_FLEET_LEASE = 20.0
# the frontend's timeout for asking a worker on the RL listener's behalf: short, so that a
# hung worker is listed with an error quickly
RL_PROBE_ENV = {"DYN_RL_REQUEST_TIMEOUT_SECS": "2"}
#: the servers only the session vLLM fleet's modules use (the fleet, the clients' LoRA worker,
#: the differential tests' reference server: ~10 processes, ~11 GB): stopped when the last of
#: those modules ends (tests/conftest.py), not at the end of the session
UNIT_SERVERS = contextlib.ExitStack()


def unit_server(request, server: contextlib.AbstractContextManager[T]) -> T:
    """Start `server` for a session fixture of the session fleet's modules: stopped with
    UNIT_SERVERS, at the latest when the session's fixtures are torn down."""
    request.addfinalizer(UNIT_SERVERS.close)
    return UNIT_SERVERS.enter_context(server)


def wait_for_workers(url: str, model: str, count: int, timeout: float = 30.0) -> list[dict]:
    """Block until the frontend at `url` routes to `count` usable workers of `model`."""
    deadline = time.monotonic() + timeout
    while True:
        workers = [w for w in httpx.get(f"{url}/health", timeout=5).json()["workers"]
                   if w["model"] == model and w["usable"]]
        if len(workers) == count:
            return workers
        if time.monotonic() > deadline:
            raise TimeoutError(f"frontend sees {len(workers)} usable workers of {model}, "
                               f"expected {count}")
        time.sleep(0.2)


@contextlib.contextmanager
def exec_started() -> Iterator[None]:
    """The processes started inside exec'd as usual, not forked from the test process's
    preload server (tests/conftest.py `preloaded`): for a test that bounds their memory
    (a forked process's RSS counts the pages it shares with the server)."""
    from rlfleet.runtime import launch

    before, launch.PRELOADED = launch.PRELOADED, None
    try:
        yield
    finally:
        launch.PRELOADED = before


GENERATED = "rlfleet_worker_generated_tokens_total"  # a worker engine's own token count


def worker_metric(proc: Proc, name: str) -> float:
    """A worker's series `name` on its serving port, summed over its labels."""
    text = httpx.get(f"{proc.ready['url']}/metrics", timeout=10).text
    return sum(float(m.group(1)) for m in
               re.finditer(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))


def fleet_metric(fleet: LocalFleet, name: str) -> float:
    """`worker_metric` summed over the fleet's live workers."""
    return sum(worker_metric(p, name) for p in fleet.workers if p.popen.poll() is None)


def wait_generated(fleet: LocalFleet, tokens: int, since: float, timeout: float = 60.0) -> None:
    """Block until the fleet's workers have generated `tokens` more tokens than `since` (a
    `fleet_metric` of rlfleet_worker_generated_tokens_total read before): a request is under
    way, whatever the load on the machine."""
    deadline = time.monotonic() + timeout
    while fleet_metric(fleet, GENERATED) - since < tokens:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the fleet did not generate {tokens} tokens in {timeout} s")
        time.sleep(0.02)


def weight_versions(fleet: LocalFleet) -> list[tuple[str | None, str]]:
    """(version, weight digest) of each of the fleet's workers, as its engine reports them."""
    out = []
    for p in fleet.workers:
        v = httpx.post(f"{p.ready['system_url']}/engine/get_weight_version", json={},
                       timeout=10).json()
        out.append((v["version"], v["weight_digest"]))
    return out


def refresh_back(fleet: LocalFleet, checkpoint: Path, journal: Path) -> None:
    """Refresh the whole session fleet to `checkpoint` as version "A" (the session's model),
    open: what a module that moved it leaves for the next ones."""
    import asyncio

    from rlfleet.refresh.coordinator import PolicyRefresh

    back = PolicyRefresh(fleet.rl_url, model=MODEL_NAME, timeout=120, journal=journal)
    try:
        result = asyncio.run(back.refresh(checkpoint, "A"))
    finally:
        back.close()
    assert result.ok, result.reason


def listening_port() -> int:
    """A free port below the kernel's ephemeral range, for a service that is restarted on
    the same port (an ephemeral port may meanwhile be the source port of some connection)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    below = range(10000, low) if low > 10200 else range(1025, 65536)
    for port in random.sample(below, 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def vllm_worker_args(model_dir: Path, served_name: str = MODEL_NAME, *extra: str) -> tuple[str, ...]:
    """An RL-enabled vLLM worker with fault injection, serving `model_dir` as `served_name`."""
    return ("--model", str(model_dir), "--served-model-name", served_name, "--enable-rl",
            "--system-port", "0", "--enable-fault-injection", *extra, *VLLM_FLAGS)


def start_workers(fleet: LocalFleet, workers: Sequence[Sequence[str]], *, kind: str,
                  env: Mapping[str, str] | None = None, timeout: float | None = None) -> list[Proc]:
    """Start one worker per argument list, all at once, and wait until each is ready."""
    timeout = timeout or (600 if kind == "vllm" else 120)
    procs = [fleet.start_worker(*args, kind=kind, env=dict(env or {}), wait=False)
             for args in workers]
    for p in procs:
        p.wait_ready(timeout)
    return procs


@contextlib.contextmanager
def local_fleet(workdir: Path, workers: Sequence[Sequence[str]], *, kind: str = "mocker",
                model: str | None = None, lease_ttl: float = 2.0, discovery: str | None = None,
                frontend: Sequence[str] | None = (), enable_rl: bool = False,
                frontend_env: Mapping[str, str] | None = None,
                worker_env: Mapping[str, str] | None = None) -> Iterator[LocalFleet]:
    """A frontend (`frontend`: its extra flags; None for no frontend) and one worker per
    argument list in `workers`; with `model`, until the frontend routes to all of them.
    Everything is stopped on exit."""
    with LocalFleet(workdir, discovery=discovery, lease_ttl=lease_ttl) as fleet:
        if frontend is not None:
            fleet.start_frontend(*frontend, enable_rl=enable_rl, env=dict(frontend_env or {}))
        start_workers(fleet, workers, kind=kind, env=worker_env)
        if model is not None and frontend is not None:
            wait_for_workers(fleet.url, model, len(workers))
        yield fleet


def replace_dead_workers(fleet: LocalFleet, worker_args: Sequence[str], model: str) -> None:
    """Start a worker like the others for each one that has exited (a test killed it), so
    that the next module finds the fleet whole; the dead ones leave `fleet.workers`."""
    dead = [p for p in fleet.workers if p.popen.poll() is not None]
    for p in dead:
        fleet.workers.remove(p)
        fleet.procs.remove(p)
    if dead:
        start_workers(fleet, [worker_args] * len(dead), kind="vllm")
    wait_for_workers(fleet.url, model, len(fleet.workers), timeout=60)


# ---------------------------------------------------------------- the refresh mocker fleet

RL_MOCK_MODEL = "mock-rl"  # what the refresh modules' mocker workers serve


def mock_args(root: Path, *extra: str) -> tuple[str, ...]:
    """An RL-enabled mocker worker with fault injection, loading weights under `root`."""
    return ("--served-model-name", RL_MOCK_MODEL, "--enable-rl", "--system-port", "0",
            "--enable-fault-injection", "--allowed-weights-root", str(root),
            "--token-delay", "0.002", "--seed", "1", *extra)


def mock_policies(root: Path) -> dict[str, Path]:
    """Two mocker checkpoints under `root` ("A": seed 1, "B": seed 2) and `root` itself."""
    return {"root": root, "A": write_mock_checkpoint(root / "A", 1),
            "B": write_mock_checkpoint(root / "B", 2)}


def two_rl_mockers(start_fleet, ckpts: dict[str, Path]) -> LocalFleet:
    """The refresh modules' fleet: two RL mocker workers behind a frontend with the RL
    listener and the post-update probe."""
    return start_fleet([mock_args(ckpts["root"])] * 2, model=RL_MOCK_MODEL, enable_rl=True,
                       frontend_env=RL_PROBE_ENV)


def fault(proc: Proc, route: str, mode: str = "error", **kw) -> None:
    """Arm the worker's fault injection on `route`."""
    r = httpx.post(f"{proc.ready['system_url']}/engine/fault_injection",
                   json={"route": route, "mode": mode, **kw}, timeout=5)
    assert r.json()["status"] == "ok", r.text


def routed(fleet: LocalFleet, expected: int | set[int] | None = None,
           timeout: float = 5.0) -> set[int]:
    """Workers the frontend routes to; with `expected` (a count, or the very workers), wait
    until the frontend agrees (discovery reaches it within its poll interval). Wait for the
    workers themselves where a count can also be met on the way, by the wrong ones (one of
    two workers closed before the other during a refresh)."""
    deadline = time.monotonic() + timeout
    while True:
        got = {w["instance_id"] for w in httpx.get(f"{fleet.url}/health").json()["workers"]
               if w["usable"]}
        done = got == expected if isinstance(expected, set) else len(got) == expected
        if expected is None or done or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


# ---------------------------------------------------------------- vLLM's own server


def vllm_serve(model_dir: Path, workdir: Path, *flags: str,
               env: Mapping[str, str] | None = None) -> contextlib.AbstractContextManager[str]:
    """vLLM's own OpenAI server on `model_dir`, served as MODEL_NAME with the fleet's engine
    flags (plus `flags`), for differential tests (rlfleet.testing.fleet.vllm_serve): its
    URL once it answers; stopped on exit."""
    return launch_vllm_serve(model_dir, MODEL_NAME, workdir, *VLLM_FLAGS, *flags,
                             env=dict(env or {}))


def pinned_clients(url: str, k: int, tries: int = 64) -> list[httpx.Client]:
    """One keep-alive client per frontend process (the kernel picks the process per
    connection; /health names the one that answered)."""
    by_pid: dict[int, httpx.Client] = {}
    for _ in range(tries):
        c = httpx.Client(base_url=url, timeout=30)
        pid = c.get("/health").json()["process"]
        if pid in by_pid:
            c.close()
        else:
            by_pid[pid] = c
        if len(by_pid) == k:
            return list(by_pid.values())
    for c in by_pid.values():
        c.close()
    raise AssertionError(f"{tries} connections reached {len(by_pid)} of {k} processes")
