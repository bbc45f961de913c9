"""Whether a worker takes rollout traffic: published as `gated` / `gate_reason` in its own
discovery entries, which every frontend routes by.

Two independent closures, and the worker is open only while neither is closed:
- the *gate*, set by whoever controls the fleet through `set_admission` (a policy-refresh
  coordinator, an operator), or closed at start (`--start-gated`, or a worker joining a
  fleet that a coordinator controls);
- the *hold*, the worker's own, while its weights are uncertain (a load that failed and
  could not be undone, an install whose self-check has not passed, an engine that died).
  No caller can open a held worker; it reopens once weights it can vouch for are installed.

A worker that a controller has gated or opened says so in its entries (`controlled: true`,
and, once opened, the policy it was opened on: `fleet_policy`): that is how a worker that
joins later knows the fleet is controlled (`rlfleet.worker.serve`)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from rlfleet.protocol.admin_vllm import AdmissionReply, AdmissionRequest
from rlfleet.runtime.discovery import DiscoveryError

log = logging.getLogger("rlfleet.admission")

FIELDS = ("gated", "gate_reason", "weights_uncertain", "controlled", "fleet_policy")


class Admission:
    def __init__(self, gated: bool = False, reason: str | None = None,
                 identity: Callable[[], dict[str, Any]] | None = None) -> None:
        """`identity`: the policy the worker serves ({"version", "digest"}), recorded as the
        fleet's when a controller opens it without naming one."""
        self.gate_reason: str | None = (reason or "gated") if gated else None  # None: open
        self.hold_reason: str | None = None  # None: the worker vouches for its weights
        self.controlled = False  # a controller called set_admission on this worker
        self.fleet_policy: dict[str, Any] | None = None  # what it was last opened on
        self._publisher: Callable[[], Awaitable[None]] | None = None
        self.identity = identity

    @property
    def gated(self) -> bool:
        return self.gate_reason is not None or self.hold_reason is not None

    @property
    def reason(self) -> str | None:
        """Why the worker is closed (its own hold first: no caller can lift it)."""
        return self.hold_reason or self.gate_reason

    def fields(self) -> dict[str, Any]:
        """What its discovery entries and /health say about it."""
        out: dict[str, Any] = {"gated": self.gated}
        if self.gated:
            out["gate_reason"] = self.reason
        if self.hold_reason is not None:
            out["weights_uncertain"] = self.hold_reason
        if self.controlled:
            out["controlled"] = True
        if self.fleet_policy is not None:
            out["fleet_policy"] = self.fleet_policy
        return out

    async def attach(self, publish: Callable[[], Awaitable[None]]) -> None:
        """Publish changes through `publish` (the worker's: it writes the whole entry from
        the current state) from now on, and now."""
        self._publisher = publish
        await self._publish()

    async def _publish(self) -> None:
        if self._publisher is None:
            return
        try:
            await self._publisher()
        except DiscoveryError as e:  # published by the keep-alive once the store is back
            log.warning("discovery: admission change not published yet: %s", e)

    # ---------------------------------------------------------------- the worker's own hold

    async def hold(self, reason: str) -> None:
        """Close the worker because its weights are uncertain; says so in discovery."""
        if self.hold_reason != reason:
            log.error("closing this worker to rollouts: %s", reason)
            self.hold_reason = reason
            await self._publish()

    async def release(self) -> None:
        """The weights are vouched for again (the controller's gate stays as it is)."""
        if self.hold_reason is not None:
            log.info("weights vouched for again; lifting the hold (%s)", self.hold_reason)
            self.hold_reason = None
            await self._publish()

    # ---------------------------------------------------------------- set_admission

    async def set_admission(self, req: AdmissionRequest) -> AdmissionReply:
        """Open or close this worker to rollout traffic (`policy`: what it is opened on,
        default the one it serves); opening a worker that holds itself is refused."""
        policy = req.policy
        self.controlled = True
        if req.open:
            if self.hold_reason is not None:
                await self._publish()  # `controlled` is news
                return AdmissionReply.failed(
                    f"this worker holds itself closed: {self.hold_reason}", open=False,
                    weights_uncertain=self.hold_reason)
            self.gate_reason = None
            if policy is None and self.identity is not None:
                policy = self.identity()
            if policy is not None:
                self.fleet_policy = {"version": policy.get("version"),
                                     "digest": policy.get("digest")}
        else:
            self.gate_reason = req.reason or "closed by set_admission"
        await self._publish()
        return AdmissionReply(open=not self.gated, reason=self.reason)
