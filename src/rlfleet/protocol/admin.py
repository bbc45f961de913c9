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
import os
import re
from pathlib import Path
from typing import Any, ClassVar

import msgspec
from msgspec import UNSET, UnsetType

from rlfleet.protocol.identity import PolicyIdentity
from rlfleet.protocol.sglang_admin import (
    SGLANG_PAUSE_MODES,
    EndSessionRequest,
    ServerInfoReply,
    SessionRequest,
)
from rlfleet.protocol.vllm_rl import (
    DISK_ENGINE_RPCS,
    RELOAD_KWARGS,
    RELOAD_WEIGHTS,
    TRANSFER_ENGINE_RPCS,
    UPDATE_WEIGHTS_FROM_PATH,
)

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


class AdminRequestError(ValueError):
    """The request body is not acceptable; the message says what to send instead."""


class UnsupportedRequest(AdminRequestError):
    """A body the real server takes, asking for what an rlfleet worker does not do (an
    `engine_rpc` it does not run): HTTP 400 `{"error", "message"}` naming it, on every
    route (not the route's own 200 failure)."""

    status = 400


class ErrorBody(msgspec.Struct, kw_only=True):
    """The body of every non-200 answer but 409 (400, 401, 404, 405, 499, 500)."""

    error: str
    message: str


class StaleEpochError(ErrorBody, kw_only=True):
    """HTTP 409: a call from an older fleet epoch than the newest the worker has seen."""

    fleet_epoch: int
    newest_fleet_epoch: int


# ---------------------------------------------------------------- bases


class Request(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True,
              omit_defaults=True):
    """A route's body. `MESSAGES`: what to tell a caller who left a field out or sent it
    with the wrong type (else a message that names the field and the type).
    `ENGINE_RPCS`: for a route whose real server takes Dynamo's `engine_rpc` (the engine
    method to run), the ones this worker runs; any other is refused by name before the rest
    of the body is read (UnsupportedRequest). None: the route takes no `engine_rpc`."""

    MESSAGES: ClassVar[dict[str, str]] = {}
    ENGINE_RPCS: ClassVar[tuple[str, ...] | None] = None
    #: string fields that may not be empty (the refusal is the field's MESSAGES entry)
    NON_EMPTY: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        for name in self.NON_EMPTY:
            if not getattr(self, name):
                raise AdminRequestError(self.MESSAGES[name])


class NoFields(Request, kw_only=True, frozen=True, forbid_unknown_fields=True,
               omit_defaults=True):
    """A route that reads no field (an empty body, or `{}`)."""


class Reply(msgspec.Struct, kw_only=True):
    """A vLLM-style reply: `status` "ok" or "error" (with `message`)."""

    status: str = "ok"
    message: str | UnsetType = UNSET

    @classmethod
    def failed(cls, message: str, **fields: Any) -> Any:
        """The failure the route expects: HTTP 200 with status "error"."""
        return cls(status="error", message=message, **fields)


class SglangReply(msgspec.Struct, kw_only=True):
    """An SGLang-style reply: `success` and `message`."""

    success: bool = True
    message: str = ""

    @classmethod
    def failed(cls, message: str, **fields: Any) -> Any:
        return cls(success=False, message=message, **fields)


class _Identified:
    """A reply that carries the policy identity (the contract's `version`, `weight_digest`,
    `step`: PolicyIdentity.reply_fields)."""

    __slots__ = ()

    def policy(self) -> PolicyIdentity:
        """The identity reported. An install without a declared version reports "unknown"
        (the version is null then)."""
        fields = {k: None if v is UNSET else v for k, v in
                  ((f, getattr(self, f, None)) for f in PolicyIdentity().reply_fields())}
        ident = PolicyIdentity.from_reply(fields)
        if ident.version == "unknown" and getattr(self, "version_declared", None) is False:
            ident = msgspec.structs.replace(ident, version=None)
        return ident


# ---------------------------------------------------------------- vLLM-style requests

PAUSE_MODES = ("keep", "wait", "abort")
_STEP = "step must be a non-negative integer (the policy's fleet step)"
_VERSION = "weight_version must be a string"
_MODEL_PATH = "model_path is required (a checkpoint directory on this worker's disk)"


def _check_step(step: int | None) -> None:
    if step is not None and step < 0:
        raise AdminRequestError(f"{_STEP}, not {step!r}")


class PauseRequest(Request, kw_only=True, frozen=True):
    # keep | wait | abort (PAUSE_MODES), or SGLang's retract | in_place (slime's body through
    # Dynamo's SGLang facade: SGLANG_PAUSE_MODES, both keep)
    mode: str = "keep"
    clear_cache: bool = False
    MESSAGES: ClassVar[dict[str, str]] = {"clear_cache": "clear_cache must be a boolean"}

    def __post_init__(self) -> None:
        if self.mode not in PAUSE_MODES and self.mode not in SGLANG_PAUSE_MODES:
            raise AdminRequestError(f"Invalid mode {self.mode!r}; expected keep|wait|abort")

    @property
    def engine_mode(self) -> str:
        """The engine's pause mode (keep | wait | abort) the request names."""
        return SGLANG_PAUSE_MODES.get(self.mode, self.mode)


class AbortRequest(Request, kw_only=True, frozen=True):
    request_id: str  # the X-Request-Id or response id of the request
    MESSAGES: ClassVar[dict[str, str]] = {
        "request_id": "request_id is required (the X-Request-Id or response id of the request)"}
    NON_EMPTY: ClassVar[tuple[str, ...]] = ("request_id",)


