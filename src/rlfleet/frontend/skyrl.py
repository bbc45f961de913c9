"""SkyRL 0.4's generation route on the frontend: POST /skyrl/v1/generate (its
VLLMServerActor's; rlfleet.protocol.skyrl), which SkyRL's RemoteInferenceClient calls when it
wants routed experts (rollout router replay): vLLM's /inference/v1/generate request and
answer (rlfleet.frontend.vllm_native, the same dispatch), whole, with each choice's
`routed_experts` packed as SkyRL packs side channels (`{data, shape, dtype}`: base64 of the
C-order array in its canonical integer dtype) instead of vLLM's base64 .npy."""

from __future__ import annotations

import base64
import json

import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, Router

from rlfleet.frontend import vllm_native
from rlfleet.frontend.generation import parse_body
from rlfleet.protocol import skyrl
from rlfleet.protocol.engine import RoutedExperts
from rlfleet.protocol.vllm_native import TokensGenerateRequest
from rlfleet.runtime.http import HttpError, json_response


class SkyrlGenerateRequest(TokensGenerateRequest):
    """vLLM's request, and SkyRL's flag for the sampler's support set (refused)."""

    return_sample_support: bool = False


def packed_routed_experts(npy_b64: str) -> dict:
    """vLLM's encoding of a choice's routed experts as SkyRL's packed envelope."""
    arr = RoutedExperts.from_npy_b64(npy_b64).array()
    dtype = skyrl.routed_expert_dtype(int(arr.max()) if arr.size else 0)
    data = np.ascontiguousarray(arr, dtype=np.dtype(dtype))
    return skyrl.envelope(base64.b64encode(data.tobytes()).decode("ascii"), list(data.shape),
                          dtype)


async def generate(request: Request) -> Response:
    req: SkyrlGenerateRequest = await parse_body(request, SkyrlGenerateRequest)
    if req.return_sample_support:
        raise HttpError(400, skyrl.SAMPLE_SUPPORT_REFUSED, param="return_sample_support")
    if req.stream:
        raise HttpError(400, skyrl.STREAM_REFUSED, param="stream")
    answer = await vllm_native.generate(request)  # the same body, read again
    if answer.status_code != 200:
        return answer
    body = json.loads(answer.body)
    for choice in body.get("choices", []):
        if isinstance(choice.get("routed_experts"), str):
            choice["routed_experts"] = packed_routed_experts(choice["routed_experts"])
    return json_response(body)


router = Router(routes=[Route(skyrl.GENERATE_PATH, generate, methods=["POST"])])
