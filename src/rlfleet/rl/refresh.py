"""PolicyRefresh: move a whole fleet to one target policy, or leave it gated with a recorded
reason. The lifecycle (shared/spec/rl-integration-reference.txt, "Coordinate Policy Refresh"):

  gate → resolve → pause → (re-resolve) → apply → reset cache → verify → resume → probe → reopen

Failure handling follows the reference table (distribute-and-update-rollout-weights.md):
a worker whose pause, cache reset, resume or probe fails is excluded and stays gated; a
worker gone from discovery is dropped; a transfer that fails after peers succeeded leaves
the fleet gated and is handled by one explicit policy (retry | rollback | hold); a version
or digest that differs keeps a synchronous fleet closed. Every refresh is journaled.

The lifecycle calls one `WorkerControl` per worker flavour (rlfleet.rl.control) and judges
the post-update probe with rlfleet.rl.probe. A coordinator started on an existing journal
resumes from it: the fleet's last verified policy is what it rolls back to."""

from __future__ import annotations

import asyncio
import enum
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from rlfleet.protocol.engine import GenerateRequest, SamplingOptions
from rlfleet.rl import telemetry
from rlfleet.rl.control import (
    Channel,
    FleetWorker,
    RefreshHeld,
    SglangControl,
    SglangWorker,
    VllmControl,
    WorkerControl,
)
from rlfleet.rl.gate import RolloutGate
from rlfleet.rl.journal import Journal
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
    REOPENED = "reopened"  # terminal: verified workers serve the target
    ROLLING_BACK = "rolling_back"
    ROLLED_BACK = "rolled_back"  # terminal: the fleet serves the previous policy, verified
    HELD = "held"  # terminal: the fleet stays gated; the journal says why


_S = RefreshState
TRANSITIONS: dict[RefreshState, frozenset[RefreshState]] = {
    _S.STARTED: frozenset({_S.GATED, _S.HELD}),
    _S.GATED: frozenset({_S.RESOLVED, _S.HELD}),
    _S.RESOLVED: frozenset({_S.PAUSED, _S.HELD}),
    _S.PAUSED: frozenset({_S.APPLIED, _S.ROLLING_BACK, _S.HELD}),
    _S.APPLIED: frozenset({_S.CACHE_RESET, _S.ROLLING_BACK, _S.HELD}),
    _S.CACHE_RESET: frozenset({_S.VERIFIED, _S.ROLLING_BACK, _S.HELD}),
    _S.VERIFIED: frozenset({_S.RESUMED, _S.ROLLING_BACK, _S.HELD}),
    _S.RESUMED: frozenset({_S.PROBED, _S.ROLLING_BACK, _S.HELD}),
    _S.PROBED: frozenset({_S.REOPENED, _S.ROLLING_BACK, _S.HELD}),
    _S.ROLLING_BACK: frozenset({_S.ROLLED_BACK, _S.HELD}),
    _S.REOPENED: frozenset(),
    _S.ROLLED_BACK: frozenset(),
    _S.HELD: frozenset(),
}


class IllegalRefreshTransition(RuntimeError):
    pass


def check_transition(old: RefreshState, new: RefreshState) -> RefreshState:
    if new not in TRANSITIONS[old]:
        raise IllegalRefreshTransition(f"refresh cannot go from {old.value} to {new.value}")
    return new


@dataclass
class Policy:
    """One target policy: where it is, what it is called, what it is."""

    version: str
    digest: str
    path: str | None = None
    probe: Probe | None = None
    tensors: Callable[[], Sequence[tuple[str, Any]]] | None = None  # for the distributed path
    source: dict[str, Any] | None = None  # where workers stage it from (the staged path)


@dataclass
class RefreshResult:
    refresh_id: int
    decision: str  # reopened | rolled_back | held
    reason: str
    state: RefreshState
    workers: list[dict[str, Any]]
    steps: list[dict[str, Any]]
    policy: Policy

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
        return {s["name"]: s["seconds"] for s in self.steps}


class _Rollback(Exception):
    """The failure policy asks for a rollback."""