class DiskUpdateRequest(Request, kw_only=True, frozen=True):
    model_path: str | None = None  # checked by weights_path (the worker's roots)
    weight_version: str | None = None
    step: int | None = None  # the policy's fleet step (rlfleet)
    # Dynamo's: the engine method that loads `model_path` (default reload_weights); each one
    # an rlfleet worker runs (DISK_ENGINE_RPCS) is the same load, digest and self-check
    engine_rpc: str | None = None
    MESSAGES: ClassVar[dict[str, str]] = {"model_path": _MODEL_PATH, "weight_version": _VERSION,
                                          "step": _STEP, "engine_rpc": "engine_rpc must be a "
                                          f"string: one of {', '.join(DISK_ENGINE_RPCS)}"}
    ENGINE_RPCS: ClassVar[tuple[str, ...] | None] = tuple(DISK_ENGINE_RPCS)

    def __post_init__(self) -> None:
        _check_step(self.step)


class NewVersionRequest(Request, kw_only=True, frozen=True):
    """Dynamo 1.7's `update/update_weight_version`: relabel the weights served."""

    new_version: str
    MESSAGES: ClassVar[dict[str, str]] = {
        "new_version": "new_version is required (a non-empty string)"}
    NON_EMPTY: ClassVar[tuple[str, ...]] = ("new_version",)


class CollectiveRpcRequest(Request, kw_only=True, frozen=True):
    """vLLM's collective_rpc body (`method`, `args`, `kwargs`, `timeout`), as vLLM's native
    `POST /collective_rpc` and Dynamo 1.7's `/engine/collective_rpc` take it. An rlfleet
    worker runs `reload_weights` only (kwargs `weights_path`, `is_checkpoint_format`): a
    reload from disk through update_weights_from_disk's checks. The fields are untyped so
    that what does not fit gets vLLM's own messages (checked here, in one place)."""

    method: Any = None  # RELOAD_WEIGHTS only
    args: Any = None  # none: reload_weights takes kwargs
    kwargs: Any = None  # {weights_path?, is_checkpoint_format?}
    timeout: float | None = None  # seconds (the reload runs under the worker's own bounds)
    MESSAGES: ClassVar[dict[str, str]] = {
        "timeout": "timeout must be a number of seconds, or null"}

    def __post_init__(self) -> None:
        if self.method is None:
            raise AdminRequestError("Missing 'method' in request body")
        if self.method != RELOAD_WEIGHTS:
            raise AdminRequestError(
                f"an rlfleet worker runs collective_rpc for {RELOAD_WEIGHTS!r} only (a reload "
                f"from disk, with update_weights_from_disk's checks), not {self.method!r}")
        kwargs = self.kwargs or {}
        unknown = sorted(set(kwargs) - set(RELOAD_KWARGS)) if isinstance(kwargs, dict) \
            else ["(kwargs is not an object)"]
        if self.args or unknown:
            raise AdminRequestError(
                f"reload_weights takes kwargs {', '.join(RELOAD_KWARGS)} only; got args "
                f"{self.args!r}, unknown kwargs {unknown}")
        if str(kwargs.get("is_checkpoint_format", True)).lower() not in ("true", "1"):
            raise AdminRequestError("rlfleet reloads checkpoint-format files only "
                                    "(is_checkpoint_format true)")

    @property
    def weights_path(self) -> str | None:
        """The checkpoint to reload; None: the model the worker was started from."""
        return (self.kwargs or {}).get("weights_path") or None


_INIT_INFO = ("init_info is required: an object with the settings of the worker's weight-transfer "
              "backend (nccl: master_address, master_port, rank_offset, world_size; modelexpress: "
              "its object-storage settings)")
_UPDATE_INFO = ("update_info is required: an object, or one per rank, naming what to transfer "
                "(nccl: names, dtype_names, shapes; modelexpress: version_id)")


class TransferInitRequest(Request, kw_only=True, frozen=True):
    """Dynamo 1.7's `update/init_weight_transfer_engine` (vLLM's init_weight_transfer_engine
    body): the backend's `init_info`, checked by the backend."""

    init_info: dict[str, Any]
    MESSAGES: ClassVar[dict[str, str]] = {"init_info": _INIT_INFO}


class TransferUpdateRequest(Request, kw_only=True, frozen=True):
    """Dynamo 1.7's `update/update_weights` (vLLM's update_weights body): one chunk's
    `update_info`, checked by the backend."""

    update_info: dict[str, Any] | list[dict[str, Any]]
    MESSAGES: ClassVar[dict[str, str]] = {"update_info": _UPDATE_INFO}


class TransferFinishRequest(Request, kw_only=True, frozen=True):
    """Dynamo 1.7's `update/finish_weight_update` (vLLM's finish_weight_update body)."""

    weight_version: str | None = None  # the label of the weights transferred; None: unchanged
    MESSAGES: ClassVar[dict[str, str]] = {"weight_version": "weight_version must be a string, "
                                          "or null"}


class SetVersionRequest(Request, kw_only=True, frozen=True):
    weight_version: str | None  # required; an explicit null counts as declared
    step: int | None = None
    MESSAGES: ClassVar[dict[str, str]] = {
        "weight_version": "weight_version is required (a string, or null)", "step": _STEP}

    def __post_init__(self) -> None:
        _check_step(self.step)


class GroupLeaveRequest(Request, kw_only=True, frozen=True):
    """Leave the trainer's group: no field. Dynamo's handler takes `engine_rpc` (default
    prime-rl's `destroy_broadcaster`): an rlfleet worker runs vLLM's
    `shutdown_weight_transfer_engine` (the shutdown step of rlfleet.worker.weight_transfer)
    and refuses any other by name."""

    ENGINE_RPCS: ClassVar[tuple[str, ...] | None] = ("shutdown_weight_transfer_engine",)
    engine_rpc: str | None = None
    group_name: str | None = None  # SGLang's: the group joined (slime names it)
    MESSAGES: ClassVar[dict[str, str]] = {
        "engine_rpc": "engine_rpc must be a string: shutdown_weight_transfer_engine",
        "group_name": "group_name must be a string (the group joined)"}


_GROUP = "master_address (string), master_port (int) and world_size (int) are required"
GROUP_BACKENDS = ("gloo", "nccl")


