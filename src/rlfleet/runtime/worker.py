"""The process around an engine: request plane, system server, discovery registration,
clean shutdown. `python -m rlfleet.vllm` and `python -m rlfleet.mocker` both end here."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import uvloop

from rlfleet.runtime import metrics, tracing
from rlfleet.runtime.address import advertised_host, discovery_peer, http_url, warn_if_unreachable
from rlfleet.runtime.discovery import Registration, new_instance_id, open_discovery
from rlfleet.runtime.engine import Engine
from rlfleet.runtime.http import AppServer, bind_socket
from rlfleet.runtime.logs import add_log_args, setup_logging
from rlfleet.runtime.progress import Progress
from rlfleet.runtime.request_plane import WorkerPlane
from rlfleet.runtime.system_server import FaultInjector, Route, failed, ok, system_app
from rlfleet.runtime.tracing import add_tracing_args

log = logging.getLogger("rlfleet.worker")

COMPONENT = "backend"


def add_worker_args(p: argparse.ArgumentParser) -> None:
    """Flags every worker shares, whatever its engine, in their own group. Flags the engine's
    parser already defines (vLLM's --served-model-name and --log-level) are left to it."""
    g = p.add_argument_group("rlfleet worker", "serving, discovery, admin (the engine's own "
                             "arguments are listed in the other groups)")

    def add(flag: str, **kw: Any) -> None:
        if flag not in p._option_string_actions:
            g.add_argument(flag, **kw)

    add("--served-model-name", default=None,
        help="name clients use in `model` (default: the --model string)")
    add("--host", default="127.0.0.1",
        help="bind address of the request plane and (unless --system-host) the system server; "
             "0.0.0.0 for a fleet across hosts")
    add("--port", type=int, default=0, help="request-plane port (0: any free port)")
    add("--advertise-host", default=None,
        help="address other hosts use to reach this worker (default: the bind address; when "
             "bound to 0.0.0.0: $VLLM_HOST_IP, $POD_IP, else the interface that routes to the "
             "discovery store)")
    add("--discovery", default=None,
        help="file:///dir or etcd://host:port[,host:port] (default: $RLFLEET_DISCOVERY, "
             "$ETCD_ENDPOINTS, else a per-user directory)")
    add("--namespace", default=os.environ.get("DYN_NAMESPACE", "dynamo"))
    add("--lease-ttl", type=float, default=float(os.environ.get("RLFLEET_LEASE_TTL", 10)),
        help="seconds a crashed worker stays listed")
    add("--enable-rl", action="store_true",
        help="advertise the `rl` endpoint so GET /v1/rl/workers lists this worker")
    add("--system-host", default=None, help="system-server bind address (default: --host)")
    add("--system-port", type=int,
        default=int(os.environ["DYN_SYSTEM_PORT"]) if os.environ.get("DYN_SYSTEM_PORT") else None,
        help="system-server port (default: $DYN_SYSTEM_PORT; unset: no system server)")
    add("--admin-token", default=os.environ.get("RLFLEET_ADMIN_TOKEN"),
        help="require `Authorization: Bearer <token>` on mutating admin routes")
    add("--allowed-weights-root", action="append", default=[],
        help="update_weights_from_disk reads only under these directories")
    add("--enable-fault-injection", action="store_true",
        help="accept POST /engine/fault_injection (tests only)")
    add("--start-gated", action="store_true",
        help="register closed to rollouts until a coordinator verifies this worker "
             "and calls set_admission (replacement workers in an RL fleet)")
    add_log_args(g)
    add_tracing_args(g)
    add("--weights-catalog", default=os.environ.get("RLFLEET_WEIGHTS_CATALOG"),
        help="version catalog (sqlite:///path or etcd://host:port) for staged weights: "
             "digests, leases, and the peers that hold a version (default: "
             "$RLFLEET_WEIGHTS_CATALOG; none: stage without it)")
    add("--weights-staging-dir", default=os.environ.get("RLFLEET_WEIGHTS_STAGING_DIR"),
        help="where staged versions are held (default: a directory in /dev/shm)")


@dataclass
class Admission:
    gated: bool
    reason: str | None = None


def staging_area(args: argparse.Namespace):
    """The worker's staging area for versions pulled while it serves (stage_weights)."""
    from rlfleet.weights.staging import StagingArea

    return StagingArea(args.weights_staging_dir, catalog=args.weights_catalog,
                       allowed_roots=args.allowed_weights_root, admin_token=args.admin_token)


def run_worker(engine: Engine, args: argparse.Namespace,
               admin_routes: Callable[[], list[Route]] | None = None, staging=None) -> None:
    """serve_worker on uvloop (the worker's event loop carries every request's events)."""
    uvloop.run(serve_worker(engine, args, admin_routes, staging=staging))


async def serve_worker(engine: Engine, args: argparse.Namespace,
                       admin_routes: Callable[[], list[Route]] | None = None,
                       staging=None) -> None:
    """Start the engine, serve it, register it, and run until SIGTERM/SIGINT. With a
    `staging` area, the system server also serves the applied version's files to peers
    (GET /weights/<version>/<file>)."""
    setup_logging(getattr(args, "log_level", None), getattr(args, "log_format", None))
    tracing.setup(f"rlfleet-worker {engine.info.served_model_name}",
                  getattr(args, "otlp_traces_endpoint", None))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    with Progress(f"starting the engine for {engine.info.served_model_name}"):
        await engine.start()
    instance_id = new_instance_id()
    faults = FaultInjector() if args.enable_fault_injection else None
    plane = WorkerPlane(engine, faults)
    rp = AppServer(plane.http_app(), bind_socket(args.host, args.port))
    await rp.start()
    servers = [rp]
    toward = discovery_peer(args.discovery)
    host = advertised_host(args.host, args.advertise_host, toward)
    warn_if_unreachable("this worker", host, args.discovery)
    request_url = http_url(host, rp.port)
    # the stream plane (what frontends use) on a free port beside the HTTP request plane
    stream = await plane.serve(bind_socket(args.host, 0))
    stream_address = f"[{host}]:{stream.port}" if ":" in host else f"{host}:{stream.port}"
    system_url = None
    regs: list[Registration] = []
    admission = Admission(gated=args.start_gated, reason="started gated: not yet verified"
                          if args.start_gated else None)
    serving = asyncio.Event()  # set once registered; /health says "ready" from then on
    # what the status page and dashboards read: the policy and the gate at scrape time,
    # tokens per second from a once-a-second sample of the token counter
    state_key = metrics.WORKER_STATE.add(engine.info.served_model_name,
                                         engine.weight_identity, lambda: admission.gated)
    rate = metrics.TokenRate(engine.series)

    async def sample_rate() -> None:
        while True:
            rate.sample()
            await asyncio.sleep(1.0)
    sampler = asyncio.create_task(sample_rate())

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
        endpoints = ["generate", "rl"] if args.enable_rl else ["generate"]

        def health() -> dict[str, Any]:
            state = "ready" if serving.is_set() else "notready"
            return {"endpoints": dict.fromkeys(endpoints, state), "instance_id": instance_id,
                    "model": engine.info.served_model_name, "gated": admission.gated,
                    "gate_reason": admission.reason, "running": engine.num_running(),
                    "tokens_per_s": rate.rate(), **engine.weight_identity()}

        app = system_app(routes, admin_token=args.admin_token, faults=faults, health=health,
                         ready=serving.is_set)
        system_host = args.system_host or args.host
        ss = AppServer(app, bind_socket(system_host, args.system_port))
        await ss.start()
        servers.append(ss)
        system_url = http_url(advertised_host(system_host, args.advertise_host, toward), ss.port)
        if staging is not None:
            from rlfleet.weights.publish import add_weights_route

            add_weights_route(app, staging.resident_dir, args.admin_token)
    if staging is not None:
        staging.attach(str(instance_id), system_url)

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
        base["gated"], base["gate_reason"] = True, admission.reason
    discovery = open_discovery(args.discovery)
    regs.append(await discovery.register(
        {**base, "endpoint": "generate",
         "request_plane_url": f"dyn://{args.namespace}.{COMPONENT}.generate"}, ttl=args.lease_ttl))
    if args.enable_rl:
        regs.append(await discovery.register(
            {**base, "endpoint": "rl", "request_plane_url": f"dyn://{args.namespace}.{COMPONENT}.rl"},
            ttl=args.lease_ttl))
    serving.set()
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
        serving.clear()
        sampler.cancel()
        metrics.WORKER_STATE.remove(state_key)
        for reg in regs:
            try:
                await asyncio.wait_for(reg.close(), 5)
            except Exception as e:  # the lease will expire anyway
                log.warning("deregistration failed: %r", e)
        await discovery.close()
        await stream.stop()
        for s in servers:
            await s.stop()
        if staging is not None:
            await staging.close()
        await engine.shutdown()
