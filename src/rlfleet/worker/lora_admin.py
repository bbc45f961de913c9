"""The LoRA adapter routes of a worker (`/engine/load_lora_adapter`, `unload_lora_adapter`,
`set_lora_admission`, `list_lora_adapters`), over the engine-control interface: each adapter
is a policy of its own, loaded, replaced by a new version, gated and unloaded while the base
model and the other adapters serve on.

`lora_path` is a peft adapter directory, or an adapter version of the weight plane
(rlfleet.weights.adapters: full, or an XOR delta applied only on the version served).

Each adapter has its own fleet fence (the epoch of its own refresh coordinator, in the
body's `fleet_epoch`): two RL runs that train one adapter each on one fleet take epochs of
their own and never fence each other, nor the base model's coordinator."""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from msgspec import UNSET

from rlfleet.protocol import admin
from rlfleet.protocol.admin import (
    AdminRequestError,
    LoraAdapterReply,
    LoraAdmissionRequest,
    LoraListReply,
    LoraLoadRequest,
    LoraRequest,
    NoFields,
)
from rlfleet.protocol.identity import PolicyIdentity
from rlfleet.weights.adapters import is_artifact, materialize_adapter
from rlfleet.weights.artifacts import ArtifactError
from rlfleet.worker.engine import AdapterState, BadRequest, EngineControl
from rlfleet.worker.system_server import FleetFence, Route

log = logging.getLogger("rlfleet.admin")


def adapter_reply(state: AdapterState, fence: FleetFence | None = None,
                  **extra: object) -> LoraAdapterReply:
    p = state.policy
    return LoraAdapterReply(lora_name=p.adapter_name, **p.reply_fields(), rank=state.rank,
                            lora_path=state.path, open=state.open, reason=state.reason,
                            fleet_epoch=fence.newest if fence else 0, **extra)


class LoraAdmin:
    """Route handlers for the adapters of one engine."""

    def __init__(self, engine: EngineControl, roots: list[Path],
                 base_name: Callable[[], str]) -> None:
        self.engine, self.roots, self.base_name = engine, roots, base_name
        self.fences: dict[str, FleetFence] = {}  # adapter name -> its coordinator's fence

    def routes(self) -> list[Route]:
        """The adapter routes, on an engine that serves adapters (vLLM's --enable-lora)."""
        if self.engine.adapter_limits() is None:
            return []
        return [Route(admin.LOAD_LORA_ADAPTER, self.load_lora_adapter),
                Route(admin.UNLOAD_LORA_ADAPTER, self.unload_lora_adapter),
                Route(admin.SET_LORA_ADMISSION, self.set_lora_admission),
                Route(admin.LIST_LORA_ADAPTERS, self.list_lora_adapters)]

    def _fence(self, req: LoraRequest) -> FleetFence:
        """The adapter's fence, checked and advanced by the call's epoch (StaleEpoch: 409)."""
        fence = self.fences.setdefault(req.lora_name, FleetFence())
        fence.check(req.fleet_epoch, advance=True)
        return fence

    def lora_path(self, raw: str) -> Path:
        """The adapter directory, inside the worker's allowed roots (as model_path is)."""
        try:
            return admin.weights_path(raw, self.roots)
        except AdminRequestError as e:
            raise AdminRequestError(str(e).replace("model_path", "lora_path")) from None

    async def load_lora_adapter(self, req: LoraLoadRequest) -> LoraAdapterReply:
        fence = self._fence(req)
        try:
            path = self.lora_path(req.lora_path)
            if is_artifact(path):  # a weight-plane version: full, or a delta on the served one
                path = await asyncio.to_thread(self._materialize, req.lora_name, path)
            policy, replaced = await self.engine.load_adapter(
                req.lora_name, path, req.weight_version, req.step, req.digest)
        except (BadRequest, AdminRequestError, ArtifactError) as e:
            return LoraAdapterReply.failed(str(e) + ("; nothing was changed" if isinstance(
                e, ArtifactError) else ""), lora_name=req.lora_name)
        state = next((s for s in self.engine.adapters() if s.policy == policy),
                     AdapterState(policy, 0, str(path)))  # (replaced again meanwhile)
        return adapter_reply(state, fence, replaced=replaced,
                             message=f"adapter {req.lora_name} serves version "
                                     f"{policy.version} (step {policy.step})")

    def _materialize(self, name: str, path: Path) -> Path:
        """The artifact at `path` as a plain adapter directory of this worker's own."""
        served = next(((s.policy.version, Path(s.path)) for s in self.engine.adapters()
                       if s.policy.adapter_name == name), None)
        out = Path(tempfile.mkdtemp(prefix=f"rlfleet-lora-{name[:32]}-"))
        try:
            return materialize_adapter(path, out, served)
        except BaseException:
            shutil.rmtree(out, ignore_errors=True)
            raise

    async def unload_lora_adapter(self, req: LoraRequest) -> LoraAdapterReply:
        fence = self._fence(req)
        try:
            policy = await self.engine.unload_adapter(req.lora_name)
        except BadRequest as e:
            return LoraAdapterReply.failed(str(e), lora_name=req.lora_name)
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
