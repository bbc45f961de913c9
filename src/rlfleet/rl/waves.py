"""The wave: the one routine that moves a set of workers to a policy,

  close (their admission) → pause → apply → reset cache → verify → resume → probe → reopen

used by a synchronous refresh (one wave: the whole fleet), a rolling one (a wave at a time
while the others serve) and a rollback (inside the wave it rolls back: apply → probe again
on the previous policy, then the wave's reopen). Each step excludes the workers that fail
it; the transfer's failures go to the failure policy (retry | rollback | hold)."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlfleet.rl.config import OnFailure, RefreshConfig, RefreshMode
from rlfleet.rl.control import FleetWorker, RefreshHeld, WorkerControl, for_each
from rlfleet.rl.hooks import RefreshHooks
from rlfleet.rl.policy import Policy
from rlfleet.rl.probe import (
    Answer,
    check_expected,
    disagreement,
    probe_request,
    read_answer,
    tolerance,
)
from rlfleet.rl.transaction import RefreshState, Rollback, Transaction
from rlfleet.runtime import tracing
from rlfleet.runtime.request_plane import WorkerError, generate_over_http


@dataclass
class Wave:
    """Workers that move to `target` together."""

    workers: list[FleetWorker]
    target: Policy
    close_reason: str  # what their admission says while they are closed
    to_apply: list[FleetWorker] | None = None  # those that need the transfer (None: all)
    rolled_back: str | None = None  # why the wave rolled back to the previous policy
    after_pause: Callable[[Wave], Awaitable[None]] | None = field(default=None, repr=False)
    # called once its workers are verified on `wave.target`, just before they reopen
    before_reopen: Callable[[Wave], Awaitable[None]] | None = field(default=None, repr=False)


async def _each(tx: Transaction, workers: Sequence[FleetWorker],
                fn: Callable[[FleetWorker], Awaitable[Any]]) -> None:
    await for_each(workers, fn, tx.ch.phase_deadline)


async def _untimed(name: str, coro: Awaitable[Any]) -> Any:
    return await coro


class Waves:
    """Runs waves on one fleet's workers (`control`), as `config` says."""

    def __init__(self, control: WorkerControl, config: RefreshConfig, hooks: RefreshHooks,
                 on_event: Callable[[str], None]) -> None:
        self.control, self.config, self.hooks, self.on_event = control, config, hooks, on_event

    def hook(self, tx: Transaction, point: str) -> None:
        if tx.kind == "refresh" and self.hooks.wants(point):
            self.hooks.reached(point)

    async def run(self, tx: Transaction, wave: Wave, *, min_workers: int | None = None
                  ) -> list[FleetWorker]:
        """Close, pause, apply, settle and reopen the wave's workers (rolled back instead
        when the failure policy says so: `wave.rolled_back`); with `min_workers`, hold the
        fleet before the reopen when fewer are verified. The workers reopened, verified."""
        control, ch, cfg = self.control, tx.ch, self.config
        await tx.timed("gate", _each(tx, wave.workers,
                                     lambda w: control.close(ch, w, wave.close_reason)))
        self.hook(tx, "gated")
        await tx.timed("pause", _each(tx, tx.active(wave.workers),
                                      lambda w: control.pause(ch, w, cfg.pause_mode)))
        await tx.move(RefreshState.PAUSED)
        if wave.after_pause is not None:
            await wave.after_pause(wave)
        self.hook(tx, "paused")
        try:
            to_apply = tx.active(wave.workers if wave.to_apply is None else wave.to_apply)
            await tx.timed("apply", self.apply(tx, to_apply, wave.target))
            if control.transfer_detail:
                tx.steps[-1]["transfer"] = control.transfer_detail
            await tx.move(RefreshState.APPLIED)
            await self.settle(tx, tx.active(wave.workers), wave.target)
            self.hook(tx, "before_reopen")
        except Rollback as e:
            await self.roll_back(tx, wave, str(e))
        ok_workers = tx.active(wave.workers)
        if min_workers is not None and len(ok_workers) < min_workers:
            raise RefreshHeld(f"only {len(ok_workers)} worker(s) verified on "
                              f"{wave.target.version}; need {min_workers}")
        if wave.before_reopen is not None:
            await wave.before_reopen(wave)
        await tx.timed("reopen", _each(tx, ok_workers, lambda w: control.open(ch, w)))
        ok_workers = tx.active(wave.workers)  # a worker whose reopen failed stays out
        for w in ok_workers:
            w.status = "verified"
        return ok_workers

    async def settle(self, tx: Transaction, ws: list[FleetWorker], target: Policy, *,
                     recorded: bool = True) -> None:
        """After the transfer: reset the cache, verify, resume, probe (each step excludes
        the workers that fail it). Unrecorded (a rollback's): no timed steps, no states."""
        control, ch = self.control, tx.ch
        timed = tx.timed if recorded else _untimed
        await timed("reset_cache", _each(tx, ws, lambda w: control.reset_cache(ch, w)))
        if recorded:
            await tx.move(RefreshState.CACHE_RESET)
        await timed("verify", self.verify_all(tx, tx.active(ws), target))
        if recorded:
            await tx.move(RefreshState.VERIFIED)
            self.hook(tx, "verified")
        await timed("resume", _each(tx, tx.active(ws), lambda w: control.resume(ch, w)))
        if recorded:
            await tx.move(RefreshState.RESUMED)
        answers = await timed("probe", self.probe_all(tx, tx.active(ws), target))
        tx.reference += answers
        if recorded:
            await tx.move(RefreshState.PROBED)

    # ------------------------------------------------------------------ apply

    async def apply(self, tx: Transaction, ws: list[FleetWorker], target: Policy) -> None:
        """Transfer `target` to `ws` under the failure policy: retried, then a rollback
        (`Rollback`) or the fleet held (`RefreshHeld`)."""
        if not ws:
            return
        control, ch, cfg = self.control, tx.ch, self.config
        if len(ws) > 1 and tx.kind == "refresh" and self.hooks.wants("apply_half"):
            half = len(ws) // 2  # tests: half the workers get the target, then the hook
            failed = await control.transfer(ch, ws[:half], target)
            self.hook(tx, "apply_half")
            failed += await control.transfer(ch, ws[half:], target)
        else:
            failed = await control.transfer(ch, ws, target)
        tries = 0
        while failed and cfg.on_failure is OnFailure.RETRY and tries < cfg.retries:
            tries += 1
            self.on_event(f"retrying the transfer to {len(failed)} worker(s) "
                          f"({tries}/{cfg.retries})")
            # a distributed group is rebuilt around the workers that still need it
            failed = await control.transfer(ch, failed, target)
        if not failed:
            return
        why = (f"transfer failed on {len(failed)} of {len(ws)} worker(s): "
               + "; ".join(f"{w.instance_id}: {w.reason}" for w in failed))
        if cfg.on_failure is OnFailure.ROLLBACK and tx.kind == "refresh":
            raise Rollback(why)
        if cfg.mode is RefreshMode.ROLLING and tx.kind == "refresh":
            for w in failed:
                w.exclude(w.reason or "transfer failed")
            raise RefreshHeld(why + "; the rolling refresh stops here: those workers stay out, "
                              "the others keep serving")
        raise RefreshHeld(why + f" (policy {cfg.on_failure.value}: the fleet stays gated)")

    async def roll_back(self, tx: Transaction, wave: Wave, why: str) -> None:
        """Reapply the previous policy to every worker still in the transaction and settle
        it the same way (a worker that fails any step stays out); the wave then reopens on
        it."""
        previous, control = tx.previous, self.control
        if previous is None:
            raise RefreshHeld(f"{why}; no previous policy to roll back to (none verified in "
                              f"the journal {tx.journal.path})")
        if not previous.sendable:
            raise RefreshHeld(f"{why}; the previous policy {previous.version} came from "
                              "memory and cannot be sent again")
        await tx.move(RefreshState.ROLLING_BACK)

        async def again() -> None:
            ws = tx.active()
            self.on_event(f"rolling back {len(ws)} worker(s) to {previous.version}: {why}")
            for w in await control.transfer(tx.ch, ws, previous):
                w.exclude(f"rollback transfer failed: {w.reason}")
            tx.reference = []
            await self.settle(tx, tx.active(ws), previous, recorded=False)

        await tx.timed("rollback", again())
        await tx.move(RefreshState.ROLLED_BACK)
        wave.target, wave.rolled_back = previous, f"{why}; rolled back to {previous.version}"

    # ------------------------------------------------------------------ verify and probe

    async def verify_all(self, tx: Transaction, ws: list[FleetWorker], target: Policy) -> None:
        found = await for_each(ws, lambda w: self.control.verify(tx.ch, w, target),
                               tx.ch.phase_deadline)
        mismatched = [m for m in found if m]
        if mismatched:
            raise RefreshHeld(f"version check differs on {', '.join(mismatched)}: a synchronous "
                              f"fleet does not reopen (target {target.version} / {target.digest})")

    async def probe_all(self, tx: Transaction, ws: list[FleetWorker], target: Policy
                        ) -> list[Answer]:
        """Post-update generation on every worker (see rlfleet.rl.probe): each must
        reproduce the expected probe, or, without one, all must agree with each other (and
        with the workers of earlier waves). The answers of the workers that passed."""
        answers = [a for a in await for_each(
            ws, lambda w: self.probe_one(tx, w, target), tx.ch.phase_deadline)
            if a is not None]
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

    async def probe_beside(self, tx: Transaction, target: Policy) -> None:
        """Before the gate: probe the versions the control loaded beside the serving ones
        (rlfleet.rl.adapter), each through its own engine name, judged as `probe_all`
        judges; any failure discards them all and holds the refresh (nothing was gated).
        The answers stand for the probe of the gated window (`early_answer`)."""
        beside = self.control.loaded_beside()
        if not beside:
            return
        ws = [b.worker for b in beside.values()]
        answers = [a for a in await for_each(ws, lambda w: self.probe_one(
            tx, w, target, adapter=beside[w.instance_id].served_name), tx.ch.phase_deadline)
            if a is not None]
        why = [f"{w.instance_id}: {w.reason}" for w in ws if not w.active]
        for a in answers:
            bad = check_expected(a, target.probe) if target.probe is not None else None
            if bad:
                why.append(f"{a.worker}: {bad}")
        if not why and target.probe is None:
            why = [d] if (d := disagreement(answers + tx.reference)) else []
        if why:
            await self.control.discard_beside(tx.ch)
            raise RefreshHeld(f"the probe through {target.version} loaded beside the serving "
                              f"version failed: {'; '.join(why)}; nothing was gated, the "
                              "serving version serves on")
        for a in answers:
            beside[a.worker].answer = a

    async def probe_one(self, tx: Transaction, w: FleetWorker, target: Policy,
                        adapter: str | None = None) -> Answer | None:
        """One worker's probe answer, straight from its request plane (None: excluded);
        `adapter`: the adapter (or adapter version's engine name) it names, if not the
        control's. A worker whose transfer switched it to the version it probed before
        the gate answers with that probe (`early_answer`)."""
        early = self.control.early_answer(w, target) if adapter is None else None
        if early is not None:
            w.record("probe", "probed before the gate", 200, None)
            return early
        if not w.request_url:
            w.exclude("no request-plane URL for the post-update generation")
            return None
        cfg = self.config
        req = probe_request(f"refresh-probe-{uuid.uuid4().hex[:12]}", target.probe,
                            cfg.probe_text)
        req.traceparent = tracing.outgoing()  # the worker's span joins the probe phase's
        req.adapter = adapter or self.control.probe_adapter
        try:
            async with tx.ch.slot():
                events = await generate_over_http(tx.requests.get(w.request_url),
                                                  w.request_url, req, cfg.timeout,
                                                  cfg.admin_token)
        except WorkerError as e:
            w.record("probe", "generate", e.status, e.body)
            w.exclude(f"post-update generation failed: HTTP {e.status} {e}")
            return None
        w.record("probe", "generate", 200, events[-1] if events else None)
        answer = read_answer(w.instance_id, req, events, target.probe, target.digest,
                             tolerance(w.dtype, cfg.probe_tolerance))
        if isinstance(answer, str):
            w.exclude(answer)
            return None
        return answer