_INIT_RPC = "init_weight_transfer_engine"


class GroupRequest(Request, kw_only=True, frozen=True):
    """Join a trainer's weight-update group (master_address, master_port, world_size, ...).
    Dynamo's handler also takes `engine_rpc` (the engine method that joins, with the body as
    its keywords; default prime-rl's `init_broadcaster`): an rlfleet worker runs vLLM's
    `init_weight_transfer_engine` (`init_info`, as NeMo RL's Dynamo refit sends it: the step
    of rlfleet.worker.weight_transfer) and refuses any other by name."""

    ENGINE_RPCS: ClassVar[tuple[str, ...] | None] = (_INIT_RPC,)
    master_address: str | None = None  # required without engine_rpc (_GROUP)
    master_port: int | None = None
    world_size: int | None = None
    rank_offset: int = 1  # this worker's first rank in the group, in [1, world_size)
    backend: str | None = None  # gloo | nccl; None: the engine's (`resolved`)
    timeout: float | None = None  # seconds; None: the worker's default (`resolved`)
    group_name: str | None = None
    engine_rpc: str | None = None  # Dynamo's: init_weight_transfer_engine only
    init_info: dict[str, Any] | None = None  # its keyword (the transfer backend's settings)
    MESSAGES: ClassVar[dict[str, str]] = {
        "master_address": _GROUP, "master_port": _GROUP, "world_size": _GROUP,
        "rank_offset": "rank_offset must be an integer in [1, world_size)",
        "timeout": "timeout must be a positive number of seconds",
        "engine_rpc": f"engine_rpc must be a string: {_INIT_RPC}", "init_info": _INIT_INFO}

    def __post_init__(self) -> None:
        if self.engine_rpc is not None:
            own = [k for k in ("master_address", "master_port", "world_size", "backend",
                               "timeout", "group_name") if getattr(self, k) is not None]
            if own or self.rank_offset != 1:
                raise AdminRequestError(f"{own[0] if own else 'rank_offset'} is rlfleet's own "
                                        f"group; with engine_rpc {_INIT_RPC} send init_info only")
            if self.init_info is None:
                raise AdminRequestError(_INIT_INFO)
            return
        if self.init_info is not None:
            raise AdminRequestError(f"init_info goes with engine_rpc {_INIT_RPC}")
        if self.master_address is None or self.master_port is None or self.world_size is None:
            raise AdminRequestError(_GROUP)
        if not 0 < self.rank_offset < self.world_size:
            raise AdminRequestError(f"rank_offset must be an integer in [1, world_size); got "
                                    f"{self.rank_offset!r}")
        if self.backend and self.backend not in GROUP_BACKENDS:
            raise AdminRequestError(f"backend must be gloo or nccl, not {self.backend!r}")
        if self.timeout is not None and self.timeout <= 0:
            raise AdminRequestError(self.MESSAGES["timeout"])

    def resolved(self, backend: str, timeout: float) -> GroupRequest:
        """With the worker's defaults for what the caller left out."""
        return msgspec.structs.replace(self, backend=self.backend or backend,
                                       timeout=timeout if self.timeout is None else self.timeout)


_TENSORS = "names, dtypes and shapes are required: equal-length, non-empty lists"


_RPC_TENSORS = ("names, dtypes and shapes announce rlfleet's own transfer over the trainer's "
                "group; with engine_rpc send that method's keyword instead")
_NCCL_RECEIVE = (f"engine_rpc {UPDATE_WEIGHTS_FROM_PATH!r} with weight_dir is prime-rl's NCCL "
                 "receive (NCCLWeightUpdateWorker: a state dict broadcast by prime-rl's trainer "
                 "to the receiver its init_broadcaster started), which an rlfleet worker does "
                 "not run; load a checkpoint with update_weights_from_disk (engine_rpc "
                 f"{UPDATE_WEIGHTS_FROM_PATH!r}, model_path), or send names, dtypes and shapes "
                 "over a group joined with init_weights_update_group")


_STEP_RPCS = ("start_weight_update", "update_weights", "finish_weight_update")


