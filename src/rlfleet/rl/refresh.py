"""PolicyRefresh: move a whole fleet to one target policy, or leave it gated with a recorded
reason. The lifecycle (shared/spec/rl-integration-reference.txt, "Coordinate Policy Refresh"):

  gate → resolve → pause → (re-resolve) → apply → reset cache → verify → resume → probe → reopen

Failure handling follows the reference table (distribute-and-update-rollout-weights.md):
a worker whose pause, cache reset, resume or probe fails is excluded and stays gated; a
worker gone from discovery is dropped; a transfer that fails after peers succeeded leaves
the fleet gated and is handled by one explicit policy (retry | rollback | hold); a version
or digest that differs keeps a synchronous fleet closed. Every refresh is journaled."""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

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
class Probe:
    """The post-update generation every worker must reproduce: greedy `token_ids` from
    `prompt`, with `logprobs` the trainer expects for the target policy."""

    prompt: list[int]
    token_ids: list[int]
    logprobs: list[float]


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


def reference_probe(checkpoint: str | Path, prompt: list[int], n: int) -> Probe:
    """Greedy tokens and logprobs of `checkpoint` by a plain transformers forward pass: what
    the trainer expects every worker to reproduce."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    seq, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq])).logits[0, -1].float()
            lsm = torch.log_softmax(logits, -1)
            t = int(torch.argmax(lsm))
            seq.append(t)
            lps.append(float(lsm[t]))
    return Probe(list(prompt), seq[len(prompt):], lps)


class PolicyRefresh:
    """Refreshes one fleet's policy. Keep one instance per fleet: it remembers the policy the
    fleet is on (for rollback and for admitting replacement workers)."""

    def __init__(self, rl_url: str | None = None, *, model: str | None = None,
                 path: UpdatePath | str = UpdatePath.VLLM_DISK,
                 sglang_workers: Sequence[SglangWorker] = (),
                 journal: Journal | str | Path = ":memory:", gate: RolloutGate | None = None,
                 on_failure: OnFailure | str = OnFailure.HOLD, retries: int = 1,
                 pause_mode: str = "wait", probe_prompt: Sequence[int] = (151644, 8948, 198),
                 probe_tokens: int = 8, probe_tolerance: float = 1e-3, min_workers: int = 1,
                 timeout: float = 120.0, admin_token: str | None = None,
                 on_event: Callable[[str], None] | None = None,
                 current: Policy | None = None) -> None:
        self.path = UpdatePath(path)
        if pause_mode not in ("keep", "wait", "abort"):
            raise ValueError(f"pause_mode must be keep, wait or abort, not {pause_mode!r}")
        self.control = self._control(self.path, rl_url, model, sglang_workers)
        self.model = model
        self.journal = journal if isinstance(journal, Journal) else Journal(journal)
        self.gate = gate or RolloutGate()
        self.on_failure = OnFailure(on_failure)
        self.retries = retries
        self.pause_mode = pause_mode
        self.probe_prompt = list(probe_prompt)
        self.probe_tokens = probe_tokens
        self.tolerance = probe_tolerance
        self.min_workers = min_workers
        self.timeout = timeout
        self.admin_token = admin_token
        self.on_event = on_event or (lambda msg: log.info("%s", msg))
        self.current = current
        self.verified: set[int] = set()  # workers verified on self.current

    @staticmethod
    def _control(path: UpdatePath, rl_url: str | None, model: str | None,
                 sglang_workers: Sequence[SglangWorker]) -> WorkerControl:
        if path is UpdatePath.SGLANG_DISK:
            return SglangControl(sglang_workers)
        if not rl_url:
            raise ValueError("the vLLM paths need rl_url (the frontend's RL listener)")
        if path is UpdatePath.VLLM_STAGED:
            from rlfleet.rl.staged import VllmStagedControl

            return VllmStagedControl(rl_url, model)
        return VllmControl(rl_url, model, distributed=path is UpdatePath.VLLM_DISTRIBUTED)

    # ------------------------------------------------------------------ public API

    async def refresh(self, checkpoint: str | Path | None, version: str, *,
                      digest: str | None = None, probe: Probe | None = None,
                      tensors: Callable[[], Sequence[tuple[str, Any]]] | None = None,
                      step: int | None = None, source: dict[str, Any] | None = None
                      ) -> RefreshResult:
        """Move every worker to the checkpoint at `checkpoint` (declared `version`); on the
        staged path, to the version workers stage from `source` (a stage_weights source)."""
        target = await self._policy(checkpoint, version, digest, probe, tensors, source)
        return await self._run(target, step=step, fleet_wide=True)

    async def admit_new_workers(self, step: int | None = None) -> RefreshResult:
        """Bring workers that joined (or restarted) onto the current policy and open them;
        the rest of the fleet keeps serving."""
        if self.current is None:
            raise RuntimeError("no current policy yet: run refresh() first")
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
        if probe is None and path is not None and (Path(path) / "config.json").exists():
            probe = await asyncio.to_thread(reference_probe, path, self.probe_prompt,
                                            self.probe_tokens)
        if self.path is UpdatePath.VLLM_DISTRIBUTED and tensors is None:
            if path is None:
                raise ValueError("the distributed path needs tensors or a checkpoint path")
            from rlfleet.weights.digest import iter_checkpoint_tensors

            tensors = lambda: list(iter_checkpoint_tensors(Path(path)))  # noqa: E731
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
            framework_step=step, update_path=control.path, target_path=target.path,
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
                return await coro
            finally:
                secs = time.perf_counter() - t0
                steps.append({"name": name, "seconds": secs})
                self.on_event(f"[refresh {refresh_id}] {name} done in {secs:.3f}s")

        def active() -> list[FleetWorker]:
            return [w for w in workers.values() if w.active]

        decision, reason = "held", ""
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
                    move(RefreshState.APPLIED)
                    await timed("reset_cache", self._each(
                        active(), lambda w: control.reset_cache(ch, w)))
                    move(RefreshState.CACHE_RESET)
                    await timed("verify", self._verify_all(ch, active(), target))
                    move(RefreshState.VERIFIED)
                    await timed("resume", self._each(active(), lambda w: control.resume(ch, w)))
                    move(RefreshState.RESUMED)
                    await timed("probe", self._each(active(), lambda w: self._probe(http, w, target)))
                    move(RefreshState.PROBED)
                except _Rollback as e:
                    if previous is None:
                        raise RefreshHeld(f"{e}; no previous policy to roll back to") from e
                    move(RefreshState.ROLLING_BACK)
                    await timed("rollback", self._rollback(ch, workers, previous, str(e)))
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
        self.on_event(f"[refresh {refresh_id}] {decision}: {reason}")
        summaries = [w.summary() for w in workers.values()]
        self.journal.update(refresh_id, ended_at=time.time(), decision=decision, reason=reason,
                            steps=steps, workers={str(w["instance_id"]): w for w in summaries})
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

    async def _probe(self, http, w: FleetWorker, target: Policy) -> None:
        """Post-update generation straight on the worker's request plane. With a reference
        probe, the expected greedy continuation is teacher-forced: the worker prefills
        prompt + continuation[:-1] (prompt logprobs, each expected token at rank 1) and
        generates the last token greedily, so every expected token is checked with a single
        decode step."""
        if not w.request_url:
            w.exclude("no request-plane URL for the post-update generation")
            return
        p = target.probe
        prompt = p.prompt + p.token_ids[:-1] if p else self.probe_prompt
        body = {"request_id": f"refresh-probe-{uuid.uuid4().hex[:12]}", "prompt_token_ids": prompt,
                "sampling": {"temperature": 0.0, "max_tokens": 1 if p else self.probe_tokens,
                             "logprobs": 0, "prompt_logprobs": 0 if p else None,
                             "ignore_eos": True}, "stream": False}
        try:
            r = await http.post(f"{w.request_url}/generate", json=body, timeout=self.timeout)
            events = [json.loads(line) for line in r.text.splitlines() if line]
            status = r.status_code
        except (httpx.HTTPError, ValueError) as e:
            w.record("probe", "generate", None, {"error": repr(e)})
            w.exclude(f"post-update generation failed: {e!r}")
            return
        w.record("probe", "generate", status, events[-1] if events else r.text[:300])
        if status != 200 or not events or "error" in events[-1] or not events[-1].get("done"):
            w.exclude(f"post-update generation failed: HTTP {status} {r.text[:300]}")
            return
        if events[0].get("weight_digest") != target.digest:
            w.exclude(f"post-update generation ran on digest {events[0].get('weight_digest')}, "
                      f"not the target {target.digest}")
            return
        if p is None:
            return
        # (token, rank, logprob) at every expected position: teacher-forced, then generated
        forced = (events[-1].get("prompt_logprobs") or [])[len(p.prompt):]
        got = [(t, e.get(str(t), {}).get("rank"), e.get(str(t), {}).get("logprob"))
               for t, e in zip(p.token_ids[:-1], forced, strict=False) if e is not None]
        got += [(lp["token_id"], lp.get("rank"), lp["logprob"]) for ev in events
                for c in ev.get("choices", []) for lp in (c.get("logprobs") or [])]
        tokens_ok = len(got) == len(p.token_ids) and all(
            g[0] == t and g[1] == 1 and g[2] is not None for g, t in zip(got, p.token_ids,
                                                                          strict=False))
        worst = max((abs(g[2] - ref) for g, ref in zip(got, p.logprobs, strict=False)
                     if g[2] is not None), default=0.0)
        if not tokens_ok:
            w.exclude("post-update generation does not reproduce the target policy's greedy "
                      f"tokens (got {[g[0] for g in got]}, expected {p.token_ids})")
        elif worst > self.tolerance:
            w.exclude(f"post-update generation does not match the target policy: max logprob "
                      f"diff {worst:.2e} > {self.tolerance:g}")

    async def _rollback(self, ch: Channel, workers: dict[int, FleetWorker], previous: Policy,
                        why: str) -> None:
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
        await self._each(active(), lambda w: self._probe(ch.http, w, previous))
