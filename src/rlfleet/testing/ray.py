"""Start a throw-away local Ray head for tests: ``with run_ray_head() as address: ...``.

Bound to 127.0.0.1 (Ray otherwise picks the machine's outward address), with its own temp
dir and ports, in its own process group that is killed at the end."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from rlfleet.testing.etcd import free_port

# keeps Ray's node address on loopback (its default on macOS/Windows; read by `ray start`,
# drivers and workers alike)
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


def ray_binary() -> str:
    local = Path(sys.executable).parent / "ray"
    return str(local) if local.exists() else (shutil.which("ray") or "ray")


#: what `ray start` says when its raylet did not register within its own fixed 30 s (a
#: loaded machine): the start is tried again
STARTUP_TIMED_OUT = "timed out during startup"


@contextlib.contextmanager
def run_ray_head(num_cpus: int = 4, timeout: float = 300, attempts: int = 3) -> Iterator[str]:
    deadline = time.monotonic() + timeout
    for attempt in range(1, attempts + 1):
        port = free_port()
        tmp = Path(tempfile.mkdtemp(prefix="rlfray-", dir="/tmp"))  # short: unix socket paths
        proc, log = _start_head(port, tmp, num_cpus)
        try:
            while b"Ray runtime started" not in (tmp / "head.log").read_bytes():
                if proc.poll() is not None or time.monotonic() > deadline:
                    said = (tmp / "head.log").read_text()[-3000:]
                    if (STARTUP_TIMED_OUT in said and attempt < attempts
                            and time.monotonic() < deadline):
                        break
                    raise RuntimeError(f"ray head not up (attempt {attempt}): {said}")
                time.sleep(0.2)
            else:
                with socket.create_connection(("127.0.0.1", port), timeout=5):
                    pass
                yield f"127.0.0.1:{port}"
                return
        finally:
            _stop_head(proc, log, tmp)


def _start_head(port: int, tmp: Path, num_cpus: int) -> tuple[subprocess.Popen, IO[bytes]]:
    # no idle Python workers started ahead of need: a lighter start on a small machine
    env = {**os.environ, **LOOPBACK_ENV, "RAY_enable_worker_prestart": "0",
           "RAY_prestart_worker_first_driver": "0"}
    cmd = [ray_binary(), "start", "--head", "--block", "--port", str(port),
           "--node-ip-address", "127.0.0.1", "--num-cpus", str(num_cpus), "--num-gpus", "0",
           "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", str(tmp),
           "--ray-client-server-port", str(free_port()),
           "--dashboard-agent-listen-port", str(free_port())]
    log = open(tmp / "head.log", "wb")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True), log


def _stop_head(proc: subprocess.Popen, log: IO[bytes], tmp: Path) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)
    log.close()
    shutil.rmtree(tmp, ignore_errors=True)
