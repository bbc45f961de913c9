"""`python -m rlfleet.frontend --processes K`: K frontend processes serving one port.

Each process binds the port with SO_REUSEPORT, so the kernel spreads the connections over
them, and each has its own event loop, discovery watch and worker links. What must hold
across processes holds because it does not live in any one of them:
- a request with an X-Request-Id is kept by the worker that runs it, and every process
  routes an ID to the same worker (rlfleet.worker.kept, rlfleet.frontend.router.rank):
  a retry through another process attaches to the first attempt; a cancel through another
  process is relayed to that worker, which checks the cancel token;
- the staleness bound (nvext.policy) is checked per request against discovery, which every
  process follows;
- /metrics, answered by whichever process the scrape reaches, sums every process's series
  (prometheus_client's multiprocess mode, in a directory this supervisor makes and
  removes), with the fleet as that process sees it in discovery.

This process only supervises: it reserves the ports (so that port 0 picks one port for
all), starts the K processes, prints the one ready line once all are ready, restarts a
process that dies, and stops them all on SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time

from prometheus_client import multiprocess

from rlfleet.runtime.launch import Proc, spawn_relayed, stop_all
from rlfleet.runtime.logs import announce_ready
from rlfleet.runtime.metrics import MULTIPROC_ENV

log = logging.getLogger("rlfleet.frontend")

READY_TIMEOUT = 120.0  # seconds for every process to be ready


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound (not listening) to `host:port` with SO_REUSEPORT: it holds the port
    (port 0: picks one) while listening processes bind it too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def run_group(args: argparse.Namespace, argv: list[str]) -> int:
    """Serve `argv` (this command line) as `args.processes` processes on one port until
    SIGTERM or SIGINT; returns the exit code."""
    held = [reserve_port(args.http_host, args.http_port)]
    ports = ["--http-port", str(held[0].getsockname()[1])]
    if args.enable_rl:
        held.append(reserve_port(args.http_host, args.rl_port))
        ports += ["--rl-port", str(held[1].getsockname()[1])]
    mp_dir = tempfile.mkdtemp(prefix="rlfleet-frontend-metrics-")
    env = {**os.environ, MULTIPROC_ENV: mp_dir}
    child_argv = [sys.executable, "-m", "rlfleet.frontend", *argv, *ports,
                  "--processes", "1", "--reuse-port"]
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    def child(i: int) -> Proc:  # its output is this process's (less its ready line)
        return spawn_relayed(f"frontend process {i}", child_argv, env)

    children: list[Proc] = []
    try:
        children = [child(i) for i in range(args.processes)]
        deadline = time.monotonic() + READY_TIMEOUT
        try:
            fields = [c.wait_ready(max(0.0, deadline - time.monotonic())) for c in children][0]
        except RuntimeError as e:  # one exited
            log.error("%s; stopping the frontend", e)
            return 1
        except TimeoutError:
            log.error("frontend processes not all ready after %.0fs; stopping the frontend",
                      READY_TIMEOUT)
            return 1
        announce_ready("frontend", {**fields, "processes": args.processes}, args.log_format)
        log.info("frontend: %d processes at %s", args.processes, fields.get("url"))
        while not stop.wait(0.5):
            for i, c in enumerate(children):
                code = c.popen.poll()
                if code is None:
                    continue
                log.warning("frontend process %d (pid %d) exited with code %s; restarting it",
                            i, c.pid, code)
                multiprocess.mark_process_dead(c.pid, mp_dir)
                children[i] = child(i)
        return 0
    finally:
        stop_all(children)
        for s in held:
            s.close()
        shutil.rmtree(mp_dir, ignore_errors=True)
