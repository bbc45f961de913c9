"""The single-server dialects served at one URL for a whole fleet (rlfleet.refresh.fleet_control,
`rlfleet control`; a frontend started with --fleet-control forwards them there): each route
of vLLM's and SGLang's server that a single-server client sends to change or ask about "the
server", and the fleet-lifecycle operation (`Op`) it maps onto. Data only: the service binds
each route to its handler, a frontend forwards exactly these paths. The bodies the routes
read are typed below (the fields the real servers take; others are ignored, as theirs
ignore them): a field of the wrong type is refused naming it."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import msgspec


class Op(enum.StrEnum):
    """The fleet-lifecycle operations a dialect route maps onto."""

    PAUSE = "pause"  # a transaction opens: every worker closed to rollouts and paused
    RESUME = "resume"  # verify, probe, resume, reopen; the transaction ends
    IS_PAUSED = "is_paused"
    RESET_CACHE = "reset_cache"  # every worker
    WORLD_SIZE = "world_size"  # the sum of the workers'
    WEIGHT_VERSION = "weight_version"  # the one version every worker serves
    UPDATE_FROM_DISK = "update_from_disk"  # a whole transaction, or a step of the open one
    TRANSFER_INIT = "transfer_init"  # each worker its rank offset in the trainer's group
    TRANSFER_START = "transfer_start"  # opens the transaction unless a pause did
    TRANSFER_UPDATE = "transfer_update"
    TRANSFER_FINISH = "transfer_finish"  # every worker on one policy, or rolled back
    LOAD_ADAPTER = "load_adapter"  # every worker, or none
    UNLOAD_ADAPTER = "unload_adapter"
    ABORT = "abort"  # requests in flight end on every worker (no pause)
    WEIGHT_CHECK = "weight_check"  # every worker's weight checksums, merged and compared
    SET_VERSION = "set_version"  # every worker relabels its weights
    REFUSED = "refused"  # what no worker does (a draft model, SkyRL's delta format): named
    UPDATE_SESSION = "update_session"  # SGLang's weight-update session, on every worker
    ENGINE_FANOUT = "engine_fanout"  # one engine route on every matching worker, as it is


@dataclasses.dataclass(frozen=True)
class ControlRoute:
    dialect: str  # vllm | sglang | areal (AReaL's vLLM server extension) | smg
    methods: tuple[str, ...]
    path: str
    op: Op
    mutating: bool = True  # needs the admin token when the service has one
    # whether a frontend forwards it (False: the frontend answers it itself, from discovery)
    forwarded: bool = True

    @property
    def deadline(self) -> float:
        """Seconds a frontend waits for the service's answer: a read is quick, an update
        moves every worker's weights."""
        return READ_DEADLINE if not self.mutating else CHANGE_DEADLINE


READ_DEADLINE = 30.0
CHANGE_DEADLINE = 900.0

