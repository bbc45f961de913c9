"""The process around an engine: request plane, system server, discovery registration,
clean shutdown. `python -m rlfleet.vllm` and `python -m rlfleet.mocker` both end here."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvloop

from rlfleet.protocol.admin import SET_ADMISSION
from rlfleet.protocol.rl import GENERATE_ENDPOINT, RL_ENDPOINT, WORKER_COMPONENT, WorkerEntry
from rlfleet.runtime import metrics, tracing
from rlfleet.runtime.address import advertised_host, discovery_peer, http_url, warn_if_unreachable
from rlfleet.runtime.auth import settle_admin_token
from rlfleet.runtime.discovery import Discovery, Registration, new_instance_id, open_discovery
from rlfleet.runtime.logs import add_log_args, announce_ready, keep_output_json, setup_logging
from rlfleet.runtime.progress import Progress
from rlfleet.runtime.server import AppServer, bind_socket, freeze_heap
from rlfleet.runtime.tracing import add_tracing_args
from rlfleet.weights.fanout import add_fanout_routes
from rlfleet.weights.publish import add_weights_route
from rlfleet.weights.staging import StagingArea
from rlfleet.worker.admission import Admission
from rlfleet.worker.engine import Engine
from rlfleet.worker.relay import Relay
from rlfleet.worker.stream_server import WorkerPlane
from rlfleet.worker.system_server import (
    FaultInjector,
    FleetFence,
    MountedRoutes,
    Route,
    system_app,
)

log = logging.getLogger("rlfleet.worker")


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
    add("--no-relay", action="store_true",
        help="do not serve the relay route (POST /engine/relay): a refresh coordinator then "
             "never asks this worker to run its calls on other workers")
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


def staging_area(args: argparse.Namespace, engine: Any = None) -> StagingArea:
    """The worker's staging area for versions pulled while it serves (stage_weights); the
    engine prepares each one for a short apply before it is READY. It knows the checkpoint
    directory the engine was started from (engine.info.model_path), the base of a delta
    named by that checkpoint's content digest alone."""
    model_path = Path(engine.info.model_path) if engine is not None else None
    return StagingArea(args.weights_staging_dir, catalog=args.weights_catalog,
                       allowed_roots=args.allowed_weights_root, admin_token=args.admin_token,
                       engine=engine,
                       startup_checkpoint=model_path if model_path and model_path.is_dir()
                       else None)


async def joins_controlled_fleet(discovery: Discovery, namespace: str, model: str) -> str | None:
    """Why a worker joining now must start gated: a controller (a policy-refresh coordinator,
    an operator) manages the admission of this model's workers, so the weights this one
    starts with are not the fleet's verified policy until the controller says so. None
    when no worker of the model is controlled (or the store cannot tell: then as before)."""
    try:
        entries = await asyncio.wait_for(
            discovery.list(namespace, WORKER_COMPONENT, GENERATE_ENDPOINT), 10)
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


async def _sample_rate(rate: metrics.TokenRate) -> None:
    """Tokens per second from a once-a-second sample of the token counter."""
    while True:
        rate.sample()
        await asyncio.sleep(1.0)


