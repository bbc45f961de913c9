"""ModelExpress's weight-transfer backend ("modelexpress") served by the worker itself, over
rlfleet's weight plane, where vLLM's engine does not run it: on vLLM's CPU build, a worker
started with `--weight-transfer-config '{"backend": "modelexpress"}'` (rlfleet.vllm.args)
answers vLLM's weight-transfer steps (rlfleet.worker.weight_transfer: vLLM's native routes
and Dynamo 1.7's /engine/update/*) with this. ModelExpress stages one READY version from
object storage and installs it; so does this, through the
staging area and the checks of every rlfleet install:

- init_weight_transfer_engine: the object-storage settings and the seed, checked as
  ModelExpress checks them (rlfleet.protocol.modelexpress: a field that does not fit is a
  400 naming it), the seed checkpoint as update_weights_from_disk checks a path;
- start_weight_update: opens an update (vLLM needs no pause for it);
- update_weights {"version_id": V}: stages V from `{object_storage_uri_prefix}/V` (a full
  version, or an XOR delta on the seed or on the version the worker holds) and applies it as
  apply_staged_weights does: only while paused (409 otherwise: rlfleet's rule; the update
  stays open), the digest recorded, the self-check before rollouts come back, the hold;
- finish_weight_update: closes the update; the served label is `weight_version`, else V;
- shutdown_weight_transfer_engine: drops the settings.

A step out of order is refused as vLLM's worker refuses it (its words, HTTP 500, vLLM's
error body); a failed update ends the update, as in vLLM, with the old weights serving
unless the install itself says they are uncertain."""

from __future__ import annotations

import asyncio
import enum
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rlfleet.protocol.admin_base import AdminRequestError
from rlfleet.protocol.admin_vllm import ApplyStagedRequest, NewVersionRequest
from rlfleet.protocol.modelexpress import ModelExpressInitInfo, read_init_info, read_update_info
from rlfleet.weights import artifacts as art
from rlfleet.weights.stage_transfer import READ_TIMEOUT, StageState

if TYPE_CHECKING:
    from rlfleet.weights.staging import StagingArea
    from rlfleet.worker.engine import EngineControl

log = logging.getLogger("rlfleet.modelexpress")


class TransferHost(Protocol):
    """What the weight-transfer steps use of the worker's admin (rlfleet.worker.admin's
    EngineAdmin, which owns them): its engine, its staging area and the install routes the
    steps end in."""

    engine: EngineControl
    staging: StagingArea | None

    def checkpoint_path(self, raw: Any) -> Path: ...

    async def apply_staged_weights(self, req: ApplyStagedRequest) -> Any: ...

    async def update_weight_version(self, req: NewVersionRequest) -> Any: ...


# refusals in vLLM's worker's words (vllm/v1/worker/gpu_worker.py) and ModelExpress's
NOT_STARTED = "start_weight_update must be called before update_weights."
ALREADY_ACTIVE = ("start_weight_update called while a weight update is already active. Call "
                  "finish_weight_update first.")
NO_START = "finish_weight_update called without a matching start_weight_update."
IN_UPDATE = "Cannot release a trainer connection during a weight update"
NOT_INITIALIZED = ("weight transfer engine is not initialized: call init_weight_transfer_engine "
                   "first")
NOT_PAUSED = ("update_weights: generation is not paused: pause it first (POST /pause, or "
              "/engine/control/pause_generation; an rlfleet worker applies weights only while "
              "paused); the weight update stays open")


class TransferState(enum.StrEnum):
    OFF = "OFF"  # no settings: before init, after shutdown
    READY = "READY"  # initialized, no update open
    OPEN = "OPEN"  # an update started, no version applied in it yet
    APPLIED = "APPLIED"  # this update applied a version; finish closes it


_T = TransferState
TRANSITIONS: dict[TransferState, frozenset[TransferState]] = {
    _T.OFF: frozenset({_T.OFF, _T.READY}),
    _T.READY: frozenset({_T.READY, _T.OPEN, _T.OFF}),
    _T.OPEN: frozenset({_T.APPLIED, _T.READY}),
    _T.APPLIED: frozenset({_T.READY}),
}