class DistributedRequest(Request, kw_only=True, frozen=True):
    """Weights from a trainer: rlfleet's own transfer (`names`, `dtypes`, `shapes` announced,
    the tensors received over the group joined with init_weights_update_group), or, with
    Dynamo's `engine_rpc`, that engine method (Dynamo's handler passes the body's other
    fields as its keywords): `reload_weights` (`weights_path`; none: the model the worker
    started from) and `update_weights_from_path` (`weight_path`, prime-rl's filesystem
    worker) each load a checkpoint from disk through update_weights_from_disk's checks;
    vLLM's `start_weight_update` (`is_checkpoint_format`), `update_weights` (`update_info`)
    and `finish_weight_update` (the label: `weight_version`) run that step of vLLM's weight
    transfer (rlfleet.worker.weight_transfer), as NeMo RL's Dynamo refit sends them."""

    names: list[str] = []
    dtypes: list[str] = []
    shapes: list[list[int]] = []
    weight_version: str | None = None
    reset_prefix_cache: bool = True
    allow_unpaused: bool = False  # apply while generating (only without the cache reset)
    step: int | None = None  # the policy's fleet step (rlfleet)
    mock_seed: int | None = None  # the mocker's simulated weights (rlfleet.mocker.engine)
    engine_rpc: str | None = None  # Dynamo's: the engine method to run (DISK_ENGINE_RPCS)
    weights_path: str | None = None  # reload_weights' keyword
    weight_path: str | None = None  # update_weights_from_path's (prime-rl's filesystem worker)
    weight_dir: str | None = None  # ... prime-rl's NCCL worker's (refused: UnsupportedRequest)
    update_info: dict[str, Any] | list[dict[str, Any]] | None = None  # update_weights' keyword
    is_checkpoint_format: bool | None = None  # start_weight_update's (true only)
    # SGLang's body (slime): the group joined, its cache flag (reset_prefix_cache's meaning
    # and default), the loader (the model's own only)
    group_name: str | None = None
    flush_cache: bool | None = None
    load_format: str | None = None
    MESSAGES: ClassVar[dict[str, str]] = {
        "names": _TENSORS, "dtypes": _TENSORS, "shapes": _TENSORS, "weight_version": _VERSION,
        "step": _STEP,
        "reset_prefix_cache": "reset_prefix_cache and allow_unpaused must be booleans",
        "allow_unpaused": "reset_prefix_cache and allow_unpaused must be booleans",
        "engine_rpc": f"engine_rpc must be a string: one of {', '.join(DISK_ENGINE_RPCS)}",
        **{k: f"{k} must be a string (a checkpoint directory on this worker's disk)"
           for k in ("weights_path", "weight_path", "weight_dir")},
        "update_info": _UPDATE_INFO,
        "is_checkpoint_format": "is_checkpoint_format must be a boolean",
        "group_name": "group_name must be a string (the group joined)",
        "flush_cache": "flush_cache must be a boolean",
        "load_format": "load_format must be a string (SGLang's loader name)"}
    ENGINE_RPCS: ClassVar[tuple[str, ...] | None] = (*DISK_ENGINE_RPCS, *_STEP_RPCS)

    def __post_init__(self) -> None:
        self._check_sglang_fields()
        if self.engine_rpc is not None:
            self._check_engine_rpc()
        elif not (len(self.names) == len(self.dtypes) == len(self.shapes) and self.names):
            raise AdminRequestError(_TENSORS)
        else:
            given = [k for k in ("weights_path", "weight_path", "weight_dir") if getattr(self, k)]
            if given:
                raise AdminRequestError(f"{given[0]} is an engine method's keyword: send it with "
                                        f"engine_rpc (one of {', '.join(DISK_ENGINE_RPCS)})")
        if self.allow_unpaused and self.reset_cache:
            raise AdminRequestError("allow_unpaused cannot be combined with reset_prefix_cache; "
                                    "send reset_prefix_cache: false, or pause first")
        _check_step(self.step)

    def _check_sglang_fields(self) -> None:
        if self.load_format is not None:
            raise UnsupportedRequest(f"load_format {self.load_format!r}: an rlfleet worker "
                                     "loads received tensors with the model's own loader only; "
                                     "leave load_format out")
        if self.flush_cache is not None and self.engine_rpc is not None:
            raise AdminRequestError("flush_cache is SGLang's field for names, dtypes and "
                                    "shapes; with engine_rpc send reset_prefix_cache")

    @property
    def reset_cache(self) -> bool:
        """Whether the install resets the prefix cache: SGLang's flush_cache when sent, else
        reset_prefix_cache."""
        return self.reset_prefix_cache if self.flush_cache is None else self.flush_cache

    def _check_engine_rpc(self) -> None:
        if self.names or self.dtypes or self.shapes or self.mock_seed is not None:
            raise AdminRequestError(_RPC_TENSORS)
        if self.engine_rpc in _STEP_RPCS:
            self._check_step_rpc()
            return
        if self.update_info is not None or self.is_checkpoint_format is not None:
            raise AdminRequestError(f"{self.engine_rpc} takes "
                                    f"{DISK_ENGINE_RPCS[self.engine_rpc]}, not update_info or "
                                    "is_checkpoint_format")
        if self.engine_rpc == UPDATE_WEIGHTS_FROM_PATH and self.weight_dir is not None:
            raise UnsupportedRequest(_NCCL_RECEIVE)
        keyword = DISK_ENGINE_RPCS[self.engine_rpc]
        wrong = [k for k in ("weights_path", "weight_path", "weight_dir")
                 if k != keyword and getattr(self, k) is not None]
        if wrong:
            raise AdminRequestError(f"{self.engine_rpc} takes {keyword}, not {wrong[0]}")
        if self.engine_rpc == UPDATE_WEIGHTS_FROM_PATH and not self.weight_path:
            raise AdminRequestError(f"{UPDATE_WEIGHTS_FROM_PATH} needs weight_path (a "
                                    "checkpoint directory on this worker's disk)")
        if self.allow_unpaused:
            raise UnsupportedRequest(f"allow_unpaused with engine_rpc {self.engine_rpc!r}: an "
                                     "rlfleet worker loads a checkpoint from disk only while "
                                     "generation is paused; pause first")

    def _check_step_rpc(self) -> None:
        rpc = self.engine_rpc
        paths = [k for k in ("weights_path", "weight_path", "weight_dir") if getattr(self, k)]
        if paths:
            raise AdminRequestError(f"{rpc} takes no {paths[0]} (a step of vLLM's weight "
                                    "transfer, not a load from disk)")
        if (rpc == "update_weights") != (self.update_info is not None):
            raise AdminRequestError(_UPDATE_INFO if rpc == "update_weights"
                                    else f"update_info goes with engine_rpc update_weights, "
                                    f"not {rpc}")
        if self.is_checkpoint_format is not None and rpc != "start_weight_update":
            raise AdminRequestError(f"is_checkpoint_format goes with engine_rpc "
                                    f"start_weight_update, not {rpc}")
        if self.is_checkpoint_format is False:
            raise UnsupportedRequest("is_checkpoint_format false: an rlfleet worker's weight "
                                     "transfer takes checkpoint-format names only")

    @property
    def transfer_step(self) -> str | None:
        """With a vLLM weight-transfer `engine_rpc`: its step (init, start, update, finish)."""
        return TRANSFER_ENGINE_RPCS.get(self.engine_rpc) if self.engine_rpc in _STEP_RPCS \
            else None

    @property
    def checkpoint(self) -> str | None:
        """With `engine_rpc`: the directory the method loads (None: reload_weights of the
        model the worker started from)."""
        return self.weights_path if self.engine_rpc == RELOAD_WEIGHTS else self.weight_path

    @property
    def version(self) -> str | None:
        return self.weight_version