_R = ControlRoute
#: vLLM 0.32 (entrypoints/rl/online/api_router.py, serve/dev/cache/api_router.py,
#: serve/dev/rpc/api_router.py, serve/lora/api_router.py)
VLLM_ROUTES = (
    _R("vllm", ("POST",), "/pause", Op.PAUSE),  # ?mode=abort|wait|keep&clear_cache=
    _R("vllm", ("POST",), "/resume", Op.RESUME),
    _R("vllm", ("GET",), "/is_paused", Op.IS_PAUSED, mutating=False),
    _R("vllm", ("POST",), "/reset_prefix_cache", Op.RESET_CACHE),
    _R("vllm", ("GET",), "/get_world_size", Op.WORLD_SIZE, mutating=False),
    _R("vllm", ("GET",), "/weight_info", Op.WEIGHT_VERSION, mutating=False),
    _R("vllm", ("POST",), "/init_weight_transfer_engine", Op.TRANSFER_INIT),  # {init_info}
    _R("vllm", ("POST",), "/start_weight_update", Op.TRANSFER_START),
    _R("vllm", ("POST",), "/update_weights", Op.TRANSFER_UPDATE),  # {update_info}
    _R("vllm", ("POST",), "/finish_weight_update", Op.TRANSFER_FINISH),  # {weight_version}
    _R("vllm", ("POST",), "/collective_rpc", Op.UPDATE_FROM_DISK),  # reload_weights only
    _R("vllm", ("POST",), "/v1/load_lora_adapter", Op.LOAD_ADAPTER),  # {lora_name, lora_path}
    _R("vllm", ("POST",), "/v1/unload_lora_adapter", Op.UNLOAD_ADAPTER),  # {lora_name}
    # SkyRL 0.3's server wraps vLLM's load (load_inplace) at this path; its client sends it
    _R("vllm", ("POST",), "/skyrl/v1/load_lora_adapter", Op.LOAD_ADAPTER),
)
#: SGLang 0.5 (srt/entrypoints/http_server.py, managers/io_struct.py)
SGLANG_ROUTES = (
    _R("sglang", ("POST",), "/pause_generation", Op.PAUSE),  # {mode: abort|retract|in_place}
    _R("sglang", ("POST",), "/continue_generation", Op.RESUME),
    # {model_path, weight_version, flush_cache, abort_all_requests, ...}
    _R("sglang", ("POST",), "/update_weights_from_disk", Op.UPDATE_FROM_DISK),
    _R("sglang", ("GET", "POST"), "/flush_cache", Op.RESET_CACHE),
    # the frontend answers this one itself (rlfleet.frontend.sglang, from discovery)
    _R("sglang", ("GET",), "/get_weight_version", Op.WEIGHT_VERSION, mutating=False,
       forwarded=False),
    _R("sglang", ("POST",), "/load_lora_adapter", Op.LOAD_ADAPTER),  # {lora_name, lora_path}
    _R("sglang", ("POST",), "/unload_lora_adapter", Op.UNLOAD_ADAPTER),  # {lora_name}
)
#: vLLM's newest dev-mode RL routes (vllm/entrypoints/serve/dev/rlhf/api_router.py)
VLLM_RL_ROUTES = (
    _R("vllm", ("POST",), "/abort_requests", Op.ABORT),  # {request_ids} (none: all)
    # {action: checksum|compare, baseline, checksums}: reads the weights (reset is refused)
    _R("vllm", ("POST",), "/weight_checker", Op.WEIGHT_CHECK, mutating=False),
    _R("vllm", ("POST",), "/update_weight_version", Op.SET_VERSION),  # {new_version}
    _R("vllm", ("POST",), "/start_draft_weight_update", Op.REFUSED),
    # SkyRL 0.4's server route: a checkpoint delta in its own format
    _R("vllm", ("POST",), "/fetch_weights", Op.REFUSED),
)
#: SGLang 0.5.23's weight-update session (http_server.py begin/end_weight_update)
SGLANG_SESSION_ROUTES = (
    _R("sglang", ("POST",), "/begin_weight_update", Op.UPDATE_SESSION),  # {selector}
    _R("sglang", ("POST",), "/end_weight_update", Op.UPDATE_SESSION),
)
#: AReaL's vLLM server extension (areal/engine/vllm_ext/areal_vllm_server.py), which its
#: RemotevLLMEngine calls: its pause aborts the requests in flight (and clears the cache),
#: its update from disk is a whole pause, load and resume
AREAL_ROUTES = (
    _R("areal", ("POST",), "/areal_pause_generation", Op.PAUSE),
    _R("areal", ("POST",), "/areal_continue_generation", Op.RESUME),
    _R("areal", ("POST",), "/areal_update_weights", Op.UPDATE_FROM_DISK),  # {model_path}
)
#: SMG's RL control plane (lightseekorg/smg, rlfleet.protocol.smg): `{path}` is the engine
#: route, called on every worker the `selector` matches; per-worker results (200, or 207
#: with `failed[]`), no fleet transaction
SMG_ROUTES = (
    _R("smg", ("GET", "POST"), "/v1/rl/engine/{path:path}", Op.ENGINE_FANOUT),
)
ROUTES = (VLLM_ROUTES + SGLANG_ROUTES + VLLM_RL_ROUTES + SGLANG_SESSION_ROUTES + AREAL_ROUTES
          + SMG_ROUTES)
#: what a frontend started with --fleet-control forwards to the service
FORWARDED = tuple(r for r in ROUTES if r.forwarded)

#: how SGLang's pause modes map onto the fleet's: retract and in_place keep the requests
#: (they go on after the resume), abort ends them with their partial output
SGLANG_PAUSE_MODES = {"abort": "abort", "retract": "keep", "in_place": "keep"}


# ---------------------------------------------------------------- the bodies routes read


class Body(msgspec.Struct, kw_only=True):
    """A route's JSON body: the fields it reads, each optional here (a route that needs one
    says so by name), typed (a value of another type is refused naming the field)."""


class PauseBody(Body):
    """SGLang's /pause_generation."""

    mode: str = "abort"


class DiskUpdateBody(Body):
    """SGLang's /update_weights_from_disk (UpdateWeightFromDiskReqInput, the fields used)."""

    model_path: str | None = None
    weight_version: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False


class CollectiveRpcBody(Body):
    """vLLM's /collective_rpc."""

    method: str | None = None
    kwargs: dict[str, Any] | None = None


class TransferInitBody(Body):
    """vLLM's /init_weight_transfer_engine."""

    init_info: dict[str, Any] | None = None


class TransferUpdateBody(Body):
    """vLLM's /update_weights (a backend's update_info, or one per rank)."""

    update_info: dict[str, Any] | list[dict[str, Any]] | None = None


class TransferFinishBody(Body):
    """vLLM's /finish_weight_update."""

    weight_version: str | None = None


class LoraBody(Body):
    """vLLM's and SGLang's LoRA load and unload."""

    lora_name: str | None = None
    lora_path: str | None = None
