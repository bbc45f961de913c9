"""The admin schema of the LoRA adapter routes under a worker's `/engine` (load, unload,
admission, list, and the staged adapter versions): each request fences on the adapter's own
epoch, in the body."""

from __future__ import annotations

from typing import Any, ClassVar

from msgspec import UNSET, UnsetType

from rlfleet.protocol import admin_base
from rlfleet.protocol.admin_base import AdminRequestError, Identified, Reply, Request
from rlfleet.protocol.admin_vllm import HANDLE_RULE, SOURCE_RULE, STAGE_VERSION_RULE, check_handle
from rlfleet.protocol.identity import PolicyIdentity

# ---------------------------------------------------------------- LoRA adapters

_LORA_NAME = ("lora_name is required: the adapter's name (what a request's `model` names; "
              "not the base model's)")
_LORA_PATH = "lora_path is required (an adapter directory on this worker's disk: " \
    "adapter_config.json and adapter_model.safetensors, as peft saves it)"
_LORA_EPOCH = "fleet_epoch must be a non-negative integer (the adapter's refresh epoch)"


class LoraRequest(Request, kw_only=True, frozen=True):
    """A call about one adapter. `fleet_epoch`: the epoch of the adapter's own refresh
    coordinator; each adapter has its own fence (two runs on one fleet never fence each
    other, nor the base model's coordinator), so it travels in the body, not the header."""

    lora_name: str
    fleet_epoch: int | None = None
    MESSAGES: ClassVar[dict[str, str]] = {"lora_name": _LORA_NAME,
                                          "fleet_epoch": _LORA_EPOCH}
    NON_EMPTY: ClassVar[tuple[str, ...]] = ("lora_name",)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fleet_epoch is not None and self.fleet_epoch < 0:
            raise AdminRequestError(_LORA_EPOCH)


class LoraLoadRequest(LoraRequest, kw_only=True, frozen=True):
    """Load an adapter, or a new version of a loaded one (vLLM's `/v1/load_lora_adapter`
    body, with rlfleet's identity fields): the new version serves requests that arrive from
    then on; requests running on the old one finish on it.

    rlfleet's additions: `handle` (instead of `lora_path`): a READY handle of
    `stage_lora_adapter`; `activate: false`: load the version beside the one that serves
    the adapter's name (requests reach it by its own `served_name` only) until
    `activate_lora_adapter` switches the name to it."""

    lora_path: str = ""
    weight_version: str | None = None  # the adapter version's label
    step: int | None = None  # the adapter's fleet step
    digest: str | None = None  # the content digest the caller expects (refused otherwise)
    load_inplace: bool = False  # vLLM's flag: accepted (a new version always replaces)
    handle: str | None = None  # a READY staging handle (stage_lora_adapter), not a path
    activate: bool = True  # false: loaded beside the serving version, not yet serving
    MESSAGES: ClassVar[dict[str, str]] = {
        **LoraRequest.MESSAGES, "lora_path": _LORA_PATH, "weight_version": admin_base.VERSION_RULE,
        "step": admin_base.STEP_RULE, "digest": "digest must be a string (blake3:<hex>)",
        "handle": HANDLE_RULE, "activate": "activate must be a boolean"}

    def __post_init__(self) -> None:
        super().__post_init__()
        admin_base.check_step(self.step)
        check_handle(self.handle)
        if not self.lora_path and self.handle is None:
            raise AdminRequestError(_LORA_PATH + "; or, instead, the handle of a version "
                                    "staged with stage_lora_adapter")
        if self.lora_path and self.handle is not None:
            raise AdminRequestError("give lora_path or handle, not both")


class LoraStageRequest(LoraRequest, kw_only=True, frozen=True):
    """Pull an adapter version from a weight-plane source while the worker serves (S3, a
    directory, the trainer's publisher, a peer that holds it), checked by its content
    digest; `load_lora_adapter` with the handle then loads it."""

    version: str
    source: dict[str, Any]  # a stage_weights source (rlfleet.weights.staging), no fanout
    digest: str | None = None
    MESSAGES: ClassVar[dict[str, str]] = {
        **LoraRequest.MESSAGES, "version": STAGE_VERSION_RULE, "source": SOURCE_RULE,
        "digest": "digest must be a string (blake3:<hex>)"}
    NON_EMPTY: ClassVar[tuple[str, ...]] = ("lora_name", "version")


class LoraStagedQuery(LoraRequest, kw_only=True, frozen=True):
    handle: str | None = None  # one handle of the adapter's; None: all of them
    MESSAGES: ClassVar[dict[str, str]] = {**LoraRequest.MESSAGES, "handle": HANDLE_RULE}

    def __post_init__(self) -> None:
        super().__post_init__()
        check_handle(self.handle)


class LoraVersionRequest(LoraRequest, kw_only=True, frozen=True):
    """One version of an adapter loaded beside the serving one (`activate: false`):
    activate it (the adapter's name serves it from then on) or discard it."""

    weight_version: str
    MESSAGES: ClassVar[dict[str, str]] = {
        **LoraRequest.MESSAGES, "weight_version": "weight_version is required: the label of "
        "the version loaded with activate: false"}
    NON_EMPTY: ClassVar[tuple[str, ...]] = ("lora_name", "weight_version")


class LoraAdmissionRequest(LoraRequest, kw_only=True, frozen=True):
    """Open or close one adapter to rollouts (the base model and other adapters serve on):
    while closed, frontends hold requests that name it (its flag in discovery)."""

    open: bool
    reason: str | None = None
    MESSAGES: ClassVar[dict[str, str]] = {**LoraRequest.MESSAGES,
                                          "open": "open (boolean) is required",
                                          "reason": "reason must be a string"}


class LoraAdapterReply(Identified, Reply, kw_only=True):
    """One adapter as a worker serves it: its policy identity (the adapter's own version,
    digest and step), its rank, whether it is open to requests, its fence."""

    lora_name: str | UnsetType = UNSET
    version: str | None | UnsetType = UNSET
    weight_digest: str | None | UnsetType = UNSET
    step: int | None | UnsetType = UNSET
    adapter: str | UnsetType = UNSET
    rank: int | UnsetType = UNSET
    lora_path: str | UnsetType = UNSET
    open: bool | UnsetType = UNSET
    reason: str | None | UnsetType = UNSET
    fleet_epoch: int | UnsetType = UNSET  # the newest epoch of the adapter's coordinator
    replaced: str | None | UnsetType = UNSET  # the version a load replaced
    served_name: str | UnsetType = UNSET  # the engine's name of this version (a request
    # naming it runs on exactly this version: a probe of a version loaded beside)

    def policy(self) -> PolicyIdentity:
        return super().policy().of_adapter(self.lora_name or None)


class LoraListReply(Reply, kw_only=True):
    adapters: list[LoraAdapterReply] | UnsetType = UNSET
    base: str | UnsetType = UNSET  # the base model's served name (their parent)
    max_loras: int | UnsetType = UNSET
    max_lora_rank: int | UnsetType = UNSET


