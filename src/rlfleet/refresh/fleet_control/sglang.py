"""The fleet control service's SGLang routes (rlfleet.protocol.fleet_control's "sglang" table):
each read as one SGLang server reads it, run as a fleet operation, answered in SGLang's shapes
(its errors too: `sglang_error`, which AReaL's routes share); SGLang 0.5.23's weight-update
session opens and closes on every worker."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from rlfleet.protocol import admin, admin_base
from rlfleet.protocol.fleet_control import (
    SGLANG_PAUSE_MODES,
    ControlRoute,
    DiskUpdateBody,
    LoraBody,
    Op,
    PauseBody,
)
from rlfleet.refresh.control import FleetWorker
from rlfleet.refresh.fleet_control.bodies import Handlers, read_body
from rlfleet.refresh.fleet_control.service import BadRequest, FleetControl, FleetFailure, fleet_now

#: SGLang's routes and their handlers (each bound by `@HANDLERS.route`)
HANDLERS = Handlers()


def sglang_error(e: FleetFailure, route: ControlRoute) -> Response:
    """SGLang's failure bodies: `{"success": false, "message"}` for its update and LoRA
    routes (HTTP 400), a plain text for /flush_cache, `{"error"}` otherwise."""
    extra = {"workers": e.workers, "rolled_back": e.rolled_back}
    if route.dialect == "areal":  # AReaL's server: `{"success": false, "message"}`, 400
        return JSONResponse({"success": False, "message": str(e), **extra}, status_code=400)
    if route.op is Op.UPDATE_FROM_DISK:
        return JSONResponse({"success": False, "message": str(e), "num_paused_requests": 0,
                             **extra}, status_code=400)
    if route.op in (Op.LOAD_ADAPTER, Op.UNLOAD_ADAPTER):
        return JSONResponse({"success": False, "error_message": str(e),
                             "loaded_adapters": None, **extra}, status_code=400)
    if route.op is Op.RESET_CACHE:
        return PlainTextResponse(f"Cache flush failed: {e}\n", status_code=400)
    return JSONResponse({"error": {"message": str(e)}, **extra}, status_code=e.status)


@HANDLERS.route("sglang", "/pause_generation")
async def _sglang_pause(ctl: FleetControl, request: Request) -> Response:
    mode = (await read_body(request, PauseBody)).mode
    if mode not in SGLANG_PAUSE_MODES:
        raise BadRequest(f"mode must be one of {', '.join(SGLANG_PAUSE_MODES)}, not {mode!r}")
    await ctl.pause(SGLANG_PAUSE_MODES[mode])
    return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})


@HANDLERS.route("sglang", "/continue_generation")
async def _sglang_continue(ctl: FleetControl, request: Request) -> Response:
    await ctl.resume()
    return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})


@HANDLERS.route("sglang", "/update_weights_from_disk")
async def _sglang_update(ctl: FleetControl, request: Request) -> Response:
    body = await read_body(request, DiskUpdateBody)
    mode = "abort" if body.abort_all_requests else None
    out = await ctl.update_from_disk(body.model_path, body.weight_version, mode)
    if body.flush_cache and ctl.is_paused():
        await ctl.reset_cache()
    return JSONResponse({"success": True, "message": f"Succeeded to update model weights: "
                         f"{len(out.workers)} worker(s) serve {out.policy.version} "
                         f"({out.policy.digest})", "num_paused_requests": 0})


@HANDLERS.route("sglang", "/flush_cache")
async def _sglang_flush(ctl: FleetControl, request: Request) -> Response:
    await ctl.reset_cache()
    return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details. "
                             "(When there are running or waiting requests, the operation "
                             "will not be performed.)\n")


@HANDLERS.route("sglang", "/get_weight_version")
async def _sglang_version(ctl: FleetControl, request: Request) -> Response:
    held = await ctl.weight_version()
    if held is None:
        raise FleetFailure("the workers do not hold one policy", 409)
    return JSONResponse({"weight_version": held.version})


@HANDLERS.route("sglang", "/load_lora_adapter")
async def _sglang_load_lora(ctl: FleetControl, request: Request) -> Response:
    body = await read_body(request, LoraBody)
    name, path = body.lora_name, body.lora_path
    await ctl.load_adapter(name, path)
    return JSONResponse({"success": True, "error_message": "",
                         "loaded_adapters": {name: path}})


@HANDLERS.route("sglang", "/unload_lora_adapter")
async def _sglang_unload_lora(ctl: FleetControl, request: Request) -> Response:
    await ctl.unload_adapter((await read_body(request, LoraBody)).lora_name)
    return JSONResponse({"success": True, "error_message": "", "loaded_adapters": {}})


@HANDLERS.route("sglang", "/begin_weight_update", "/end_weight_update")
async def _sglang_session(ctl: FleetControl, request: Request) -> Response:
    """SGLang 0.5.23's /begin_weight_update and /end_weight_update on every worker: the
    fleet's session opens (closes) on all of them, or the ones that moved move back."""
    begin = request.url.path == "/begin_weight_update"
    body = await read_body(request)
    route = admin.BEGIN_WEIGHT_UPDATE if begin else admin.END_WEIGHT_UPDATE
    try:
        req = admin.read_request(route, body)
    except admin_base.AdminRequestError as e:
        raise BadRequest(str(e)) from None
    undo_route = admin.END_WEIGHT_UPDATE if begin else admin.BEGIN_WEIGHT_UPDATE
    async with ctl.lock:
        ch, ws = await fleet_now(ctl)
        moved: list[FleetWorker] = []
        refused: list[str] = []

        async def one(w: FleetWorker) -> None:
            res = await ch.on(w, route.name, route, req)
            if res.ok:
                moved.append(w)
            else:
                refused.append(f"worker {w.instance_id}: {res.message}")
        await ctl._each(ws, one)
        if refused:
            undo = admin.read_request(undo_route, {})
            await ctl._each(moved, lambda w: ch.on(w, undo_route.name, undo_route, undo))
            return JSONResponse({"success": False, "message": "; ".join(refused)},
                                status_code=400)
    return JSONResponse({"success": True, "message": "Success"})
