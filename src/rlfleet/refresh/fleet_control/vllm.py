"""The fleet control service's vLLM routes (rlfleet.protocol.fleet_control's "vllm" table):
each read as one vLLM server reads it, run as a fleet operation
(rlfleet.refresh.fleet_control.service), answered in vLLM's shapes; vLLM's newest RL routes
run each worker's own route on every worker."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from rlfleet.protocol import admin, admin_vllm, vllm_rl
from rlfleet.protocol.fleet_control import (
    CollectiveRpcBody,
    LoraBody,
    TransferFinishBody,
    TransferInitBody,
    TransferUpdateBody,
)
from rlfleet.refresh.control import FleetWorker
from rlfleet.refresh.fleet_control.bodies import Handler, Handlers, flag, read_body, required
from rlfleet.refresh.fleet_control.service import (
    BadRequest,
    FleetControl,
    FleetFailure,
    fleet_now,
    on_each_native,
)
from rlfleet.runtime import weight_checker

#: vLLM's routes and their handlers (each bound by `@HANDLERS.route`)
HANDLERS = Handlers()


def vllm_error(e: FleetFailure) -> JSONResponse:
    """vLLM's RL routes' error body (`{"error": "..."}`), with the workers and what was
    rolled back beside it."""
    return JSONResponse({"error": str(e), "workers": e.workers, "rolled_back": e.rolled_back},
                        status_code=e.status)


def _runs(op: Callable[[FleetControl], Awaitable[Any]], answer: dict[str, Any]) -> Handler:
    """The handler of a route that reads no body: it runs `op`, then answers `answer`."""
    async def handler(ctl: FleetControl, request: Request) -> Response:
        await op(ctl)
        return JSONResponse(answer)
    return handler


HANDLERS.route("vllm", "/resume")(_runs(FleetControl.resume, {"status": "resumed"}))
HANDLERS.route("vllm", "/start_weight_update")(
    _runs(FleetControl.transfer_start, {"message": "Weight update started"}))


@HANDLERS.route("vllm", "/pause")
async def _vllm_pause(ctl: FleetControl, request: Request) -> Response:
    mode = request.query_params.get("mode", "abort")
    flag(request.query_params.get("clear_cache"), "clear_cache", True)
    await ctl.pause(mode)
    return JSONResponse({"status": "paused"})


@HANDLERS.route("vllm", "/is_paused")
async def _vllm_is_paused(ctl: FleetControl, request: Request) -> Response:
    return JSONResponse({"is_paused": ctl.is_paused()})


@HANDLERS.route("vllm", "/reset_prefix_cache")
async def _vllm_reset(ctl: FleetControl, request: Request) -> Response:
    try:
        await ctl.reset_cache()
    except FleetFailure as e:
        if e.status == 500:  # vLLM: the reset did not happen (blocks still held)
            return JSONResponse({"success": False, "error": str(e)})
        raise
    return JSONResponse({"success": True})


@HANDLERS.route("vllm", "/get_world_size")
async def _vllm_world_size(ctl: FleetControl, request: Request) -> Response:
    include_dp = flag(request.query_params.get("include_dp"), "include_dp", True)
    return JSONResponse({"world_size": await ctl.world_size(include_dp)})


@HANDLERS.route("vllm", "/weight_info")
async def _vllm_weight_info(ctl: FleetControl, request: Request) -> Response:
    held = await ctl.weight_version()
    if held is None:
        raise FleetFailure("the workers do not hold one policy (a refresh is under way, or "
                           "the fleet needs `rlfleet recover`)", 409)
    return JSONResponse({"weight_version": held.version or "default"})


@HANDLERS.route("vllm", "/init_weight_transfer_engine")
async def _vllm_init(ctl: FleetControl, request: Request) -> Response:
    body = await read_body(request, TransferInitBody)
    await ctl.transfer_init(required(body.init_info, "init_info is required (the "
                                     "weight-transfer backend's settings)"))
    return JSONResponse({"message": "Weight transfer initialized"})


@HANDLERS.route("vllm", "/update_weights")
async def _vllm_update(ctl: FleetControl, request: Request) -> Response:
    body = await read_body(request, TransferUpdateBody)
    await ctl.transfer_update(required(body.update_info, "update_info is required"))
    return JSONResponse({"message": "Weights updated"})


@HANDLERS.route("vllm", "/finish_weight_update")
async def _vllm_finish(ctl: FleetControl, request: Request) -> Response:
    await ctl.transfer_finish((await read_body(request, TransferFinishBody)).weight_version)
    return JSONResponse({"message": "Weight update finished"})


@HANDLERS.route("vllm", "/collective_rpc")
async def _vllm_collective_rpc(ctl: FleetControl, request: Request) -> Response:
    body = await read_body(request, CollectiveRpcBody)
    if body.method != "reload_weights":
        raise BadRequest(f"collective_rpc runs reload_weights only on a fleet (a reload from "
                         f"disk on every worker, as one transaction), not {body.method!r}")
    path = (body.kwargs or {}).get("weights_path")
    if not isinstance(path, str) or not path:
        raise BadRequest("reload_weights needs kwargs.weights_path: a checkpoint directory "
                         "every worker can read (a string)")
    out = await ctl.update_from_disk(path, None)
    return JSONResponse({"results": [None] * len(out.workers)})


@HANDLERS.route("vllm", "/v1/load_lora_adapter")
async def _vllm_load_lora(ctl: FleetControl, request: Request) -> Response:
    body = await read_body(request, LoraBody)
    name = body.lora_name
    await ctl.load_adapter(name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@HANDLERS.route("vllm", "/v1/unload_lora_adapter")
async def _vllm_unload_lora(ctl: FleetControl, request: Request) -> Response:
    name = (await read_body(request, LoraBody)).lora_name
    await ctl.unload_adapter(name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


@HANDLERS.route("vllm", "/abort_requests")
async def _vllm_abort_requests(ctl: FleetControl, request: Request) -> Response:
    """vLLM's /abort_requests on every worker: the IDs named (each worker ends those it
    runs), or every request in flight; the fleet is not paused."""
    ids = (await read_body(request)).get("request_ids")
    if ids is not None and (not isinstance(ids, list) or
                            not all(isinstance(i, str) for i in ids)):
        raise BadRequest("request_ids must be a list of request IDs (none: every request)")
    said = await on_each_native(ctl, vllm_rl.ABORT_REQUESTS.path,
                                 {"request_ids": ids} if ids else {})
    aborted = len(ids) if ids else sum(int(a.get("aborted", 0)) for a in said)
    return JSONResponse({"status": "aborted", "aborted": aborted})


@HANDLERS.route("vllm", "/weight_checker")
async def _vllm_weight_checker(ctl: FleetControl, request: Request) -> Response:
    """vLLM's weight checker over the fleet: the workers' reports merged, each worker's ranks
    under its own data-parallel rank (in instance order), compared like one server's."""
    body = await read_body(request)
    try:
        action, baseline, others = weight_checker.read_reports(body)
    except ValueError as e:
        raise BadRequest(str(e)) from None
    if action == "reset":
        raise BadRequest(weight_checker.RESET_REFUSED)
    reports = await on_each_native(ctl, vllm_rl.WEIGHT_CHECKER.path, {"action": "checksum"})
    merged = weight_checker.merge([weight_checker.under_dp(r.get("checksums") or {}, dp)
                                   for dp, r in enumerate(reports)])
    if baseline is None:
        return JSONResponse({"checksums": merged})
    match, mismatches, ranks = weight_checker.compare([baseline, merged, *others])
    return JSONResponse({"match": match, "mismatches": mismatches, "ranks": ranks})


@HANDLERS.route("vllm", "/update_weight_version")
async def _vllm_update_weight_version(ctl: FleetControl, request: Request) -> Response:
    """vLLM's /update_weight_version {new_version}: every worker relabels its weights."""
    version = (await read_body(request)).get("new_version")
    if not isinstance(version, str) or not version:
        raise BadRequest("new_version is required (a non-empty string)")
    async with ctl.lock:
        ch, ws = await fleet_now(ctl)
        failed: list[FleetWorker] = []

        async def relabel(w: FleetWorker) -> None:
            res = await ch.on(w, "set_version", admin.UPDATE_UPDATE_WEIGHT_VERSION,
                              admin_vllm.NewVersionRequest(new_version=version))
            if not res.ok:
                failed.append(w)
        await ctl._each(ws, relabel)
    if failed:
        raise FleetFailure(f"the weight version was not set on {ctl._named(failed)}", 500,
                           [w.summary() for w in failed])
    return JSONResponse({"success": True, "new_version": version})


@HANDLERS.route("vllm", "/start_draft_weight_update")
async def _vllm_start_draft(ctl: FleetControl, request: Request) -> Response:
    raise BadRequest(vllm_rl.DRAFT_REFUSED)
