"""python -m rlfleet.frontend [--http-host H] [--http-port P] [--advertise-host A] [--discovery URL]
[--processes K]"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

import uvloop

from rlfleet.frontend import dispatch
from rlfleet.frontend.app import build_app
from rlfleet.frontend.dispatch import MAX_RESPONSE_ENTRIES
from rlfleet.frontend.fleet_control import ControlForward, exposure, networks
from rlfleet.frontend.kv import DEFAULT_OVERLAP_WEIGHT, DEFAULT_OVERLOAD, KvRouter
from rlfleet.frontend.processes import run_group
from rlfleet.frontend.rl import rl_app
from rlfleet.frontend.router import DOWN_SECONDS, ROUTER_MODES, WorkerPool
from rlfleet.frontend.runs import GenerationRuns
from rlfleet.frontend.sessions import DEFAULT_TTL
from rlfleet.runtime import tracing
from rlfleet.runtime.address import advertised_host, discovery_peer, http_url
from rlfleet.runtime.auth import settle_admin_token
from rlfleet.runtime.discovery import open_discovery
from rlfleet.runtime.flags import Flag, add_flags
from rlfleet.runtime.limits import ServerLimits, raise_fd_limit
from rlfleet.runtime.logs import add_log_args, announce_ready, keep_output_json, setup_logging
from rlfleet.runtime.request_plane import STALL_TIMEOUT, StreamClient
from rlfleet.runtime.server import AppServer, bind_socket, freeze_heap
from rlfleet.runtime.tracing import add_tracing_args

log = logging.getLogger("rlfleet.frontend")


def _truthy(v: str | None) -> bool:
    return (v or "").strip().lower() in ("1", "true", "yes", "on")


def routing_flags() -> tuple[Flag, ...]:
    """The router's flags (rlfleet.frontend.router, rlfleet.frontend.kv)."""
    return (
        Flag("--router-mode", "round-robin",
             "kv: to the worker holding the longest prefix of the prompt's token IDs (from its KV "
             "events, else from what this frontend sent it), unless overloaded",
             choices=ROUTER_MODES),
        Flag("--kv-overload-threshold", DEFAULT_OVERLOAD,
             "router mode kv: a worker is overloaded, and a request whose prefix (or session) "
             "it holds goes elsewhere, when (its requests in flight, less those with the very "
             "same prompt, + 1) > this x (the mean over the candidates + 1) (default "
             "%(default)s)"),
        Flag("--kv-overlap-weight", DEFAULT_OVERLAP_WEIGHT,
             "router mode kv: the weight of a request's own uncached prompt tokens in a "
             "worker's cost, beside the prefill queued there and the stall its prefill puts on "
             "the requests running there (docs/routing.md; default %(default)s; higher: "
             "stickier to the prefix)"),
        Flag("--kv-session-ttl", DEFAULT_TTL,
             "router mode kv: seconds a session (X-Session-ID) stays bound to its worker after "
             "its last request, unless POST /finish_session releases it first"),
    )


