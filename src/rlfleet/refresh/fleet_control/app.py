"""The fleet control service's HTTP app (`rlfleet control`): every dialect route of
rlfleet.protocol.fleet_control's ROUTES, bound to its handler by the dialect's route module
(vllm, sglang, areal, smg, skyrl), behind the admin token where it changes the fleet, with
each failure answered in the dialect's error shape; and GET /control/health."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rlfleet.protocol.fleet_control import ROUTES, ControlRoute
from rlfleet.refresh.config import RefreshConfig
from rlfleet.refresh.control import FleetFenced
from rlfleet.refresh.fleet_control import areal, sglang, skyrl, smg, vllm
from rlfleet.refresh.fleet_control.bodies import Handler
from rlfleet.refresh.fleet_control.service import FleetControl, FleetFailure
from rlfleet.refresh.fleet_control.sglang import sglang_error
from rlfleet.refresh.fleet_control.smg import smg_error
from rlfleet.refresh.fleet_control.vllm import vllm_error

log = logging.getLogger("rlfleet.fleet_control")

#: each route of the tables (rlfleet.protocol.fleet_control) and its handler
HANDLERS: dict[tuple[str, str], Handler] = {
    **vllm.HANDLERS, **skyrl.HANDLERS, **sglang.HANDLERS, **areal.HANDLERS, **smg.HANDLERS,
}


def _authorized(request: Request, token: str | None) -> bool:
    if not token:
        return True
    auth = request.headers.get("authorization", "")
    return auth[:7].lower() == "bearer " and auth[7:] == token


def _endpoint(ctl: FleetControl, route: ControlRoute) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        if route.mutating and not _authorized(request, ctl.config.admin_token):
            e = FleetFailure("this route changes the fleet: send the admin token as "
                             "Authorization: Bearer <token>", 401)
            return vllm_error(e) if route.dialect == "vllm" else sglang_error(e, route)
        try:
            return await HANDLERS[route.dialect, route.path](ctl, request)
        except FleetFenced as fenced:  # a newer coordinator (`rlfleet recover`, ...) took over
            ctl.dropped(str(fenced))
            e = FleetFailure(f"another coordinator took the fleet over ({fenced}); this "
                             "service's transaction is dropped: check `rlfleet journal`", 409)
            return vllm_error(e) if route.dialect == "vllm" else sglang_error(e, route)
        except FleetFailure as e:
            log.warning("%s %s: %s", request.method, route.path, e)
            if route.dialect == "smg":
                return smg_error(e)
            return vllm_error(e) if route.dialect == "vllm" else sglang_error(e, route)
        except Exception as e:
            log.exception("%s %s failed", request.method, route.path)
            failure = FleetFailure(f"{route.path} failed: {e!r}", 500)
            return vllm_error(failure) if route.dialect == "vllm" else sglang_error(failure, route)
    return endpoint


async def _health(request: Request) -> Response:
    ctl: FleetControl = request.app.state.control
    s = ctl.session
    return JSONResponse({"status": "ok", "paused": s is not None,
                         "refresh_id": s.id if s else None,
                         "journal": ctl.journal.path, "rl_url": ctl.control.rl_url})


def control_app(ctl: FleetControl) -> Starlette:
    """The service's HTTP app: every dialect route of ROUTES, and GET /control/health."""
    app = Starlette(routes=[Route("/control/health", _health, methods=["GET"]),
                            *(Route(r.path, _endpoint(ctl, r), methods=list(r.methods))
                              for r in ROUTES)])
    app.state.control = ctl
    return app


async def serve(config: RefreshConfig, host: str, port: int, log_format: str | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Run the service until `stop` (default: SIGINT / SIGTERM): recover the fleet's
    unfinished transactions from the journal first, then answer on host:port and print
    the ready line (`RLFLEET_CONTROL_READY url=...`)."""
    import signal

    from rlfleet.runtime.logs import announce_ready
    from rlfleet.runtime.server import AppServer, bind_socket

    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    ctl = FleetControl(config, on_event=lambda msg: log.info("%s", msg))
    try:
        recovered = await ctl.recover()
        if recovered:
            log.info("recovered from the journal %s: %s", ctl.journal.path, recovered)
        server = AppServer(control_app(ctl), bind_socket(host, port))
        await server.start()
        announce_ready("control", {"url": server.url, "journal": ctl.journal.path,
                                   "recovered": "yes" if recovered else "no"}, log_format)
        try:
            await stop.wait()
        finally:
            await server.stop()
    finally:
        await ctl.aclose()
