"""PolicyRefresh: move a whole fleet to one target policy, or leave it gated with a recorded
reason. The lifecycle (docs/contract.md, "Policy refresh"):

  gate → resolve → pause → (re-resolve) → apply → reset cache → verify → resume → probe → reopen

Failure handling follows the failure table of the same section:
a worker whose pause, cache reset, resume or probe fails is excluded and stays gated; a
worker gone from discovery is dropped; a transfer that fails after peers succeeded leaves
the fleet gated and is handled by one explicit policy (retry | rollback | hold); a version
or digest that differs keeps a synchronous fleet closed.

Every refresh is a fleet transaction, recorded in the journal (rlfleet.journal), which
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

The lifecycle calls one `WorkerControl` per worker flavour (rlfleet.refresh.control) and judges
the post-update probe with rlfleet.refresh.probe."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from rlfleet.journal import RefreshJournal, open_journal
from rlfleet.protocol.identity import PolicyIdentity
from rlfleet.refresh import committed as committed_policy
from rlfleet.refresh import recovery, telemetry
from rlfleet.refresh.adapter import VllmAdapterControl
from rlfleet.refresh.config import RefreshConfig, RefreshMode, UpdatePath
from rlfleet.refresh.control import (
    Channel,
    FleetFenced,
    FleetWorker,
    RefreshHeld,
    SglangControl,
    VllmControl,
    WorkerControl,
    for_each,
)
from rlfleet.refresh.hooks import NO_HOOKS, RefreshHooks
from rlfleet.refresh.policy import Policy
from rlfleet.refresh.probe import Probe, reference_probe
from rlfleet.refresh.relay import RelayTree
from rlfleet.refresh.staged import VllmStagedControl, source_digest
from rlfleet.refresh.transaction import RefreshResult, RefreshState, Transaction
from rlfleet.refresh.waves import Wave, Waves
from rlfleet.rollout.gate import RolloutGate
from rlfleet.runtime import tracing
from rlfleet.runtime.admin_client import AdminConnections
from rlfleet.runtime.limits import raise_fd_limit

log = logging.getLogger("rlfleet.refresh")

#: what a transaction's lifecycle returns: the policy the fleet serves verified, the
#: decision, and the reason (it raises RefreshHeld to hold the fleet)
Lifecycle = Callable[[Transaction], Awaitable[tuple[Policy, str, str]]]


#: the oldest generation's threshold while a transaction runs: no full collection
_QUIET_THRESHOLD = 1 << 30
_quiet_lock = threading.Lock()
_quiet: list[Any] = [0, None]  # transactions under way in this process; the threshold before


@contextlib.contextmanager
def no_full_collection() -> Iterator[None]:
    """No full collection of the garbage collector while a transaction runs (the oldest
    generation's threshold raised; the young generations are collected as always): a
    refresh of a thousand workers keeps a few million objects alive until it ends (each
    worker's calls and replies, for the journal), and each full collection walked them
    all and the process's whole heap besides (0.2-0.5 s each, a few per refresh). The
    threshold is put back when the last transaction of the process ends (unless someone
    changed it meanwhile); cyclic garbage that reached the oldest generation is then
    collected as before, by the next full collection."""
    with _quiet_lock:
        _quiet[0] += 1
        if _quiet[0] == 1:
            _quiet[1] = gc.get_threshold()
            gc.set_threshold(*_quiet[1][:2], _QUIET_THRESHOLD)
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet[0] -= 1
            now = gc.get_threshold()
            if _quiet[0] == 0 and len(now) > 2 and now[2] == _QUIET_THRESHOLD:
                gc.set_threshold(*now[:2], _quiet[1][2])


@functools.cache
def _tls(peer: str) -> ssl.SSLContext:
    """The TLS context of the process's coordinators toward the RL listener (as httpx makes
    its default one) or toward workers (as AdminConnections makes its default one), made
    once: loading a CA bundle costs tens of milliseconds, twice a transaction otherwise."""
    return httpx.create_ssl_context() if peer == "listener" else ssl.create_default_context()


def make_control(config: RefreshConfig) -> WorkerControl:
    """The control of the workers `config.path` updates."""
    if config.path is UpdatePath.SGLANG_DISK:
        return SglangControl(config.sglang_workers)
    if config.path is UpdatePath.VLLM_STAGED:
        return VllmStagedControl(config.rl_url, config.model, fanout=config.stage_fanout)
    if config.path is UpdatePath.VLLM_ADAPTER:
        return VllmAdapterControl(config.rl_url, config.model, config.adapter)
    return VllmControl(config.rl_url, config.model,
                       distributed=config.path is UpdatePath.VLLM_DISTRIBUTED,
                       backend=config.transfer_backend, master_address=config.master_address,
                       master_port=config.master_port)


class PolicyRefresh:
    """Refreshes one fleet's policy. Keep one instance per fleet: it remembers the policy the
    fleet is on (for rollback and for admitting replacement workers), and takes it again
    from the journal before every transaction (the journal is the source of truth).

    While `refresh`, `admit_new_workers` or `recover` runs, the garbage collector makes
    no full collection (`no_full_collection`: the young generations are collected as
    always), which in a refresh of a thousand workers took more CPU than the rest of the
    coordinator's work; the collector's thresholds are put back when it ends."""

    def __init__(self, rl_url: str | None = None, *, config: RefreshConfig | None = None,
                 journal: RefreshJournal | str | Path | None = None,
                 rollout_gate: RolloutGate | None = None,
                 on_event: Callable[[str], None] | None = None, current: Policy | None = None,
                 hooks: RefreshHooks = NO_HOOKS, **options: Any) -> None:
        """How it refreshes: `config`, with `rl_url` and `options` (any of RefreshConfig's
        fields) set in it; `PolicyRefresh(url, model="m", mode="rolling")` is
        `PolicyRefresh(config=RefreshConfig(rl_url=url, model="m", mode="rolling"))`.
        `journal`: an open journal, or where one is (config.journal). `rollout_gate`: the
        trainer-side gate its rollouts wait on (closed while the fleet changes). `current`:
        the policy the fleet serves, when the journal does not know it. `hooks`: tests
        only (rlfleet.refresh.hooks)."""
        if rl_url is not None:
            options["rl_url"] = rl_url
        if journal is not None and not isinstance(journal, RefreshJournal):
            options["journal"] = journal
        self.config = config.replace(**options) if config else RefreshConfig(**options)
        self.control = make_control(self.config)
        self.journal = open_journal(journal if isinstance(journal, RefreshJournal)
                                    else self.config.journal)
        self.rollout_gate = rollout_gate or RolloutGate()
        self.on_event = on_event or (lambda msg: log.info("%s", msg))
        self.waves = Waves(self.control, self.config, hooks, self.on_event)
        self.current = current
        self.verified: set[int] = set()  # workers verified on self.current
        # what each worker was last seen holding ({version, digest, step}), kept in the journal
        self.holdings: dict[int, PolicyIdentity] = {}
        self.relays: RelayTree | None = None  # the last transaction's relay tree
        # the committed-policy record this coordinator last wrote (epoch, refresh, policies)
        self._published: tuple[Any, ...] | None = None
        self._from_journal(announce=True)

    @property
    def mode(self) -> RefreshMode:
        return self.config.mode

    def _from_journal(self, announce: bool = False) -> None:
        """Take the fleet's last verified policy from the journal (rlfleet.refresh.recovery)."""
        found = recovery.last_verified(self.journal, self.control.fleet, self.config.model)
        self.holdings = found.holdings
        if found.policy is None:
            return
        self.current, self.verified = found.policy, found.workers
        if announce:
            c = self.current
            self.on_event(f"journal {self.journal.path}: last verified policy {c.version} "
                          f"({c.digest}, step {c.step}) on {len(self.verified)} worker(s), "
                          f"refresh {found.refresh_id}")

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
        with no_full_collection(), tracing.span("policy refresh",
                                                attributes={"rlfleet.version": version}):
            target = await self._policy(checkpoint, version, digest, probe, tensors, source)
            await self.recover()
            target = target.at_step(self.next_step(step))
            if self.mode is RefreshMode.ROLLING:
                return await self._transaction("refresh", target,
                                               lambda tx: self._rolling(tx, target))
            return await self._transaction(
                "refresh", target, lambda tx: self._sync(tx, target, fleet_wide=True))

    async def admit_new_workers(self) -> RefreshResult:
        """Bring workers that joined (or restarted) onto the current policy and open them;
        the rest of the fleet keeps serving."""
        with no_full_collection():
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
        verified policy (rlfleet.refresh.recovery). None when there is nothing to recover."""
        with no_full_collection():
            return await self._recover()

    async def _recover(self) -> RefreshResult | None:
        await asyncio.to_thread(self._from_journal)
        found = await recovery.unfinished(self.journal, self.control.fleet, self.config.model)
        if not found:
            return None
        last = found[-1]
        target = recovery.interrupted_target(last)
        self.on_event(f"journal {self.journal.path}: refresh {last['id']} (epoch "
                      f"{last['fleet_epoch']}) to {target.version} never finished (state "
                      f"{last['state']}): recovering it")
        result = await self._transaction(
            "recovery", target, lambda tx: self._sync(tx, target, fleet_wide=True,
                                                      interrupted=found),
            recovery_of=last["id"])
        await recovery.close_interrupted(self.journal, found, result)
        return result

    # ------------------------------------------------------------------ building blocks

    async def _policy(self, checkpoint: str | Path | None, version: str, digest: str | None,
                      probe: Probe | None,
                      tensors: Callable[[], Sequence[tuple[str, Any]]] | None,
                      source: dict[str, Any] | None = None) -> Policy:
        path = str(Path(checkpoint).resolve()) if checkpoint is not None else None
        cfg = self.config
        staged = cfg.path is UpdatePath.VLLM_STAGED
        if staged and source is None and path is not None:
            source = {"kind": "disk", "path": path}
        if staged and source is None and digest is None:
            raise ValueError("the staged path needs a checkpoint directory, a source, or the "
                             "version's digest (workers that hold it are its peers)")
        if digest is None and path is None and source is not None and not staged:
            digest = await asyncio.to_thread(source_digest, source, version)
        if digest is None and not staged:  # staged: the workers' digest (`_staged_identity`)
            if path is None:
                raise ValueError("give a checkpoint path or the target digest")
            from rlfleet.weights.digest import checkpoint_digest  # torch: only when needed

            digest = await asyncio.to_thread(checkpoint_digest, Path(path))
        if probe is None and cfg.probe_from_checkpoint:
            if path is None or not (Path(path) / "config.json").exists():
                raise ValueError("probe_from_checkpoint needs a checkpoint directory with "
                                 "config.json")
            probe = await asyncio.to_thread(reference_probe, path, None, cfg.probe_tokens)
        if cfg.path is UpdatePath.VLLM_DISTRIBUTED and tensors is None and path is None:
            raise ValueError("the distributed path needs tensors or a checkpoint path")
        return Policy(PolicyIdentity(version=version, digest=digest, adapter=cfg.adapter),
                      path=path,
                      tensors=tensors, source=source, probe=probe)

    # ------------------------------------------------------------------ a transaction

    async def _transaction(self, kind: str, target: Policy, lifecycle: Lifecycle,
                           recovery_of: int | None = None) -> RefreshResult:
        """Take the next epoch, run `lifecycle`, and record how it ended."""
        await asyncio.to_thread(self._from_journal)
        decision, reason, served = "held", "", None
        async with self._client() as http, AdminConnections(tls=_tls("workers")) as workers:
            tx = await self._begin(kind, target, recovery_of, http, workers)
            try:
                served, decision, reason = await lifecycle(tx)
                if kind == "admit":
                    self.verified |= {w.instance_id for w in tx.active()}
                else:
                    self.verified = {w.instance_id for w in tx.active()}
                self.current = served
                # waiting attempts expect the reopened policy before the gate opens
                self.rollout_gate.open((served.version, served.digest) if served else None)
            except RefreshHeld as e:
                tx.state = RefreshState.HELD
                decision, reason = "held", str(e)
            except FleetFenced as e:
                tx.state = RefreshState.FENCED
                decision, reason = "fenced", (f"fleet epoch {tx.epoch} was fenced: {e}; "
                                              "another coordinator owns the fleet, nothing "
                                              "more was changed")
            except Exception as e:
                tx.state = RefreshState.HELD
                decision, reason = "held", f"coordinator error: {e!r}"
                log.exception("policy refresh %s failed", tx.id)
            finally:
                await tx.requests.aclose()
            telemetry.REFRESH_TOTAL.labels(decision).inc()
        self.on_event(f"[refresh {tx.id}] {decision}: {reason}")
        return await self._end(tx, target, served, decision, reason)

    def _client(self) -> httpx.AsyncClient:
        """The client for the frontend's RL listener (the workers' own: AdminConnections, at
        most one kept-alive connection each; the descriptor limit is raised for them)."""
        raise_fd_limit()
        return httpx.AsyncClient(verify=_tls("listener"))

    def _channel(self, http: httpx.AsyncClient, workers: AdminConnections,
                 epoch: int | None = None) -> Channel:
        cfg = self.config
        relay = None if cfg.relay_threshold is None else RelayTree(
            cfg.relay_threshold, cfg.relay_fanout, on_event=self.on_event)
        self.relays = relay  # the last transaction's: how each phase's calls went (hops)
        # an adapter's epochs are its own, in the LoRA routes' bodies: the worker's fleet
        # epoch (the base model's coordinators') never fences them, nor they it
        return Channel(http, cfg.timeout, cfg.admin_token, epoch, workers,
                       epoch_header=cfg.adapter is None, concurrency=cfg.concurrency,
                       phase_timeout=cfg.phase_timeout, relay=relay)

    async def _begin(self, kind: str, target: Policy, recovery_of: int | None,
                     http: httpx.AsyncClient, workers: AdminConnections) -> Transaction:
        """Open the transaction's record in the journal, at the fleet's next epoch."""
        previous, control, cfg = self.current, self.control, self.config
        try:  # a store behind the fleet (a new in-memory journal) catches up with it
            floor = await control.newest_epoch(self._channel(http, workers))
        except (RefreshHeld, httpx.HTTPError, ValueError) as e:
            log.warning("could not read the workers' fleet epochs: %r", e)
            floor = 0
        refresh_id, epoch = await asyncio.to_thread(
            self.journal.open_transaction, fleet=control.fleet, floor_epoch=floor,
            kind=kind, framework_step=target.step, model=cfg.model,
            update_path=control.path, target=target.identity, target_path=target.path,
            target_source=target.source, recovery_of=recovery_of,
            previous=previous.identity if previous else None)
        self.on_event(f"[refresh {refresh_id}] {kind} to {target.version} (step "
                      f"{target.step}), fleet epoch {epoch}")
        # workers serving either policy stay routable while the transaction runs
        await self._publish(epoch, refresh_id, previous.identity if previous else None,
                            target.identity)
        return Transaction(kind, refresh_id, epoch, self._channel(http, workers, epoch),
                           workers,  # the workers' HTTP request planes (probes) too
                           self.journal, self.on_event, previous)

    async def _end(self, tx: Transaction, target: Policy, served: Policy | None,
                   decision: str, reason: str) -> RefreshResult:
        """Record how the transaction ended; its result."""
        summaries = [w.summary() for w in tx.workers.values()]
        await asyncio.to_thread(
            self.journal.update, tx.id, only_open=True, ended_at=time.time(),
            state=tx.state.value, decision=decision, reason=reason, steps=tx.steps,
            workers={str(w["instance_id"]): w for w in summaries},
            served=served.identity if served else None,
            served_path=served.path if served else None,
            served_source=served.source if served else None,
            verified_workers=sorted(self.verified) if served else [])
        if decision != "fenced":
            self.holdings.update({w.instance_id: w.holds
                                  for w in tx.workers.values() if w.holds})
        if served is not None and decision != "fenced":
            await self._publish(tx.epoch, tx.id, served.identity, None)
        return RefreshResult(tx.id, decision, reason, tx.state, summaries, tx.steps,
                             served or target, tx.epoch, tx.kind)

    async def _publish(self, epoch: int, refresh_id: int, committed: PolicyIdentity | None,
                       admitting: PolicyIdentity | None) -> None:
        """The fleet's committed policy, where every frontend routes by it. An adapter's
        refresh publishes none: the record names the base model's policy, and an adapter is
        fenced per adapter on the workers (rlfleet.refresh.adapter) instead."""
        control, cfg = self.control, self.config
        if any(p is not None and p.adapter for p in (committed, admitting)):
            return
        record = (epoch, refresh_id, committed, admitting)
        if record == self._published:  # once per change: the commit wrote what the end says
            return
        if await committed_policy.publish(
                cfg.discovery or control.discovery_url, control.namespace,
                {cfg.model} if cfg.model else control.models, epoch=epoch,
                refresh_id=refresh_id, committed=committed, admitting=admitting,
                seen_epoch=control.seen_epoch, on_event=self.on_event):
            self._published = record

    async def _prepare(self, tx: Transaction, target: Policy, skip: set[int]) -> Policy:
        """Before the gate, while the fleet serves: the target staged on the workers (but
        `skip`), and an adapter's version loaded beside the serving one probed. The target,
        with its digest when the caller gave none (`_staged_identity`)."""
        await tx.timed("stage", self.control.prepare(tx.ch, target, skip))
        if target.digest is None:
            target = await self._staged_identity(tx, target)
        await tx.timed("probe_beside", self.waves.probe_beside(tx, target))
        return target

    async def _staged_identity(self, tx: Transaction, target: Policy) -> Policy:
        """`target` with the content digest its caller did not give: the one every worker
        computed as it staged the version (each tensor hashed as it landed: the version is
        read once, by the workers), else, when none staged it (every one installs from
        disk), the checkpoint's, computed here. Recorded in the journal and in the committed
        policy's record before the gate."""
        control = self.control
        try:
            digest = control.staged_digest()
        except RefreshHeld:
            await control.release(tx.ch)
            raise
        if digest is None:
            if target.path is None:
                raise RefreshHeld(f"no worker staged {target.version} and it has no checkpoint "
                                  "directory to digest: give its digest")
            from rlfleet.weights.digest import checkpoint_digest  # torch: only when needed

            digest = await tx.timed("digest", asyncio.to_thread(checkpoint_digest,
                                                                Path(target.path)))
        target = target.with_digest(digest)
        await asyncio.to_thread(self.journal.update, tx.id, only_open=True,
                                target=target.identity)
        await self._publish(tx.epoch, tx.id, tx.previous.identity if tx.previous else None,
                            target.identity)
        return target

    # ------------------------------------------------------------------ synchronous

    async def _sync(self, tx: Transaction, target: Policy, *, fleet_wide: bool,
                    interrupted: list[dict[str, Any]] | None = None
                    ) -> tuple[Policy, str, str]:
        """The whole selected fleet gated while it moves to `target`, in one wave. A
        recovery (`interrupted`: the unfinished transactions) decides after the pause which
        policy the fleet reopens on, from what the workers hold."""
        control, ch = self.control, tx.ch
        close_reason = (f"recovering an interrupted refresh to {target.version}" if interrupted
                        else f"policy refresh to {target.version}")
        if control.stages and not interrupted:  # pulled while the fleet serves
            target = await self._prepare(tx, target, set() if fleet_wide else set(self.verified))
        if fleet_wide:
            self.rollout_gate.close(close_reason)
        await tx.move(RefreshState.GATED)
        found = await tx.timed("resolve", control.discover(ch))
        tx.workers.update(found if fleet_wide else
                          {i: w for i, w in found.items() if i not in self.verified})
        await tx.record(intended_workers=sorted(tx.workers))
        if not tx.active():
            raise RefreshHeld("no worker to refresh" if fleet_wide else "no new worker to admit")
        await tx.move(RefreshState.RESOLVED)
        recovered = ""

        async def after_pause(wave: Wave) -> None:
            nonlocal recovered
            await self._membership(tx, close_reason)
            wave.workers = list(tx.workers.values())
            if interrupted:
                wave.target, wave.to_apply, recovered = await recovery.choose(
                    tx, control, target, tx.previous, interrupted, self.on_event)

        async def before_commit(wave: Wave) -> None:  # one call per worker: joined ones too
            await self._membership(tx, close_reason, settle_joined=False)
            wave.workers = list(tx.workers.values())

        async def commit(wave: Wave) -> None:  # before the verified workers reopen
            await self._publish(tx.epoch, tx.id, wave.target.identity, None)

        wave = Wave(list(tx.workers.values()), target, close_reason, after_pause=after_pause,
                    before_reopen=commit, before_commit=before_commit,
                    may_commit=not interrupted)
        ok_workers = await self.waves.run(tx, wave, min_workers=self.config.min_workers)
        if wave.rolled_back:
            return wave.target, "rolled_back", wave.rolled_back
        await tx.move(RefreshState.REOPENED)
        out = [w for w in tx.workers.values() if not w.active]
        why = ((recovered + "; ") if recovered else "") + (
            f"{len(ok_workers)} worker(s) verified on {wave.target.version}"
            + (f"; kept out: {', '.join(f'{w.instance_id} ({w.reason})' for w in out)}"
               if out else ""))
        return wave.target, "reopened", why

    async def _membership(self, tx: Transaction, close_reason: str, *,
                          settle_joined: bool = True) -> None:
        """Membership changes before transfer: workers gone from discovery are dropped,
        workers that joined are included (closed and paused first with `settle_joined`; else
        their commit call does both)."""
        control = self.control
        if not control.dynamic_membership:
            return
        now = await control.discover(tx.ch)
        for iid, w in tx.workers.items():
            if iid not in now and w.active:
                w.exclude("left discovery before the transfer", "missing")
        for iid, w in now.items():
            if iid not in tx.workers and w.active and iid not in self.verified:
                tx.workers[iid] = w
                if settle_joined:
                    await control.close(tx.ch, w, close_reason)
                    await control.pause(tx.ch, w, self.config.pause_mode)
                self.on_event(f"worker {iid} joined during the refresh: included")

    # ------------------------------------------------------------------ rolling

    async def _rolling(self, tx: Transaction, target: Policy) -> tuple[Policy, str, str]:
        """Waves of workers leave routing, move to the target and come back while the
        others serve. Refused before anything changes when a serving worker would lag the
        target by more than max_lag steps, or when a wave would leave fewer than
        min_serving workers serving."""
        control, ch, cfg = self.control, tx.ch, self.config
        if control.stages:
            target = await self._prepare(tx, target, set())
        found = await tx.timed("resolve", control.discover(ch))
        tx.workers.update(found)
        await tx.record(intended_workers=sorted(tx.workers))
        if not tx.active():
            raise RefreshHeld("no worker to refresh")
        await tx.move(RefreshState.RESOLVED)
        await tx.timed("inspect", self._inspect_all(tx))
        pending = self._lagging(tx.active(), target)
        close_reason = f"rolling refresh to {target.version}"
        waves = 0
        while pending:
            room = len(tx.active()) - cfg.min_serving
            size = min(room, cfg.wave_size or room, len(pending))
            if size < 1:
                raise RefreshHeld(f"{len(tx.active())} worker(s) serve; taking one out would "
                                  f"leave fewer than min_serving={cfg.min_serving} "
                                  f"({len(pending)} not updated)")
            batch, pending = pending[:size], pending[size:]
            waves += 1
            tx.wave = waves
            await self.waves.run(tx, Wave(batch, target, close_reason))
            await tx.move(RefreshState.WAVE_REOPENED)
            pending = tx.active(pending)
        tx.wave = None
        ok_workers = tx.active()
        if len(ok_workers) < cfg.min_workers:
            raise RefreshHeld(f"only {len(ok_workers)} worker(s) verified on "
                              f"{target.version}; need {cfg.min_workers}")
        for w in ok_workers:
            w.status = "verified"
        await tx.move(RefreshState.REOPENED)
        out = [w for w in tx.workers.values() if not w.active]
        return target, "reopened", (
            f"{len(ok_workers)} worker(s) verified on {target.version} in {waves} wave(s) "
            f"(max_lag {cfg.max_lag}, min_serving {cfg.min_serving})"
            + (f"; kept out: {', '.join(f'{w.instance_id} ({w.reason})' for w in out)}"
               if out else ""))

    async def _inspect_all(self, tx: Transaction) -> None:
        await for_each(tx.active(), lambda w: self.control.inspect(tx.ch, w),
                       tx.ch.phase_deadline)

    def _lagging(self, ws: list[FleetWorker], target: Policy) -> list[FleetWorker]:
        """The serving workers a rolling refresh to `target` moves; RefreshHeld when one
        reports no step or would lag the target by more than max_lag."""
        unknown = [w.instance_id for w in ws if w.holds is None or w.holds.step is None]
        if unknown:
            raise RefreshHeld(f"a rolling refresh needs each serving worker's fleet step; "
                              f"worker(s) {unknown} report none: refresh the fleet "
                              "synchronously once")
        lag = target.step - min(w.holds.step for w in ws)
        if lag > self.config.max_lag:
            raise RefreshHeld(f"step {target.step} is {lag} steps ahead of a serving worker; "
                              f"a rolling refresh keeps every serving worker within "
                              f"max_lag={self.config.max_lag}: refresh synchronously, or in "
                              "smaller steps")
        return [w for w in ws if not target.is_held(w.holds)]
