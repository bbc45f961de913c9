"""The process around an engine: request plane, system server, discovery registration,
clean shutdown. `python -m rlfleet.vllm` and `python -m rlfleet.mocker` both end here."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from collections.abc import Callable
from typing import Any

import uvloop

from rlfleet.protocol.admin import SET_ADMISSION
from rlfleet.runtime import metrics, tracing
from rlfleet.runtime.address import advertised_host, discovery_peer, http_url, warn_if_unreachable
from rlfleet.runtime.auth import settle_admin_token
from rlfleet.runtime.discovery import Discovery, Registration, new_instance_id, open_discovery
from rlfleet.runtime.http import AppServer, bind_socket
from rlfleet.runtime.logs import add_log_args, setup_logging
from rlfleet.runtime.progress import Progress
from rlfleet.runtime.tracing import add_tracing_args
from rlfleet.worker.admission import FIELDS as ADMISSION_FIELDS
from rlfleet.worker.admission import Admission
from rlfleet.worker.engine import Engine
from rlfleet.worker.request_plane import WorkerPlane
from rlfleet.worker.system_server import FaultInjector, FleetFence, Route, system_app

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
    add("--admin-token", default=None,
        help="require `Authorization: Bearer <token>` on mutating admin routes and on the "
             "request plane (/generate, /abort, /tokenize, the stream plane; frontends then "
             "need the same token) (other users "
             "of the host can read a command line: prefer --admin-token-file or "
             "$RLFLEET_ADMIN_TOKEN)")
    add("--admin-token-file", default=os.environ.get("RLFLEET_ADMIN_TOKEN_FILE"),
        help="read the admin token from this file (default: $RLFLEET_ADMIN_TOKEN_FILE, else "
             "$RLFLEET_ADMIN_TOKEN)")
    add("--allowed-weights-root", action="append", default=[],
        help="update_weights_from_disk reads only under these directories")
    add("--trust-request-chat-template", action="store_true",
        help="render chat templates that clients send (chat_template_kwargs.chat_template); "
             "off by default: a template is code the worker runs")
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


def settle_worker_args(args: argparse.Namespace) -> None:
    """Checks and resolutions of the worker flags; ValueError says what to change."""
    settle_admin_token(args)


def staging_area(args: argparse.Namespace, engine: Any = None):
    """The worker's staging area for versions pulled while it serves (stage_weights); the
    engine prepares each one for a short apply before it is READY."""
    from rlfleet.weights.staging import StagingArea

    return StagingArea(args.weights_staging_dir, catalog=args.weights_catalog,
                       allowed_roots=args.allowed_weights_root, admin_token=args.admin_token,
                       engine=engine)


async def joins_controlled_fleet(discovery: Discovery, namespace: str, model: str) -> str | None:
    """Why a worker joining now must start gated: a controller (a policy-refresh coordinator,
    an operator) manages the admission of this model's workers, so the weights this one
    starts with are not the fleet's verified policy until the controller says so. None
    when no worker of the model is controlled (or the store cannot tell: then as before)."""
    try:
        entries = await asyncio.wait_for(discovery.list(namespace, COMPONENT, "generate"), 10)
    except Exception as e:  # registration will say whether the store works
        log.warning("cannot tell whether the fleet is controlled: %r", e)
        return None
    peers = [e for e in entries if e.get("model") == model and e.get("controlled")]
    if not peers:
        return None
    policies = sorted({f"{p['fleet_policy'].get('version')} ({p['fleet_policy'].get('digest')})"
                       for p in peers if isinstance(p.get("fleet_policy"), dict)})
    return ("joined a fleet whose admission a coordinator controls"
            + (f" (serving {', '.join(policies)})" if policies else "")
            + ": gated until it verifies this worker")


ENGINE_WATCH_INTERVAL = 2.0


async def _watch_engine(engine: Engine, admission: Admission) -> None:
    """A dead engine closes the worker to rollouts at once (its entry says why), whether or
    not anyone probes its liveness."""
    check = getattr(engine, "check_health", None)
    if check is None:
        return
    while True:
        await asyncio.sleep(ENGINE_WATCH_INTERVAL)
        try:
            await check()
        except Exception as e:
            await admission.hold(f"the engine is not healthy: {e!r}")
            return


def run_worker(engine: Engine, args: argparse.Namespace,
               admin_routes: Callable[[], list[Route]] | None = None, staging=None,
               admission: Admission | None = None, fence: FleetFence | None = None) -> None:
    """serve_worker on uvloop (the worker's event loop carries every request's events)."""
    uvloop.run(serve_worker(engine, args, admin_routes, staging=staging, admission=admission,
                            fence=fence))


async def serve_worker(engine: Engine, args: argparse.Namespace,
                       admin_routes: Callable[[], list[Route]] | None = None,
                       staging=None, admission: Admission | None = None,
                       fence: FleetFence | None = None) -> None:
    """Start the engine, serve it, register it, and run until SIGTERM/SIGINT. With a
    `staging` area, the system server also serves the applied version's files to peers
    (GET /weights/<version>/<file>). `admission`: the one the admin routes share (they
    hold the worker closed while its weights are uncertain); `fence`: the fleet epoch the
    admin routes report (EngineAdmin.fence). The discovery entry carries the admission
    state, the applied policy (weight_version, weight_digest, weight_step) and the newest
    fleet epoch, and is republished whenever one of them changes."""
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
    plane = WorkerPlane(engine, faults, args.trust_request_chat_template, args.admin_token)
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
    admission = admission or Admission()
    if args.start_gated:
        admission.gate_reason = "started gated: not yet verified"
    serving = asyncio.Event()  # set once registered; /health says "ready" from then on
    fence = fence if fence is not None else FleetFence()
    publishing = asyncio.Lock()  # one entry write at a time, each from the current state
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

    def live_fields() -> dict[str, Any]:
        """What the entry says about this worker's state now."""
        return {**admission.fields(), **engine.weight_identity(), "fleet_epoch": fence.newest}

    def entry_now(entry: dict[str, Any]) -> dict[str, Any]:
        return {**{k: v for k, v in entry.items() if k not in ADMISSION_FIELDS},
                **live_fields()}

    async def publish() -> None:
        """Write the entries again if the state they describe changed."""
        async with publishing:
            for reg in regs:
                entry = entry_now(reg.entry)
                if entry != reg.entry:
                    await reg.update(entry)

    async def changed() -> None:
        try:
            await publish()
        except Exception as e:  # noqa: BLE001 - the keep-alive publishes it once it can
            log.warning("could not publish this worker's new state in discovery: %r", e)

    if args.system_port is not None:
        # never behind a long control call: a worker can always be taken out of rotation
        routes = (admin_routes() if admin_routes else []) + [
            Route(SET_ADMISSION, admission.set_admission)]
        endpoints = ["generate", "rl"] if args.enable_rl else ["generate"]

        def health() -> dict[str, Any]:
            state = "ready" if serving.is_set() else "notready"
            return {"endpoints": dict.fromkeys(endpoints, state), "instance_id": instance_id,
                    "model": engine.info.served_model_name, "running": engine.num_running(),
                    "tokens_per_s": rate.rate(), **live_fields()}

        app = system_app(routes, admin_token=args.admin_token, faults=faults, health=health,
                         ready=serving.is_set, fence=fence, changed=changed)
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
    discovery = open_discovery(args.discovery)
    if not admission.gated:
        why = await joins_controlled_fleet(discovery, args.namespace, info.served_model_name)
        if why:
            log.warning("%s", why)
            admission.gate_reason = why
    base.update(live_fields())
    regs.append(await discovery.register(
        {**base, "endpoint": "generate",
         "request_plane_url": f"dyn://{args.namespace}.{COMPONENT}.generate"}, ttl=args.lease_ttl))
    if args.enable_rl:
        regs.append(await discovery.register(
            {**base, "endpoint": "rl", "request_plane_url": f"dyn://{args.namespace}.{COMPONENT}.rl"},
            ttl=args.lease_ttl))
    await admission.attach(publish)

    background: set[asyncio.Future] = set()

    async def rejoined(entry: dict[str, Any]) -> dict[str, Any]:
        """The worker was out of discovery for a while (stopped, cut off): a controlled
        fleet may have moved on without it, so it re-joins gated, as a new worker would."""
        if not admission.gated:
            why = await joins_controlled_fleet(discovery, args.namespace, info.served_model_name)
            if why:
                log.warning("re-joined after its lease lapsed: %s", why)
                admission.gate_reason = f"re-joined after its lease lapsed: {why}"
                # the other registrations too (each waits for its own keep-alive's lock)
                task = asyncio.ensure_future(changed())
                background.add(task)
                task.add_done_callback(background.discard)
        return entry_now(entry)

    for reg in regs:
        reg.on_lapse = rejoined
    serving.set()
    watch = asyncio.create_task(_watch_engine(engine, admission), name="engine-watch")
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
        watch.cancel()
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