class TransferError(Exception):
    """A weight-transfer step refused or failed: HTTP `status`, vLLM's error body."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


class ModelExpressTransfer:
    """The backend's state on one worker (the system server runs one control call at a
    time, so the steps never overlap)."""

    def __init__(self, engine_admin: TransferHost) -> None:
        if engine_admin.staging is None:
            raise ValueError("the modelexpress weight-transfer backend needs a staging area")
        self.admin = engine_admin
        self.staging = engine_admin.staging
        self.state = TransferState.OFF
        self.settings: ModelExpressInitInfo | None = None
        self.seed: Path | None = None  # the seed checkpoint, checked
        self.applied_version: str | None = None  # what this update applied

    @property
    def updating(self) -> bool:
        """An update started and not finished."""
        return self.state in (_T.OPEN, _T.APPLIED)

    def move(self, new: TransferState) -> None:
        if new not in TRANSITIONS[self.state]:
            raise AssertionError(f"weight transfer {self.state} -> {new} is not a transition")
        self.state = new

    async def run(self, step: str, payload: Any = None, weight_version: str | None = None
                  ) -> None:
        """One of vLLM's weight-transfer steps (rlfleet.protocol.vllm_rl.TRANSFER_STEPS)."""
        if step == "init":
            self.init(payload)
        elif step == "start":
            self.start()
        elif step == "update":
            await self.update(payload)
        elif step == "finish":
            await self.finish(weight_version)
        elif step == "shutdown":
            self.shutdown()
        else:
            raise ValueError(f"unknown weight-transfer step {step!r}")

    def init(self, raw: Any) -> None:
        if self.state in (_T.OPEN, _T.APPLIED):
            raise TransferError("Cannot initialize the weight transfer engine during a weight "
                                "update")
        info = read_init_info(raw)
        try:
            seed = self.admin.checkpoint_path(info.seed_checkpoint_path)
        except AdminRequestError as e:
            raise AdminRequestError(f"seed_checkpoint_path: {e}") from None
        self.settings, self.seed = info, seed
        self.move(_T.READY)
        log.info("ModelExpress weight transfer initialized: versions under %s, seed %s (%s)",
                 info.object_storage_uri_prefix, info.initial_base_version_id, seed)

    def start(self) -> None:
        if self.state is _T.OFF:
            raise TransferError(NOT_INITIALIZED)
        if self.state is not _T.READY:
            raise TransferError(ALREADY_ACTIVE)
        self.applied_version = None
        self.move(_T.OPEN)

    async def update(self, raw: Any) -> None:
        if self.state is _T.APPLIED:
            raise TransferError(f"this weight update already applied version "
                                f"{self.applied_version!r}: call finish_weight_update first")
        if self.state is not _T.OPEN:
            raise TransferError(NOT_STARTED)
        if not await self.admin.engine.is_paused():
            raise TransferError(NOT_PAUSED, 409)
        try:
            version = read_update_info(raw).version_id
            await self._stage_and_apply(version)
        except BaseException:
            self.move(_T.READY)  # as in vLLM: a failed update ends it
            raise
        self.applied_version = version
        self.move(_T.APPLIED)

    async def finish(self, weight_version: str | None) -> None:
        if self.state not in (_T.OPEN, _T.APPLIED):
            raise TransferError(NO_START)
        self.move(_T.READY)
        label = weight_version if weight_version is not None else self.applied_version
        if label is not None:
            await self.admin.update_weight_version(NewVersionRequest(new_version=label))

    def shutdown(self) -> None:
        if self.state in (_T.OPEN, _T.APPLIED):
            raise TransferError(IN_UPDATE)
        self.settings = self.seed = None
        self.move(_T.OFF)

    async def _stage_and_apply(self, version: str) -> None:
        """Stage `version` from object storage, wait until it is READY, apply it."""
        assert self.settings is not None
        uri = self.settings.version_uri(version)
        source: dict[str, Any] = {"kind": "s3", "uri": uri, "chain": True}
        if self.settings.object_storage_endpoint_url:
            source["endpoint_url"] = self.settings.object_storage_endpoint_url
        base = await asyncio.to_thread(self._seed_base, version, uri)
        if base is not None:
            source["base"] = base
        policy = self.admin.engine.applied().policy
        # staged inside the pause and installed at once: no shadow, a reload in place
        h = await self.staging.stage(version, source, applied=(policy.version, policy.digest),
                                     prepare=False)
        await h.done.wait()
        if h.state is not StageState.READY:
            raise TransferError(f"ModelExpress version {version!r} could not be staged from "
                                f"{uri}: {h.error}; the previous weights are still serving")
        said = await self.admin.apply_staged_weights(ApplyStagedRequest(handle=h.handle))
        if said.status != "ok":
            await self.staging.release(h.handle)
            raise TransferError(f"applying ModelExpress version {version!r}: {said.message}")
        log.info("applied ModelExpress version %s (digest %s)", version, said.weight_digest)

    def _seed_base(self, version: str, uri: str) -> dict[str, str] | None:
        """The seed as the stage request's base when `version` is a delta on it (its index
        names initial_base_version_id); else None: the staging area finds the base (the
        version the worker holds, or the chain back to a full version)."""
        assert self.settings is not None
        parent, key = art.split_version_uri(uri)
        storage = art.open_storage(parent, self.settings.object_storage_endpoint_url,
                                   READ_TIMEOUT)
        try:
            plan = art.plan_version(storage.read, key, version=version)
        except (art.ArtifactError, FileNotFoundError) as e:  # no index, a shard missing, ...
            raise TransferError(f"ModelExpress version {version!r} at {uri}: {e}") from None
        finally:
            storage.close()
        if plan.format == "xor-delta" and plan.base_version == self.settings.initial_base_version_id:
            return {"version": plan.base_version, "path": str(self.seed)}
        return None
