"""The admin contract between a refresh coordinator and a worker's system server, as data:
every route of both flavours (vLLM-style `/engine/<route>`, SGLang-style fixed `control/*`
routes and the allow-listed native methods) with its request Struct, its reply Struct and
its flags, in one table (`ROUTES`, `NATIVE_METHODS`). The system server decodes a body
against the route's request Struct once (`read_request`: an unknown field is refused by
name, a wrong type names the field); callers build the same Structs
(`rlfleet.runtime.admin_client`). Shapes: docs/contract.md.

A request Struct encodes only the fields its caller set (`omit_defaults`); a reply field
that the contract sometimes omits is `UNSET` until a handler sets it. A failure the route
expects is its reply's `failed(message)`: `{"status": "error", "message"}` (HTTP 200) on
the vLLM-style routes, `{"success": false, "message"}` on SGLang's; a native method with a
bad body raises instead (HTTP 500), as SGLang's own methods do."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, ClassVar

import msgspec

from rlfleet.protocol import admin_lora, admin_vllm
from rlfleet.protocol.admin_base import AdminRequestError, NoFields, Request, SglangReply, UnsupportedRequest
from rlfleet.protocol.admin_faults import FaultReply, FaultRequest
from rlfleet.protocol.sglang_admin import (
    AnyBody,
    EndSessionRequest,
    NativeContinueRequest,
    NativeFlushRequest,
    NativePauseRequest,
    NativeReply,
    NativeVersionReply,
    ServerInfoReply,
    SessionRequest,
    SglangDiskReply,
    SglangDiskRequest,
    SglangVersionReply,
    SglangVersionRequest,
)
from rlfleet.protocol.vllm_rl import DISK_ENGINE_RPCS, TRANSFER_ENGINE_RPCS

# ---------------------------------------------------------------- headers and errors

#: the admin token, as `Bearer <token>`, on every mutating call when the worker has one
AUTH_HEADER = "Authorization"
# a refresh coordinator's fleet epoch on every control call; a worker that has seen a newer
# one answers 409 with this `error` (rlfleet.worker.system_server.FleetFence)
EPOCH_HEADER = "X-Fleet-Epoch"
STALE_EPOCH = "Stale fleet epoch"
#: the URL prefix of every route on a worker's system server (GET it: the route listing)
ROUTE_PREFIX = "/engine"


def bearer(token: str) -> str:
    """The `Authorization` value that carries the admin token."""
    return f"Bearer {token}"


# ---------------------------------------------------------------- the commit (its body is another route's)

COMMIT_INSTALLS = ("update_weights_from_disk", "apply_staged_weights")
_COMMIT_INSTALL = f"install is required: one of {', '.join(COMMIT_INSTALLS)}"


class CommitRequest(Request, kw_only=True, frozen=True):
    """commit_policy (an rlfleet extension): one call that moves a worker to a policy, each
    step through the worker's own route, under that route's rules (its fence, its armed
    faults): close its admission (`close_reason`; None leaves it as it is), pause
    (`pause_mode`), install (`install`, with `body`: that route's request), reset the prefix
    cache (`reset_cache`), verify (get_weight_version reports `expect_version` /
    `expect_digest`, liveness_probe passes) and resume. It stops at the first step that
    fails: the worker stays closed and, past the pause, paused. No step starts once
    `deadline_s` seconds have passed since the call began (a step under way runs to its
    end: an install cut halfway would leave the weights uncertain)."""

    install: str
    body: dict[str, Any]
    expect_version: str
    expect_digest: str
    close_reason: str | None = None
    pause_mode: str = "wait"
    reset_cache: bool = True
    deadline_s: float = 60.0
    #: the post-update probe (a request-plane generate request, as `POST /generate` takes
    #: it): run after the resume on the worker's own request plane, its events answered in
    #: the reply (`admin_vllm.CommitReply.probe`); a worker without a request plane leaves it unrun
    probe: dict[str, Any] | None = None
    MESSAGES: ClassVar[dict[str, str]] = {
        "install": _COMMIT_INSTALL,
        "probe": "probe must be an object (a request-plane generate request) or null",
        "body": "body is required: the install route's request (an object)",
        "expect_version": "expect_version is required: the version the worker must report",
        "expect_digest": "expect_digest is required: the weight digest the worker must report",
        "close_reason": "close_reason must be a string (or null: admission left as it is)",
        "pause_mode": f"pause_mode must be one of {', '.join(admin_vllm.PAUSE_MODES)}",
        "reset_cache": "reset_cache must be a boolean",
        "deadline_s": "deadline_s must be a positive number of seconds"}
    NON_EMPTY: ClassVar[tuple[str, ...]] = ("expect_version", "expect_digest")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.install not in COMMIT_INSTALLS:
            raise AdminRequestError(f"install {self.install!r} is not an install route: "
                                    f"{_COMMIT_INSTALL}")
        if self.pause_mode not in admin_vllm.PAUSE_MODES:
            raise AdminRequestError(self.MESSAGES["pause_mode"])
        if isinstance(self.deadline_s, bool) or not self.deadline_s > 0 or \
                self.deadline_s != self.deadline_s:
            raise AdminRequestError(self.MESSAGES["deadline_s"])
        route = ROUTES[self.install]
        try:  # refused here, before anything changes, when the install would refuse it
            read_struct(route.request, route.name, self.body)
        except AdminRequestError as e:
            raise AdminRequestError(f"body (the {route.name} request): {e}") from None


# ---------------------------------------------------------------- the route table


@dataclasses.dataclass(frozen=True)
class AdminRoute:
    """One route: its name under /engine/, its request and reply types and its flags."""

    name: str
    request: type
    reply: type
    mutating: bool = True  # needs the admin token when one is set; advances the fleet epoch
    serialized: bool = True  # runs under the worker's control lock, one call at a time
    fenced: bool = True  # refused from an older fleet epoch (not: fault injection; LoRA: in the body)
    native: bool = False  # an SGLang native method: a bad body raises (HTTP 500)
    listed: bool = True  # in the worker's route listing (GET /engine, discovery's `routes`)

    def failure(self, message: str) -> Any:
        """The reply the route gives for a request it refuses."""
        return self.reply.failed(message)

    def at(self, path: str) -> AdminRoute:
        """The same route served under another path (a native method's configured one)."""
        return dataclasses.replace(self, name=path)


def _read(name: str, request: type, reply: type) -> AdminRoute:
    return AdminRoute(name, request, reply, mutating=False, serialized=False)


LIVENESS_PROBE = _read("liveness_probe", NoFields, admin_vllm.LivenessReply)
PAUSE_GENERATION = AdminRoute("pause_generation", admin_vllm.PauseRequest, admin_vllm.PauseReply)
RESUME_GENERATION = AdminRoute("resume_generation", NoFields, admin_vllm.MessageReply)
FLUSH_CACHE = AdminRoute("flush_cache", NoFields, admin_vllm.MessageReply)
ABORT_REQUEST = AdminRoute("abort_request", admin_vllm.AbortRequest, admin_vllm.AbortReply, serialized=False)
UPDATE_WEIGHTS_FROM_DISK = AdminRoute("update_weights_from_disk", admin_vllm.DiskUpdateRequest,
                                      admin_vllm.InstallReply)
GET_WEIGHT_VERSION = _read("get_weight_version", NoFields, admin_vllm.VersionReply)
SET_WEIGHT_VERSION = AdminRoute("set_weight_version",
                                admin_vllm.SetVersionRequest, admin_vllm.SetVersionReply)
INIT_WEIGHTS_UPDATE_GROUP = AdminRoute("init_weights_update_group",
                                       admin_vllm.GroupRequest, admin_vllm.MessageReply)
UPDATE_WEIGHTS_FROM_DISTRIBUTED = AdminRoute("update_weights_from_distributed",
                                             admin_vllm.DistributedRequest, admin_vllm.InstallReply)
DESTROY_WEIGHTS_UPDATE_GROUP = AdminRoute("destroy_weights_update_group", admin_vllm.GroupLeaveRequest,
                                          admin_vllm.MessageReply)
STAGE_WEIGHTS = AdminRoute("stage_weights", admin_vllm.StageRequest, admin_vllm.StageReply)
GET_STAGED_WEIGHTS = _read("get_staged_weights", admin_vllm.StagedQuery, admin_vllm.StagedListReply)
APPLY_STAGED_WEIGHTS = AdminRoute("apply_staged_weights",
                                  admin_vllm.ApplyStagedRequest, admin_vllm.InstallReply)
RELEASE_STAGED_WEIGHTS = AdminRoute("release_staged_weights", admin_vllm.HandleRequest, admin_vllm.StageReply)
SET_ADMISSION = AdminRoute("set_admission",
                           admin_vllm.AdmissionRequest, admin_vllm.AdmissionReply, serialized=False)
# TEST ONLY (rlfleet.protocol.admin_faults): served only with --enable-fault-injection
FAULT_INJECTION = AdminRoute("fault_injection", FaultRequest, FaultReply, fenced=False)
COMMIT_POLICY = AdminRoute("commit_policy", CommitRequest, admin_vllm.CommitReply)

# LoRA adapters (not named load_lora / unload_lora: Dynamo's RL route list has none of its
# LoRA routes); each adapter fences on its own epoch, in the body (admin_lora.LoraRequest)
LOAD_LORA_ADAPTER = AdminRoute("load_lora_adapter", admin_lora.LoraLoadRequest, admin_lora.LoraAdapterReply,
                               serialized=False, fenced=False)
UNLOAD_LORA_ADAPTER = AdminRoute("unload_lora_adapter", admin_lora.LoraRequest, admin_lora.LoraAdapterReply,
                                 serialized=False, fenced=False)
SET_LORA_ADMISSION = AdminRoute("set_lora_admission",
                                admin_lora.LoraAdmissionRequest, admin_lora.LoraAdapterReply,
                                serialized=False, fenced=False)
LIST_LORA_ADAPTERS = _read("list_lora_adapters", NoFields, admin_lora.LoraListReply)
LORA = (LOAD_LORA_ADAPTER, UNLOAD_LORA_ADAPTER, SET_LORA_ADMISSION, LIST_LORA_ADAPTERS)
# adapter versions staged while serving and loaded beside the serving one (engines that can)
STAGE_LORA_ADAPTER = AdminRoute("stage_lora_adapter", admin_lora.LoraStageRequest, admin_vllm.StageReply,
                                serialized=False, fenced=False)
GET_STAGED_LORA_ADAPTER = _read("get_staged_lora_adapter",
                                admin_lora.LoraStagedQuery, admin_vllm.StagedListReply)
ACTIVATE_LORA_ADAPTER = AdminRoute("activate_lora_adapter", admin_lora.LoraVersionRequest,
                                   admin_lora.LoraAdapterReply, serialized=False, fenced=False)
DISCARD_LORA_ADAPTER = AdminRoute("discard_lora_adapter", admin_lora.LoraVersionRequest,
                                  admin_lora.LoraAdapterReply, serialized=False, fenced=False)
LORA_STAGED = (STAGE_LORA_ADAPTER, GET_STAGED_LORA_ADAPTER, ACTIVATE_LORA_ADAPTER,
               DISCARD_LORA_ADAPTER)

SGLANG_UPDATE_WEIGHTS_FROM_DISK = AdminRoute("control/update_weights_from_disk",
                                             SglangDiskRequest, SglangDiskReply)
SGLANG_UPDATE_WEIGHTS_FROM_DISTRIBUTED = AdminRoute("control/update_weights_from_distributed",
                                                    AnyBody, SglangReply)
SGLANG_UPDATE_WEIGHTS_FROM_TENSOR = AdminRoute("control/update_weights_from_tensor", AnyBody,
                                               SglangReply)
SGLANG_UPDATE_WEIGHTS_FROM_IPC = AdminRoute("control/update_weights_from_ipc", AnyBody,
                                            SglangReply)
SGLANG_UPDATE_WEIGHT_VERSION = AdminRoute("control/update_weight_version",
                                          SglangVersionRequest, SglangVersionReply)

# Dynamo 1.7's layout of the vLLM worker's routes, beside 1.6's flat names (the same
# handlers where both name one), listed in a worker's `routes` as 1.7 lists them: the
# control/* and update/* names a 1.7 client requires, and `collective_rpc` (vLLM's body;
# `reload_weights` only, the same handler as vLLM's native `POST /collective_rpc` at the
# worker's admin_base_url).
CONTROL_PAUSE_GENERATION = PAUSE_GENERATION.at("control/pause_generation")
CONTROL_RESUME_GENERATION = RESUME_GENERATION.at("control/resume_generation")
CONTROL_IS_PAUSED = _read("control/is_paused", NoFields, admin_vllm.IsPausedReply)
# ... and its flat name, beside 1.6's (RL clients that speak the flat names call it); served,
# not listed: a worker's listing stays the route list Dynamo 1.7 advertises
IS_PAUSED = dataclasses.replace(CONTROL_IS_PAUSED, name="is_paused", listed=False)
CONTROL_GET_WEIGHT_VERSION = _read("control/get_weight_version", NoFields, admin_vllm.WeightVersionReply)
UPDATE_UPDATE_WEIGHT_VERSION = AdminRoute("update/update_weight_version", admin_vllm.NewVersionRequest,
                                          admin_vllm.WeightVersionReply)
COLLECTIVE_RPC = AdminRoute("collective_rpc", admin_vllm.CollectiveRpcRequest, admin_vllm.CollectiveRpcReply)
# ... and vLLM's weight-transfer steps (the same code as vLLM's native routes at the
# worker's admin_base_url: rlfleet.worker.weight_transfer), answered `{"status", "message"}`
UPDATE_INIT_WEIGHT_TRANSFER_ENGINE = AdminRoute("update/init_weight_transfer_engine",
                                                admin_vllm.TransferInitRequest, admin_vllm.MessageReply)
UPDATE_START_WEIGHT_UPDATE = AdminRoute("update/start_weight_update", NoFields, admin_vllm.MessageReply)
UPDATE_UPDATE_WEIGHTS = AdminRoute("update/update_weights", admin_vllm.TransferUpdateRequest,
                                   admin_vllm.MessageReply)
UPDATE_FINISH_WEIGHT_UPDATE = AdminRoute("update/finish_weight_update", admin_vllm.TransferFinishRequest,
                                         admin_vllm.MessageReply)
DYNAMO_17_TRANSFER = (UPDATE_INIT_WEIGHT_TRANSFER_ENGINE, UPDATE_START_WEIGHT_UPDATE,
                      UPDATE_UPDATE_WEIGHTS, UPDATE_FINISH_WEIGHT_UPDATE)
DYNAMO_17 = (CONTROL_PAUSE_GENERATION, CONTROL_RESUME_GENERATION, CONTROL_IS_PAUSED,
             CONTROL_GET_WEIGHT_VERSION, UPDATE_UPDATE_WEIGHT_VERSION, COLLECTIVE_RPC,
             *DYNAMO_17_TRANSFER)

# SGLang's names under the vLLM-style /engine (slime's control calls through Dynamo's SGLang
# facade: rlfleet.protocol.sglang_admin): continue_generation is resume_generation with
# SGLang's body; server_info (and get_server_info) SGLang's server arguments. The other
# names slime sends (pause_generation, flush_cache, the group routes) are the table's own,
# which take SGLang's bodies too. Served, not listed (the listing stays Dynamo's).
CONTINUE_GENERATION = AdminRoute("continue_generation", NativeContinueRequest, admin_vllm.MessageReply,
                                 listed=False)
SERVER_INFO = AdminRoute("server_info", NoFields, ServerInfoReply, mutating=False,
                         serialized=False, listed=False)
GET_SERVER_INFO = dataclasses.replace(SERVER_INFO, name="get_server_info")
# SGLang 0.5.23's weight-update session (`{"success", "message"}`)
BEGIN_WEIGHT_UPDATE = AdminRoute("begin_weight_update", SessionRequest, SglangReply,
                                 listed=False)
END_WEIGHT_UPDATE = AdminRoute("end_weight_update", EndSessionRequest, SglangReply,
                               listed=False)
SGLANG_NAMES = (CONTINUE_GENERATION, SERVER_INFO, GET_SERVER_INFO, BEGIN_WEIGHT_UPDATE,
                END_WEIGHT_UPDATE)

#: the lifecycle every vLLM-style refresh path needs
VLLM_LIFECYCLE = (PAUSE_GENERATION, RESUME_GENERATION, GET_WEIGHT_VERSION, LIVENESS_PROBE,
                  FLUSH_CACHE)
VLLM_GROUP = (INIT_WEIGHTS_UPDATE_GROUP, UPDATE_WEIGHTS_FROM_DISTRIBUTED,
              DESTROY_WEIGHTS_UPDATE_GROUP)
STAGED = (STAGE_WEIGHTS, GET_STAGED_WEIGHTS, APPLY_STAGED_WEIGHTS, RELEASE_STAGED_WEIGHTS)
SGLANG_FIXED = (SGLANG_UPDATE_WEIGHTS_FROM_DISK, SGLANG_UPDATE_WEIGHTS_FROM_DISTRIBUTED,
                SGLANG_UPDATE_WEIGHTS_FROM_TENSOR, SGLANG_UPDATE_WEIGHTS_FROM_IPC,
                SGLANG_UPDATE_WEIGHT_VERSION)

#: the allow-listed SGLang native methods, by method name; a deployment serves each under the
#: path it configures (DYN_SGLANG_ENGINE_ROUTES: `NATIVE_METHODS[m].at(path)`)
NATIVE_METHODS = {r.name: r for r in (
    AdminRoute("pause_generation", NativePauseRequest, NativeReply, native=True),
    AdminRoute("continue_generation", NativeContinueRequest, NativeReply, native=True),
    AdminRoute("flush_cache", NativeFlushRequest, NativeReply, native=True),
    AdminRoute("get_weight_version", NoFields, NativeVersionReply, mutating=False,
               serialized=False, native=True),
)}
NATIVE_PAUSE_GENERATION = NATIVE_METHODS["pause_generation"]
NATIVE_CONTINUE_GENERATION = NATIVE_METHODS["continue_generation"]
NATIVE_FLUSH_CACHE = NATIVE_METHODS["flush_cache"]
NATIVE_GET_WEIGHT_VERSION = NATIVE_METHODS["get_weight_version"]

#: every fixed route, by name (the native methods' paths are configured)
ROUTES = {r.name: r for r in (
    LIVENESS_PROBE, PAUSE_GENERATION, RESUME_GENERATION, FLUSH_CACHE, ABORT_REQUEST,
    UPDATE_WEIGHTS_FROM_DISK, GET_WEIGHT_VERSION, SET_WEIGHT_VERSION, *VLLM_GROUP, *STAGED,
    SET_ADMISSION, FAULT_INJECTION, COMMIT_POLICY, *SGLANG_FIXED, *DYNAMO_17, IS_PAUSED, *LORA,
    *LORA_STAGED, *SGLANG_NAMES)}

# ---------------------------------------------------------------- whose schema each route follows

_DYNAMO_VLLM = "Dynamo components/src/dynamo/vllm/handlers.py"
_DYNAMO_17 = f"{_DYNAMO_VLLM} (1.7's control/* and update/* layout)"
_VLLM_RL = "vLLM vllm/entrypoints/rl/online/api_router.py (the body, under Dynamo 1.7's name)"
_SGLANG = ("SGLang python/sglang/srt/managers/io_struct.py, as Dynamo's SGLang worker serves it "
           "(components/src/dynamo/sglang)")
_RLFLEET = "rlfleet's own (no upstream server has it; docs in this module)"

#: per route of the table, the source file of the server whose request and reply schema it
#: follows: a field that server's handler reads is taken here (honoured, or refused by name
#: with HTTP 400: UnsupportedRequest), one it refuses stays refused. rlfleet's additions to a
#: borrowed route (`step`, `fleet_epoch`, `dtype`, `adapters`, ...) are marked "rlfleet" at
#: their fields. The native methods (NATIVE_METHODS) follow SGLang's
#: python/sglang/srt/managers/tokenizer_manager.py methods of the same names.
FOLLOWS: dict[str, str] = {
    **dict.fromkeys((
        "liveness_probe", "pause_generation", "resume_generation", "flush_cache",
        "abort_request", "update_weights_from_disk", "get_weight_version",
        "init_weights_update_group", "update_weights_from_distributed",
        "destroy_weights_update_group"), _DYNAMO_VLLM),
    **dict.fromkeys(("control/pause_generation", "control/resume_generation",
                     "control/is_paused", "control/get_weight_version",
                     "update/update_weight_version"), _DYNAMO_17),
    "is_paused": f"{_DYNAMO_17}: control/is_paused under its flat name",
    "collective_rpc": "vLLM vllm/entrypoints/serve/dev/rpc/api_router.py (Dynamo 1.7 serves "
                      "it under /engine too)",
    **dict.fromkeys(("update/init_weight_transfer_engine", "update/start_weight_update",
                     "update/update_weights", "update/finish_weight_update"), _VLLM_RL),
    **dict.fromkeys((r.name for r in SGLANG_FIXED), _SGLANG),
    **dict.fromkeys((r.name for r in SGLANG_NAMES), f"{_SGLANG}: the names slime sends to "
                    "Dynamo's SGLang /engine facade (examples/rl/slime/)"),
    "load_lora_adapter": "vLLM vllm/entrypoints/serve/lora/api_router.py "
                         "(/v1/load_lora_adapter's body, with rlfleet's identity fields)",
    "unload_lora_adapter": "vLLM vllm/entrypoints/serve/lora/api_router.py "
                           "(/v1/unload_lora_adapter's body)",
    **dict.fromkeys(("set_weight_version", "stage_weights", "get_staged_weights",
                     "apply_staged_weights", "release_staged_weights", "set_admission",
                     "fault_injection", "commit_policy", "set_lora_admission",
                     "list_lora_adapters", "stage_lora_adapter", "get_staged_lora_adapter",
                     "activate_lora_adapter", "discard_lora_adapter"), _RLFLEET),
}


def route_names(routes: tuple[AdminRoute, ...] | list[AdminRoute]) -> frozenset[str]:
    return frozenset(r.name for r in routes)


# ---------------------------------------------------------------- decoding a body

_UNKNOWN = re.compile(r"Object contains unknown field `(?P<field>[^`]*)`(?: - at `(?P<at>[^`]*)`)?")
_MISSING = re.compile(r"Object missing required field `(?P<field>[^`]*)`")
_TYPE = re.compile(r"Expected `(?P<want>[^`]*)`, got `(?P<got>[^`]*)` - at `\$\.(?P<at>[^`]*)`")


def read_request(route: AdminRoute, body: dict[str, Any]) -> Any:
    """The body as the route's request; AdminRequestError says what is wrong: a field the
    route does not take (by name, with the ones it does), a missing one, a wrong type, or
    a rule the request breaks."""
    return read_struct(route.request, route.name, body)


#: why an rlfleet worker does not run an engine method Dynamo's clients are known to name
_NOT_RUN = {
    "init_broadcaster": "prime-rl's NCCL broadcast receiver (its worker extension); an rlfleet "
                        "worker joins a trainer's group with master_address, master_port, "
                        "world_size[, rank_offset, backend]",
    "destroy_broadcaster": "prime-rl's NCCL broadcast receiver (its worker extension)",
}


def check_engine_rpc(request: type, name: str, body: Any) -> None:
    """Refuse, by name, an `engine_rpc` the route's real server takes that this worker does
    not run (UnsupportedRequest: HTTP 400), before the rest of the body (that method's
    keywords) is read."""
    runs = getattr(request, "ENGINE_RPCS", None)
    if runs is None or not isinstance(body, dict) or body.get("engine_rpc") is None:
        return
    rpc = body["engine_rpc"]
    if not isinstance(rpc, str):
        raise AdminRequestError(f"engine_rpc must be a string, not {type(rpc).__name__} ({name})")
    if rpc in runs:
        return
    why = f": {_NOT_RUN[rpc]}" if rpc in _NOT_RUN else ""
    if not runs:
        raise UnsupportedRequest(f"{name}: an rlfleet worker runs no engine_rpc here, not "
                                 f"{rpc!r}{why}; leave engine_rpc out")
    loads = [r for r in runs if r in DISK_ENGINE_RPCS]
    steps = [r for r in runs if r in TRANSFER_ENGINE_RPCS]
    kinds = ([f"{', '.join(loads)} (a load of a checkpoint from disk with "
              "update_weights_from_disk's checks)"] if loads else []) + \
        ([f"{', '.join(steps)} (vLLM's weight-transfer steps)"] if steps else [])
    raise UnsupportedRequest(f"{name}: an rlfleet worker does not run engine_rpc {rpc!r}{why}; "
                             f"it runs {'; '.join(kinds)}")


def read_struct(request: type, name: str, body: Any) -> Any:
    """`body` as a `request` Struct (what `name` takes), refused as read_request refuses."""
    check_engine_rpc(request, name, body)
    try:
        return msgspec.convert(body, request)
    except msgspec.ValidationError as e:
        if isinstance(e.__cause__, AdminRequestError):
            raise e.__cause__ from None
        raise AdminRequestError(_explain(request, name, str(e))) from None


def _explain(request: type, name: str, error: str) -> str:
    messages: dict[str, str] = getattr(request, "MESSAGES", {})
    fields = getattr(request, "__struct_fields__", ())
    if m := _UNKNOWN.fullmatch(error):
        where = f" (in {m['at'].removeprefix('$.')})" if m["at"] else ""
        takes = ", ".join(fields) if fields else "no fields"
        return (f"unknown field {m['field']!r}{where}: {name} takes {takes}")
    if m := _MISSING.fullmatch(error):
        return messages.get(m["field"], f"{m['field']} is required by {name}")
    if m := _TYPE.fullmatch(error):
        generic = f"{m['at']} must be {m['want']}, not {m['got']} ({name})"
        return messages.get(m["at"], generic)  # a nested field: its path
    return f"{name}: {error}"