_SOURCE = ('source is required: {"kind": "disk", "path": DIR} | {"kind": "s3", "uri": '
           '"s3://bucket/prefix/VERSION"} | {"kind": "trainer", "url": URL} | {"kind": "peer"'
           '[, "url": SYSTEM_URL[, "fanout": {"holders", "origin", "stall"}]]}')
_STAGE_VERSION = ('version is required (the name of the version to stage), with source: '
                  '{"kind": "disk"|"s3"|"trainer"|"peer", ...}')
_HANDLE = "handle is required (the one stage_weights returned; get_staged_weights lists them)"


class StageRequest(Request, kw_only=True, frozen=True):
    version: str  # the name of the version to stage
    source: dict[str, Any]  # checked by rlfleet.weights.staging.parse_source
    digest: str | None = None  # the version's content digest, when the caller knows it
    #: stage it only where the engine prepares it while serving (installing it is then a
    #: swap); a worker that cannot answers at once with `cannot_stage` (why), and its caller
    #: installs the version from disk instead (rlfleet.refresh.staged)
    require_swap: bool = False
    MESSAGES: ClassVar[dict[str, str]] = {
        "version": _STAGE_VERSION, "source": _SOURCE,
        "digest": "digest must be a string (blake3:<hex>)",
        "require_swap": "require_swap must be a boolean"}

    def __post_init__(self) -> None:
        if not self.version:
            raise AdminRequestError(_STAGE_VERSION)


class FanoutOrigin(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Where a fan-out downstream reads the chunks no holder can serve: the version's full
    artifact (ranged reads, resumed from the chunk it has)."""

    uri: str  # s3://bucket/prefix/VERSION, or a version directory (file:///dir/VERSION)
    endpoint_url: str | None = None  # the S3 endpoint (default: the usual environment)


class PeerFanout(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A peer source's `fanout`: pull the version chunk by chunk from the source's `url`
    (the upstream) while the upstream itself still receives it; a downstream whose holder
    dies or stalls mid-transfer goes on, from the chunk it has, at the next of `holders`,
    then at `origin`. Every chunk is checked by its Adler-32, every tensor by the
    artifact's when the manifest carries it, the whole version by its content digest."""

    holders: list[str] = []  # other holders' system URLs, in the order to fail over to
    origin: FanoutOrigin | None = None  # the artifact, when every holder fails
    stall: float = 10.0  # seconds a holder may send nothing before the next one is tried

    def __post_init__(self) -> None:
        bad = [u for u in self.holders if not u.startswith(("http://", "https://"))]
        if bad:
            raise AdminRequestError(f"source.fanout.holders: {bad[0]!r} is not a system URL "
                                    "(http://host:port)")
        if self.stall <= 0:
            raise AdminRequestError("source.fanout.stall must be a positive number of seconds")
        if self.origin is not None and not self.origin.uri:
            raise AdminRequestError("source.fanout.origin.uri must be the version's URI")


class FanoutProgress(msgspec.Struct, kw_only=True):
    """A handle's part in a fan-out, as get_staged_weights lists it."""

    chunks_total: int = 0
    chunks_ready: int = 0  # chunks this worker holds (and serves) now
    chunks_served: int = 0  # chunks it served to downstreams
    chunks_from_staging: int = 0  # chunks received while their holder was still STAGING
    corrupt_chunks: int = 0  # chunks refused by their Adler-32 (and fetched again)
    failovers: int = 0  # times it moved on to another holder (or the origin)
    origin_chunks: int = 0  # chunks read from the origin artifact
    holder: str | None = None  # where chunks come from now ("origin": the artifact)


def _check_handle(handle: str | None) -> None:
    if handle is not None and not handle:
        raise AdminRequestError(_HANDLE)


class StagedQuery(Request, kw_only=True, frozen=True):
    handle: str | None = None  # one handle; None: all of them
    MESSAGES: ClassVar[dict[str, str]] = {"handle": _HANDLE}

    def __post_init__(self) -> None:
        _check_handle(self.handle)


class HandleRequest(Request, kw_only=True, frozen=True):
    handle: str
    MESSAGES: ClassVar[dict[str, str]] = {"handle": _HANDLE}

    def __post_init__(self) -> None:
        _check_handle(self.handle)


class ApplyStagedRequest(Request, kw_only=True, frozen=True):
    handle: str
    weight_version: str | None = None  # default: the staged version's name
    step: int | None = None
    #: the served label stays what it is (as vLLM's reload_weights keeps it), whatever the
    #: staged version's name: an update that names no version (rlfleet.refresh.fleet_control)
    keep_label: bool = False
    MESSAGES: ClassVar[dict[str, str]] = {"handle": _HANDLE, "weight_version": _VERSION,
                                          "step": _STEP,
                                          "keep_label": "keep_label must be a boolean"}

    def __post_init__(self) -> None:
        _check_handle(self.handle)
        _check_step(self.step)


class AdmissionRequest(Request, kw_only=True, frozen=True):
    """Open or close a worker to rollout traffic (rlfleet.worker.admission)."""

    open: bool
    reason: str | None = None
    policy: dict[str, Any] | None = None  # {"version", "digest"} it is opened on
    MESSAGES: ClassVar[dict[str, str]] = {
        "open": "open (boolean) is required", "reason": "reason must be a string",
        "policy": "policy must be an object {version, digest}"}


#: the install routes a commit_policy call may run (their bodies are checked as theirs)
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
    #: the reply (`CommitReply.probe`); a worker without a request plane leaves it unrun
    probe: dict[str, Any] | None = None
    MESSAGES: ClassVar[dict[str, str]] = {
        "install": _COMMIT_INSTALL,
        "probe": "probe must be an object (a request-plane generate request) or null",
        "body": "body is required: the install route's request (an object)",
        "expect_version": "expect_version is required: the version the worker must report",
        "expect_digest": "expect_digest is required: the weight digest the worker must report",
        "close_reason": "close_reason must be a string (or null: admission left as it is)",
        "pause_mode": f"pause_mode must be one of {', '.join(PAUSE_MODES)}",
        "reset_cache": "reset_cache must be a boolean",
        "deadline_s": "deadline_s must be a positive number of seconds"}
    NON_EMPTY: ClassVar[tuple[str, ...]] = ("expect_version", "expect_digest")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.install not in COMMIT_INSTALLS:
            raise AdminRequestError(f"install {self.install!r} is not an install route: "
                                    f"{_COMMIT_INSTALL}")
        if self.pause_mode not in PAUSE_MODES:
            raise AdminRequestError(self.MESSAGES["pause_mode"])
        if isinstance(self.deadline_s, bool) or not self.deadline_s > 0 or \
                self.deadline_s != self.deadline_s:
            raise AdminRequestError(self.MESSAGES["deadline_s"])
        route = ROUTES[self.install]
        try:  # refused here, before anything changes, when the install would refuse it
            read_struct(route.request, route.name, self.body)
        except AdminRequestError as e:
            raise AdminRequestError(f"body (the {route.name} request): {e}") from None


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
        **LoraRequest.MESSAGES, "lora_path": _LORA_PATH, "weight_version": _VERSION,
        "step": _STEP, "digest": "digest must be a string (blake3:<hex>)",
        "handle": _HANDLE, "activate": "activate must be a boolean"}

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_step(self.step)
        _check_handle(self.handle)
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
        **LoraRequest.MESSAGES, "version": _STAGE_VERSION, "source": _SOURCE,
        "digest": "digest must be a string (blake3:<hex>)"}
    NON_EMPTY: ClassVar[tuple[str, ...]] = ("lora_name", "version")