def frontend_flags() -> tuple[Flag, ...]:
    """The frontend's own flags (ServerLimits, logs and tracing add theirs); read when the
    command line is, since some defaults come from the environment."""
    return (
        Flag("--http-host", "127.0.0.1",
             "bind address of the OpenAI routes and the RL listener (0.0.0.0: all)"),
        Flag("--http-port", int(os.environ.get("DYN_HTTP_PORT", 8000)),
             "OpenAI routes port (default: $DYN_HTTP_PORT, else 8000)"),
        Flag("--advertise-host", None,
             "address clients on other hosts use (default: the bind address; when bound to "
             "0.0.0.0: $VLLM_HOST_IP, $POD_IP, else the interface that routes to the discovery "
             "store)"),
        Flag("--discovery", None,
             "file:///dir or etcd://host:port[,host:port] (default: $RLFLEET_DISCOVERY, "
             "$ETCD_ENDPOINTS, else a per-user directory)"),
        Flag("--namespace", os.environ.get("DYN_NAMESPACE", "dynamo")),
        *routing_flags(),
        Flag("--gated-hold", 60.0,
             "seconds a request waits while every worker of its model is gated or off the "
             "committed policy (a policy refresh), or while none serves a policy within its "
             "nvext.policy; then 503 (409 for the policy bound)"),
        Flag("--request-timeout", 600.0,
             "seconds to wait for a worker's next event before failing the request"),
        Flag("--enable-rl", _truthy(os.environ.get("DYN_ENABLE_RL")),
             "serve GET /v1/rl/workers on --rl-port (or $DYN_ENABLE_RL)"),
        Flag("--rl-port", int(os.environ.get("DYN_RL_PORT", 8001))),
        Flag("--stall-timeout", STALL_TIMEOUT,
             "the stream-plane heartbeat: seconds a worker with requests in flight may answer "
             "nothing at all (not even a ping, sent after a third of it) before it is marked down "
             "and its requests fail over (not yet started) or fail (default %(default)g; 0: "
             "never)"),
        Flag("--down-seconds", DOWN_SECONDS,
             "seconds a worker that stalled, broke a request or could not be reached stays out of "
             "routing before it is tried again (default %(default)g)"),
        Flag("--admin-token", None,
             "the fleet's admin token: sent to workers (their request plane requires it when they "
             "have one) and accepted to cancel any run (prefer --admin-token-file or "
             "$RLFLEET_ADMIN_TOKEN)"),
        Flag("--admin-token-file", os.environ.get("RLFLEET_ADMIN_TOKEN_FILE"),
             "read the admin token from this file (default: $RLFLEET_ADMIN_TOKEN_FILE, else "
             "$RLFLEET_ADMIN_TOKEN)"),
        Flag("--max-response-entries", MAX_RESPONSE_ENTRIES,
             "refuse (400) a request whose n x max_tokens x (1 + logprobs) could exceed this "
             "(default %(default)s; 0: no limit)"),
        Flag("--max-kept-bytes", 2 << 30,
             "about how much memory the events of runs kept for X-Request-Id retries may hold "
             "(default 2 GiB); beyond it the oldest finished runs are forgotten, and new ones are "
             "refused (429) while runs in flight hold it all"),
        Flag("--journal", os.environ.get("RLFLEET_JOURNAL"),
             "the policy-refresh journal (a SQLite file or etcd://host:port[/name]) whose last "
             "refreshes the status page (GET /fleet on the RL listener) shows (default: "
             "$RLFLEET_JOURNAL)"),
        Flag("--fleet-control", None,
             "the fleet control service's URL (`rlfleet control`): vLLM's and SGLang's control "
             "routes (/pause, /resume, /update_weights_from_disk, ...) at this frontend's URL are "
             "forwarded there, each a fleet operation (docs/one-url.md); default: not served",
             type=str),
        Flag("--fleet-control-from", [],
             "with --fleet-control: a network (CIDR) whose callers may send the routes that "
             "change the fleet without the admin token (repeat for more; loopback always may; "
             "without an admin token nobody else may: docs/security.md)", metavar="CIDR"),
        Flag("--processes", 1,
             "serve the port from this many processes (SO_REUSEPORT: the kernel spreads "
             "connections over them); a retry of an X-Request-Id through any of them, or through "
             "another frontend on the same discovery store, attaches to the first attempt "
             "(default 1)"),
        Flag("--reuse-port", False, argparse.SUPPRESS),  # set on each of --processes K
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rlfleet.frontend",
                                description="OpenAI-compatible frontend over an rlfleet fleet")
    add_flags(p, frontend_flags())
    ServerLimits.add_args(p)
    add_log_args(p)
    add_tracing_args(p)
    args = p.parse_args(argv)
    _check(p, args)
    return args


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every cross-check of the flags, each refused with what to give instead."""
    if not args.kv_overload_threshold > 1:
        p.error(f"--kv-overload-threshold must be greater than 1, got "
                f"{args.kv_overload_threshold}")
    if not args.kv_overlap_weight >= 0:
        p.error(f"--kv-overlap-weight must be at least 0, got {args.kv_overlap_weight}")
    if not args.kv_session_ttl > 0:
        p.error(f"--kv-session-ttl must be positive, got {args.kv_session_ttl}")
    for flag in ("stall_timeout", "down_seconds"):
        if not getattr(args, flag) >= 0:
            p.error(f"--{flag.replace('_', '-')} must be 0 or more seconds")
    if args.processes < 1:
        p.error(f"--processes must be at least 1, got {args.processes}")
    try:
        settle_admin_token(args)
        networks(args.fleet_control_from)
    except ValueError as e:
        p.error(str(e))
    if args.fleet_control_from and not args.fleet_control:
        p.error("--fleet-control-from names who may send control routes: it needs "
                "--fleet-control")


async def serve(args: argparse.Namespace) -> None:
    setup_logging(args.log_level, args.log_format)
    tracing.setup("rlfleet-frontend", args.otlp_traces_endpoint)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    discovery = open_discovery(args.discovery)
    kv = KvRouter(args.kv_overload_threshold, args.kv_overlap_weight, args.kv_session_ttl) \
        if args.router_mode == "kv" else None
    pool = WorkerPool(discovery, args.namespace, mode=args.router_mode,
                      gated_hold=args.gated_hold, kv=kv, down_seconds=args.down_seconds)
    client = StreamClient(request_timeout=args.request_timeout,
                          stall_timeout=args.stall_timeout or None, admin_token=args.admin_token)
    dispatch.MAX_RESPONSE_ENTRIES = args.max_response_entries or None
    runs = GenerationRuns(max_kept_bytes=args.max_kept_bytes, admin_token=args.admin_token)
    await pool.start()
    limits = ServerLimits.from_args(args)
    reuse = args.reuse_port
    control = ControlForward(args.fleet_control, admin_token=args.admin_token,
                             allowed=args.fleet_control_from) if args.fleet_control else None
    if warning := exposure(args.http_host, args.fleet_control, args.admin_token,
                           args.fleet_control_from):
        log.warning("%s", warning)
    servers = [AppServer(build_app(pool, client, runs, fleet_control=control),
                         bind_socket(args.http_host, args.http_port, reuse), limits=limits)]
    if args.enable_rl:
        servers.append(AppServer(rl_app(discovery, args.namespace, args.journal),
                                 bind_socket(args.http_host, args.rl_port, reuse), limits=limits))
    for s in servers:
        await s.start()
    host = advertised_host(args.http_host, args.advertise_host, discovery_peer(args.discovery))
    urls = [http_url(host, s.port) for s in servers]
    freeze_heap()
    # the one line on stdout that launchers wait for
    announce_ready("frontend", {"url": urls[0], **({"rl_url": urls[1]} if len(urls) > 1 else {})},
                   args.log_format)
    log.info("frontend at %s (discovery %s, router %s)", urls[0], discovery.url,
             args.router_mode)
    try:
        await stop.wait()
    finally:
        for s in servers:
            await s.stop()
        await pool.stop()
        await client.close()
        await discovery.close()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    keep_output_json(args.log_format)
    # a frontend holds a socket per client and per worker: the soft descriptor limit (often
    # 1,024) is raised to the hard one, for this process and any it starts
    raise_fd_limit()
    if args.processes > 1:
        setup_logging(args.log_level, args.log_format)
        sys.exit(run_group(args, argv))
    uvloop.run(serve(args))


if __name__ == "__main__":
    main()
