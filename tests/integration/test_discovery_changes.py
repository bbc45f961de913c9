"""Discovery that costs what changes: a frontend follows a store change by change (etcd's
watch events; the file store's changed files), its view equal to the store's after 10,000
changes; the RL listener answers 503 with Retry-After while its store cannot be read, and
lists again once it is back; route probes happen once per worker life; the frontend raises
its soft descriptor limit."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import random
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from rlfleet.frontend.rl import rl_app
from rlfleet.frontend.router import WorkerPool
from rlfleet.runtime.discovery import Discovery, FileDiscovery, open_discovery
from rlfleet.runtime.discovery.file import _Notify
from rlfleet.testing.etcd import discovery_entry, free_port, run_etcd
from tests.fleets import RL_PROBE_ENV, mock_args, wait_for_workers

CHANGES = 10_000
WORKERS = 100


def worker_entry(ns: str, i: int, **extra: Any) -> dict[str, Any]:
    """A routable worker's generate entry (what the frontend's pool keeps)."""
    return discovery_entry(ns, "backend", "generate", transport={"http": f"http://127.0.0.1:{i}"},
                           stream_plane=f"127.0.0.1:{10_000 + i}", model="m", load=0, **extra)


async def eventually(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        await asyncio.sleep(0.1)


async def churn(ns: str, writer: Discovery, total: int) -> None:
    """`total` changes to the store: workers register, change (load, gate, policy) and
    leave; at most one change in flight per registration, so each one's last is known."""
    rng = random.Random(7)
    regs = [await writer.register(worker_entry(ns, i), ttl=60) for i in range(WORKERS)]
    done = WORKERS
    while done < total:
        batch = regs[: min(len(regs), total - done)]
        ops = []
        for reg in batch:
            roll = rng.random()
            if roll < 0.01:
                ops.append(reg.close())
            else:
                ops.append(reg.update({**reg.entry, "load": rng.randrange(1000),
                                       "gated": roll < 0.3,
                                       "weight_version": f"v{rng.randrange(5)}"}))
        await asyncio.gather(*ops)
        done += len(batch)
        closed = [r for r in batch if r._closed]
        regs = [r for r in regs if not r._closed]
        for _ in closed:  # as many join as left
            if done < total:
                regs.append(await writer.register(worker_entry(ns, 500 + done), ttl=60))
                done += 1
        rng.shuffle(regs)


async def pool_equals_store(pool: WorkerPool, store: Discovery, ns: str) -> bool:
    listed = {e["instance_id"]: e for e in await store.list(ns, endpoint="generate")}
    return {iid: w.entry for iid, w in pool.workers.items()} == listed


async def test_etcd_ten_thousand_changes_reach_the_frontend_by_event(etcd_pair, ns: str) -> None:
    reader, writer = etcd_pair
    # ~100 puts at once, beside the suite's other processes on two cores: a put may wait
    # longer than the default 3 s here, and what is checked is what reaches the reader
    writer.deadline = 30.0
    pool = WorkerPool(reader, ns)
    await pool.start()
    try:
        await churn(ns, writer, CHANGES)
        await eventually(lambda: pool_equals_store(pool, writer, ns), 60,
                         "the frontend's workers equal to etcd's entries")
        assert len(pool.workers) > WORKERS / 2
        assert reader.lists == 1  # listed once at the start; every change came as an event
    finally:
        await pool.stop()


async def test_the_file_store_reads_only_what_changed(tmp_path: Path, ns: str) -> None:
    writer, reader = FileDiscovery(tmp_path / "d"), FileDiscovery(tmp_path / "d")
    (tmp_path / "d").mkdir()
    kernel_watch = _Notify.open(tmp_path / "d")
    pool = WorkerPool(reader, ns)
    await pool.start()
    scans = 0
    real_scan = reader._scan

    def counting_scan():
        nonlocal scans
        scans += 1
        return real_scan()
    reader._scan = counting_scan  # type: ignore[method-assign]
    try:
        await churn(ns, writer, 2_000)
        await eventually(lambda: pool_equals_store(pool, writer, ns), 60,
                         "the frontend's workers equal to the directory's entries")
        if kernel_watch is not None:  # a local filesystem: the changed files alone were read
            assert scans == 0
    finally:
        if kernel_watch is not None:
            kernel_watch.close()
        await pool.stop()
        await writer.close()
        await reader.close()


# ---------------------------------------------------------------- the store out of reach


def rl_worker_entry(ns: str) -> dict[str, Any]:
    return discovery_entry(ns, "backend", "rl", 1, transport={"http": "http://127.0.0.1:9"},
                           request_plane_url=f"dyn://{ns}.backend.rl", model="m")


