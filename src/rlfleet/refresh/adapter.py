"""A LoRA adapter's refresh (`UpdatePath.VLLM_ADAPTER`): PolicyRefresh's lifecycle, with the
adapter as the policy. Each step acts on the adapter alone, so the base model and the other
adapters keep serving on the same workers throughout:

- before the gate (`prepare`, as the staged path's): each worker pulls the version from its
  source (`stage_lora_adapter`: S3, a directory, the trainer, a peer that holds it; checked
  by its digest) when the target has one, loads it beside the serving version
  (`load_lora_adapter`, `activate: false`), and the probe runs through that version's own
  engine name (rlfleet.refresh.waves, `probe_beside`) while the old version serves the adapter's
  name. Any failure discards the versions loaded beside and holds the refresh: nothing was
  gated, the old version serves on every worker;
- gate: the adapter's own admission flag (`set_lora_admission`; frontends hold its requests),
  on every worker of the fleet;
- pause, cache reset: none (vLLM loads a new adapter version between engine steps; a version
  has a prefix-cache key of its own);
- apply: `activate_lora_adapter` (the adapter's name switches to the version probed before
  the gate; requests running on the old one finish on it, which is then removed); a worker
  that had none loaded beside (it joined, or a rollback) loads it here instead;
- verify: the adapter's identity as the worker lists it; probe: the answer from before the
  gate for a worker that switched to the version it probed, else a generation that names
  the adapter, on the worker's request plane;
- fence: the adapter's own epochs (in the body), so two runs that train two adapters on one
  fleet, and the base model's coordinator, never fence each other;
- journal: the fleet is `<rl_url>#lora=<name>`, so each adapter has its history and epochs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from rlfleet.protocol import admin, admin_lora
from rlfleet.protocol.admin_lora import (
    LoraAdmissionRequest,
    LoraLoadRequest,
    LoraStagedQuery,
    LoraStageRequest,
    LoraVersionRequest,
)
from rlfleet.protocol.admin_vllm import StagedSummary
from rlfleet.protocol.identity import PolicyIdentity
from rlfleet.refresh.control import (
    Beside,
    Channel,
    FleetWorker,
    RefreshHeld,
    gather_all,
    lost,
)
from rlfleet.refresh.staged import VllmStagedControl

if TYPE_CHECKING:
    from rlfleet.refresh.policy import Policy
    from rlfleet.refresh.probe import Answer

ADAPTER_ROUTES = admin.route_names(admin.LORA) | {admin.LIVENESS_PROBE.name}
BESIDE_ROUTE = admin.ACTIVATE_LORA_ADAPTER.name  # a worker that loads versions beside


@dataclass
class Loaded:
    """How one load of an adapter version on a worker ended."""

    ok: bool
    why: str | None = None
    unreachable: bool = False
    served_name: str | None = None


class VllmAdapterControl(VllmStagedControl):
    """The workers of the RL listener that serve `model`, refreshing its adapter `adapter`."""

    release_route = None  # an adapter's staging handle ends by its own deadline
    stage_routes: frozenset[str] = frozenset()  # BESIDE_ROUTE, checked where it loads

    def __init__(self, rl_url: str, model: str | None, adapter: str) -> None:
        """`model`: the base model the adapter adapts (its name, or the adapter's own: then
        every worker that serves adapters is a candidate)."""
        super().__init__(rl_url, None if model == adapter else model)
        self.adapter = self.probe_adapter = adapter
        self.fleet = f"{self.rl_url}#lora={adapter}"
        self.path = "vllm-adapter"
        self.required_routes = ADAPTER_ROUTES
        self.beside: dict[int, Beside] = {}  # worker -> the target loaded beside (prepare)
        self.switched: set[int] = set()  # workers switched to the version they probed

    # ------------------------------------------------------------ state

    async def newest_epoch(self, ch: Channel) -> int:
        ws = await self.discover(ch)
        found = await gather_all(self._listed(ch, w) for w in ws.values() if w.active)
        return max((a.fleet_epoch or 0 for a in found if a is not None), default=0)

    async def _listed(self, ch: Channel, w: FleetWorker) -> admin_lora.LoraAdapterReply | None:
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

    # ------------------------------------------------------------ staging (before the gate)

    def _stage_call(self, ch: Channel, target: Policy, source: dict[str, Any]
                    ) -> tuple[admin.AdminRoute, Any]:
        return admin.STAGE_LORA_ADAPTER, LoraStageRequest(
            lora_name=self.adapter, version=target.version, source=source,
            digest=target.digest, fleet_epoch=ch.epoch)

    def _query_call(self, ch: Channel, handle: str) -> tuple[admin.AdminRoute, Any]:
        return admin.GET_STAGED_LORA_ADAPTER, LoraStagedQuery(lora_name=self.adapter,
                                                              handle=handle)

    async def _load(self, ch: Channel, w: FleetWorker, target: Policy, step: str,
                    activate: bool) -> Loaded:
        """Load `target` on `w`: staged from its source first (peers that hold it, then
        the version's own), else from its directory."""
        where: dict[str, Any]
        if target.source is not None and BESIDE_ROUTE in w.routes:
            summary: StagedSummary = await self._stage(ch, w, target)
            self.staged.pop(w.instance_id, None)
            w.record("stage", "staged", 200, msgspec.to_builtins(summary))
            if summary.state != "READY":
                return Loaded(False, f"staging failed: {summary.error}", summary.unreachable)
            where = {"handle": summary.handle}
        elif target.path is not None:
            where = {"lora_path": target.path}
        else:
            return Loaded(False, f"adapter {self.adapter}: version {target.version} has no "
                                 "adapter directory to load, and this worker stages none")
        res = await ch.on(w, step, admin.LOAD_LORA_ADAPTER, LoraLoadRequest(
            lora_name=self.adapter, weight_version=target.version, step=target.step,
            digest=target.digest, fleet_epoch=ch.epoch, activate=activate, **where))
        if not res.ok:
            return Loaded(False, str(res.message), res.unreachable)
        return Loaded(True, served_name=res.reply.served_name or None)

    async def prepare(self, ch: Channel, target: Policy, skip: set[int]) -> None:
        """Before the gate: stage and load `target` beside the serving version on every
        worker in discovery (but `skip`) that can; any failure discards what was loaded
        and holds the refresh (nothing gated). The probe through the versions loaded
        beside follows (rlfleet.refresh.waves.Waves.probe_beside)."""
        self.beside, self.switched = {}, set()
        found = await self.discover(ch)
        ws = [w for i, w in found.items()
              if w.active and i not in skip and BESIDE_ROUTE in w.routes]
        results = await gather_all(self._load(ch, w, target, "stage", False) for w in ws)
        for w, r in zip(ws, results, strict=True):
            if r.ok and r.served_name:
                self.beside[w.instance_id] = Beside(w, target.version, r.served_name)
        failed = [(w, r) for w, r in zip(ws, results, strict=True) if not r.ok]
        if failed:
            await self.discard_beside(ch)
            raise RefreshHeld(f"adapter {self.adapter}: {target.version} could not be loaded "
                              "beside the serving version on " + "; ".join(
                                  f"{w.instance_id}: {r.why}" for w, r in failed)
                              + "; nothing was gated, the serving version serves on")

    def loaded_beside(self) -> dict[int, Beside]:
        return self.beside

    async def discard_beside(self, ch: Channel) -> None:
        """Drop every version loaded beside by `prepare` (a failure before the gate)."""
        await gather_all(ch.on(b.worker, "stage", admin.DISCARD_LORA_ADAPTER,
                               LoraVersionRequest(lora_name=self.adapter,
                                                  weight_version=b.version,
                                                  fleet_epoch=ch.epoch))
                         for b in self.beside.values())
        self.beside = {}

    def early_answer(self, w: FleetWorker, target: Policy) -> Answer | None:
        b = self.beside.get(w.instance_id)
        if w.instance_id in self.switched and b is not None and b.version == target.version:
            return b.answer
        return None

    # ------------------------------------------------------------ the gated window

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
        """Switch each worker to the version it loaded beside; one that has none loads
        `target` now (staged from its source, or from its directory)."""
        failed: list[FleetWorker] = []

        async def one(w: FleetWorker) -> None:
            b = self.beside.get(w.instance_id)
            if b is not None and b.version == target.version:
                w.calls[:0] = b.worker.calls  # staged, loaded and probed before the gate
                res = await ch.on(w, "apply", admin.ACTIVATE_LORA_ADAPTER, LoraVersionRequest(
                    lora_name=self.adapter, weight_version=target.version,
                    fleet_epoch=ch.epoch))
                r = Loaded(res.ok, None if res.ok else str(res.message), res.unreachable)
                if res.ok:
                    self.switched.add(w.instance_id)
            else:
                r = await self._load(ch, w, target, "apply", True)
            if r.ok:
                if target.source is not None:  # a peer for workers that join later
                    urls = self.holders.setdefault(target.version, [])
                    if w.system_url not in urls:
                        urls.append(w.system_url)
            elif r.unreachable:
                w.exclude(f"unreachable at transfer: {r.why}", "missing")
            else:
                w.reason = f"transfer failed: {r.why}"
                failed.append(w)
        await gather_all(one(w) for w in ws)  # staging has its own deadline (stage_timeout)
        return failed

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

