"""PolicyRefresh: move a whole fleet to one target policy, or leave it gated with a recorded
reason. The lifecycle (shared/spec/rl-integration-reference.txt, "Coordinate Policy Refresh"):

  gate → resolve → pause → (re-resolve) → apply → reset cache → verify → resume → probe → reopen

Failure handling follows the reference table (distribute-and-update-rollout-weights.md):
a worker whose pause, cache reset, resume or probe fails is excluded and stays gated; a
worker gone from discovery is dropped; a transfer that fails after peers succeeded leaves
the fleet gated and is handled by one explicit policy (retry | rollback | hold); a version
or digest that differs keeps a synchronous fleet closed.

Every refresh is a fleet transaction, recorded in the journal (rlfleet.rl.journal), which
is the source of truth:
- **epoch**: it takes the fleet's next epoch from the journal's store with a
  compare-and-set and sends it on every control call (`X-Fleet-Epoch`). A worker refuses
  calls from an epoch older than the newest it has seen, so a coordinator that another one
  has taken over (it was paused, partitioned, or started at the same time) stops at its
  next call with `decision: fenced` and changes nothing more.
- **recovery**: a coordinator that finds a transaction of its fleet that was begun and
  never finished (its coordinator crashed, or is being taken over) recovers it first, as a
  transaction of its own: it closes and pauses every worker (which fences the old one),
  rolls forward when every worker holds the interrupted target, else back to the last
  verified policy, and reopens the fleet only on one verified policy (`recover`).
- **steps**: every policy carries a fleet step (the refresh's `step`; default one above the
  step the fleet serves; steps only increase) that workers record, publish in discovery and
  stamp on every token they generate.

Two modes: "sync" (the whole fleet gated while it changes) and "rolling" (workers updated in
waves while the rest serve: a worker that serves is never more than `max_lag` steps behind
the target, and never fewer than `min_serving` workers serve).

The lifecycle calls one `WorkerControl` per worker flavour (rlfleet.rl.control) and judges
the post-update probe with rlfleet.rl.probe."""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from rlfleet.protocol.engine import GenerateRequest, SamplingOptions
from rlfleet.protocol.identity import PolicyIdentity
from rlfleet.rl import telemetry
from rlfleet.rl.control import (
    Channel,
    FleetFenced,
    FleetWorker,
    RefreshHeld,
    SglangControl,
    SglangWorker,
    VllmControl,
    WorkerControl,
    gather_all,
)
from rlfleet.rl.gate import RolloutGate
from rlfleet.rl.journal import RefreshJournal, open_journal
from rlfleet.rl.probe import (
    PROBE_TEXT,
    Answer,
    Probe,
    check_expected,
    disagreement,
    reference_probe,
    tolerance,
)
from rlfleet.runtime import tracing
from rlfleet.runtime.request_plane import WorkerError, generate_over_http

log = logging.getLogger("rlfleet.refresh")

class UpdatePath(enum.StrEnum):
    VLLM_DISK = "vllm-disk"
    VLLM_DISTRIBUTED = "vllm-distributed"
    SGLANG_DISK = "sglang-disk"
    VLLM_STAGED = "vllm-staged"  # pulled while serving (rlfleet.rl.staged), installed gated


class OnFailure(enum.StrEnum):
    RETRY = "retry"  # retry the failed workers, then hold
    ROLLBACK = "rollback"  # reapply the previous policy everywhere, verify it, reopen on it
    HOLD = "hold"  # keep the fleet gated for an operator


class RefreshMode(enum.StrEnum):
    SYNC = "sync"  # the whole fleet gated while it changes
    ROLLING = "rolling"  # in waves, the rest serving, within max_lag steps


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


# Tests only: RLFLEET_TEST_REFRESH_HOOK=<point>=kill|stop makes this coordinator process
# SIGKILL or SIGSTOP itself when a refresh reaches <point>, so that a test can interrupt a
# coordinator at a named step of its lifecycle deterministically. Never set it otherwise.
TEST_HOOK = "RLFLEET_TEST_REFRESH_HOOK"
TEST_HOOK_POINTS = ("gated", "paused", "apply_half", "verified", "before_reopen")


def _test_hook_wants(point: str) -> str | None:
    where, _, action = os.environ.get(TEST_HOOK, "").partition("=")
    return action if where == point and action in ("kill", "stop") else None