class WorkerProcess:
    """One started engine, served: its request plane (HTTP and the stream plane), its
    system server (with --system-port), and its discovery entries, which carry the
    admission state, the applied policy and the newest fleet epoch, and are republished
    whenever one of them changes."""

    def __init__(self, engine: Engine, args: argparse.Namespace,
                 admin_routes: Callable[[], list[Route]] | None = None, staging: Any = None,
                 admission: Admission | None = None, fence: FleetFence | None = None,
                 mounted: MountedRoutes | None = None, discovery: Discovery | None = None
                 ) -> None:
        """`discovery`: a store client shared with other workers of this process (its
        entries stay this worker's own, under the client's one lease on etcd; the owner of
        the client closes it); default: one of its own, from --discovery."""
        self.engine, self.args = engine, args
        self.mounted = mounted  # vLLM's native RL routes (rlfleet.worker.native_rl)
        self.admin_routes, self.staging = admin_routes, staging
        self.admission = admission or Admission()
        if args.start_gated:
            self.admission.gate_reason = "started gated: not yet verified"
        self.fence = fence if fence is not None else FleetFence()
        self.instance_id = new_instance_id()
        self.faults = FaultInjector() if args.enable_fault_injection else None
        self.plane = WorkerPlane(engine, self.faults, args.trust_request_chat_template,
                                 args.admin_token)
        self.endpoints = [GENERATE_ENDPOINT, RL_ENDPOINT] if args.enable_rl else [GENERATE_ENDPOINT]
        self._own_discovery = discovery is None
        self.discovery = open_discovery(args.discovery) if discovery is None else discovery
        self.serving = asyncio.Event()  # set once registered; /health says "ready" from then on
        self.servers: list[AppServer] = []  # the HTTP servers this worker owns (stops)
        self.regs: list[Registration] = []
        self.request_url = self.stream_address = ""
        self.system_url: str | None = None
        self.stream: Any = None
        self._toward = discovery_peer(args.discovery)
        self._publishing = asyncio.Lock()  # one entry write at a time, each from the current state
        self._background: set[asyncio.Future] = set()
        self._tasks: list[asyncio.Task] = []
        self._rate = metrics.TokenRate(engine.series)
        self._state_key: Any = None
        self.relay: Relay | None = None  # the relay route's clients (closed at stop)

    async def start(self) -> None:
        """Serve (one HTTP server for the request plane and the system server), register,
        and say so on stdout."""
        server = AppServer.shared(await self.bind())
        await server.start()
        self.servers.append(server)
        await self.go_live()

    async def bind(self) -> list[tuple[Any, socket.socket]]:
        """Bind the request plane and (with --system-port) the system server, start the
        stream plane, and learn the URLs; the HTTP apps and their sockets, for a server
        the caller starts (`start`, or one server for many workers: `serve_workers`)."""
        pairs = [self._request_plane()]
        self.stream = await self.plane.serve(bind_socket(self.args.host, 0))
        host = advertised_host(self.args.host, self.args.advertise_host, self._toward)
        port = self.stream.port
        self.stream_address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if self.args.system_port is not None:
            pairs.append(self._system())
        return pairs

    async def go_live(self, announce: bool = True, check_fleet: bool = True) -> None:
        """Once its HTTP server answers: register, watch the engine, and (`announce`) write
        the ready line on stdout. `check_fleet`: ask the store whether the fleet is
        controlled (False: the caller did, for many workers at once)."""
        # what the status page and dashboards read: the policy and the gate at scrape time
        self._state_key = metrics.WORKER_STATE.add(self.engine.info.served_model_name,
                                                   self.engine.serving_policy,
                                                   lambda: self.admission.gated)
        self._tasks.append(asyncio.create_task(_sample_rate(self._rate)))
        if self.staging is not None:
            self.staging.attach(str(self.instance_id), self.system_url)
        await self._register(check_fleet)
        self.serving.set()
        self._tasks.append(asyncio.create_task(_watch_engine(self.engine, self.admission),
                                               name="engine-watch"))
        model = self.engine.info.served_model_name
        if announce:  # one line on stdout that launchers (tests, `rlfleet up`, the demo) wait for
            freeze_heap()
            announce_ready("worker", self.ready_fields(), getattr(self.args, "log_format", None))
        log.info("worker %s serving %s at %s (system server: %s, discovery: %s)",
                 self.instance_id, model, self.request_url, self.system_url, self.discovery.url)

    def ready_fields(self) -> dict[str, Any]:
        return {"instance_id": self.instance_id, "url": self.request_url,
                "system_url": self.system_url or "",
                "model": self.engine.info.served_model_name, "stream": self.stream_address}

    def _request_plane(self) -> tuple[Any, socket.socket]:
        args = self.args
        sock = bind_socket(args.host, args.port)
        host = advertised_host(args.host, args.advertise_host, self._toward)
        warn_if_unreachable("this worker", host, args.discovery)
        self.request_url = http_url(host, sock.getsockname()[1])
        return self.plane.http_app(), sock

    def _system(self) -> tuple[Any, socket.socket]:
        args = self.args
        # never behind a long control call: a worker can always be taken out of rotation
        routes = (self.admin_routes() if self.admin_routes else []) + [
            Route(SET_ADMISSION, self.admission.set_admission)]
        for r in routes:  # commit_policy runs its probe on this worker's request plane
            if r.spec.name == "commit_policy" and hasattr(r.handler, "__self__") and \
                    hasattr(r.handler.__self__, "use_plane"):
                r.handler.__self__.use_plane(self.plane)
        if not getattr(args, "no_relay", False):
            self.relay = Relay(args.admin_token)
            routes.append(self.relay.route())
        app = system_app(routes, admin_token=args.admin_token, faults=self.faults,
                         health=self.health, ready=self.serving.is_set, fence=self.fence,
                         changed=self.changed, mounted=self.mounted)
        system_host = args.system_host or args.host
        sock = bind_socket(system_host, args.system_port)
        self.system_url = http_url(advertised_host(system_host, args.advertise_host,
                                                   self._toward), sock.getsockname()[1])
        if self.staging is not None:
            add_weights_route(app, self.staging.resident_dir, args.admin_token)
            add_fanout_routes(app, self.staging.held, args.admin_token)
        return app, sock

    # ---------------------------------------------------------------- what it says about itself

    def live_fields(self) -> dict[str, Any]:
        """What the entries and /health say about this worker's state now."""
        return {**self.admission.fields(), **self.engine.serving_policy().stamped(),
                "fleet_epoch": self.fence.newest}

    def health(self) -> dict[str, Any]:
        state = "ready" if self.serving.is_set() else "notready"
        return {"endpoints": dict.fromkeys(self.endpoints, state),
                "instance_id": self.instance_id, "model": self.engine.info.served_model_name,
                "running": self.engine.num_running(), "tokens_per_s": self._rate.rate(),
                **self.live_fields()}

    def entry(self, endpoint: str) -> dict[str, Any]:
        """This worker's discovery entry for `endpoint`, from its state now."""
        info = self.engine.info
        return WorkerEntry(
            namespace=self.args.namespace, component=WORKER_COMPONENT,
            instance_id=self.instance_id, transport={"http": self.request_url},
            stream_plane=self.stream_address, model=info.served_model_name,
            model_path=info.model_path, vocab_size=info.vocab_size,
            max_model_len=info.max_model_len, pid=os.getpid(), system_url=self.system_url,
            admin_base_url=self.system_url, world_size=info.world_size,
            weight_transfer_backend=info.weight_transfer_backend,
            **self.admission.fields(),
            policy=self.engine.serving_policy(),
            adapters=[{**a.policy.to_dict(), "rank": a.rank, "path": a.path, "open": a.open}
                      for a in self.engine.adapters()] or None,
            fleet_epoch=self.fence.newest, endpoint=endpoint,
            request_plane_url=f"dyn://{self.args.namespace}.{WORKER_COMPONENT}.{endpoint}",
            kv_events=self._kv_events(), kv_block_size=info.kv_block_size,
            logprobs_mode=info.logprobs_mode, tokenizer=info.tokenizer,
        ).to_entry()

    def _kv_events(self) -> str | None:
        """The engine's KV-event endpoint as a frontend connects to it: a wildcard bind
        address becomes the host this worker advertises."""
        ep = self.engine.info.kv_events
        if ep is None:
            return None
        rest, _, port = ep.removeprefix("tcp://").rpartition(":")
        if rest in ("*", "0.0.0.0", "[::]", "::"):
            host = self.stream_address.rpartition(":")[0]
            return f"tcp://{host}:{port}"
        return ep

    # ---------------------------------------------------------------- discovery

    async def _register(self, check_fleet: bool = True) -> None:
        if check_fleet and not self.admission.gated:
            await self._gate_if_controlled()
        for endpoint in self.endpoints:
            reg = await self.discovery.register(self.entry(endpoint), ttl=self.args.lease_ttl)
            self.regs.append(reg)
        await self.admission.attach(self.publish)
        for reg in self.regs:
            reg.on_lapse = self._rejoined

    async def _gate_if_controlled(self, context: str = "") -> bool:
        """Close the worker if it joins a fleet a controller manages; whether it did."""
        why = await joins_controlled_fleet(self.discovery, self.args.namespace,
                                           self.engine.info.served_model_name)
        if not why:
            return False
        reason = f"{context}: {why}" if context else why
        log.warning("%s", reason)
        self.admission.gate_reason = reason
        return True

    async def publish(self) -> None:
        """Write the entries again if the state they describe changed."""
        async with self._publishing:
            for reg in self.regs:
                entry = self.entry(reg.entry["endpoint"])
                if entry != reg.entry:
                    await reg.update(entry)

    async def changed(self) -> None:
        try:
            await self.publish()
        except Exception as e:  # noqa: BLE001 - the keep-alive publishes it once it can
            log.warning("could not publish this worker's new state in discovery: %r", e)

    async def _rejoined(self, entry: dict[str, Any]) -> dict[str, Any]:
        """The worker was out of discovery for a while (stopped, cut off): a controlled
        fleet may have moved on without it, so it re-joins gated, as a new worker would."""
        if not self.admission.gated and await self._gate_if_controlled(
                "re-joined after its lease lapsed"):
            # the other registrations too (each waits for its own keep-alive's lock)
            task = asyncio.ensure_future(self.changed())
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return self.entry(entry["endpoint"])

    # ---------------------------------------------------------------- shutdown

    async def stop(self) -> None:
        """Deregister, stop serving, shut the engine down."""
        log.info("shutting down worker %s", self.instance_id)
        self.serving.clear()
        for task in self._tasks:
            task.cancel()
        if self._state_key is not None:
            metrics.WORKER_STATE.remove(self._state_key)
        for reg in self.regs:
            try:
                await asyncio.wait_for(reg.close(), 5)
            except Exception as e:  # the lease will expire anyway
                log.warning("deregistration failed: %r", e)
        if self._own_discovery:
            await self.discovery.close()
        if self.stream is not None:
            await self.stream.stop()
        for s in self.servers:
            await s.stop()
        if self.relay is not None:
            await self.relay.aclose()
        if self.staging is not None:
            await self.staging.close()
        await self.engine.shutdown()