class PolicyRefresh:
    """Refreshes one fleet's policy. Keep one instance per fleet: it remembers the policy the
    fleet is on (for rollback and for admitting replacement workers)."""

    def __init__(self, rl_url: str | None = None, *, model: str | None = None,
                 path: UpdatePath | str = UpdatePath.VLLM_DISK,
                 sglang_workers: Sequence[SglangWorker] = (),
                 journal: Journal | str | Path = ":memory:", gate: RolloutGate | None = None,
                 on_failure: OnFailure | str = OnFailure.HOLD, retries: int = 1,
                 pause_mode: str = "wait", probe_text: str = PROBE_TEXT,
                 probe_tokens: int = 8, probe_tolerance: float | None = None,
                 probe_from_checkpoint: bool = False, transfer_backend: str = "gloo",
                 master_address: str | None = None, master_port: int | None = None,
                 min_workers: int = 1, timeout: float = 120.0, admin_token: str | None = None,
                 on_event: Callable[[str], None] | None = None,
                 current: Policy | None = None) -> None:
        """`probe_tolerance`: max logprob difference in the post-update probe (default: by
        the dtype each worker serves in, see rlfleet.rl.probe). `probe_from_checkpoint`:
        without a trainer's probe, compute the expected one from the checkpoint with
        transformers (loads the whole model here); else the workers must agree with each
        other on `probe_text`. `transfer_backend`, `master_address` (default: this host's
        address toward the workers), `master_port`: the distributed path's process group."""
        self.path = UpdatePath(path)
        if pause_mode not in ("keep", "wait", "abort"):
            raise ValueError(f"pause_mode must be keep, wait or abort, not {pause_mode!r}")
        if probe_tokens < 1:
            raise ValueError("probe_tokens must be at least 1")
        self.control = self._control(self.path, rl_url, model, sglang_workers,
                                     transfer_backend, master_address, master_port)
        self.model = model
        self.journal = journal if isinstance(journal, Journal) else Journal(journal)
        self.gate = gate or RolloutGate()
        self.on_failure = OnFailure(on_failure)
        self.retries = retries
        self.pause_mode = pause_mode
        self.probe_text = probe_text
        self.probe_tokens = probe_tokens
        self.tolerance = probe_tolerance
        self.probe_from_checkpoint = probe_from_checkpoint
        self.min_workers = min_workers
        self.timeout = timeout
        self.admin_token = admin_token
        self.on_event = on_event or (lambda msg: log.info("%s", msg))
        self.current = current
        self.verified: set[int] = set()  # workers verified on self.current
        if current is None:
            self._resume_from_journal()
        # what each worker was last seen holding ({version, digest}), kept in the journal
        self.holdings = self.journal.holdings(self.control.fleet, self.model)

    def _resume_from_journal(self) -> None:
        """A coordinator started on an existing journal (a new process, after a crash or a
        held refresh) takes the fleet's last verified policy from it: the policy a rollback
        returns to and replacement workers are admitted on."""
        row = self.journal.last_served(self.control.fleet, self.model)
        if row is None:
            return
        self.current = Policy(version=row["served_version"], digest=row["served_digest"],
                              path=row["served_path"])
        self.verified = set(row["verified_workers"] or [])
        self.on_event(f"journal {self.journal.path}: last verified policy "
                      f"{self.current.version} ({self.current.digest}) on "
                      f"{len(self.verified)} worker(s), refresh {row['id']}")

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

    # ------------------------------------------------------------------ public API

    async def refresh(self, checkpoint: str | Path | None, version: str, *,
                      digest: str | None = None, probe: Probe | None = None,
                      tensors: Callable[[], Sequence[tuple[str, Any]]] | None = None,
                      step: int | None = None, source: dict[str, Any] | None = None
                      ) -> RefreshResult:
        """Move every worker to the checkpoint at `checkpoint` (declared `version`); on the
        staged path, to the version workers stage from `source` (a stage_weights source)."""
        with tracing.span("policy refresh", attributes={"rlfleet.version": version}):
            target = await self._policy(checkpoint, version, digest, probe, tensors, source)
            return await self._run(target, step=step, fleet_wide=True)

    async def admit_new_workers(self, step: int | None = None) -> RefreshResult:
        """Bring workers that joined (or restarted) onto the current policy and open them;
        the rest of the fleet keeps serving."""
        if self.current is None:
            raise RuntimeError("no current policy yet: run refresh() first")
        with tracing.span("admit new workers"):
            return await self._run(self.current, step=step, fleet_wide=False)

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

    async def _each(self, workers: list[FleetWorker], fn) -> None:
        await asyncio.gather(*(fn(w) for w in workers))

    # ------------------------------------------------------------------ the lifecycle

    async def _run(self, target: Policy, *, step: int | None, fleet_wide: bool) -> RefreshResult:
        previous = self.current
        control = self.control
        steps: list[dict[str, Any]] = []
        workers: dict[int, FleetWorker] = {}
        state = RefreshState.STARTED
        refresh_id = self.journal.begin(
            framework_step=step, fleet=control.fleet, model=self.model,
            update_path=control.path, target_path=target.path,
            target_version=target.version, target_digest=target.digest,
            previous_version=previous.version if previous else None,
            previous_digest=previous.digest if previous else None)

        def move(new: RefreshState) -> None:
            nonlocal state
            state = check_transition(state, new)

        async def timed(name: str, coro):
            t0 = time.perf_counter()
            self.on_event(f"[refresh {refresh_id}] {name} ...")
            try:
                with tracing.span(f"refresh {name}", attributes={"rlfleet.refresh_id": refresh_id}):
                    return await coro  # each worker's control call: a span under this one
            finally:
                secs = time.perf_counter() - t0
                steps.append({"name": name, "seconds": secs})
                telemetry.REFRESH_SECONDS.labels(name).observe(secs)
                self.on_event(f"[refresh {refresh_id}] {name} done in {secs:.3f}s")

        def active() -> list[FleetWorker]:
            return [w for w in workers.values() if w.active]

        decision, reason = "held", ""
        requests = httpx.AsyncClient()  # the workers' HTTP request planes (probes)
        async with httpx.AsyncClient() as http:
            ch = Channel(http, self.timeout, self.admin_token)
            gate_reason = f"policy refresh to {target.version}"
            try:
                if control.stages:  # pulled while the fleet serves: the gate is still open
                    await timed("stage", control.prepare(
                        ch, target, set() if fleet_wide else set(self.verified)))
                if fleet_wide:
                    self.gate.close(gate_reason)
                move(RefreshState.GATED)
                found = await timed("resolve", control.discover(ch))
                workers.update(found if fleet_wide else
                               {i: w for i, w in found.items() if i not in self.verified})
                self.journal.update(refresh_id, intended_workers=sorted(workers))
                if not active():
                    raise RefreshHeld("no worker to refresh" if fleet_wide
                                      else "no new worker to admit")
                move(RefreshState.RESOLVED)
                await timed("gate", self._each(list(workers.values()),
                                               lambda w: control.close(ch, w, gate_reason)))
                await timed("pause", self._each(
                    active(), lambda w: control.pause(ch, w, self.pause_mode)))
                await self._membership(ch, workers, gate_reason)
                move(RefreshState.PAUSED)
                try:
                    await timed("apply", self._apply_with_policy(ch, active(), target))
                    if control.transfer_detail:
                        steps[-1]["transfer"] = control.transfer_detail
                    move(RefreshState.APPLIED)
                    await timed("reset_cache", self._each(
                        active(), lambda w: control.reset_cache(ch, w)))
                    move(RefreshState.CACHE_RESET)
                    await timed("verify", self._verify_all(ch, active(), target))
                    move(RefreshState.VERIFIED)
                    await timed("resume", self._each(active(), lambda w: control.resume(ch, w)))
                    move(RefreshState.RESUMED)
                    await timed("probe", self._probe_all(requests, active(), target))
                    move(RefreshState.PROBED)
                except _Rollback as e:
                    if previous is None:
                        raise RefreshHeld(f"{e}; no previous policy to roll back to (none "
                                          f"verified in the journal {self.journal.path})") from e
                    if previous.path is None and previous.tensors is None:
                        raise RefreshHeld(f"{e}; the previous policy {previous.version} came "
                                          "from memory and cannot be sent again") from e
                    move(RefreshState.ROLLING_BACK)
                    await timed("rollback", self._rollback(ch, requests, workers, previous,
                                                           str(e)))
                    target = previous
                    move(RefreshState.ROLLED_BACK)
                    decision, reason = "rolled_back", f"{e}; rolled back to {previous.version}"
                ok_workers = active()
                if len(ok_workers) < self.min_workers:
                    raise RefreshHeld(f"only {len(ok_workers)} worker(s) verified on "
                                      f"{target.version}; need {self.min_workers}")
                await timed("reopen", self._each(ok_workers, lambda w: control.open(ch, w)))
                ok_workers = active()  # a worker whose reopen failed stays out
                for w in ok_workers:
                    w.status = "verified"
                if state is not RefreshState.ROLLED_BACK:
                    move(RefreshState.REOPENED)
                    out = [w for w in workers.values() if not w.active]
                    decision = "reopened"
                    reason = (f"{len(ok_workers)} worker(s) verified on {target.version}"
                              + (f"; kept out: {', '.join(f'{w.instance_id} ({w.reason})' for w in out)}"
                                 if out else ""))
                self.current = target
                if fleet_wide:
                    self.verified = {w.instance_id for w in ok_workers}
                else:
                    self.verified |= {w.instance_id for w in ok_workers}
                self.gate.open()
            except RefreshHeld as e:
                state = RefreshState.HELD
                decision, reason = "held", str(e)
            except Exception as e:
                state = RefreshState.HELD
                decision, reason = "held", f"coordinator error: {e!r}"
                log.exception("policy refresh %s failed", refresh_id)
        await requests.aclose()
        telemetry.REFRESH_TOTAL.labels(decision).inc()
        self.on_event(f"[refresh {refresh_id}] {decision}: {reason}")
        summaries = [w.summary() for w in workers.values()]
        served = target if decision != "held" else None
        self.journal.update(refresh_id, ended_at=time.time(), decision=decision, reason=reason,
                            steps=steps, workers={str(w["instance_id"]): w for w in summaries},
                            served_version=served.version if served else None,
                            served_digest=served.digest if served else None,
                            served_path=served.path if served else None,
                            verified_workers=sorted(self.verified) if served else [])
        self.holdings.update({w.instance_id: w.holds for w in workers.values() if w.holds})
        return RefreshResult(refresh_id, decision, reason, state, summaries, steps, target)

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

    async def _apply_with_policy(self, ch: Channel, ws: list[FleetWorker],
                                 target: Policy) -> None:
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
        if self.on_failure is OnFailure.ROLLBACK:
            raise _Rollback(why)
        raise RefreshHeld(why + f" (policy {self.on_failure.value}: the fleet stays gated)")

    async def _verify_all(self, ch: Channel, ws: list[FleetWorker], target: Policy) -> None:
        found = await asyncio.gather(*(self.control.verify(ch, w, target) for w in ws))
        mismatched = [m for m in found if m]
        if mismatched:
            raise RefreshHeld(f"version check differs on {', '.join(mismatched)}: a synchronous "
                              f"fleet does not reopen (target {target.version} / {target.digest})")

    async def _probe_all(self, requests: httpx.AsyncClient, ws: list[FleetWorker],
                         target: Policy) -> None:
        """Post-update generation on every worker (see rlfleet.rl.probe): each must
        reproduce the expected probe, or, without one, all must agree with each other."""
        answers = [a for a in await asyncio.gather(
            *(self._probe_one(requests, w, target) for w in ws)) if a is not None]
        if target.probe is not None:
            by_id = {w.instance_id: w for w in ws}
            for a in answers:
                why = check_expected(a, target.probe)
                if why:
                    by_id[a.worker].exclude(why)
            return
        why = disagreement(answers)
        if why:
            raise RefreshHeld(why)

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
            events = await generate_over_http(requests, w.request_url, req, self.timeout)
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

    async def _rollback(self, ch: Channel, requests: httpx.AsyncClient,
                        workers: dict[int, FleetWorker], previous: Policy, why: str) -> None:
        """Reapply the previous policy to every worker still in the set and verify it the
        same way; a worker that fails any step stays out."""
        control = self.control
        ws = [w for w in workers.values() if w.active]
        self.on_event(f"rolling back {len(ws)} worker(s) to {previous.version}: {why}")
        failed = await control.transfer(ch, ws, previous)
        for w in failed:
            w.exclude(f"rollback transfer failed: {w.reason}")

        def active() -> list[FleetWorker]:
            return [w for w in ws if w.active]
        await self._each(active(), lambda w: control.reset_cache(ch, w))
        await self._verify_all(ch, active(), previous)
        await self._each(active(), lambda w: control.resume(ch, w))
        await self._probe_all(requests, active(), previous)
