"""The admin schema of rlfleet's vLLM-style routes under a worker's `/engine` (the flat
names of Dynamo 1.6's vLLM worker, and the layout Dynamo 1.7 gives the same bodies): every
request and reply Struct of the lifecycle, weight installs (from disk, a trainer's group,
vLLM's transfer steps, staged versions and their fan-out), admission and commit. The routes
that carry them are rlfleet.protocol.admin's table."""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec
from msgspec import UNSET, UnsetType

from rlfleet.protocol.admin_base import (
    MODEL_PATH_RULE,
    STEP_RULE,
    VERSION_RULE,
    AdminRequestError,
    Identified,
    Reply,
    Request,
    UnsupportedRequest,
    check_step,
)
from rlfleet.protocol.sglang_admin import SGLANG_PAUSE_MODES
from rlfleet.protocol.vllm_rl import (
    DISK_ENGINE_RPCS,
    RELOAD_KWARGS,
    RELOAD_WEIGHTS,
    TRANSFER_ENGINE_RPCS,
    UPDATE_WEIGHTS_FROM_PATH,
)

# ---------------------------------------------------------------- vLLM-style requests

PAUSE_MODES = ("keep", "wait", "abort")


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
    MESSAGES: ClassVar[dict[str, str]] = {"model_path": MODEL_PATH_RULE, "weight_version": VERSION_RULE,
                                          "step": STEP_RULE, "engine_rpc": "engine_rpc must be a "
                                          f"string: one of {', '.join(DISK_ENGINE_RPCS)}"}
    ENGINE_RPCS: ClassVar[tuple[str, ...] | None] = tuple(DISK_ENGINE_RPCS)

    def __post_init__(self) -> None:
        check_step(self.step)


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
        "weight_version": "weight_version is required (a string, or null)", "step": STEP_RULE}

    def __post_init__(self) -> None:
        check_step(self.step)


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
        "names": _TENSORS, "dtypes": _TENSORS, "shapes": _TENSORS, "weight_version": VERSION_RULE,
        "step": STEP_RULE,
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
        check_step(self.step)

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


SOURCE_RULE = ('source is required: {"kind": "disk", "path": DIR} | {"kind": "s3", "uri": '
           '"s3://bucket/prefix/VERSION"} | {"kind": "trainer", "url": URL} | {"kind": "peer"'
           '[, "url": SYSTEM_URL[, "fanout": {"holders", "origin", "stall"}]]}')
STAGE_VERSION_RULE = ('version is required (the name of the version to stage), with source: '
                  '{"kind": "disk"|"s3"|"trainer"|"peer", ...}')
HANDLE_RULE = "handle is required (the one stage_weights returned; get_staged_weights lists them)"


class StageRequest(Request, kw_only=True, frozen=True):
    version: str  # the name of the version to stage
    source: dict[str, Any]  # checked by rlfleet.weights.stage_transfer.parse_source
    digest: str | None = None  # the version's content digest, when the caller knows it
    #: stage it only where the engine prepares it while serving (installing it is then a
    #: swap); a worker that cannot answers at once with `cannot_stage` (why), and its caller
    #: installs the version from disk instead (rlfleet.refresh.staged)
    require_swap: bool = False
    MESSAGES: ClassVar[dict[str, str]] = {
        "version": STAGE_VERSION_RULE, "source": SOURCE_RULE,
        "digest": "digest must be a string (blake3:<hex>)",
        "require_swap": "require_swap must be a boolean"}

    def __post_init__(self) -> None:
        if not self.version:
            raise AdminRequestError(STAGE_VERSION_RULE)


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


def check_handle(handle: str | None) -> None:
    if handle is not None and not handle:
        raise AdminRequestError(HANDLE_RULE)


class StagedQuery(Request, kw_only=True, frozen=True):
    handle: str | None = None  # one handle; None: all of them
    MESSAGES: ClassVar[dict[str, str]] = {"handle": HANDLE_RULE}

    def __post_init__(self) -> None:
        check_handle(self.handle)


class HandleRequest(Request, kw_only=True, frozen=True):
    handle: str
    MESSAGES: ClassVar[dict[str, str]] = {"handle": HANDLE_RULE}

    def __post_init__(self) -> None:
        check_handle(self.handle)


class ApplyStagedRequest(Request, kw_only=True, frozen=True):
    handle: str
    weight_version: str | None = None  # default: the staged version's name
    step: int | None = None
    #: the served label stays what it is (as vLLM's reload_weights keeps it), whatever the
    #: staged version's name: an update that names no version (rlfleet.refresh.fleet_control)
    keep_label: bool = False
    MESSAGES: ClassVar[dict[str, str]] = {"handle": HANDLE_RULE, "weight_version": VERSION_RULE,
                                          "step": STEP_RULE,
                                          "keep_label": "keep_label must be a boolean"}

    def __post_init__(self) -> None:
        check_handle(self.handle)
        check_step(self.step)


class AdmissionRequest(Request, kw_only=True, frozen=True):
    """Open or close a worker to rollout traffic (rlfleet.worker.admission)."""

    open: bool
    reason: str | None = None
    policy: dict[str, Any] | None = None  # {"version", "digest"} it is opened on
    MESSAGES: ClassVar[dict[str, str]] = {
        "open": "open (boolean) is required", "reason": "reason must be a string",
        "policy": "policy must be an object {version, digest}"}


#: the install routes a commit_policy call may run (their bodies are checked as theirs)

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


class InstallReply(Identified, Reply, kw_only=True):
    """Every install route's reply (from disk, from a trainer, staged)."""

    version: str | None | UnsetType = UNSET  # "unknown" when none was declared
    version_declared: bool | UnsetType = UNSET
    weight_digest: str | None | UnsetType = UNSET
    step: int | None | UnsetType = UNSET
    weights_uncertain: str | None | UnsetType = UNSET
    handle: str | UnsetType = UNSET  # apply_staged_weights: the handle applied
    staged_digest: str | None | UnsetType = UNSET  # ... and the staged copy's digest


class VersionReply(Identified, Reply, kw_only=True):
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


class CommitReply(Identified, Reply, kw_only=True):
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