def _stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


@dataclass
class WorkerParts:
    """What one served worker is made of (see `WorkerProcess`)."""

    engine: Engine
    args: argparse.Namespace
    admin_routes: Callable[[], list[Route]] | None = None
    staging: Any = None
    admission: Admission | None = None
    fence: FleetFence | None = None
    mounted: MountedRoutes | None = None


REGISTER_CONCURRENCY = 64  # replicas registering (or deregistering) at once


def run_workers(parts: list[WorkerParts]) -> None:
    """serve_workers on uvloop, in a process of its own."""
    keep_output_json(getattr(parts[0].args, "log_format", None))
    uvloop.run(serve_workers(parts))


async def serve_worker(engine: Engine, args: argparse.Namespace,
                       admin_routes: Callable[[], list[Route]] | None = None,
                       staging=None, admission: Admission | None = None,
                       fence: FleetFence | None = None,
                       mounted: MountedRoutes | None = None) -> None:
    """Start the engine, serve it, register it, and run until SIGTERM/SIGINT. With a
    `staging` area, the system server also serves the applied version's files to peers
    (GET /weights/<version>/<file>). `admission`: the one the admin routes share (they
    hold the worker closed while its weights are uncertain); `fence`: the fleet epoch the
    admin routes report (EngineAdmin.fence); `mounted`: routes beside /engine/* (vLLM's
    native RL routes). See `WorkerProcess`."""
    await serve_workers([WorkerParts(engine, args, admin_routes, staging, admission, fence,
                                     mounted)])


