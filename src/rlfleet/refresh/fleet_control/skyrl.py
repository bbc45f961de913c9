"""The fleet control service's SkyRL routes (its VLLMServerActor's own LoRA load, and its
weight fetch, refused), served in the vLLM table."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from rlfleet.protocol import skyrl
from rlfleet.protocol.fleet_control import LoraBody
from rlfleet.refresh.fleet_control.bodies import Handlers, read_body
from rlfleet.refresh.fleet_control.service import BadRequest, FleetControl

#: SkyRL's routes and their handlers (each bound by `@HANDLERS.route`)
HANDLERS = Handlers()


@HANDLERS.route("vllm", "/skyrl/v1/load_lora_adapter")
async def _skyrl_load_lora(ctl: FleetControl, request: Request) -> Response:
    """SkyRL's own server route: vLLM's load, answered as JSON."""
    body = await read_body(request, LoraBody)
    name = body.lora_name
    await ctl.load_adapter(name, body.lora_path)
    return JSONResponse({"status": "ok", "lora_name": name})


@HANDLERS.route("vllm", "/fetch_weights")
async def _skyrl_fetch_weights(ctl: FleetControl, request: Request) -> Response:
    raise BadRequest(skyrl.FETCH_WEIGHTS_REFUSED)
