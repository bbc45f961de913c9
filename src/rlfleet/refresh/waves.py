"""The wave: the one routine that moves a set of workers to a policy,

  close (their admission) → pause → apply → reset cache → verify → resume → probe → reopen

used by a synchronous refresh (one wave: the whole fleet), a rolling one (a wave at a time
while the others serve) and a rollback (inside the wave it rolls back: apply → probe again
on the previous policy, then the wave's reopen). Each step excludes the workers that fail
it; the transfer's failures go to the failure policy (retry | rollback | hold).

Two ways to run it, the same steps judged the same way and journaled under the same names:
- **in one call per worker** (`commit_policy`, where every worker of the wave lists it and
  the path can name its install): close → resume run on the worker under its own deadline,
  and the coordinator judges each step from the reply; then the probe (which the worker
  ran in the same call, on its own request plane, where it can: judged from the reply as
  a direct probe's stream) and the reopen. A
  worker's admin calls in a refresh: the commit and the reopen (and, staged, the stage);
- **step by step**, a call per worker per step: workers that do not serve the route, the
  distributed path (the coordinator broadcasts), a recovery (it decides the target after
  the pause), and a refresh with test hooks (rlfleet.refresh.hooks) at its steps."""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlfleet.protocol import admin
from rlfleet.refresh.config import OnFailure, RefreshConfig, RefreshMode
from rlfleet.refresh.control import FleetWorker, RefreshHeld, WorkerControl, for_each
from rlfleet.refresh.hooks import POINTS, RefreshHooks
from rlfleet.refresh.policy import Policy
from rlfleet.refresh.probe import (
    Answer,
    ask,
    check_expected,
    committed_events,
    disagreement,
    probe_request,
    read_answer,
    tolerance,
)
from rlfleet.refresh.transaction import RefreshState, Rollback, Transaction
from rlfleet.runtime import tracing
from rlfleet.runtime.request_plane import WorkerError


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
    # in one call per worker: called before the commit calls (where after_pause would be)
    before_commit: Callable[[Wave], Awaitable[None]] | None = field(default=None, repr=False)
    may_commit: bool = True  # False: step by step (after_pause decides what is applied)


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

    def _commits(self, tx: Transaction, wave: Wave) -> bool:
        """Whether the wave's workers move in one call each (see the module doc)."""
        if not wave.may_commit or (tx.kind == "refresh" and any(map(self.hooks.wants, POINTS))):
            return False
        ws = tx.active(wave.workers)
        return bool(ws) and all(self.control.commits(w, wave.target) for w in ws)

    async def run(self, tx: Transaction, wave: Wave, *, min_workers: int | None = None
                  ) -> list[FleetWorker]:
        """Close, pause, apply, settle and reopen the wave's workers (rolled back instead
        when the failure policy says so: `wave.rolled_back`); with `min_workers`, hold the
        fleet before the reopen when fewer are verified. The workers reopened, verified."""
        if self._commits(tx, wave):
            if wave.before_commit is not None:
                await wave.before_commit(wave)
            if self._commits(tx, wave):  # a worker that joined may not serve the route
                return await self._run_committed(tx, wave, min_workers)
        return await self._run_steps(tx, wave, min_workers)

    async def _run_steps(self, tx: Transaction, wave: Wave, min_workers: int | None
                         ) -> list[FleetWorker]:
        """The wave a call per worker per step."""
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
        return await self._reopen(tx, wave, min_workers)

    async def _reopen(self, tx: Transaction, wave: Wave, min_workers: int | None
                      ) -> list[FleetWorker]:
        control, ch = self.control, tx.ch
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

    #: the steps one commit_policy call runs, journaled under these names
    COMMIT_STEPS = ("gate", "pause", "apply", "reset_cache", "verify", "resume")

    async def _run_committed(self, tx: Transaction, wave: Wave, min_workers: int | None
                             ) -> list[FleetWorker]:
        """The wave in one commit_policy call per worker, then the probe and the reopen.
        Each lifecycle step is journaled with the slowest worker's own time in it (the
        whole phase's time with the first: `commit_seconds`)."""
        control, ch, cfg = self.control, tx.ch, self.config
        ws = tx.active(wave.workers)
        marks = {w.instance_id: len(w.calls) for w in ws}
        # the steps path announces each phase as it starts ("<label> apply ..."); here the
        # phases start together, inside each worker's one call: announced once, by name
        label = f"[refresh {tx.id}]" + (f" wave {tx.wave}:" if tx.wave else "")
        self.on_event(f"{label} commit ... ({len(ws)} worker(s), one "
                      f"{admin.COMMIT_POLICY.name} call each: {', '.join(self.COMMIT_STEPS)})")
        t0 = time.perf_counter()
        with tracing.span("refresh commit", attributes={"rlfleet.refresh_id": tx.id}):
            # the post-update probe runs inside each commit: one request for the wave, so
            # that every worker's commit has the same body (a relay batches them); or after
            # the reopen (`probe_after_reopen`)
            probe = None if cfg.probe_after_reopen else self._probe_request(wave.target)
            results = await for_each(ws, lambda w: control.commit(
                ch, w, wave.target, wave.close_reason, cfg.pause_mode, probe),
                ch.commit_deadline)
        wall = time.perf_counter() - t0
        slowest = dict.fromkeys(self.COMMIT_STEPS, 0.0)
        for w in ws:
            for c in w.calls[marks[w.instance_id]:]:
                if c["step"] in slowest:
                    slowest[c["step"]] = max(slowest[c["step"]], c.get("seconds", 0.0))
        for i, (name, secs) in enumerate(slowest.items()):
            tx.add_step(name, secs, via=admin.COMMIT_POLICY.name,
                        **({"commit_seconds": wall} if i == 0 else {}))
        self.on_event(f"{label} {len(ws)} worker(s) committed in one call each "
                      f"in {wall:.3f}s")
        await tx.advance(RefreshState.PAUSED)
        failed = [w for w, r in zip(ws, results, strict=True) if r is not None and r[0]]
        mismatched = [r[1] for r in results if r is not None and r[1]]
        try:
            if failed:  # the failure policy, then the rest of the steps for the retried
                retried = await self.apply(tx, ws, wave.target, failed=failed)
                mismatched += await self._settle_each(tx, retried, wave.target)
            await tx.advance(RefreshState.APPLIED, RefreshState.CACHE_RESET)
            if mismatched:
                raise RefreshHeld(f"version check differs on {', '.join(mismatched)}: a "
                                  f"synchronous fleet does not reopen (target "
                                  f"{wave.target.version} / {wave.target.digest})")
            await tx.advance(RefreshState.VERIFIED, RefreshState.RESUMED)
            if cfg.probe_after_reopen:
                return await self._reopen_then_probe(tx, wave, min_workers)
            answers = await tx.timed("probe", self.probe_all(tx, tx.active(wave.workers),
                                                             wave.target))
            tx.reference += answers
            await tx.move(RefreshState.PROBED)
        except Rollback as e:
            # the committed workers generate again (closed to rollouts): pause them first
            await _each(tx, tx.active(), lambda w: control.pause(ch, w, cfg.pause_mode))
            await self.roll_back(tx, wave, str(e))
        return await self._reopen(tx, wave, min_workers)

    async def _reopen_then_probe(self, tx: Transaction, wave: Wave, min_workers: int | None
                                 ) -> list[FleetWorker]:
        """`probe_after_reopen`: reopen the verified workers, then probe them; a worker that
        fails its probe is closed again (left out, as before the reopen), and a probe on
        which the workers disagree closes the whole wave again and holds the fleet."""
        control, ch = self.control, tx.ch
        opened = await self._reopen(tx, wave, min_workers)
        try:
            answers = await tx.timed("probe", self.probe_all(tx, opened, wave.target))
        except RefreshHeld as e:
            why = f"post-update probe: {e}"
            await _each(tx, opened, lambda w: control.close(ch, w, why))
            for w in opened:
                w.exclude(why)
            raise
        tx.reference += answers
        failed = [w for w in opened if not w.active]
        await for_each(failed, lambda w: control.close(ch, w, w.reason or "probe failed"),
                       ch.phase_deadline)
        await tx.move(RefreshState.PROBED)
        ok_workers = tx.active(wave.workers)
        if min_workers is not None and len(ok_workers) < min_workers:
            raise RefreshHeld(f"only {len(ok_workers)} worker(s) passed the post-update "
                              f"probe on {wave.target.version}; need {min_workers}")
        return ok_workers

    async def _settle_each(self, tx: Transaction, ws: list[FleetWorker], target: Policy
                           ) -> list[str]:
        """Reset, verify and resume workers whose transfer a retry completed after their
        commit stopped at it; the version mismatches."""
        control, ch = self.control, tx.ch
        await _each(tx, ws, lambda w: control.reset_cache(ch, w))
        found = await for_each(tx.active(ws), lambda w: control.verify(ch, w, target),
                               ch.phase_deadline)
        await _each(tx, tx.active(ws), lambda w: control.resume(ch, w))
        return [m for m in found if m]

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

    async def apply(self, tx: Transaction, ws: list[FleetWorker], target: Policy, *,
                    failed: list[FleetWorker] | None = None) -> list[FleetWorker]:
        """Transfer `target` to `ws` under the failure policy: retried, then a rollback
        (`Rollback`) or the fleet held (`RefreshHeld`). With `failed`: those of `ws` whose
        transfer failed already (in their commit). The workers of `failed` a retry moved."""
        control, ch, cfg = self.control, tx.ch, self.config
        first = list(failed or [])
        if failed is None:
            if not ws:
                return []
            failed = await control.transfer(ch, ws, target)
        tries = 0
        while failed and cfg.on_failure is OnFailure.RETRY and tries < cfg.retries:
            tries += 1
            self.on_event(f"retrying the transfer to {len(failed)} worker(s) "
                          f"({tries}/{cfg.retries})")
            # a distributed group is rebuilt around the workers that still need it
            failed = await control.transfer(ch, failed, target)
        if not failed:
            return [w for w in first if w.active]
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
        """Post-update generation on every worker (see rlfleet.refresh.probe): each must
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
        (rlfleet.refresh.adapter), each through its own engine name, judged as `probe_all`
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

    def _probe_request(self, target: Policy, adapter: str | None = None) -> Any:
        """A post-update probe's request for `target` (rlfleet.refresh.probe.probe_request), on
        engine name `adapter` or the control's."""
        req = probe_request(f"refresh-probe-{uuid.uuid4().hex[:12]}", target.probe,
                            self.config.probe_text)
        req.traceparent = tracing.outgoing()  # the worker's span joins the caller's
        req.adapter = adapter or self.control.probe_adapter
        return req

    async def probe_one(self, tx: Transaction, w: FleetWorker, target: Policy,
                        adapter: str | None = None) -> Answer | None:
        """One worker's probe answer, straight from its request plane (None: excluded);
        `adapter`: the adapter (or adapter version's engine name) it names, if not the
        control's. A worker whose transfer switched it to the version it probed before
        the gate answers with that probe (`early_answer`); one whose commit_policy call ran
        the probe for `target` (`FleetWorker.committed_probe`) with what it answered there,
        judged the same way."""
        committed, w.committed_probe = w.committed_probe, None
        early = self.control.early_answer(w, target) if adapter is None else None
        if early is not None:
            w.record("probe", "probed before the gate", 200, None)
            return early
        if not w.request_url:
            w.exclude("no request-plane URL for the post-update generation")
            return None
        cfg = self.config
        via: dict[str, str] = {}
        try:
            if committed is not None and adapter is None and committed[0] is target:
                via = {"via": admin.COMMIT_POLICY.name}  # the journal says where it ran
                req, events = committed[1], committed_events(committed[2], w.instance_id)
            else:
                req = self._probe_request(target, adapter)
                async with tx.ch.slot():
                    events = await ask(tx.requests.session(w.request_url), w.request_url,
                                       req, cfg.timeout, cfg.admin_token)
        except WorkerError as e:
            w.record("probe", "generate", e.status, e.body)
            w.calls[-1] |= via
            w.exclude(f"post-update generation failed: HTTP {e.status} {e}")
            return None
        w.record("probe", "generate", 200, events[-1] if events else None)
        w.calls[-1] |= via
        answer = read_answer(w.instance_id, req, events, target.probe, target.digest,
                             tolerance(w.dtype, cfg.probe_tolerance))
        if isinstance(answer, str):
            w.exclude(answer)
            return None
        return answer
