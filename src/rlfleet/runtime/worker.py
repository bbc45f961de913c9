"""The process around an engine: request plane, system server, discovery registration,
clean shutdown. `python -m rlfleet.vllm` and `python -m rlfleet.mocker` both end here."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import uvloop

from rlfleet.runtime.discovery import Registration, new_instance_id, open_discovery
from rlfleet.runtime.engine import Engine
from rlfleet.runtime.http import AppServer, bind_socket
from rlfleet.runtime.request_plane import WorkerPlane
from rlfleet.runtime.system_server import FaultInjector, Route, failed, ok, system_app

log = logging.getLogger("rlfleet.worker")

COMPONENT = "backend"


def add_worker_args(p: argparse.ArgumentParser) -> None:
    """Flags every worker shares, whatever its engine."""
    p.add_argument("--served-model-name", default=None,
                   help="name clients use in `model` (default: the model directory's name)")
    p.add_argument("--host", default="127.0.0.1", help="request-plane bind address")
    p.add_argument("--port", type=int, default=0, help="request-plane port (0: any free port)")
    p.add_argument("--discovery", default=None,
                   help="file:///dir or etcd://host:port (default: $RLFLEET_DISCOVERY, "
                        "else a per-user directory)")
    p.add_argument("--namespace", default=os.environ.get("DYN_NAMESPACE", "dynamo"))
    p.add_argument("--lease-ttl", type=float, default=float(os.environ.get("RLFLEET_LEASE_TTL", 10)),
                   help="seconds a crashed worker stays listed")
    p.add_argument("--enable-rl", action="store_true",
                   help="advertise the `rl` endpoint so GET /v1/rl/workers lists this worker")
    p.add_argument("--system-host", default="127.0.0.1", help="system-server bind address")
    p.add_argument("--system-port", type=int,
                   default=int(os.environ["DYN_SYSTEM_PORT"]) if os.environ.get("DYN_SYSTEM_PORT")
                   else None,
                   help="system-server port (default: $DYN_SYSTEM_PORT; unset: no system server)")
    p.add_argument("--admin-token", default=os.environ.get("RLFLEET_ADMIN_TOKEN"),
                   help="require `Authorization: Bearer <token>` on mutating admin routes")
    p.add_argument("--allowed-weights-root", action="append", default=[],
                   help="update_weights_from_disk reads only under these directories")
    p.add_argument("--enable-fault-injection", action="store_true",
                   help="accept POST /engine/fault_injection (tests only)")
    p.add_argument("--start-gated", action="store_true",
                   help="register closed to rollouts until a coordinator verifies this worker "
                        "and calls set_admission (replacement workers in an RL fleet)")
    p.add_argument("--log-level", default=os.environ.get("RLFLEET_LOG_LEVEL", "info"))


@dataclass
class Admission:
    gated: bool
    reason: str | None = None


def _advertised_host(bind_host: str) -> str:
    if bind_host in ("0.0.0.0", "::"):
        return socket.gethostname()
    return bind_host


def run_worker(engine: Engine, args: argparse.Namespace,
               admin_routes: Callable[[], list[Route]] | None = None) -> None:
    """serve_worker on uvloop (the worker's event loop carries every request's events)."""
    uvloop.run(serve_worker(engine, args, admin_routes))


async def serve_worker(engine: Engine, args: argparse.Namespace,
                       admin_routes: Callable[[], list[Route]] | None = None) -> None:
    """Start the engine, serve it, register it, and run until SIGTERM/SIGINT."""
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    await engine.start()
    instance_id = new_instance_id()
    faults = FaultInjector() if args.enable_fault_injection else None
    plane = WorkerPlane(engine, faults)
    rp = AppServer(plane.http_app(), bind_socket(args.host, args.port))
    await rp.start()
    servers = [rp]
    host = _advertised_host(args.host)
    request_url = f"http://{host}:{rp.port}"
    # the stream plane (what frontends use) on a free port beside the HTTP request plane
    stream = await plane.serve(bind_socket(args.host, 0))
    stream_address = f"[{host}]:{stream.port}" if ":" in host else f"{host}:{stream.port}"
    system_url = None
    regs: list[Registration] = []
    admission = Admission(gated=args.start_gated)

    async def set_admission(body: dict) -> dict:
        """Open or close this worker to rollout traffic: the flag lives in its own discovery
        entry, so every frontend stops (or starts) routing to it."""
        open_ = body.get("open")
        if not isinstance(open_, bool):
            return failed("open (boolean) is required")
        reason = body.get("reason")
        admission.gated, admission.reason = not open_, reason if not open_ else None
        for reg in regs:
            await reg.update({**reg.entry, "gated": admission.gated,
                              "gate_reason": admission.reason})
        return ok(open=open_, reason=admission.reason)

    if args.system_port is not None:
        routes = (admin_routes() if admin_routes else []) + [Route("set_admission", set_admission)]
        app = system_app(routes, admin_token=args.admin_token, faults=faults,
                         health=lambda: {"instance_id": instance_id,
                                         "model": engine.info.served_model_name,
                                         "gated": admission.gated, **engine.weight_identity()})
        ss = AppServer(app, bind_socket(args.system_host, args.system_port))
        await ss.start()
        servers.append(ss)
        system_url = f"http://{_advertised_host(args.system_host)}:{ss.port}"

    info = engine.info
    base: dict[str, Any] = {
        "namespace": args.namespace, "component": COMPONENT, "instance_id": instance_id,
        "transport": {"http": request_url}, "stream_plane": stream_address,
        "model": info.served_model_name,
        "model_path": info.model_path, "vocab_size": info.vocab_size,
        "max_model_len": info.max_model_len, "pid": os.getpid(),
    }
    if system_url:
        base["system_url"] = system_url
    if admission.gated:
        base["gated"], base["gate_reason"] = True, "started gated: not yet verified"
    discovery = open_discovery(args.discovery)
    regs.append(await discovery.register(
        {**base, "endpoint": "generate",
         "request_plane_url": f"dyn://{args.namespace}.{COMPONENT}.generate"}, ttl=args.lease_ttl))
    if args.enable_rl:
        regs.append(await discovery.register(
            {**base, "endpoint": "rl", "request_plane_url": f"dyn://{args.namespace}.{COMPONENT}.rl"},
            ttl=args.lease_ttl))
    # one line on stdout that launchers (tests, `rlfleet up`, the demo) wait for
    print(f"RLFLEET_WORKER_READY instance_id={instance_id} url={request_url} "
          f"system_url={system_url or ''} model={info.served_model_name} "
          f"stream={stream_address}", flush=True)
    log.info("worker %s serving %s at %s (system server: %s, discovery: %s)", instance_id,
             info.served_model_name, request_url, system_url, discovery.url)
    try:
        await stop.wait()
    finally:
        log.info("shutting down worker %s", instance_id)
        for reg in regs:
            try:
                await asyncio.wait_for(reg.close(), 5)
            except Exception as e:  # the lease will expire anyway
                log.warning("deregistration failed: %r", e)
        await discovery.close()
        await stream.stop()
        for s in servers:
            await s.stop()
        await engine.shutdown()
