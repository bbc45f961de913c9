"""A LoRA adapter's refresh (`UpdatePath.VLLM_ADAPTER`): PolicyRefresh's lifecycle, with the
adapter as the policy. Each step acts on the adapter alone, so the base model and the other
adapters keep serving on the same workers throughout:

- gate: the adapter's own admission flag (`set_lora_admission`; frontends hold its requests);
- pause, cache reset: none (vLLM loads a new adapter version between engine steps; a version
  has a prefix-cache key of its own);
- apply: `load_lora_adapter`, the new version beside the old one, which requests running on
  it finish on; a load that fails leaves the old version serving;
- verify: the adapter's identity as the worker lists it; probe: a generation that names the
  adapter, on the worker's request plane;
- fence: the adapter's own epochs (in the body), so two runs that train two adapters on one
  fleet, and the base model's coordinator, never fence each other;
- journal: the fleet is `<rl_url>#lora=<name>`, so each adapter has its history and epochs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlfleet.protocol import admin
from rlfleet.protocol.admin import LoraAdmissionRequest, LoraLoadRequest
from rlfleet.protocol.identity import PolicyIdentity
from rlfleet.rl.control import (
    Channel,
    FleetWorker,
    RefreshHeld,
    VllmControl,
    gather_all,
    lost,
)

if TYPE_CHECKING:
    from rlfleet.rl.policy import Policy

ADAPTER_ROUTES = admin.route_names(admin.LORA) | {admin.LIVENESS_PROBE.name}


class VllmAdapterControl(VllmControl):
    """The workers of the RL listener that serve `model`, refreshing its adapter `adapter`."""

    def __init__(self, rl_url: str, model: str | None, adapter: str) -> None:
        """`model`: the base model the adapter adapts (its name, or the adapter's own: then
        every worker that serves adapters is a candidate)."""
        super().__init__(rl_url, None if model == adapter else model)
        self.adapter = self.probe_adapter = adapter
        self.fleet = f"{self.rl_url}#lora={adapter}"
        self.path = "vllm-adapter"
        self.required_routes = ADAPTER_ROUTES

    async def newest_epoch(self, ch: Channel) -> int:
        ws = await self.discover(ch)
        found = await gather_all(self._listed(ch, w) for w in ws.values() if w.active)
        return max((a.fleet_epoch or 0 for a in found if a is not None), default=0)

    async def _listed(self, ch: Channel, w: FleetWorker) -> admin.LoraAdapterReply | None:
        """The adapter as the worker lists it (None: it does not serve it)."""
        res = await ch.call(w.system_url, admin.LIST_LORA_ADAPTERS)
        if not res.ok:
            return None
        return next((a for a in res.reply.adapters or [] if a.lora_name == self.adapter),
                    None)

    async def inspect(self, ch: Channel, w: FleetWorker) -> PolicyIdentity | None:
        res = await ch.on(w, "inspect", admin.LIST_LORA_ADAPTERS)
        if not res.ok:
            w.exclude(f"adapter listing failed: {res.message}", lost(res))
            return None
        found = next((a for a in res.reply.adapters or [] if a.lora_name == self.adapter), None)
        w.holds = found.policy() if found is not None else None
        return w.holds

    async def _admission(self, ch: Channel, w: FleetWorker, step: str, open_: bool,
                         reason: str | None = None) -> None:
        res = await ch.on(w, step, admin.SET_LORA_ADMISSION, LoraAdmissionRequest(
            lora_name=self.adapter, open=open_, reason=reason, fleet_epoch=ch.epoch))
        if not res.ok and "no LoRA adapter" not in str(res.message):  # a first load: none yet
            w.exclude(f"adapter {step} failed: {res.message}", lost(res))

    async def close(self, ch: Channel, w: FleetWorker, reason: str) -> None:
        await self._admission(ch, w, "gate", False, reason)

    async def open(self, ch: Channel, w: FleetWorker) -> None:
        await self._admission(ch, w, "reopen", True)

    async def pause(self, ch: Channel, w: FleetWorker, mode: str) -> None:
        """Nothing to pause: the engine serves on while the adapter's version changes."""

    async def resume(self, ch: Channel, w: FleetWorker) -> None:
        """Nothing was paused."""

    async def reset_cache(self, ch: Channel, w: FleetWorker) -> None:
        """A new version has prefix-cache keys of its own (rlfleet.vllm.adapters)."""

    async def transfer(self, ch: Channel, ws: list[FleetWorker], target: Policy
                       ) -> list[FleetWorker]:
        if target.path is None:
            raise RefreshHeld(f"adapter {self.adapter}: version {target.version} has no "
                              "adapter directory to load")
        return await self._transfer_each(ch, ws, admin.LOAD_LORA_ADAPTER, LoraLoadRequest(
            lora_name=self.adapter, lora_path=target.path, weight_version=target.version,
            step=target.step, digest=target.digest, fleet_epoch=ch.epoch))

    async def verify(self, ch: Channel, w: FleetWorker, target: Policy) -> str | None:
        found = await self.inspect(ch, w)
        if found is None:
            if w.active:
                w.exclude(f"adapter {self.adapter} is not loaded")
            return None
        if found.version != target.version or found.digest != target.digest:
            w.exclude("adapter version or digest differs from the target")
            return f"{w.instance_id} reports {found.version!r} / {found.digest}"
        return None