async def within(what: str, aw: Any, timeout: float = 60.0) -> Any:
    """`aw`'s result, or a failure naming the step and every task's stack when it has none
    within `timeout` s (one CI run hung in this module's file-store test for 20 minutes
    with no sign of where)."""
    task = asyncio.ensure_future(aw)
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if task in done:
        return task.result()
    stacks = io.StringIO()
    for t in asyncio.all_tasks():
        t.print_stack(file=stacks)
    task.cancel()
    raise AssertionError(f"{what}: nothing in {timeout:g} s; the tasks:\n{stacks.getvalue()}")


def assert_unavailable(r: httpx.Response, store: str) -> None:
    assert r.status_code == 503, r.text
    assert int(r.headers["Retry-After"]) > 0
    body = r.json()
    assert body["error"]["type"] == "discovery_unavailable"
    assert body["discovery"] == store and store in body["error"]["message"]


async def test_an_unreadable_file_store_gets_503_then_lists_again(tmp_path: Path,
                                                                  ns: str) -> None:
    """The directory cannot be listed (mode 000; as root, which reads any directory, a
    regular file in its place): 503 with Retry-After, and the listing once it is back; the
    frontend's workers stay those it saw."""
    store = tmp_path / "d"
    owner, d = open_discovery(store.as_uri()), open_discovery(store.as_uri())
    reg = await within("register", owner.register(rl_worker_entry(ns), ttl=30))
    worker = await within("register", owner.register(worker_entry(ns, 1), ttl=30))
    pool = WorkerPool(d, ns)
    await within("pool.start", pool.start())
    app = rl_app(d, ns)
    aside = tmp_path / "aside"
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://listener") as http:
            assert (await within("list", http.get("/v1/rl/workers"))).status_code == 200
            assert set(pool.workers) == {worker.entry["instance_id"]}
            if os.geteuid() == 0:
                store.rename(aside)
                store.write_text("not a directory")
            else:
                store.chmod(0)
            assert_unavailable(await within("list, store gone", http.get("/v1/rl/workers")),
                               d.url)
            await asyncio.sleep(1)  # the pool's watch meets the same store
            assert set(pool.workers) == {worker.entry["instance_id"]}
            if os.geteuid() == 0:
                store.unlink()
                aside.rename(store)
            else:
                store.chmod(0o700)
            r = await within("list, store back", http.get("/v1/rl/workers"))
            assert r.status_code == 200, r.text
            assert [w["instance_id"] for w in r.json()["workers"]] == [1]
    finally:
        if store.is_file():
            store.unlink()
        if aside.exists():
            aside.rename(store)
        store.chmod(0o700)
        await within("pool.stop", pool.stop())
        await within("close", reg.close())
        await within("close", worker.close())
        await within("close", owner.close())
        await within("close", d.close())


async def test_a_watch_cancelled_while_it_reads_the_store_ends(tmp_path: Path) -> None:
    """A loop that reads the file store (as a pool's watch does) ends at the first cancel,
    whenever it lands: Python 3.11's wait_for, which the store's reads used, let 3 of 4
    cancels landing as a read finished go by, and a pool's stop then waited forever."""
    d = open_discovery((tmp_path / "d").as_uri())
    assert isinstance(d, FileDiscovery)

    async def reads() -> None:
        while True:
            await d._io(time.sleep, 0.0005)
    t: asyncio.Future | None = None
    try:
        for _ in range(100):
            t = asyncio.ensure_future(reads())
            await asyncio.sleep(random.uniform(0, 0.005))
            t.cancel()
            await asyncio.wait({t}, timeout=2)
            assert t.done() and t.cancelled(), "a cancel went by: the loop ran on"
    finally:
        while t is not None and not t.done():
            t.cancel()
            await asyncio.wait({t}, timeout=0.1)
        await d.close()


def etcd_pid(port: int) -> int:
    """The etcd process serving clients on `port` (started by this test)."""
    want = f"http://127.0.0.1:{port}".encode()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            args = cmdline.read_bytes().split(b"\0")
            if args and args[0].endswith(b"etcd") and want in args:
                return int(cmdline.parent.name)
    raise LookupError(f"no etcd on port {port}")


def completion(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=30,
                      json={"model": "mock-rl", "prompt": [1, 2, 3], "max_tokens": 2})


