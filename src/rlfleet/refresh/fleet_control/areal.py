"""The fleet control service's AReaL routes (AReaL's vLLM server's pause, continue and update
from disk), answered as AReaL's server answers; its errors are SGLang's shapes
(rlfleet.refresh.fleet_control.sglang.sglang_error)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from rlfleet.refresh.fleet_control.bodies import Handlers, read_body
from rlfleet.refresh.fleet_control.service import BadRequest, FleetControl

#: AReaL's routes and their handlers (each bound by `@HANDLERS.route`)
HANDLERS = Handlers()


@HANDLERS.route("areal", "/areal_pause_generation")
async def _areal_pause(ctl: FleetControl, request: Request) -> Response:
    """AReaL's pause: the requests in flight are aborted (their partial output returned)."""
    await ctl.pause("abort")
    return JSONResponse({"success": True, "message": "Generation paused and all requests "
                                                     "aborted"})


@HANDLERS.route("areal", "/areal_continue_generation")
async def _areal_continue(ctl: FleetControl, request: Request) -> Response:
    await ctl.resume()
    return JSONResponse({"success": True, "message": "Generation continued"})


@HANDLERS.route("areal", "/areal_update_weights")
async def _areal_update(ctl: FleetControl, request: Request) -> Response:
    """AReaL's update from disk: inside a pause a step of it, else a transaction of its own
    that aborts the requests in flight, as AReaL's server pauses for it."""
    body = await read_body(request)
    load_format = body.get("load_format", "auto")
    if load_format not in (None, "auto"):
        raise BadRequest(f"load_format {load_format!r}: the workers load the checkpoint's own "
                         "format only (auto)")
    out = await ctl.update_from_disk(body.get("model_path"), None, "abort")
    return JSONResponse({"success": True, "message": "".join(
        f"TP rank: {rank} success\n" for rank in range(len(out.workers)))})