class LoraStagedQuery(LoraRequest, kw_only=True, frozen=True):
    handle: str | None = None  # one handle of the adapter's; None: all of them
    MESSAGES: ClassVar[dict[str, str]] = {**LoraRequest.MESSAGES, "handle": _HANDLE}

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_handle(self.handle)


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


# error: 200 with status "error"; http500: the contract's 500; hang: sleep hang_seconds first;
# exit: the process dies; respond: answer with the given `body` instead of running the route;
# delay: sleep hang_seconds, then run the route as usual
FAULT_MODES = ("error", "http500", "hang", "exit", "respond", "delay")
_FAULT_ROUTE = "route is required (the name of the route to fail)"


class FaultRequest(Request, kw_only=True, frozen=True):
    """Make a named route fail `times` times (tests only; 0 disarms)."""

    route: str
    mode: str = "error"  # FAULT_MODES
    times: int = 1
    hang_seconds: float = 3600.0
    body: dict[str, Any] | None = None  # what mode respond answers with
    MESSAGES: ClassVar[dict[str, str]] = {
        "route": _FAULT_ROUTE, "times": "times must be a non-negative integer (0 disarms)",
        "hang_seconds": "hang_seconds must be a non-negative number",
        "body": "mode respond needs body (the JSON object to answer with)"}

    def __post_init__(self) -> None:
        if not self.route:
            raise AdminRequestError(_FAULT_ROUTE)
        if self.mode not in FAULT_MODES:
            raise AdminRequestError(f"Invalid mode {self.mode!r}; expected "
                                    f"{'|'.join(FAULT_MODES)}")
        for name in ("times", "hang_seconds"):
            if getattr(self, name) < 0:
                raise AdminRequestError(self.MESSAGES[name])
        if self.mode == "respond" and self.body is None:
            raise AdminRequestError(self.MESSAGES["body"])


# ---------------------------------------------------------------- SGLang-style requests


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
        "model_path": _MODEL_PATH, "weight_version": _VERSION, "step": _STEP,
        **{k: f"{k} must be a boolean" for k in ("flush_cache", "keep_pause",
                                                  "abort_all_requests")}}

    def __post_init__(self) -> None:
        _check_step(self.step)


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


# ---------------------------------------------------------------- replies


class MessageReply(Reply, kw_only=True):
    """`{"status", "message"}` and, when the worker holds itself closed, why."""

    weights_uncertain: str | None | UnsetType = UNSET


class LivenessReply(Reply, kw_only=True):
    alive: bool | UnsetType = UNSET
    weights_uncertain: str | None | UnsetType = UNSET  # why the worker holds itself closed
    busy: bool | UnsetType = UNSET  # a long control call runs (only when true)
    self_check: str | UnsetType = UNSET  # "pending": installed weights not yet checked


class PauseReply(Reply, kw_only=True):
    mode: str | UnsetType = UNSET
    clear_cache: bool | UnsetType = UNSET


class AbortReply(Reply, kw_only=True):
    request_id: str | UnsetType = UNSET


class InstallReply(_Identified, Reply, kw_only=True):
    """Every install route's reply (from disk, from a trainer, staged)."""

    version: str | None | UnsetType = UNSET  # "unknown" when none was declared
    version_declared: bool | UnsetType = UNSET
    weight_digest: str | None | UnsetType = UNSET
    step: int | None | UnsetType = UNSET
    weights_uncertain: str | None | UnsetType = UNSET
    handle: str | UnsetType = UNSET  # apply_staged_weights: the handle applied
    staged_digest: str | None | UnsetType = UNSET  # ... and the staged copy's digest


class VersionReply(_Identified, Reply, kw_only=True):
    version: str | None | UnsetType = UNSET
    # the declared label again, under the name Dynamo 1.7's control/get_weight_version, vLLM's
    # /weight_info and SGLang's get_weight_version use (null while none is declared)
    weight_version: str | None | UnsetType = UNSET
    version_declared: bool | UnsetType = UNSET
    weight_digest: str | None | UnsetType = UNSET
    step: int | None | UnsetType = UNSET
    fleet_epoch: int | UnsetType = UNSET  # the newest fleet epoch the worker has seen
    dtype: str | UnsetType = UNSET  # what the engine computes in, when known
    adapters: list[dict[str, Any]] | UnsetType = UNSET  # each LoRA adapter's own identity