def _test_hook(point: str) -> None:
    action = _test_hook_wants(point)
    if action is None:
        return
    print(f"RLFLEET_TEST_HOOK {point} {action}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL if action == "kill" else signal.SIGSTOP)


@dataclass
class Policy:
    """One target policy: where it is, what it is called, what it is, its fleet step."""

    version: str
    digest: str
    path: str | None = None
    probe: Probe | None = None
    tensors: Callable[[], Sequence[tuple[str, Any]]] | None = None  # for the distributed path
    source: dict[str, Any] | None = None  # where workers stage it from (the staged path)
    step: int | None = None

    @property
    def identity(self) -> PolicyIdentity:
        return PolicyIdentity(version=self.version, digest=self.digest, step=self.step)

    def held_by(self, w: FleetWorker) -> bool:
        """Whether the worker last reported holding this policy."""
        h = w.holds
        return h is not None and (h.version, h.digest) == (self.version, self.digest) and (
            self.step is None or h.step == self.step)

    @property
    def sendable(self) -> bool:
        return self.path is not None or self.tensors is not None or self.source is not None


@dataclass
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


class _Rollback(Exception):
    """The failure policy asks for a rollback."""


class _Tx:
    """One transaction in progress: its journal record, epoch, control channel, workers,
    state and timed steps."""

    def __init__(self, owner: PolicyRefresh, kind: str, refresh_id: int, epoch: int,
                 ch: Channel, requests: httpx.AsyncClient) -> None:
        self.owner, self.kind, self.id, self.epoch = owner, kind, refresh_id, epoch
        self.ch, self.requests = ch, requests
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
        j = self.owner.journal
        if not await asyncio.to_thread(j.update, self.id, only_open=True, **fields):
            raise FleetFenced(f"refresh {self.id} (epoch {self.epoch}) was taken over: the "
                              f"journal {j.path} shows it ended by another coordinator")

    async def move(self, new: RefreshState) -> None:
        self.state = check_transition(self.state, new)
        await self.record(state=new.value)

    async def timed(self, name: str, coro: Awaitable[Any]) -> Any:
        t0 = time.perf_counter()
        label = f"[refresh {self.id}]" + (f" wave {self.wave}:" if self.wave else "")
        self.owner.on_event(f"{label} {name} ...")
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
            self.owner.on_event(f"{label} {name} done in {secs:.3f}s")
            if ok:
                await self.record(steps=self.steps)


class PolicyRefresh:
    """Refreshes one fleet's policy. Keep one instance per fleet: it remembers the policy the
    fleet is on (for rollback and for admitting replacement workers), and takes it again
    from the journal before every transaction (the journal is the source of truth)."""

    def __init__(self, rl_url: str | None = None, *, model: str | None = None,
                 path: UpdatePath | str = UpdatePath.VLLM_DISK,
                 sglang_workers: Sequence[SglangWorker] = (),
                 journal: RefreshJournal | str | Path = ":memory:",
                 gate: RolloutGate | None = None,
                 on_failure: OnFailure | str = OnFailure.HOLD, retries: int = 1,
                 pause_mode: str = "wait", probe_text: str = PROBE_TEXT,
                 probe_tokens: int = 8, probe_tolerance: float | None = None,
                 probe_from_checkpoint: bool = False, transfer_backend: str = "gloo",
                 master_address: str | None = None, master_port: int | None = None,
                 min_workers: int = 1, timeout: float = 120.0, admin_token: str | None = None,
                 on_event: Callable[[str], None] | None = None,
                 current: Policy | None = None, mode: RefreshMode | str = RefreshMode.SYNC,
                 max_lag: int = 1, min_serving: int = 1,
                 wave_size: int | None = None) -> None:
        """`probe_tolerance`: max logprob difference in the post-update probe (default: by
        the dtype each worker serves in, see rlfleet.rl.probe). `probe_from_checkpoint`:
        without a trainer's probe, compute the expected one from the checkpoint with
        transformers (loads the whole model here); else the workers must agree with each
        other on `probe_text`. `transfer_backend`, `master_address` (default: this host's
        address toward the workers), `master_port`: the distributed path's process group.
        `journal`: a path, `:memory:`, ``etcd://host:port[/name]`` or an open journal; every
        coordinator of one fleet must use the same one. `mode` "rolling": update `wave_size`
        workers at a time (default: as many as keeps `min_serving` serving) while the rest
        serve, refusing a target more than `max_lag` steps ahead of a serving worker."""
        self.path = UpdatePath(path)
        self.mode = RefreshMode(mode)
        if pause_mode not in ("keep", "wait", "abort"):
            raise ValueError(f"pause_mode must be keep, wait or abort, not {pause_mode!r}")
        if probe_tokens < 1:
            raise ValueError("probe_tokens must be at least 1")
        if type(max_lag) is not int or max_lag < 0:
            raise ValueError(f"max_lag must be a non-negative integer (steps), not {max_lag!r}")
        if type(min_serving) is not int or min_serving < 1:
            raise ValueError("min_serving must be at least 1")
        if wave_size is not None and (type(wave_size) is not int or wave_size < 1):
            raise ValueError("wave_size must be at least 1")
        self.on_failure = OnFailure(on_failure)
        if self.mode is RefreshMode.ROLLING:
            if self.path is UpdatePath.SGLANG_DISK:
                raise ValueError("a rolling refresh needs workers that leave and rejoin "
                                 "routing (set_admission in discovery): use a vLLM path")
            if self.on_failure is OnFailure.ROLLBACK:
                raise ValueError("a rolling refresh does not roll back: workers that fail stay "
                                 "out and the rest keep serving (on_failure hold or retry)")
        self.control = self._control(self.path, rl_url, model, sglang_workers,
                                     transfer_backend, master_address, master_port)
        self.model = model
        self.journal = open_journal(journal)
        self.gate = gate or RolloutGate()
        self.retries = retries
        self.pause_mode = pause_mode
        self.probe_text = probe_text
        self.probe_tokens = probe_tokens
        self.tolerance = probe_tolerance
        self.probe_from_checkpoint = probe_from_checkpoint
        self.min_workers = min_workers
        self.max_lag, self.min_serving, self.wave_size = max_lag, min_serving, wave_size
        self.timeout = timeout
        self.admin_token = admin_token
        self.on_event = on_event or (lambda msg: log.info("%s", msg))
        self.current = current
        self.verified: set[int] = set()  # workers verified on self.current
        # what each worker was last seen holding ({version, digest, step}), kept in the journal
        self.holdings: dict[int, PolicyIdentity] = {}
        self._from_journal(announce=True)

    def _from_journal(self, announce: bool = False) -> None:
        """Take the fleet's last verified policy from the journal (a new process, after a
        crash or a held refresh, or another coordinator's refresh since): the policy a
        rollback returns to and replacement workers are admitted on."""
        row = self.journal.last_served(self.control.fleet, self.model)
        self.holdings = self.journal.holdings(self.control.fleet, self.model)
        if row is None:
            return
        served = row.served
        self.current = Policy(version=served.version, digest=served.digest,
                              path=row["served_path"], source=row["served_source"],
                              step=served.step)
        self.verified = set(row["verified_workers"] or [])
        if announce:
            self.on_event(f"journal {self.journal.path}: last verified policy "
                          f"{self.current.version} ({self.current.digest}, step "
                          f"{self.current.step}) on {len(self.verified)} worker(s), "
                          f"refresh {row['id']}")

    @staticmethod
    def _control(path: UpdatePath, rl_url: str | None, model: str | None,
                 sglang_workers: Sequence[SglangWorker], backend: str,
                 master_address: str | None, master_port: int | None) -> WorkerControl:
        if path is UpdatePath.SGLANG_DISK:
            return SglangControl(sglang_workers)
        if not rl_url:
            raise ValueError("the vLLM paths need rl_url (the frontend's RL listener)")
        if path is UpdatePath.VLLM_STAGED:
            from rlfleet.rl.staged import VllmStagedControl

            return VllmStagedControl(rl_url, model)
        return VllmControl(rl_url, model, distributed=path is UpdatePath.VLLM_DISTRIBUTED,
                           backend=backend, master_address=master_address,
                           master_port=master_port)

    def close(self) -> None:
        """Release the journal's store."""
        self.journal.close()

    # ------------------------------------------------------------------ public API

    def next_step(self, step: int | None = None) -> int:
        """The fleet step a refresh to a new policy takes: `step` (checked: steps only
        increase), else one above the step the fleet serves."""
        served = self.current.step if self.current is not None else None
        if step is None:
            return (served if served is not None else -1) + 1
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be a non-negative integer, not {step!r}")
        if served is not None and step <= served:
            raise ValueError(f"fleet steps only increase: the fleet serves step {served} "
                             f"({self.current.version}); give a step above it")
        return step

    async def refresh(self, checkpoint: str | Path | None, version: str, *,
                      digest: str | None = None, probe: Probe | None = None,
                      tensors: Callable[[], Sequence[tuple[str, Any]]] | None = None,
                      step: int | None = None, source: dict[str, Any] | None = None
                      ) -> RefreshResult:
        """Move every worker to the checkpoint at `checkpoint` (declared `version`, fleet
        `step`); on the staged path, to the version workers stage from `source` (a
        stage_weights source). An unfinished transaction of the fleet is recovered first."""
        with tracing.span("policy refresh", attributes={"rlfleet.version": version}):
            target = await self._policy(checkpoint, version, digest, probe, tensors, source)
            await self.recover()
            target.step = self.next_step(step)
            if self.mode is RefreshMode.ROLLING:
                return await self._transaction("refresh", target,
                                               lambda tx: self._rolling(tx, target))
            return await self._transaction(
                "refresh", target, lambda tx: self._sync(tx, target, fleet_wide=True))

    async def admit_new_workers(self) -> RefreshResult:
        """Bring workers that joined (or restarted) onto the current policy and open them;
        the rest of the fleet keeps serving."""
        await self.recover()
        if self.current is None:
            raise RuntimeError("no current policy yet: run refresh() first")
        current = self.current
        with tracing.span("admit new workers"):
            return await self._transaction(
                "admit", current, lambda tx: self._sync(tx, current, fleet_wide=False))

    async def recover(self) -> RefreshResult | None:
        """Recover the fleet's unfinished transactions (their coordinator crashed, or is
        taken over now): fence and pause every worker, roll forward when every worker holds
        the interrupted target, else back to the last verified policy; reopen only on one
        verified policy. None when there is nothing to recover."""
        await asyncio.to_thread(self._from_journal)
        found = await asyncio.to_thread(self.journal.unfinished, self.control.fleet,
                                        self.model, 1 << 62)
        if not found:
            return None
        last = found[-1]
        target = Policy(version=last.target.version, digest=last.target.digest,
                        path=last["target_path"], source=last["target_source"],
                        step=last["framework_step"])
        self.on_event(f"journal {self.journal.path}: refresh {last['id']} (epoch "
                      f"{last['fleet_epoch']}) to {target.version} never finished (state "
                      f"{last['state']}): recovering it")
        result = await self._transaction(
            "recovery", target, lambda tx: self._sync(tx, target, fleet_wide=True,
                                                      interrupted=found),
            recovery_of=last["id"])
        if result.decision != "fenced":
            what = (f"recovered by refresh {result.refresh_id} (epoch {result.epoch}): "
                    f"{result.reason}" if result.ok else
                    f"recovery {result.refresh_id} (epoch {result.epoch}) held the fleet: "
                    f"{result.reason}")
            for rec in found:
                await asyncio.to_thread(
                    self.journal.update, rec["id"], only_open=True, ended_at=time.time(),
                    decision="recovered" if result.ok else "abandoned",
                    reason=f"interrupted after state {rec['state']}; {what}")
        return result

    # ------------------------------------------------------------------ building blocks

    async def _policy(self, checkpoint, version, digest, probe, tensors, source=None) -> Policy:
        path = str(Path(checkpoint).resolve()) if checkpoint is not None else None
        if self.path is UpdatePath.VLLM_STAGED and source is None:
            if path is None:
                raise ValueError("the staged path needs a source (or a checkpoint path)")
            source = {"kind": "disk", "path": path}
        if digest is None and path is None and source is not None:
            from rlfleet.rl.staged import source_digest

            digest = await asyncio.to_thread(source_digest, source, version)
        if digest is None:
            if path is None:
                raise ValueError("give a checkpoint path or the target digest")
            from rlfleet.weights.digest import checkpoint_digest

            digest = await asyncio.to_thread(checkpoint_digest, Path(path))
        if probe is None and self.probe_from_checkpoint:
            if path is None or not (Path(path) / "config.json").exists():
                raise ValueError("probe_from_checkpoint needs a checkpoint directory with "
                                 "config.json")
            probe = await asyncio.to_thread(reference_probe, path, None, self.probe_tokens)
        if self.path is UpdatePath.VLLM_DISTRIBUTED and tensors is None and path is None:
            raise ValueError("the distributed path needs tensors or a checkpoint path")
        return Policy(version=version, digest=digest, path=path, probe=probe, tensors=tensors,
                      source=source)

    async def _each(self, workers: Sequence[FleetWorker], fn) -> None:
        await gather_all(fn(w) for w in workers)

    # ------------------------------------------------------------------ a transaction

    async def _transaction(self, kind: str, target: Policy,
                           lifecycle: Callable[[_Tx], Awaitable[tuple[Policy, str, str]]],
                           recovery_of: int | None = None) -> RefreshResult:
        """Take the next epoch, run `lifecycle` (it returns the policy the fleet serves
        verified, the decision and the reason; it raises RefreshHeld to hold the fleet),
        and record how it ended."""
        await asyncio.to_thread(self._from_journal)
        previous, control = self.current, self.control
        decision, reason, served = "held", "", None
        async with httpx.AsyncClient() as http:
            try:  # a store behind the fleet (a new in-memory journal) catches up with it
                floor = await control.newest_epoch(Channel(http, self.timeout, self.admin_token))
            except (RefreshHeld, httpx.HTTPError, ValueError) as e:
                log.warning("could not read the workers' fleet epochs: %r", e)
                floor = 0
            refresh_id, epoch = await asyncio.to_thread(
                self.journal.open_transaction, fleet=control.fleet, floor_epoch=floor,
                kind=kind, framework_step=target.step, model=self.model,
                update_path=control.path, target=target.identity, target_path=target.path,
                target_source=target.source, recovery_of=recovery_of,
                previous=previous.identity if previous else None)
            self.on_event(f"[refresh {refresh_id}] {kind} to {target.version} (step "
                          f"{target.step}), fleet epoch {epoch}")
            tx = _Tx(self, kind, refresh_id, epoch,
                     Channel(http, self.timeout, self.admin_token, epoch),
                     httpx.AsyncClient())  # the workers' HTTP request planes (probes)
            try:
                served, decision, reason = await lifecycle(tx)
                if kind == "admit":
                    self.verified |= {w.instance_id for w in tx.active()}
                else:
                    self.verified = {w.instance_id for w in tx.active()}
                self.current = served
                # waiting attempts expect the reopened policy before the gate opens
                self.gate.open((served.version, served.digest) if served else None)
            except RefreshHeld as e:
                tx.state = RefreshState.HELD
                decision, reason = "held", str(e)
            except FleetFenced as e:
                tx.state = RefreshState.FENCED
                decision, reason = "fenced", (f"fleet epoch {epoch} was fenced: {e}; another "
                                              "coordinator owns the fleet, nothing more was "
                                              "changed")
            except Exception as e:
                tx.state = RefreshState.HELD
                decision, reason = "held", f"coordinator error: {e!r}"
                log.exception("policy refresh %s failed", refresh_id)
            finally:
                await tx.requests.aclose()
            telemetry.REFRESH_TOTAL.labels(decision).inc()
        self.on_event(f"[refresh {refresh_id}] {decision}: {reason}")
        summaries = [w.summary() for w in tx.workers.values()]
        await asyncio.to_thread(
            self.journal.update, refresh_id, only_open=True, ended_at=time.time(),
            state=tx.state.value, decision=decision, reason=reason, steps=tx.steps,
            workers={str(w["instance_id"]): w for w in summaries},
            served=served.identity if served else None,
            served_path=served.path if served else None,
            served_source=served.source if served else None,
            verified_workers=sorted(self.verified) if served else [])
        if decision != "fenced":
            self.holdings.update({w.instance_id: w.holds
                                  for w in tx.workers.values() if w.holds})
        return RefreshResult(refresh_id, decision, reason, tx.state, summaries, tx.steps,
                             served or target, epoch, kind)

    # ------------------------------------------------------------------ synchronous

    async def _sync(self, tx: _Tx, target: Policy, *, fleet_wide: bool,
                    interrupted: list[dict[str, Any]] | None = None
                    ) -> tuple[Policy, str, str]:
        """The whole selected fleet gated while it moves to `target`. A recovery
        (`interrupted`: the unfinished transactions) decides after the pause which policy
        the fleet reopens on, from what the workers hold."""
        control, ch = self.control, tx.ch
        previous = self.current
        gate_reason = (f"recovering an interrupted refresh to {target.version}" if interrupted
                       else f"policy refresh to {target.version}")
        if control.stages and not interrupted:  # pulled while the fleet serves
            await tx.timed("stage", control.prepare(
                ch, target, set() if fleet_wide else set(self.verified)))
        if fleet_wide:
            self.gate.close(gate_reason)
        await tx.move(RefreshState.GATED)
        found = await tx.timed("resolve", control.discover(ch))
        tx.workers.update(found if fleet_wide else
                          {i: w for i, w in found.items() if i not in self.verified})
        await tx.record(intended_workers=sorted(tx.workers))
        if not tx.active():
            raise RefreshHeld("no worker to refresh" if fleet_wide else "no new worker to admit")
        await tx.move(RefreshState.RESOLVED)
        await tx.timed("gate", self._each(list(tx.workers.values()),
                                          lambda w: control.close(ch, w, gate_reason)))
        self._hook(tx, "gated")
        await tx.timed("pause", self._each(tx.active(),
                                           lambda w: control.pause(ch, w, self.pause_mode)))
        await self._membership(ch, tx.workers, gate_reason)
        await tx.move(RefreshState.PAUSED)
        self._hook(tx, "paused")
        decision, why = "reopened", ""
        to_apply = tx.active()
        if interrupted:
            target, to_apply, why = await self._choose(tx, target, previous, interrupted)
        try:
            await tx.timed("apply", self._apply_with_policy(tx, to_apply, target))
            if control.transfer_detail:
                tx.steps[-1]["transfer"] = control.transfer_detail
            await tx.move(RefreshState.APPLIED)
            await self._settle(tx, tx.active(), target)
            self._hook(tx, "before_reopen")
        except _Rollback as e:
            if previous is None:
                raise RefreshHeld(f"{e}; no previous policy to roll back to (none "
                                  f"verified in the journal {self.journal.path})") from e
            if not previous.sendable:
                raise RefreshHeld(f"{e}; the previous policy {previous.version} came "
                                  "from memory and cannot be sent again") from e
            await tx.move(RefreshState.ROLLING_BACK)
            await tx.timed("rollback", self._rollback(tx, previous, str(e)))
            target = previous
            await tx.move(RefreshState.ROLLED_BACK)
            decision, why = "rolled_back", f"{e}; rolled back to {previous.version}"
        ok_workers = tx.active()
        if len(ok_workers) < self.min_workers:
            raise RefreshHeld(f"only {len(ok_workers)} worker(s) verified on "
                              f"{target.version}; need {self.min_workers}")
        await tx.timed("reopen", self._each(ok_workers, lambda w: control.open(ch, w)))
        ok_workers = tx.active()  # a worker whose reopen failed stays out
        for w in ok_workers:
            w.status = "verified"
        if decision == "reopened":
            await tx.move(RefreshState.REOPENED)
            out = [w for w in tx.workers.values() if not w.active]
            why = ((why + "; ") if why else "") + (
                f"{len(ok_workers)} worker(s) verified on {target.version}"
                + (f"; kept out: {', '.join(f'{w.instance_id} ({w.reason})' for w in out)}"
                   if out else ""))
        return target, decision, why

    async def _settle(self, tx: _Tx, ws: list[FleetWorker], target: Policy) -> None:
        """After the transfer: reset the cache, verify, resume, probe (each step excludes
        the workers that fail it)."""
        control, ch = self.control, tx.ch
        await tx.timed("reset_cache", self._each(ws, lambda w: control.reset_cache(ch, w)))
        await tx.move(RefreshState.CACHE_RESET)
        await tx.timed("verify", self._verify_all(tx, tx.active(ws), target))
        await tx.move(RefreshState.VERIFIED)
        self._hook(tx, "verified")
        await tx.timed("resume", self._each(tx.active(ws), lambda w: control.resume(ch, w)))
        await tx.move(RefreshState.RESUMED)
        answers = await tx.timed("probe", self._probe_all(tx, tx.active(ws), target))
        tx.reference += answers
        await tx.move(RefreshState.PROBED)

    def _hook(self, tx: _Tx, point: str) -> None:
        if tx.kind == "refresh":
            _test_hook(point)

    async def _choose(self, tx: _Tx, interrupted_target: Policy, previous: Policy | None,
                      interrupted: list[dict[str, Any]]
                      ) -> tuple[Policy, list[FleetWorker], str]:
        """A recovery's decision, with every worker fenced and paused: forward to the
        interrupted target when every worker holds it, else back to the last verified
        policy (forward by finishing the transfer when there is none); which workers still
        need it; and why, for the journal."""
        await tx.timed("inspect", self._each(tx.active(),
                                             lambda w: self.control.inspect(tx.ch, w)))
        ws = tx.active()
        last = interrupted[-1]
        was = (f"refresh {last['id']} (epoch {last['fleet_epoch']}) to "
               f"{interrupted_target.version}, interrupted after state {last['state']}")
        held = ", ".join(f"{w.instance_id} holds {w.holds.version if w.holds else None}" for w in ws)
        if ws and all(interrupted_target.held_by(w) for w in ws):
            chosen, how = interrupted_target, "rolled forward: every worker holds it"
        elif previous is not None and previous.sendable:
            chosen, how = previous, f"rolled back to {previous.version} ({held})"
        elif interrupted_target.sendable:
            chosen, how = interrupted_target, (f"rolled forward (no verified policy to return "
                                               f"to; {held})")
        else:
            raise RefreshHeld(f"recovering {was}: the workers differ ({held}) and neither the "
                              "target nor a verified policy can be sent again")
        self.on_event(f"[refresh {tx.id}] recovering {was}: {how}")
        await tx.record(reason=f"recovering {was}: {how}")
        return chosen, [w for w in ws if not chosen.held_by(w)], f"recovered {was}: {how}"

    # ------------------------------------------------------------------ rolling

    async def _rolling(self, tx: _Tx, target: Policy) -> tuple[Policy, str, str]:
        """Waves of workers leave routing, move to the target and come back while the
        others serve. Refused before anything changes when a serving worker would lag the
        target by more than max_lag steps, or when a wave would leave fewer than
        min_serving workers serving."""
        control, ch = self.control, tx.ch
        if control.stages:
            await tx.timed("stage", control.prepare(ch, target, set()))
        found = await tx.timed("resolve", control.discover(ch))
        tx.workers.update(found)
        await tx.record(intended_workers=sorted(tx.workers))
        if not tx.active():
            raise RefreshHeld("no worker to refresh")
        await tx.move(RefreshState.RESOLVED)
        await tx.timed("inspect", self._each(tx.active(), lambda w: control.inspect(ch, w)))
        ws = tx.active()
        unknown = [w.instance_id for w in ws if w.holds is None or w.holds.step is None]
        if unknown:
            raise RefreshHeld(f"a rolling refresh needs each serving worker's fleet step; "
                              f"worker(s) {unknown} report none: refresh the fleet "
                              "synchronously once")
        lag = target.step - min(w.holds.step for w in ws)
        if lag > self.max_lag:
            raise RefreshHeld(f"step {target.step} is {lag} steps ahead of a serving worker; "
                              f"a rolling refresh keeps every serving worker within "
                              f"max_lag={self.max_lag}: refresh synchronously, or in smaller "
                              "steps")
        pending = [w for w in ws if not target.held_by(w)]
        gate_reason = f"rolling refresh to {target.version}"
        waves = 0
        while pending:
            room = len(tx.active()) - self.min_serving
            size = min(room, self.wave_size or room, len(pending))
            if size < 1:
                raise RefreshHeld(f"{len(tx.active())} worker(s) serve; taking one out would "
                                  f"leave fewer than min_serving={self.min_serving} "
                                  f"({len(pending)} not updated)")
            batch, pending = pending[:size], pending[size:]
            waves += 1
            tx.wave = waves
            await tx.timed("gate", self._each(batch,
                                              lambda w: control.close(ch, w, gate_reason)))
            await tx.timed("pause", self._each(tx.active(batch),
                                               lambda w: control.pause(ch, w, self.pause_mode)))
            await tx.move(RefreshState.PAUSED)
            await tx.timed("apply", self._apply_with_policy(tx, tx.active(batch), target))
            await tx.move(RefreshState.APPLIED)
            await self._settle(tx, tx.active(batch), target)
            await tx.timed("reopen", self._each(tx.active(batch),
                                                lambda w: control.open(ch, w)))
            for w in tx.active(batch):
                w.status = "verified"
            await tx.move(RefreshState.WAVE_REOPENED)
            pending = tx.active(pending)
        tx.wave = None
        ok_workers = tx.active()
        if len(ok_workers) < self.min_workers:
            raise RefreshHeld(f"only {len(ok_workers)} worker(s) verified on "
                              f"{target.version}; need {self.min_workers}")
        for w in ok_workers:
            w.status = "verified"
        await tx.move(RefreshState.REOPENED)
        out = [w for w in tx.workers.values() if not w.active]
        return target, "reopened", (
            f"{len(ok_workers)} worker(s) verified on {target.version} in {waves} wave(s) "
            f"(max_lag {self.max_lag}, min_serving {self.min_serving})"
            + (f"; kept out: {', '.join(f'{w.instance_id} ({w.reason})' for w in out)}"
               if out else ""))

    # ------------------------------------------------------------------ fleet-level steps

    async def _membership(self, ch: Channel, workers: dict[int, FleetWorker],
                          gate_reason: str) -> None:
        """Membership changes before transfer: refresh the set."""
        if not self.control.dynamic_membership:
            return
        now = await self.control.discover(ch)
        for iid, w in workers.items():
            if iid not in now and w.active:
                w.exclude("left discovery before the transfer", "missing")
        for iid, w in now.items():
            if iid not in workers and w.active and iid not in self.verified:
                workers[iid] = w
                await self.control.close(ch, w, gate_reason)
                await self.control.pause(ch, w, self.pause_mode)
                self.on_event(f"worker {iid} joined during the refresh: included")

    async def _apply_with_policy(self, tx: _Tx, ws: list[FleetWorker], target: Policy) -> None:
        if not ws:
            return
        ch = tx.ch
        if _test_hook_wants("apply_half") and tx.kind == "refresh" and len(ws) > 1:
            # tests only: half the workers get the target, then the hook stops this process
            half = len(ws) // 2
            failed = await self.control.transfer(ch, ws[:half], target)
            self._hook(tx, "apply_half")
            failed += await self.control.transfer(ch, ws[half:], target)
        else:
            failed = await self.control.transfer(ch, ws, target)
        tries = 0
        while failed and self.on_failure is OnFailure.RETRY and tries < self.retries:
            tries += 1
            self.on_event(f"retrying the transfer to {len(failed)} worker(s) ({tries}/{self.retries})")
            # a distributed group is rebuilt around the workers that still need it
            failed = await self.control.transfer(ch, failed, target)
        if not failed:
            return
        why = (f"transfer failed on {len(failed)} of {len(ws)} worker(s): "
               + "; ".join(f"{w.instance_id}: {w.reason}" for w in failed))
        if self.on_failure is OnFailure.ROLLBACK and tx.kind == "refresh":
            raise _Rollback(why)
        if self.mode is RefreshMode.ROLLING and tx.kind == "refresh":
            for w in failed:
                w.exclude(w.reason or "transfer failed")
            raise RefreshHeld(why + "; the rolling refresh stops here: those workers stay out, "
                              "the others keep serving")
        raise RefreshHeld(why + f" (policy {self.on_failure.value}: the fleet stays gated)")

    async def _verify_all(self, tx: _Tx, ws: list[FleetWorker], target: Policy) -> None:
        found = await gather_all(self.control.verify(tx.ch, w, target) for w in ws)
        mismatched = [m for m in found if m]
        if mismatched:
            raise RefreshHeld(f"version check differs on {', '.join(mismatched)}: a synchronous "
                              f"fleet does not reopen (target {target.version} / {target.digest})")

    async def _probe_all(self, tx: _Tx, ws: list[FleetWorker], target: Policy) -> list[Answer]:
        """Post-update generation on every worker (see rlfleet.rl.probe): each must
        reproduce the expected probe, or, without one, all must agree with each other (and
        with the workers of earlier waves). The answers of the workers that passed."""
        answers = [a for a in await gather_all(
            self._probe_one(tx.requests, w, target) for w in ws) if a is not None]
        if target.probe is not None:
            by_id = {w.instance_id: w for w in ws}
            for a in answers:
                why = check_expected(a, target.probe)
                if why:
                    by_id[a.worker].exclude(why)
            return [a for a in answers if by_id[a.worker].active]
        why = disagreement(answers + tx.reference)
        if why:
            raise RefreshHeld(why)
        return answers

    async def _probe_one(self, requests: httpx.AsyncClient, w: FleetWorker,
                         target: Policy) -> Answer | None:
        """One worker's probe answer, straight from its request plane (None: excluded).
        An expected probe is teacher-forced: the worker prefills prompt + expected[:-1]
        (prompt logprobs: each expected token, its rank and logprob) and generates the last
        token greedily, so every expected token is checked in one decode step."""
        if not w.request_url:
            w.exclude("no request-plane URL for the post-update generation")
            return None
        p = target.probe
        rid = f"refresh-probe-{uuid.uuid4().hex[:12]}"
        if p is not None:
            req = GenerateRequest(request_id=rid, prompt_token_ids=p.prompt + p.token_ids[:-1],
                                  stream=False, sampling=SamplingOptions(
                                      temperature=0.0, max_tokens=1, logprobs=0,
                                      prompt_logprobs=0, ignore_eos=True))
        else:  # the worker's own first choice at every prompt position, then one token
            req = GenerateRequest(request_id=rid, prompt=self.probe_text, stream=False,
                                  sampling=SamplingOptions(
                                      temperature=0.0, max_tokens=1, logprobs=0,
                                      prompt_logprobs=1, ignore_eos=True))
        req.traceparent = tracing.outgoing()  # the worker's span joins the probe phase's
        try:
            events = await generate_over_http(requests, w.request_url, req, self.timeout,
                                              self.admin_token)
        except WorkerError as e:
            w.record("probe", "generate", e.status, e.body)
            w.exclude(f"post-update generation failed: HTTP {e.status} {e}")
            return None
        w.record("probe", "generate", 200, events[-1] if events else None)
        if not events or not events[-1].get("done"):
            w.exclude("post-update generation failed: the stream ended early")
            return None
        head = events[0]
        if head.get("weight_digest") != target.digest:
            w.exclude(f"post-update generation ran on digest {head.get('weight_digest')}, "
                      f"not the target {target.digest}")
            return None
        tokens: list[tuple[int, int | None, float | None]] = []
        prompt_lps = events[-1].get("prompt_logprobs") or []
        if p is not None:
            for t, e in zip(p.token_ids[:-1], prompt_lps[len(p.prompt):], strict=False):
                entry = (e or {}).get(str(t), {})
                tokens.append((t, entry.get("rank"), entry.get("logprob")))
        else:
            for e in prompt_lps[1:]:
                first = [(int(t), v.get("rank"), v.get("logprob")) for t, v in (e or {}).items()
                         if v.get("rank") == 1]
                tokens.append(first[0] if first else (-1, None, None))
        tokens += [(lp["token_id"], lp.get("rank"), lp.get("logprob")) for ev in events
                   for c in ev.get("choices", []) for lp in (c.get("logprobs") or [])]
        prompt = head.get("prompt_token_ids") or list(req.prompt_token_ids or [])
        return Answer(w.instance_id, prompt, tokens, tolerance(w.dtype, self.tolerance))

    async def _rollback(self, tx: _Tx, previous: Policy, why: str) -> None:
        """Reapply the previous policy to every worker still in the set and verify it the
        same way; a worker that fails any step stays out."""
        control, ch = self.control, tx.ch
        ws = tx.active()
        self.on_event(f"rolling back {len(ws)} worker(s) to {previous.version}: {why}")
        failed = await control.transfer(ch, ws, previous)
        for w in failed:
            w.exclude(f"rollback transfer failed: {w.reason}")
        await self._each(tx.active(ws), lambda w: control.reset_cache(ch, w))
        await self._verify_all(tx, tx.active(ws), previous)
        await self._each(tx.active(ws), lambda w: control.resume(ch, w))
        tx.reference = []
        await self._probe_all(tx, tx.active(ws), previous)
