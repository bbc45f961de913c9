"""SMG's RL surface (lightseekorg/smg, the Shepherd Model Gateway's `--enable-rl`: its
`crates/rl` and the `openai_protocol::rl` wire types) as rlfleet answers it:

- the request header `x-smg-version-policy: any | latest-only | min-version:<v> |
  max-staleness:<k>` (which workers may serve the request, against the newest weights the
  model's workers hold), mapped onto rlfleet's staleness bound (`nvext.policy`: fleet
  steps), `any` being no bound;
- the response headers `x-smg-weight-version` (the version of the weights that served the
  request, when versioned) and `x-smg-mixed-version: true` (a whole answer whose tokens
  came from more than one version);
- `/v1/rl/engine/{path}?selector=...`: one engine route called on every matching worker,
  answered as an `RlFanoutResponse` (HTTP 200, or 207 when `failed[]` is not empty).
Errors answer `{"error": <code>, "message"}` with SMG's codes. Data only."""

from __future__ import annotations

from typing import Any

import msgspec

VERSION_POLICY_HEADER = "x-smg-version-policy"
WEIGHT_VERSION_HEADER = "x-smg-weight-version"
MIXED_VERSION_HEADER = "x-smg-mixed-version"
#: version labels SMG counts as unversioned (SGLang's and vLLM's placeholder)
UNVERSIONED = frozenset({"default"})
POLICIES = "any | latest-only | min-version:<v> | max-staleness:<k>"

FANOUT_PREFIX = "/v1/rl/engine/"

# SMG's error codes
INVALID_VERSION_POLICY = "invalid_version_policy"
SELECTOR_REQUIRED = "selector_required"
INVALID_SELECTOR = "invalid_selector"
NO_WORKERS_MATCH = "no_workers_match"
INVALID_ENGINE_PATH = "invalid_engine_path"
INVALID_BODY = "invalid_body"
UPSTREAM_ERROR = "upstream_error"
UPSTREAM_UNREACHABLE = "upstream_unreachable"
UPSTREAM_TIMEOUT = "upstream_timeout"

#: the selector keys rlfleet's workers match: `key=value[,key=value...]`, every term holding
SELECTOR_KEYS = ("engine", "model", "id")
#: what every rlfleet worker is to a selector's `engine` (its control surface is vLLM's)
ENGINE = "vllm"


def error(code: str, message: str) -> dict[str, Any]:
    return {"error": code, "message": message}


class CallOutcome(msgspec.Struct, kw_only=True, omit_defaults=True):
    """`RlCallOutcome`: one completed call, whatever its HTTP status."""

    worker_id: str
    url: str
    status: int
    latency_ms: int
    body: Any = None


class FailedCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    """`RlFailedCall`: a call that did not succeed (also in `results` when it completed)."""

    worker_id: str
    url: str
    error: str
    message: str
    status: int | None = None


class FanoutResponse(msgspec.Struct, kw_only=True):
    """`RlFanoutResponse`: HTTP 200 when `failed` is empty, 207 otherwise."""

    results: dict[str, CallOutcome]
    failed: list[FailedCall]
    total: int
    succeeded: int