class IsPausedReply(Reply, kw_only=True):
    """Dynamo 1.7's `control/is_paused`."""

    is_paused: bool | UnsetType = UNSET


class WeightVersionReply(Reply, kw_only=True):
    """Dynamo 1.7's `control/get_weight_version` and `update/update_weight_version`: the
    version label alone (null while none has been declared)."""

    weight_version: str | None = None


class CollectiveRpcReply(Reply, kw_only=True):
    """collective_rpc's result: one entry per rank (`reload_weights` returns None on each),
    vLLM's `{"results": [...]}`; on /engine/ with the route's `status`."""

    results: list[Any] | UnsetType = UNSET


class SetVersionReply(Reply, kw_only=True):
    version: str | None | UnsetType = UNSET
    step: int | None | UnsetType = UNSET


class StageReply(Reply, kw_only=True):
    handle: str | UnsetType = UNSET
    state: str | UnsetType = UNSET  # STAGING | READY | APPLIED | FAILED | RELEASED ...
    version: str | UnsetType = UNSET
    cannot_stage: str | UnsetType = UNSET  # why this worker cannot stage it as asked


class StagedSummary(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One staging handle as get_staged_weights lists it (rlfleet.weights.staging), or a
    coordinator's own account of a staging that got no handle (`unreachable`: it could not
    reach the worker; never on the wire)."""

    handle: str | None = None
    version: str | None = None
    state: str  # STAGING | READY | APPLIED | FAILED | RELEASED ...
    format: str | None = None
    base_version: str | None = None
    source: dict[str, Any] | None = None
    bytes_done: int | None = None
    bytes_total: int | None = None
    tensors_done: int | None = None
    tensors_total: int | None = None
    digest: str | None = None
    error: str | None = None
    applied: bool = False
    prepared: str | None = None  # how the engine prepared it while serving
    prepare_seconds: float | None = None  # how long the engine took to prepare it
    #: why this worker cannot stage it as asked (require_swap): it is installed from disk
    cannot_stage: str | None = None
    seconds: float | None = None
    fanout: FanoutProgress | None = None  # chunks served and received in a fan-out
    unreachable: bool = False


class StagedListReply(Reply, kw_only=True):
    staged: list[StagedSummary] | UnsetType = UNSET  # each handle's summary
    resident: dict[str, Any] | None | UnsetType = UNSET  # {version, digest} (all handles)


class LoraAdapterReply(_Identified, Reply, kw_only=True):
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


class AdmissionReply(Reply, kw_only=True):
    open: bool | UnsetType = UNSET
    reason: str | None | UnsetType = UNSET
    weights_uncertain: str | None | UnsetType = UNSET


class CommitStep(msgspec.Struct, kw_only=True):
    """One step of a commit_policy call, as a call to its route would have answered."""

    step: str  # gate | pause | apply | reset_cache | verify | resume (the refresh's names)
    route: str  # the route it ran
    http_status: int  # what the route answered (200, or 409 / 500 as its call would)
    body: Any  # the route's reply body
    seconds: float  # how long the worker spent in it


class CommitProbe(msgspec.Struct, kw_only=True):
    """The post-update probe a commit_policy call ran (`CommitRequest.probe`), as
    `POST /generate` would have answered it: its HTTP status (and message when not 200),
    and every event of the stream (the head first, the last one `done` or an error)."""

    http_status: int
    events: list[dict[str, Any]] = msgspec.field(default_factory=list)
    message: str | None = None
    body: dict[str, Any] | None = None  # the refusal's body, as the route answered it


class CommitReply(_Identified, Reply, kw_only=True):
    """commit_policy's reply: every step it ran, in order (the last one failed when
    `failed_step` is set), and the policy identity the worker reports after the install
    (get_weight_version's)."""

    steps: list[CommitStep] = msgspec.field(default_factory=list)
    failed_step: str | UnsetType = UNSET
    version: str | None | UnsetType = UNSET
    version_declared: bool | UnsetType = UNSET
    weight_digest: str | None | UnsetType = UNSET
    step: int | None | UnsetType = UNSET
    dtype: str | UnsetType = UNSET
    probe: CommitProbe | UnsetType = UNSET  # the probe run, when asked and the worker can


class FaultReply(Reply, kw_only=True):
    route: str | UnsetType = UNSET
    mode: str | UnsetType = UNSET
    times: int | UnsetType = UNSET


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


LIVENESS_PROBE = _read("liveness_probe", NoFields, LivenessReply)
PAUSE_GENERATION = AdminRoute("pause_generation", PauseRequest, PauseReply)
RESUME_GENERATION = AdminRoute("resume_generation", NoFields, MessageReply)
FLUSH_CACHE = AdminRoute("flush_cache", NoFields, MessageReply)
ABORT_REQUEST = AdminRoute("abort_request", AbortRequest, AbortReply, serialized=False)
UPDATE_WEIGHTS_FROM_DISK = AdminRoute("update_weights_from_disk", DiskUpdateRequest,
                                      InstallReply)
GET_WEIGHT_VERSION = _read("get_weight_version", NoFields, VersionReply)
SET_WEIGHT_VERSION = AdminRoute("set_weight_version", SetVersionRequest, SetVersionReply)
INIT_WEIGHTS_UPDATE_GROUP = AdminRoute("init_weights_update_group", GroupRequest, MessageReply)
UPDATE_WEIGHTS_FROM_DISTRIBUTED = AdminRoute("update_weights_from_distributed",
                                             DistributedRequest, InstallReply)
DESTROY_WEIGHTS_UPDATE_GROUP = AdminRoute("destroy_weights_update_group", GroupLeaveRequest,
                                          MessageReply)
STAGE_WEIGHTS = AdminRoute("stage_weights", StageRequest, StageReply)
GET_STAGED_WEIGHTS = _read("get_staged_weights", StagedQuery, StagedListReply)
APPLY_STAGED_WEIGHTS = AdminRoute("apply_staged_weights", ApplyStagedRequest, InstallReply)
RELEASE_STAGED_WEIGHTS = AdminRoute("release_staged_weights", HandleRequest, StageReply)
SET_ADMISSION = AdminRoute("set_admission", AdmissionRequest, AdmissionReply, serialized=False)
FAULT_INJECTION = AdminRoute("fault_injection", FaultRequest, FaultReply, fenced=False)
COMMIT_POLICY = AdminRoute("commit_policy", CommitRequest, CommitReply)

# LoRA adapters (not named load_lora / unload_lora: Dynamo's RL route list has none of its
# LoRA routes); each adapter fences on its own epoch, in the body (LoraRequest)
LOAD_LORA_ADAPTER = AdminRoute("load_lora_adapter", LoraLoadRequest, LoraAdapterReply,
                               serialized=False, fenced=False)
UNLOAD_LORA_ADAPTER = AdminRoute("unload_lora_adapter", LoraRequest, LoraAdapterReply,
                                 serialized=False, fenced=False)
SET_LORA_ADMISSION = AdminRoute("set_lora_admission", LoraAdmissionRequest, LoraAdapterReply,
                                serialized=False, fenced=False)
LIST_LORA_ADAPTERS = _read("list_lora_adapters", NoFields, LoraListReply)
LORA = (LOAD_LORA_ADAPTER, UNLOAD_LORA_ADAPTER, SET_LORA_ADMISSION, LIST_LORA_ADAPTERS)
# adapter versions staged while serving and loaded beside the serving one (engines that can)
STAGE_LORA_ADAPTER = AdminRoute("stage_lora_adapter", LoraStageRequest, StageReply,
                                serialized=False, fenced=False)
GET_STAGED_LORA_ADAPTER = _read("get_staged_lora_adapter", LoraStagedQuery, StagedListReply)
ACTIVATE_LORA_ADAPTER = AdminRoute("activate_lora_adapter", LoraVersionRequest,
                                   LoraAdapterReply, serialized=False, fenced=False)
DISCARD_LORA_ADAPTER = AdminRoute("discard_lora_adapter", LoraVersionRequest,
                                  LoraAdapterReply, serialized=False, fenced=False)
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
CONTROL_IS_PAUSED = _read("control/is_paused", NoFields, IsPausedReply)
# ... and its flat name, beside 1.6's (RL clients that speak the flat names call it); served,
# not listed: a worker's listing stays the route list Dynamo 1.7 advertises
IS_PAUSED = dataclasses.replace(CONTROL_IS_PAUSED, name="is_paused", listed=False)
CONTROL_GET_WEIGHT_VERSION = _read("control/get_weight_version", NoFields, WeightVersionReply)
UPDATE_UPDATE_WEIGHT_VERSION = AdminRoute("update/update_weight_version", NewVersionRequest,
                                          WeightVersionReply)
COLLECTIVE_RPC = AdminRoute("collective_rpc", CollectiveRpcRequest, CollectiveRpcReply)
# ... and vLLM's weight-transfer steps (the same code as vLLM's native routes at the
# worker's admin_base_url: rlfleet.worker.weight_transfer), answered `{"status", "message"}`
UPDATE_INIT_WEIGHT_TRANSFER_ENGINE = AdminRoute("update/init_weight_transfer_engine",
                                                TransferInitRequest, MessageReply)
UPDATE_START_WEIGHT_UPDATE = AdminRoute("update/start_weight_update", NoFields, MessageReply)
UPDATE_UPDATE_WEIGHTS = AdminRoute("update/update_weights", TransferUpdateRequest,
                                   MessageReply)
UPDATE_FINISH_WEIGHT_UPDATE = AdminRoute("update/finish_weight_update", TransferFinishRequest,
                                         MessageReply)
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
CONTINUE_GENERATION = AdminRoute("continue_generation", NativeContinueRequest, MessageReply,
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


# ---------------------------------------------------------------- checkpoint paths


def weights_path(raw: Any, roots: list[Path]) -> Path:
    """`model_path` resolved (symlinks too), inside the allowed roots when any are set, and
    an existing directory none of whose entries (what a loader may read) leads outside them
    either, through a symlink."""
    if not isinstance(raw, str) or not raw:
        raise AdminRequestError("model_path is required (a checkpoint directory on this "
                                "worker's disk)")
    if "\0" in raw:
        raise AdminRequestError("model_path contains a null byte: send a plain directory path")
    try:
        path = Path(raw).resolve()
        inside = not roots or _within(path, roots)
        if inside and not path.is_dir():
            raise AdminRequestError(f"model_path {raw} does not exist or is not a directory")
        escapes = _escaping_links(path, roots) if inside and roots else []
    except (OSError, RuntimeError) as e:  # too long, unreadable, a symlink loop
        raise AdminRequestError(f"model_path {raw} cannot be read: {e}") from e
    if not inside:
        raise AdminRequestError(f"model_path {raw} is outside the allowed weights roots "
                                f"({', '.join(map(str, roots))})")
    if escapes:
        raise AdminRequestError(f"model_path {raw} holds symlinks that lead outside the allowed "
                                f"weights roots: {', '.join(sorted(escapes)[:5])}; copy the "
                                "files in instead")
    return path


def _within(path: Path, roots: list[Path]) -> bool:
    return any(path == r or path.is_relative_to(r) for r in roots)


def _escaping_links(path: Path, roots: list[Path]) -> list[str]:
    """Symlinks anywhere under `path` whose targets are outside the roots (relative names)."""
    out = []
    for top, dirs, files in os.walk(path):
        for name in dirs + files:
            entry = Path(top) / name
            if entry.is_symlink() and not _within(entry.resolve(), roots):
                out.append(str(entry.relative_to(path)))
    return out
