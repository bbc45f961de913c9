"""Start and stop local fleet processes (frontend, workers) for `rlfleet up`, the demo,
benchmarks and tests. Every process gets the engine environment written by setup
(`<venv>/rlfleet.env`), its own process group, and a log file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


def engine_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for engine processes: os.environ plus <venv>/rlfleet.env (the CPU or
    GPU engine settings chosen at setup time)."""
    env = dict(os.environ if base is None else base)
    envfile = Path(sys.prefix) / "rlfleet.env"
    if envfile.exists():
        for line in envfile.read_text().splitlines():
            key, sep, value = line.partition("=")
            if sep and key.strip() and key.strip() not in env:
                env[key.strip()] = value.strip()
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _parse_ready(line: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path
    ready: dict[str, str] = field(default_factory=dict)
    _ready_event: threading.Event = field(default_factory=threading.Event)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def wait_ready(self, timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while not self._ready_event.wait(0.2):
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.popen.returncode} before it "
                                   f"was ready; log: {self.log_path}\n{self.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready after {timeout:.0f}s; log: {self.log_path}"
                                   f"\n{self.tail()}")
        return self.ready

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit code. Whatever the process
        left behind in its group (an engine-core child, say) is killed too."""
        self.signal(signal.SIGTERM)
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            code = self.popen.wait(5)
        deadline = time.monotonic() + 5.0
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
            while time.monotonic() < deadline:  # until the kernel has removed them all
                os.killpg(self.popen.pid, 0)
                time.sleep(0.05)
        except (ProcessLookupError, PermissionError):
            pass
        return code


def spawn(name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None,
          ready_marker: str = "RLFLEET_", cwd: Path | None = None) -> Proc:
    """Start `argv` in its own process group; its output goes straight to
    <log_dir>/<name>.log (no pipe: a busy parent never blocks the child's writes), and the
    first line starting with `ready_marker` and containing `_READY` marks it ready."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as out:
        popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=engine_env(env),
                                 start_new_session=True, cwd=cwd)
    proc = Proc(name, popen, log_path)

    def watch() -> None:
        """Read the log as it grows until the ready line (or the process ends)."""
        with open(log_path, "rb") as f:
            pending = b""
            while True:
                chunk = f.readline()
                if not chunk:
                    if popen.poll() is not None:
                        return
                    time.sleep(0.05)
                    continue
                pending += chunk
                if not pending.endswith(b"\n"):
                    continue
                line, pending = pending.decode(errors="replace"), b""
                if line.startswith(ready_marker) and "_READY" in line.split()[0]:
                    proc.ready = _parse_ready(line.strip())
                    proc._ready_event.set()
                    return

    threading.Thread(target=watch, name=f"ready-{name}", daemon=True).start()
    return proc


class Fleet:
    """A local fleet: one frontend and any number of workers sharing one discovery store.
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
                     env: dict[str, str] | None = None, cwd: Path | None = None) -> Proc:
        """kind: "vllm" (python -m rlfleet.vllm) or "mocker" (python -m rlfleet.mocker);
        `cwd`: the directory a relative --model is resolved in."""
        name = name or f"{kind}-worker-{len(self.workers)}"
        argv = [sys.executable, "-m", f"rlfleet.{kind}", "--lease-ttl", str(self.lease_ttl),
                *self._common(), *extra]
        p = spawn(name, argv, self.workdir / "logs", env={**os.environ, **(env or {})}, cwd=cwd)
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
        for p in reversed(self.procs):
            p.signal(signal.SIGTERM)
        for p in reversed(self.procs):
            p.stop()
        self.procs.clear()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
