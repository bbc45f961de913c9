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

from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

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
