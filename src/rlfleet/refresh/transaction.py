"""One refresh transaction in progress (`Transaction`: its journal record, fleet epoch,
control channel, workers, state and timed steps), the refresh state machine (`RefreshState`
and its allowed transitions in one table) and how a transaction ended (`RefreshResult`)."""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rlfleet.journal import RefreshJournal
from rlfleet.refresh import telemetry
from rlfleet.refresh.control import Channel, FleetFenced, FleetWorker
from rlfleet.refresh.policy import Policy
from rlfleet.refresh.probe import Answer
from rlfleet.runtime import tracing
from rlfleet.runtime.admin_client import AdminConnections


class RefreshState(enum.StrEnum):
    STARTED = "started"
    GATED = "gated"
    RESOLVED = "resolved"
    PAUSED = "paused"
    APPLIED = "applied"
    CACHE_RESET = "cache_reset"
    VERIFIED = "verified"
    RESUMED = "resumed"
    PROBED = "probed"
    WAVE_REOPENED = "wave_reopened"  # rolling: one wave serves the target again
    REOPENED = "reopened"  # terminal: verified workers serve the target
    ROLLING_BACK = "rolling_back"
    ROLLED_BACK = "rolled_back"  # terminal: the fleet serves the previous policy, verified
    HELD = "held"  # terminal: the fleet stays gated; the journal says why
    FENCED = "fenced"  # terminal: another coordinator took the fleet over; nothing touched since


_S = RefreshState
_STOP = frozenset({_S.HELD, _S.FENCED})  # any live state may end here
TRANSITIONS: dict[RefreshState, frozenset[RefreshState]] = {
    _S.STARTED: frozenset({_S.GATED, _S.RESOLVED}) | _STOP,  # rolling: no fleet gate
    _S.GATED: frozenset({_S.RESOLVED}) | _STOP,
    _S.RESOLVED: frozenset({_S.PAUSED, _S.REOPENED}) | _STOP,  # rolling: all there already
    _S.PAUSED: frozenset({_S.APPLIED, _S.ROLLING_BACK}) | _STOP,
    _S.APPLIED: frozenset({_S.CACHE_RESET, _S.ROLLING_BACK}) | _STOP,
    _S.CACHE_RESET: frozenset({_S.VERIFIED, _S.ROLLING_BACK}) | _STOP,
    _S.VERIFIED: frozenset({_S.RESUMED, _S.ROLLING_BACK}) | _STOP,
    _S.RESUMED: frozenset({_S.PROBED, _S.ROLLING_BACK}) | _STOP,
    _S.PROBED: frozenset({_S.REOPENED, _S.WAVE_REOPENED, _S.ROLLING_BACK}) | _STOP,
    _S.WAVE_REOPENED: frozenset({_S.PAUSED, _S.REOPENED}) | _STOP,
    _S.ROLLING_BACK: frozenset({_S.ROLLED_BACK}) | _STOP,
    _S.REOPENED: frozenset(),
    _S.ROLLED_BACK: frozenset(),
    _S.HELD: frozenset(),
    _S.FENCED: frozenset(),
}


class IllegalRefreshTransition(RuntimeError):
    pass


def check_transition(old: RefreshState, new: RefreshState) -> RefreshState:
    if new not in TRANSITIONS[old]:
        raise IllegalRefreshTransition(f"refresh cannot go from {old.value} to {new.value}")
    return new