async def serve_workers(parts: list[WorkerParts]) -> None:
    """`serve_worker` for one worker or many in this process (`python -m rlfleet.mocker
    --replicas N`): each its own engine, request plane, system server, admin state and
    discovery entries; one HTTP server for all their listeners and one client of the
    discovery store (on etcd, one lease for all their entries). Many: one ready line
    (RLFLEET_WORKERS_READY) once all registered."""
    args = parts[0].args
    setup_logging(getattr(args, "log_level", None), getattr(args, "log_format", None))
    name = parts[0].engine.info.served_model_name
    tracing.setup(f"rlfleet-worker {name}", getattr(args, "otlp_traces_endpoint", None))
    stop = _stop_on_signals()
    with Progress(f"starting the engine for {name}"
                  + (f" ({len(parts)} replicas)" if len(parts) > 1 else "")):
        await _bounded([p.engine.start() for p in parts])
    shared = open_discovery(args.discovery) if len(parts) > 1 else None
    workers = [WorkerProcess(p.engine, p.args, p.admin_routes, p.staging, p.admission,
                             p.fence, p.mounted, discovery=shared) for p in parts]
    server: AppServer | None = None
    try:
        if shared is None:
            await workers[0].start()
        else:
            server = AppServer.shared([pair for w in workers for pair in await w.bind()])
            await server.start()
            await _replicas_live(workers, shared, args)
        await stop.wait()
    finally:
        await _bounded([w.stop() for w in workers])
        if server is not None:
            await server.stop()
        if shared is not None:
            await shared.close()


async def _replicas_live(workers: list[WorkerProcess], discovery: Discovery,
                         args: argparse.Namespace) -> None:
    """Register every replica (whether the fleet is controlled is asked once, not once per
    replica: each ask lists the store) and say so in one line."""
    model = workers[0].engine.info.served_model_name
    why = await joins_controlled_fleet(discovery, args.namespace, model)
    for w in workers:
        if why and not w.admission.gated:
            w.admission.gate_reason = why
    await _bounded([w.go_live(announce=False, check_fleet=False) for w in workers])
    freeze_heap()
    announce_ready("workers", {"replicas": len(workers), "model": model,
                               "first_url": workers[0].request_url,
                               "first_system_url": workers[0].system_url or ""},
                   getattr(args, "log_format", None))
    log.info("%d simulated workers of %s serving (discovery: %s)", len(workers), model,
             discovery.url)


async def _bounded(coros: list[Awaitable[Any]], limit: int = REGISTER_CONCURRENCY) -> None:
    """Await `coros`, at most `limit` at once; the first failure is raised (after all ran)."""
    gate = asyncio.Semaphore(limit)

    async def one(c: Awaitable[Any]) -> None:
        async with gate:
            await c
    results = await asyncio.gather(*(one(c) for c in coros), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
