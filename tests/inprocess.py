"""A mocker fleet inside the test's own event loop: a frontend (with the RL listener) and
mocker workers, over file discovery. For tests that must see every process's state at once
(the spans of one trace, in the SDK's in-memory exporter). The mocker is a simulator: tests
that claim real-engine behaviour start real vLLM workers instead."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
from pathlib import Path

import httpx

from rlfleet.frontend.app import build_app
from rlfleet.frontend.rl import rl_app
from rlfleet.frontend.router import WorkerPool
from rlfleet.mocker.admin import MockAdmin
from rlfleet.mocker.engine import MockEngine, add_mock_args
from rlfleet.runtime.discovery import open_discovery
from rlfleet.runtime.request_plane import StreamClient
from rlfleet.runtime.server import AppServer, bind_socket
from rlfleet.worker.serve import add_worker_args, serve_worker, staging_area


def mock_worker_args(*argv: str) -> argparse.Namespace:
    """The mocker's command line (python -m rlfleet.mocker), parsed."""
    p = argparse.ArgumentParser()
    add_mock_args(p)
    add_worker_args(p)
    return p.parse_args(list(argv))


class InProcessFleet:
    def __init__(self, root: Path, model: str, workers: int = 2, journal: str | None = None,
                 worker_args: tuple[str, ...] = ()) -> None:
        self.root, self.model, self.n, self.journal = root, model, workers, journal
        self.discovery_url = f"file://{root / 'discovery'}"
        self.weights = root / "weights"
        self.worker_args = worker_args
        self.tasks: list[asyncio.Task] = []
        self.engines: list[MockEngine] = []
        self.servers: list[AppServer] = []

    async def __aenter__(self) -> InProcessFleet:
        # each worker sets up this process's logging (its --log-format): undone on exit
        root = logging.getLogger()
        self._logging = (list(root.handlers), root.level)
        self.weights.mkdir(parents=True, exist_ok=True)
        self.discovery = open_discovery(self.discovery_url)
        self.pool = WorkerPool(self.discovery, "dynamo")
        self.client = StreamClient(request_timeout=30)
        for i in range(self.n):
            args = mock_worker_args(
                "--served-model-name", self.model, "--enable-rl", "--system-port", "0",
                "--discovery", self.discovery_url, "--allowed-weights-root", str(self.weights),
                "--token-delay", "0.001", "--seed", "1", "--lease-ttl", "3",
                "--enable-fault-injection", *self.worker_args)
            engine = MockEngine(args)
            staging = staging_area(args)
            admin = MockAdmin(engine, args.allowed_weights_root, staging=staging)
            self.engines.append(engine)
            self.tasks.append(asyncio.create_task(
                serve_worker(engine, args, admin.routes, staging=staging), name=f"worker-{i}"))
        await self.pool.start()
        front = AppServer(build_app(self.pool, self.client), bind_socket("127.0.0.1", 0))
        rl = AppServer(rl_app(self.discovery, "dynamo", journal=self.journal),
                       bind_socket("127.0.0.1", 0))
        for s in (front, rl):
            await s.start()
            self.servers.append(s)
        self.url = f"http://127.0.0.1:{front.port}"
        self.rl_url = f"http://127.0.0.1:{rl.port}"
        await self.wait_workers(self.n)
        return self

    async def wait_workers(self, n: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=5) as c:
            while True:
                for t in self.tasks:
                    if t.done():
                        t.result()  # a worker that failed to start: its error
                workers = (await c.get(f"{self.rl_url}/v1/rl/workers")).json()["workers"]
                if len(self.pool.for_model(self.model)) >= n and len(workers) >= n:
                    return
                assert time.monotonic() < deadline, f"{n} workers never registered"
                await asyncio.sleep(0.05)

    async def __aexit__(self, *exc: object) -> None:
        for t in self.tasks:
            t.cancel()
        for t in self.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for s in self.servers:
            await s.stop()
        await self.pool.stop()
        await self.client.close()
        await self.discovery.close()
        root = logging.getLogger()
        for h in list(root.handlers):
            root.removeHandler(h)
        handlers, level = self._logging
        for h in handlers:
            root.addHandler(h)
        root.setLevel(level)
