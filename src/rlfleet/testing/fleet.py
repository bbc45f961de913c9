"""Fleets of local processes for tests, benchmarks and the demo: `LocalFleet` (one frontend
and any number of workers sharing one discovery store) and vLLM's own server
(`vllm_serve`), the baseline of the differential tests and benchmarks. Both start their
processes with rlfleet.runtime.launch (`spawn`, `Proc`), as `rlfleet up` does."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx

from rlfleet.runtime.launch import Proc, free_port, pinned_env, spawn, stop_all

VLLM_SERVE = "vllm.entrypoints.openai.api_server"  # `vllm serve` without the `vllm` command


@contextlib.contextmanager
def vllm_serve(model: Path, served_name: str, log_dir: Path, *flags: str,
               env: dict[str, str] | None = None, timeout: float = 600) -> Iterator[str]:
    """vLLM's own OpenAI server (`vllm serve`, the baseline that differential tests and
    benchmarks compare rlfleet with) on `model` as `served_name`, with `flags` (engine flags
    and others), on 127.0.0.1 at a free port, with the engine environment plus `env`: its
    URL once `/v1/models` answers. Its output is <log_dir>/vllm-serve-<port>.log; it is
    stopped (its process group) on exit, also when it fails to start."""
    port = free_port()
    argv = [sys.executable, "-m", VLLM_SERVE, "--model", str(model), "--served-model-name",
            served_name, "--host", "127.0.0.1", "--port", str(port), *flags]
    with http_server(f"vllm-serve-{port}", argv, port, "/v1/models", log_dir,
                     {**os.environ, **(env or {})}, timeout, stop_timeout=30) as url:
        yield url


@contextlib.contextmanager
def http_server(name: str, argv: list[str], port: int, probe: str, log_dir: Path,
                env: dict[str, str], timeout: float, stop_timeout: float) -> Iterator[str]:
    """A server process (`argv`, listening on 127.0.0.1:`port`), its output in
    <log_dir>/<name>.log: its URL once GET `probe` answers 200; stopped (its process
    group) on exit, also when it fails to start."""
    proc = spawn(name, argv, log_dir, env=env, ready_marker=None)
    url = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{url}{probe}", timeout=2).status_code == 200
        return False

    try:
        proc.wait_ready(timeout, answers)
        yield url
    finally:
        proc.stop(stop_timeout)


class LocalFleet:
    """A fleet of local processes: one frontend and any number of workers sharing one
    discovery store (tests, benchmarks, the demo; the trainer's API is `rlfleet.rl.Fleet`).
    Use as a context manager; everything it started is stopped on exit, also on errors."""

    def __init__(self, workdir: Path, discovery: str | None = None,
                 namespace: str = "dynamo", lease_ttl: float = 10.0) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.discovery = discovery or f"file://{self.workdir / 'discovery'}"
        self.namespace = namespace
        self.lease_ttl = lease_ttl
        self.procs: list[Proc] = []
        self.frontend: Proc | None = None
        self.workers: list[Proc] = []

    def _common(self) -> list[str]:
        return ["--discovery", self.discovery, "--namespace", self.namespace]

    def start_frontend(self, *extra: str, enable_rl: bool = False, timeout: float = 60,
                       env: dict[str, str] | None = None) -> Proc:
        argv = [sys.executable, "-m", "rlfleet.frontend", "--http-port", "0", *self._common()]
        if enable_rl:
            argv += ["--enable-rl", "--rl-port", "0"]
        p = spawn("frontend", [*argv, *extra], self.workdir / "logs",
                  env={**os.environ, **(env or {})})
        self.procs.append(p)
        self.frontend = p
        p.wait_ready(timeout)
        return p

    def start_worker(self, *extra: str, kind: str = "vllm", wait: bool = True,
                     timeout: float = 300, name: str | None = None,
                     env: dict[str, str] | None = None, cwd: Path | None = None,
                     cores: str | None = None) -> Proc:
        """kind: "vllm" (python -m rlfleet.vllm) or "mocker" (python -m rlfleet.mocker);
        `cwd`: the directory a relative --model is resolved in; `cores`: the CPUs a CPU
        engine runs on (a CPU_BIND list, with `pinned_env`, as `rlfleet up` gives it)."""
        name = name or f"{kind}-worker-{len(self.workers)}"
        argv = [sys.executable, "-m", f"rlfleet.{kind}", "--lease-ttl", str(self.lease_ttl),
                *self._common(), *extra]
        env = {**os.environ, **(env or {}), **(pinned_env(cores) if cores else {})}
        p = spawn(name, argv, self.workdir / "logs", env=env, cwd=cwd)
        self.procs.append(p)
        self.workers.append(p)
        if wait:
            p.wait_ready(timeout)
        return p

    @property
    def url(self) -> str:
        assert self.frontend is not None, "no frontend started"
        return self.frontend.ready["url"]

    @property
    def rl_url(self) -> str:
        assert self.frontend is not None, "no frontend started"
        return self.frontend.ready["rl_url"]

    def stop(self) -> None:
        stop_all(list(reversed(self.procs)))
        self.procs.clear()

    def __enter__(self) -> LocalFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
