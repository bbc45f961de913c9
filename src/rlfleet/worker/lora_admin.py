"""The LoRA adapter routes of a worker (`/engine/load_lora_adapter`, `unload_lora_adapter`,
`set_lora_admission`, `list_lora_adapters`), over the engine-control interface: each adapter
is a policy of its own, loaded, replaced by a new version, gated and unloaded while the base
model and the other adapters serve on.

`lora_path` is a peft adapter directory, or an adapter version of the weight plane
(rlfleet.weights.adapters: full, or an XOR delta applied only on the version served).

Each adapter has its own fleet fence (the epoch of its own refresh coordinator, in the
body's `fleet_epoch`): two RL runs that train one adapter each on one fleet take epochs of
their own and never fence each other, nor the base model's coordinator.

Staging (`stage_lora_adapter`, `get_staged_lora_adapter`): an adapter version is pulled
while the worker serves, from the sources of the base model's staging (S3, a directory, the
trainer's publisher, a peer's `/weights` route: rlfleet.weights.staging, one StagingArea per
adapter), checked tensor by tensor and by its content digest; a delta is applied on the
adapter's resident staged copy (the version it serves, when that came staged). Loading the
READY handle makes it the adapter's resident copy once it serves the adapter's name, which
the worker's `/weights` route then serves to peers (with its adapter_config.json). With the
worker's catalog (--weights-catalog), a version published there (publish_adapter's
`catalog`) lists the workers that serve it staged as its holders, as a model version does,
and a peer source without a url stages from one of them.

Beside (`load_lora_adapter` with `activate: false`, then `activate_lora_adapter` or
`discard_lora_adapter`), on engines that load a version beside the serving one (vLLM): a
refresh loads and probes the new version (through its own `served_name`) while the old
one serves the adapter's name, and its gated window only switches the name."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from msgspec import UNSET

from rlfleet.protocol import admin
from rlfleet.protocol.admin_base import AdminRequestError, NoFields
from rlfleet.protocol.admin_lora import (
    LoraAdapterReply,
    LoraAdmissionRequest,
    LoraListReply,
    LoraLoadRequest,
    LoraRequest,
    LoraStagedQuery,
    LoraStageRequest,
    LoraVersionRequest,
)
from rlfleet.protocol.admin_vllm import StagedListReply, StageReply
from rlfleet.protocol.identity import PolicyIdentity
from rlfleet.runtime.paths import weights_path
from rlfleet.weights.adapters import ADAPTER_CONFIG, is_artifact, materialize_adapter
from rlfleet.weights.artifacts import ArtifactError
from rlfleet.weights.stage_transfer import StageRequestError, open_source_storage, parse_source
from rlfleet.weights.staging import StagingArea, default_staging_root
from rlfleet.worker.engine import AdapterState, BadRequest, EngineControl
from rlfleet.worker.system_server import FleetFence, Route

log = logging.getLogger("rlfleet.admin")


def adapter_reply(state: AdapterState, fence: FleetFence | None = None,
                  **extra: object) -> LoraAdapterReply:
    p = state.policy
    return LoraAdapterReply(lora_name=p.adapter_name, **p.reply_fields(), rank=state.rank,
                            lora_path=state.path, open=state.open, reason=state.reason,
                            fleet_epoch=fence.newest if fence else 0, **extra)


LORA_TMP_PREFIX = "rlfleet-lora-"  # + the worker's pid: its adapter directories, in TMPDIR


class LoraAdmin:
    """Route handlers for the adapters of one engine."""

    def __init__(self, engine: EngineControl, roots: list[Path],
                 base_name: Callable[[], str], staging: StagingArea | None = None) -> None:
        """`staging`: the worker's staging area (its root and admin token are the adapters'
        too; its /weights route serves the adapters' resident copies)."""
        self.engine, self.roots, self.base_name = engine, roots, base_name
        self.fences: dict[str, FleetFence] = {}  # adapter name -> its coordinator's fence
        self.staging = staging
        self.areas: dict[str, StagingArea] = {}  # adapter name -> its staged versions
        self.configs: dict[str, bytes] = {}  # handle -> the version's adapter_config.json
        self.beside: dict[str, str | None] = {}  # adapter -> the handle loaded beside
        self.made: dict[str, list[Path]] = {}  # adapter -> directories made for its versions
        self._own: Path | None = None  # where they are made; removed when the process ends
        if staging is not None:
            staging.also_serves.append(self.resident_dir)

    def routes(self) -> list[Route]:
        """The adapter routes, on an engine that serves adapters (vLLM's --enable-lora)."""
        if self.engine.adapter_limits() is None:
            return []
        staged = [] if not self.engine.loads_adapters_beside else [
            Route(admin.STAGE_LORA_ADAPTER, self.stage_lora_adapter),
            Route(admin.GET_STAGED_LORA_ADAPTER, self.get_staged_lora_adapter),
            Route(admin.ACTIVATE_LORA_ADAPTER, self.activate_lora_adapter),
            Route(admin.DISCARD_LORA_ADAPTER, self.discard_lora_adapter)]
        return [Route(admin.LOAD_LORA_ADAPTER, self.load_lora_adapter),
                Route(admin.UNLOAD_LORA_ADAPTER, self.unload_lora_adapter),
                Route(admin.SET_LORA_ADMISSION, self.set_lora_admission),
                Route(admin.LIST_LORA_ADAPTERS, self.list_lora_adapters), *staged]

    def _fence(self, req: LoraRequest, advance: bool = True) -> FleetFence:
        """The adapter's fence, checked by the call's epoch (StaleEpoch: 409) and, for a
        call that changes something, advanced by it."""
        fence = self.fences.setdefault(req.lora_name, FleetFence())
        fence.check(req.fleet_epoch, advance=advance)
        return fence

    def lora_path(self, raw: str) -> Path:
        """The adapter directory, inside the worker's allowed roots (as model_path is)."""
        try:
            return weights_path(raw, self.roots)
        except AdminRequestError as e:
            raise AdminRequestError(str(e).replace("model_path", "lora_path")) from None

    def _close_first(self, name: str, first: bool, req: LoraRequest) -> None:
        """An adapter's first version, put in place by a refresh (a fleet epoch given), is
        closed to requests until that refresh reopens it: there was nothing to gate before
        it, and it must not be routed before the refresh has verified it."""
        if first and req.fleet_epoch is not None:
            self.engine.set_adapter_open(name, False, f"adapter {name}: its first version "
                                         "opens when the refresh that loaded it reopens")

    def _served(self, name: str) -> AdapterState | None:
        return next((s for s in self.engine.adapters() if s.policy.adapter_name == name), None)

    # ------------------------------------------------------------ staging

    def _area(self, name: str) -> StagingArea:
        if name not in self.areas:
            tag = hashlib.sha256(name.encode()).hexdigest()[:16]  # any name, one directory
            s = self.staging
            self.areas[name] = StagingArea(
                (s.root if s is not None else default_staging_root()) / "lora" / tag,
                allowed_roots=[str(r) for r in self.roots], admin_token=self._token(),
                # the worker's catalog and identity: its holders of adapter versions
                catalog=s.catalog if s is not None else None,
                worker_id=s.worker_id if s is not None else "",
                system_url=s.system_url if s is not None else None)
        return self.areas[name]

    def _token(self) -> str | None:
        """The admin token a peer's /weights route wants (the worker's own)."""
        return self.staging.admin_token if self.staging is not None else None

    def resident_dir(self, version: str) -> Path | None:
        """An adapter version this worker holds staged and serves (for peers' /weights)."""
        return next((d for a in self.areas.values()
                     if (d := a.resident_dir(version)) is not None), None)

    def _config(self, raw: dict, version: str) -> bytes:
        """The version's adapter_config.json, read from its source (a deadline per read)."""
        if isinstance(raw, dict) and "fanout" in raw:
            raise StageRequestError("source.fanout: an adapter version is pulled whole (it is "
                                    "megabytes): name the peer's url alone")
        src = parse_source(raw, version, [Path(r) for r in self.roots])
        if src.kind == "peer" and not src.location:
            raise StageRequestError("source.url is required for a peer source of an adapter "
                                    "version, unless the worker's catalog lists a holder")
        where = f"{src.kind} source {src.describe()}"
        try:
            storage = open_source_storage(src, min(10.0, src.timeout), self._token())
        except Exception as e:  # noqa: BLE001 - a bad endpoint, said by name
            raise ArtifactError(f"{where}: {e}") from e
        try:
            return storage.read(f"{src.key}/{ADAPTER_CONFIG}")
        except FileNotFoundError:
            raise StageRequestError(f"{where} has no {ADAPTER_CONFIG}: not an adapter "
                                    "version (publish it with "
                                    "rlfleet.weights.adapters.publish_adapter)") from None
        except Exception as e:  # noqa: BLE001 - any transport's error, said by name
            raise ArtifactError(f"{where}: reading {ADAPTER_CONFIG} failed: {e!r}") from e
        finally:
            storage.close()

    async def _config_of(self, name: str, raw: Any, version: str) -> bytes:
        """`_config`; for a peer source without a url, from the first holder of the version
        the catalog lists that answers (the tensors then come from those holders too)."""
        if not (isinstance(raw, dict) and raw.get("kind") == "peer" and not raw.get("url")):
            return await asyncio.to_thread(self._config, raw, version)
        urls = await self._area(name).holder_urls(version)
        if not urls:
            raise StageRequestError(f"no peer url given, and no other worker holds {version} "
                                    "in this worker's catalog" + ("" if self.staging and
                                    self.staging.catalog else " (it has none)"))
        errors = []
        for url in urls:
            try:
                return await asyncio.to_thread(self._config, {**raw, "url": url}, version)
            except ArtifactError as e:
                errors.append(f"{url}: {e}")
        raise ArtifactError(f"no holder of {version} could serve it: " + "; ".join(errors))

    async def stage_lora_adapter(self, req: LoraStageRequest) -> StageReply:
        """Start pulling an adapter version while the engine serves; returns at once with
        the handle (STAGING), which ends READY (checked) or FAILED with the reason."""
        self._fence(req)
        try:
            config = await self._config_of(req.lora_name, req.source, req.version)
            served = self._served(req.lora_name)
            h = await self._area(req.lora_name).stage(
                req.version, req.source, digest=req.digest,
                applied=(served.policy.version, served.policy.digest) if served else
                (None, None))
        except (AdminRequestError, ArtifactError, OSError) as e:
            return StageReply.failed(f"adapter {req.lora_name}: {e}")
        self.configs[h.handle] = config
        return StageReply(handle=h.handle, state=h.state.value, version=h.version)

    async def get_staged_lora_adapter(self, req: LoraStagedQuery) -> StagedListReply:
        self._fence(req, advance=False)
        area = self.areas.get(req.lora_name)
        if area is None:
            return StagedListReply.failed(f"nothing was staged for adapter {req.lora_name!r}")
        try:
            found = [area.get(req.handle).summary()] if req.handle else area.summaries()
        except AdminRequestError as e:
            return StagedListReply.failed(str(e))
        r = area.resident
        return StagedListReply(staged=found,
                               resident={"version": r.version, "digest": r.digest} if r else None)

    def _staged_dir(self, name: str, handle: str) -> tuple[Path, str | None]:
        """The READY handle's version as a plain adapter directory; (it, its digest)."""
        area = self.areas.get(name)
        if area is None:
            raise StageRequestError(f"nothing was staged for adapter {name!r}")
        h, staged = area.ready(handle)
        (staged.dir / ADAPTER_CONFIG).write_bytes(self.configs[handle])
        return self._materialize(name, staged.dir, served=False), h.digest

    # ------------------------------------------------------------ loading

    async def _source_dir(self, req: LoraLoadRequest) -> tuple[Path, str | None, bool]:
        """(the plain adapter directory to load, the digest it must have, whether it was
        made here from a staged handle or an artifact)."""
        if req.handle is not None:
            path, staged_digest = await asyncio.to_thread(self._staged_dir, req.lora_name,
                                                          req.handle)
            return path, req.digest or staged_digest, True
        path = self.lora_path(req.lora_path)
        if is_artifact(path):  # a weight-plane version: full, or a delta on the served one
            return await asyncio.to_thread(self._materialize, req.lora_name, path), \
                req.digest, True
        return path, req.digest, False

    async def load_lora_adapter(self, req: LoraLoadRequest) -> LoraAdapterReply:
        fence = self._fence(req)
        name, path, made = req.lora_name, None, False
        try:
            path, digest, made = await self._source_dir(req)
            if req.activate:
                first = self._served(name) is None
                policy, replaced = await self.engine.load_adapter(
                    name, path, req.weight_version, req.step, digest)
                self._close_first(name, first, req)
                await self._now_serves(name, req.handle, policy)
                served_name = None
            else:
                policy, served_name = await self.engine.load_adapter_beside(
                    name, path, req.weight_version, req.step, digest)
                replaced, self.beside[name] = None, req.handle
        except (BadRequest, AdminRequestError, ArtifactError) as e:
            if made and path is not None:
                shutil.rmtree(path, ignore_errors=True)
            return LoraAdapterReply.failed(str(e) + ("; nothing was changed" if isinstance(
                e, ArtifactError) else ""), lora_name=name)
        if made:
            self._keep(name, path)
        state = next((s for s in self.engine.adapters() if s.policy == policy),
                     AdapterState(policy, 0, str(path)))  # (replaced again, or beside)
        where = (f"beside the serving version, as {served_name}" if served_name
                 else "serving")
        return adapter_reply(state, fence, replaced=replaced, served_name=served_name or UNSET,
                             message=f"adapter {name} version {policy.version} (step "
                                     f"{policy.step}) loaded {where}")

    def _keep(self, name: str, path: Path, keep: int = 3) -> None:
        """Keep the directory made for a version `name` loaded; remove those made for
        older ones beyond the newest `keep` (the serving version, one loaded beside, and
        the one just replaced, whose running requests finish on it)."""
        made = self.made.setdefault(name, [])
        made.append(path)
        for old in made[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        del made[:-keep]

    async def _now_serves(self, name: str, handle: str | None, policy: PolicyIdentity) -> None:
        """The adapter serves the version of `handle` (its staged copy becomes the resident
        one), or one loaded from a path (the resident copy no longer describes it)."""
        area = self.areas.get(name)
        if area is None:
            return
        if handle is not None:
            await area.applied(handle, policy.digest)
            self.configs.pop(handle, None)
        else:
            await area.weights_replaced()

    async def activate_lora_adapter(self, req: LoraVersionRequest) -> LoraAdapterReply:
        """Requests naming the adapter run on its version loaded beside from now on."""
        fence = self._fence(req)
        first = self._served(req.lora_name) is None
        try:
            policy, replaced = await self.engine.activate_adapter(req.lora_name,
                                                                  req.weight_version)
        except BadRequest as e:
            return LoraAdapterReply.failed(str(e), lora_name=req.lora_name)
        self._close_first(req.lora_name, first, req)
        await self._now_serves(req.lora_name, self.beside.pop(req.lora_name, None), policy)
        return adapter_reply(self._served(req.lora_name) or AdapterState(policy, 0, ""), fence,
                             replaced=replaced, message=f"adapter {req.lora_name} serves "
                             f"version {policy.version} (step {policy.step})")

    async def discard_lora_adapter(self, req: LoraVersionRequest) -> LoraAdapterReply:
        """Drop the version loaded beside; the serving one serves on."""
        fence = self._fence(req)
        try:
            policy = await self.engine.discard_adapter(req.lora_name, req.weight_version)
        except BadRequest as e:
            return LoraAdapterReply.failed(str(e), lora_name=req.lora_name)
        handle = self.beside.pop(req.lora_name, None)
        if handle is not None and req.lora_name in self.areas:
            await self.areas[req.lora_name].release(handle)
            self.configs.pop(handle, None)
        return LoraAdapterReply(lora_name=req.lora_name, **policy.reply_fields(),
                                fleet_epoch=fence.newest, message=f"adapter {req.lora_name}: "
                                f"version {policy.version} discarded")

    def _materialize(self, name: str, path: Path, served: bool = True) -> Path:
        """The artifact at `path` as a plain adapter directory of this worker's own (a delta
        on the version `name` serves)."""
        state = self._served(name) if served else None
        if self._own is None:
            self._own = Path(tempfile.mkdtemp(prefix=f"{LORA_TMP_PREFIX}{os.getpid()}-"))
            weakref.finalize(self, shutil.rmtree, self._own, True)  # (also at exit)
        out = Path(tempfile.mkdtemp(prefix=f"{name[:32]}-", dir=self._own))
        try:
            return materialize_adapter(path, out, (state.policy.version, Path(state.path))
                                       if state else None)
        except BaseException:
            shutil.rmtree(out, ignore_errors=True)
            raise

    async def unload_lora_adapter(self, req: LoraRequest) -> LoraAdapterReply:
        fence = self._fence(req)
        try:
            policy = await self.engine.unload_adapter(req.lora_name)
        except BadRequest as e:
            return LoraAdapterReply.failed(str(e), lora_name=req.lora_name)
        for d in self.made.pop(req.lora_name, []):  # vLLM holds what still runs in memory
            shutil.rmtree(d, ignore_errors=True)
        if req.lora_name in self.areas:  # nor does it hold any version for peers now
            await self.areas[req.lora_name].weights_replaced()
        return LoraAdapterReply(lora_name=req.lora_name, **policy.reply_fields(),
                                fleet_epoch=fence.newest,
                                message=f"adapter {req.lora_name} unloaded")

    async def set_lora_admission(self, req: LoraAdmissionRequest) -> LoraAdapterReply:
        fence = self._fence(req)
        try:
            state = self.engine.set_adapter_open(req.lora_name, req.open, req.reason)
        except BadRequest as e:
            return LoraAdapterReply.failed(str(e), lora_name=req.lora_name)
        return adapter_reply(state, fence)

    async def list_lora_adapters(self, req: NoFields) -> LoraListReply:
        limits = self.engine.adapter_limits()
        return LoraListReply(
            adapters=[adapter_reply(s, self.fences.get(s.policy.adapter_name or ""))
                      for s in self.engine.adapters()],
            base=self.base_name(), max_loras=limits[0] if limits else UNSET,
            max_lora_rank=limits[1] if limits else UNSET)


def adapter_policies(engine: EngineControl) -> list[PolicyIdentity]:
    """Each adapter's policy (what get_weight_version and discovery list beside the base)."""
    return [s.policy for s in engine.adapters()]