def test_etcd_stopped_or_killed_gets_503_and_requests_are_served(tmp_path: Path) -> None:
    """etcd SIGSTOPped, then SIGKILLed and started again on its data: meanwhile requests
    are served by the workers the frontend knows, the RL listener answers 503 with
    Retry-After naming the store, and lists the worker again once etcd is back."""
    from rlfleet.testing.fleet import LocalFleet

    port, data = free_port(), tmp_path / "etcd"
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(run_etcd(client_port=port, data_dir=data))
        fleet = stack.enter_context(LocalFleet(tmp_path / "fleet", discovery=url,
                                               lease_ttl=10))
        fleet.start_frontend(enable_rl=True, env=RL_PROBE_ENV)
        fleet.start_worker(*mock_args(tmp_path), kind="mocker", timeout=120)
        wait_for_workers(fleet.url, "mock-rl", 1)

        def listed() -> list[int]:
            r = httpx.get(f"{fleet.rl_url}/v1/rl/workers", timeout=30)
            assert r.status_code == 200, r.text
            return [w["instance_id"] for w in r.json()["workers"]]

        assert len(listed()) == 1
        pid = etcd_pid(port)
        os.kill(pid, signal.SIGSTOP)
        try:
            assert_unavailable(httpx.get(f"{fleet.rl_url}/v1/rl/workers", timeout=30), url)
            assert completion(fleet.url).status_code == 200
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_listed(listed)

        os.kill(pid, signal.SIGKILL)  # its launcher (run_etcd, on exit) reaps it
        assert_unavailable(httpx.get(f"{fleet.rl_url}/v1/rl/workers", timeout=30), url)
        assert completion(fleet.url).status_code == 200
        with run_etcd(client_port=port, data_dir=data):
            wait_listed(listed)
            assert completion(fleet.url).status_code == 200
            fleet.stop()


def wait_listed(listed, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if len(listed()) == 1:
                return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.5)


# ---------------------------------------------------------------- route probes, descriptors


def route_probes(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(r'^rlfleet_frontend_route_probes_total\{outcome="ok"\} (\S+)$', text,
                      re.M)
    return float(found.group(1)) if found else 0.0


def test_route_probes_happen_once_per_worker_life(start_fleet, tmp_path: Path) -> None:
    fleet = start_fleet([mock_args(tmp_path)] * 2, model="mock-rl", enable_rl=True,
                        frontend_env=RL_PROBE_ENV)

    def listing() -> list[dict]:
        r = httpx.get(f"{fleet.rl_url}/v1/rl/workers", timeout=30)
        assert r.status_code == 200, r.text
        workers = r.json()["workers"]
        assert all(w["routes"] and "error" not in w for w in workers), workers
        return workers

    for _ in range(3):  # three listings, as a refresh makes
        assert len(listing()) == 2
    assert route_probes(fleet.url) == 2
    fleet.start_worker(*mock_args(tmp_path), kind="mocker", timeout=300)
    wait_for_workers(fleet.url, "mock-rl", 3)
    for _ in range(3):
        assert len(listing()) == 3
    assert route_probes(fleet.url) == 3  # only the new worker was probed
    gone = fleet.workers[0]
    gone.signal(signal.SIGTERM)
    gone.popen.wait(30)
    fleet.start_worker(*mock_args(tmp_path), kind="mocker", timeout=300)  # a new life
    wait_for_workers(fleet.url, "mock-rl", 3)
    deadline = time.monotonic() + 30
    while {w["instance_id"] for w in listing()} & {int(gone.ready["instance_id"])}:
        assert time.monotonic() < deadline, "the stopped worker is still listed"
        time.sleep(0.5)
    assert len(listing()) == 3
    assert route_probes(fleet.url) == 4


def test_the_frontend_raises_its_soft_descriptor_limit(tmp_path: Path) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"the hard descriptor limit is {hard}: nothing to raise")
    lowered = ("import os, resource, sys; "
               "resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit("
               "resource.RLIMIT_NOFILE)[1])); os.execv(sys.executable, [sys.executable, "
               "'-m', 'rlfleet.frontend', *sys.argv[1:]])")
    store = (tmp_path / "d").as_uri()
    p = subprocess.Popen([sys.executable, "-c", lowered, "--http-port", "0", "--discovery",
                          store], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert p.stdout is not None
        assert p.stdout.readline().strip()  # its ready line: it has started
        limits = Path(f"/proc/{p.pid}/limits").read_text()
        row = next(line for line in limits.splitlines() if line.startswith("Max open files"))
        got_soft, got_hard = row.split()[3:5]
        assert got_soft == got_hard and got_soft != "256", row
    finally:
        p.terminate()
        p.wait(30)
