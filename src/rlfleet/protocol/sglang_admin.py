"""SGLang's control names and bodies under a vLLM worker's `/engine` (the routes of
Dynamo's SGLang worker facade that slime's external engines call: Dynamo's
`examples/rl/slime/`), mapped onto the operations the worker's own routes run. Structs
only: rlfleet.protocol.admin puts them in the route table, rlfleet.worker.admin serves them.

Slime appends SGLang's own paths to each control base `http://host:port/engine`:
`/server_info` (GET; `/get_server_info` too), `/pause_generation`, `/flush_cache` (GET),
`/init_weights_update_group`, `/update_weights_from_distributed`,
`/destroy_weights_update_group`, `/continue_generation`. SGLang's bodies
(python/sglang/srt/managers/io_struct.py): `PauseGenerationReqInput {mode}`,
`ContinueGenerationReqInput {torch_empty_cache}`, `InitWeightsUpdateGroupReqInput`
(master_address, master_port, rank_offset, world_size, group_name, backend),
`UpdateWeightsFromDistributedReqInput` (names, dtypes, shapes, group_name, flush_cache,
weight_version, load_format), `DestroyWeightsUpdateGroupReqInput {group_name}`; SGLang
0.5.23's weight-update session (`/begin_weight_update {selector}`, `/end_weight_update`),
which brackets its distributed and tensor updates: opened twice, or closed while none is
open, it answers `{"success": false, "message"}`."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import msgspec
from msgspec import UNSET, UnsetType

from rlfleet.protocol.admin_base import (
    MODEL_PATH_RULE,
    STEP_RULE,
    VERSION_RULE,
    AdminRequestError,
    Request,
    SglangReply,
    check_step,
)

#: SGLang's pause modes onto the engine's: retract and in_place keep the requests (they go on
#: after the resume), abort ends them with their partial output
SGLANG_PAUSE_MODES = {"abort": "abort", "retract": "keep", "in_place": "keep"}


class ServerInfoReply(msgspec.Struct, kw_only=True):
    """SGLang's `get_server_info` as one worker answers it: its server arguments that
    clients read (slime: the parallel sizes, the disaggregation mode), the weight version,
    and the contract's `status`."""

    status: str = "ok"
    message: str | UnsetType = UNSET
    model_path: str | UnsetType = UNSET
    tokenizer_path: str | UnsetType = UNSET
    served_model_name: str | UnsetType = UNSET
    context_length: int | UnsetType = UNSET
    tp_size: int | UnsetType = UNSET  # the engine's ranks (one worker: no pipeline, no DP)
    pp_size: int = 1
    dp_size: int = 1
    ep_size: int = 1
    disaggregation_mode: str = "null"  # SGLang's "no prefill/decode split"
    is_embedding: bool = False
    skip_tokenizer_init: bool = False
    weight_version: str | None | UnsetType = UNSET
    version: str | UnsetType = UNSET  # rlfleet's version (SGLang: its own)

    @classmethod
    def failed(cls, message: str, **fields: Any) -> ServerInfoReply:
        return cls(status="error", message=message, **fields)


class SessionRequest(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True,
                     omit_defaults=True):
    """SGLang 0.5.23's `BeginWeightUpdateReqInput`: which runners the session opens
    (an rlfleet worker runs the target model only: `draft` is refused)."""

    selector: Literal["target", "draft", "all"] = "all"


class EndSessionRequest(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True,
                        omit_defaults=True):
    """SGLang 0.5.23's `EndWeightUpdateReqInput`: no field."""


#: SGLang's answers of the session's routes (scheduler_components/weight_updater.py)
SESSION_OPEN = "a weight-update session is already open; call end_weight_update() first"
SESSION_CLOSED = "no weight-update session is open; call begin_weight_update() first"
NO_DRAFT = ("selector 'draft': this worker runs no speculative-decoding draft model; open the "
            "session with selector 'target' or 'all'")


# ---------------------------------------------------------------- SGLang-style requests
# (the fixed control/* routes and the allow-listed native methods of rlfleet.protocol.admin)


class SglangDiskRequest(Request, kw_only=True, frozen=True):
    """`control/update_weights_from_disk`: SGLang's UpdateWeightFromDiskReqInput."""

    model_path: str | None = None
    weight_version: str | None = None  # replaces the version; else the previous one stays
    step: int | None = None  # rlfleet: the new policy's fleet step
    flush_cache: bool = True
    keep_pause: bool = False  # stay paused after the update
    abort_all_requests: bool = False
    # SGLang's own, read by SGLang and accepted (unused) by the mocker
    load_format: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    MESSAGES: ClassVar[dict[str, str]] = {
        "model_path": MODEL_PATH_RULE, "weight_version": VERSION_RULE, "step": STEP_RULE,
        **{k: f"{k} must be a boolean" for k in ("flush_cache", "keep_pause",
                                                  "abort_all_requests")}}

    def __post_init__(self) -> None:
        check_step(self.step)


class SglangVersionRequest(Request, kw_only=True, frozen=True):
    """`control/update_weight_version`: the version as `weight_version` or, as SGLang names
    it, `new_version`."""

    weight_version: str | None = None
    new_version: str | None = None
    abort_all_requests: bool = False
    MESSAGES: ClassVar[dict[str, str]] = {
        "weight_version": "weight_version is required (a non-empty string)",
        "new_version": "weight_version is required (a non-empty string)",
        "abort_all_requests": "abort_all_requests must be a boolean"}

    def __post_init__(self) -> None:
        if not self.version:
            raise AdminRequestError(self.MESSAGES["weight_version"])

    @property
    def version(self) -> str | None:
        return self.weight_version if self.weight_version is not None else self.new_version


class AnyBody(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """A body the route does not read (the update routes the mocker does not support): it
    accepts whatever SGLang's own route would."""

    MESSAGES: ClassVar[dict[str, str]] = {}


class NativePauseRequest(Request, kw_only=True, frozen=True):
    mode: str = "abort"  # abort | retract | in_place (checked by the method: HTTP 500)


class NativeContinueRequest(Request, kw_only=True, frozen=True):
    torch_empty_cache: bool = True


class NativeFlushRequest(Request, kw_only=True, frozen=True):
    timeout_s: float | None = None


class SglangDiskReply(SglangReply, kw_only=True):
    num_paused_requests: int = 0  # requests held by the pause while the weights changed


class SglangVersionReply(SglangReply, kw_only=True):
    new_version: str | UnsetType = UNSET


class NativeReply(msgspec.Struct, kw_only=True):
    """A native method's result (rlfleet.mocker.admin.sglang_result): None is
    `{"status": "ok"}`, a (success, message[, num_paused_requests]) tuple those keys."""

    status: str | UnsetType = UNSET
    success: bool | UnsetType = UNSET
    message: str | UnsetType = UNSET
    num_paused_requests: int | UnsetType = UNSET


class NativeVersionReply(msgspec.Struct, kw_only=True):
    weight_version: str | None = None