@dataclass(repr=False)
class RefreshResult:
    refresh_id: int
    decision: str  # reopened | rolled_back | held | fenced
    reason: str
    state: RefreshState
    workers: list[dict[str, Any]]
    steps: list[dict[str, Any]]
    policy: Policy
    epoch: int = 0  # the transaction's fleet epoch
    kind: str = "refresh"  # refresh | admit | recovery

    def __repr__(self) -> str:
        """One line: the workers by status, not each one's calls. (The dataclass's repr
        held every call of every worker: megabytes for a thousand workers, which
        asyncio.run spent whole seconds making, as it restores its SIGINT handler, whose
        repr names the finished task and so its result.)"""
        statuses: dict[str, int] = {}
        for w in self.workers:
            statuses[w.get("status")] = statuses.get(w.get("status"), 0) + 1
        return (f"RefreshResult(refresh_id={self.refresh_id}, kind={self.kind!r}, "
                f"decision={self.decision!r}, state={self.state.value!r}, epoch={self.epoch}, "
                f"policy={self.policy.version!r}, workers={statuses}, steps={len(self.steps)}, "
                f"reason={self.reason!r})")

    @property
    def ok(self) -> bool:
        return self.state is RefreshState.REOPENED

    @property
    def fleet_moved(self) -> bool:
        """Every worker the refresh selected serves the target, verified (`ok` allows
        workers kept out of a reopened fleet)."""
        return self.ok and bool(self.workers) and all(
            w["status"] == "verified" for w in self.workers)

    @property
    def seconds(self) -> float:
        return sum(s["seconds"] for s in self.steps)

    def step_seconds(self) -> dict[str, float]:
        """Seconds per lifecycle step (summed over the waves of a rolling refresh)."""
        out: dict[str, float] = {}
        for s in self.steps:
            out[s["name"]] = out.get(s["name"], 0.0) + s["seconds"]
        return out


class Rollback(Exception):
    """The failure policy asks for a rollback."""


class Transaction:
    """One transaction in progress: its journal record, epoch, control channel, workers,
    state and timed steps."""

    def __init__(self, kind: str, refresh_id: int, epoch: int, ch: Channel,
                 requests: AdminConnections, journal: RefreshJournal,
                 on_event: Callable[[str], None], previous: Policy | None) -> None:
        self.kind, self.id, self.epoch = kind, refresh_id, epoch
        self.ch, self.requests = ch, requests
        self.journal, self.on_event = journal, on_event
        self.previous = previous  # the verified policy before it (what a rollback returns to)
        self.state = RefreshState.STARTED
        self.steps: list[dict[str, Any]] = []
        self.workers: dict[int, FleetWorker] = {}
        self.wave: int | None = None  # rolling: the wave in progress (1-based)
        self.reference: list[Answer] = []  # rolling: the probe answers of earlier waves

    def active(self, among: Sequence[FleetWorker] | None = None) -> list[FleetWorker]:
        return [w for w in (self.workers.values() if among is None else among) if w.active]

    async def record(self, **fields: Any) -> None:
        """Write to this transaction's record, unless another coordinator ended it (it
        recovered this transaction: this coordinator has been taken over)."""
        j = self.journal
        if not await asyncio.to_thread(j.update, self.id, only_open=True, **fields):
            raise FleetFenced(f"refresh {self.id} (epoch {self.epoch}) was taken over: the "
                              f"journal {j.path} shows it ended by another coordinator")

    async def move(self, new: RefreshState) -> None:
        self.state = check_transition(self.state, new)
        await self.record(state=new.value)

    async def advance(self, *states: RefreshState) -> None:
        """Move through `states` in order (each transition checked), recorded once with the
        steps so far: what one call per worker did (commit_policy)."""
        for new in states:
            self.state = check_transition(self.state, new)
        await self.record(state=self.state.value, steps=self.steps)

    def add_step(self, name: str, seconds: float, **detail: Any) -> None:
        """A step timed elsewhere (by the workers, inside one call each): in the steps and
        the metrics as a timed one is, recorded with the next write."""
        telemetry.REFRESH_SECONDS.labels(name).observe(seconds)
        self.steps.append({"name": name, "seconds": seconds, **detail,
                           **({"wave": self.wave} if self.wave else {})})

    async def timed(self, name: str, coro: Awaitable[Any]) -> Any:
        t0 = time.perf_counter()
        label = f"[refresh {self.id}]" + (f" wave {self.wave}:" if self.wave else "")
        self.on_event(f"{label} {name} ...")
        ok = False
        try:
            with tracing.span(f"refresh {name}", attributes={"rlfleet.refresh_id": self.id}):
                out = await coro  # each worker's control call: a span under this one
            ok = True
            return out
        finally:
            secs = time.perf_counter() - t0
            telemetry.REFRESH_SECONDS.labels(name).observe(secs)
            self.steps.append({"name": name, "seconds": secs,
                               **({"wave": self.wave} if self.wave else {})})
            self.on_event(f"{label} {name} done in {secs:.3f}s")
            if ok:
                await self.record(steps=self.steps)

