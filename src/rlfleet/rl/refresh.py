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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from rlfleet.protocol.rl import PROTOCOL_VERSION
from rlfleet.rl.gate import RolloutGate
from rlfleet.rl.journal import Journal

log = logging.getLogger("rlfleet.refresh")


class UpdatePath(enum.StrEnum):
    VLLM_DISK = "vllm-disk"
    VLLM_DISTRIBUTED = "vllm-distributed"
    SGLANG_DISK = "sglang-disk"


_LIFECYCLE = {"pause_generation", "resume_generation", "get_weight_version", "liveness_probe",
              "flush_cache"}
REQUIRED_ROUTES: dict[UpdatePath, frozenset[str]] = {
    UpdatePath.VLLM_DISK: frozenset(_LIFECYCLE | {"update_weights_from_disk"}),
    UpdatePath.VLLM_DISTRIBUTED: frozenset(_LIFECYCLE | {
        "init_weights_update_group", "update_weights_from_distributed",
        "destroy_weights_update_group"}),
}


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


@dataclass
class SglangWorker:
    """An SGLang worker, whose URLs come from the deployment (SGLang workers are not in
    /v1/rl/workers)."""

    system_url: str
    request_url: str
    name: str = ""


@dataclass
class FleetWorker:
    instance_id: int
    system_url: str
    request_url: str | None
    model: str | None = None
    routes: frozenset[str] = frozenset()
    status: str = "selected"  # selected | excluded | missing | verified
    reason: str | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)

    def record(self, step: str, route: str, http_status: int | None, body: Any) -> None:
        self.calls.append({"step": step, "route": route, "http_status": http_status,
                           "body": body, "at": time.time()})

    def exclude(self, why: str, status: str = "excluded") -> None:
        if self.status in ("selected", "verified"):
            self.status, self.reason = status, why
            log.warning("worker %s %s: %s", self.instance_id, status, why)

    @property
    def active(self) -> bool:
        return self.status in ("selected", "verified")

    def summary(self) -> dict[str, Any]:
        return {"instance_id": self.instance_id, "system_url": self.system_url,
                "model": self.model, "status": self.status, "reason": self.reason,
                "calls": self.calls}


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
    def seconds(self) -> float:
        return sum(s["seconds"] for s in self.steps)

    def step_seconds(self) -> dict[str, float]:
        return {s["name"]: s["seconds"] for s in self.steps}

    @property
    def all_verified(self) -> bool:
        """The whole selected fleet moved: the refresh reopened on its target and every
        worker it selected is verified on it (`ok` holds as soon as one worker is)."""
        return self.state is RefreshState.REOPENED and bool(self.workers) and \
            all(w["status"] == "verified" for w in self.workers)


class RefreshHeld(Exception):
    """The refresh stops here; the fleet stays gated."""


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
        if self.path is UpdatePath.SGLANG_DISK and not sglang_workers:
            raise ValueError("the SGLang path needs sglang_workers (system and request URLs)")
        if self.path is not UpdatePath.SGLANG_DISK and not rl_url:
            raise ValueError("the vLLM paths need rl_url (the frontend's RL listener)")
        if pause_mode not in ("keep", "wait", "abort"):
            raise ValueError(f"pause_mode must be keep, wait or abort, not {pause_mode!r}")
        self.rl_url = rl_url.rstrip("/") if rl_url else None
        self.model = model
        self.sglang_workers = list(sglang_workers)
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
        self.headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.on_event = on_event or (lambda msg: log.info("%s", msg))
        self.current = current
        self.verified: set[int] = set()  # workers verified on self.current

    # ------------------------------------------------------------------ public API

    async def refresh(self, checkpoint: str | Path | None, version: str, *,
                      digest: str | None = None, probe: Probe | None = None,
                      tensors: Callable[[], Sequence[tuple[str, Any]]] | None = None,
                      step: int | None = None) -> RefreshResult:
        """Move every worker to the checkpoint at `checkpoint` (declared `version`)."""
        target = await self._policy(checkpoint, version, digest, probe, tensors)
        return await self._run(target, step=step, fleet_wide=True)

    async def admit_new_workers(self, step: int | None = None) -> RefreshResult:
        """Bring workers that joined (or restarted) onto the current policy and open them;
        the rest of the fleet keeps serving."""
        if self.current is None:
            raise RuntimeError("no current policy yet: run refresh() first")
        return await self._run(self.current, step=step, fleet_wide=False)

    # ------------------------------------------------------------------ building blocks

    async def _policy(self, checkpoint, version, digest, probe, tensors) -> Policy:
        path = str(Path(checkpoint).resolve()) if checkpoint is not None else None
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
        return Policy(version=version, digest=digest, path=path, probe=probe, tensors=tensors)

    async def _call(self, http: httpx.AsyncClient, w: FleetWorker, step: str, route: str,
                    body: dict[str, Any] | None = None, timeout: float | None = None
                    ) -> tuple[bool, dict[str, Any]]:
        """POST {system_url}/engine/<route>; ok means HTTP 200 and a body that says so."""
        try:
            r = await http.post(f"{w.system_url}/engine/{route}", json=body or {},
                                headers=self.headers, timeout=timeout or self.timeout)
            status = r.status_code
            try:
                data = r.json()
            except ValueError:
                data = {"raw": r.text[:500]}
        except httpx.HTTPError as e:
            w.record(step, route, None, {"error": repr(e)})
            return False, {"unreachable": True, "message": repr(e)}
        w.record(step, route, status, data)
        good = status == 200 and isinstance(data, dict) and (
            data.get("status") == "ok" or data.get("success") is True)
        return good, data if isinstance(data, dict) else {"body": data}

    async def _discover(self, http: httpx.AsyncClient) -> dict[int, FleetWorker]:
        if self.path is UpdatePath.SGLANG_DISK:
            return {i: FleetWorker(i, w.system_url.rstrip("/"), w.request_url.rstrip("/"),
                                   model=w.name or None)
                    for i, w in enumerate(self.sglang_workers)}
        r = await http.get(f"{self.rl_url}/v1/rl/workers", timeout=self.timeout)
        if r.status_code != 200:
            raise RefreshHeld(f"discovery failed: HTTP {r.status_code} {r.text[:300]}")
        body = r.json()
        if body.get("protocol_version") != PROTOCOL_VERSION:
            raise RefreshHeld(f"unsupported discovery protocol_version "
                              f"{body.get('protocol_version')!r} (this coordinator speaks 1)")
        out = {}
        for e in body.get("workers", []):
            if self.model is not None and e.get("model") != self.model:
                continue
            w = FleetWorker(int(e["instance_id"]), e.get("system_url", ""),
                            (e.get("transport") or {}).get("http"), e.get("model"),
                            frozenset(e.get("routes", [])))
            need = REQUIRED_ROUTES[self.path] - w.routes
            if e.get("error"):
                w.exclude(f"discovery probe failed: {e['error']}")
            elif not w.system_url:
                w.exclude("no system_url")
            elif need:
                w.exclude(f"missing routes for {self.path.value}: {sorted(need)}")
            out[w.instance_id] = w
        return out

    async def _each(self, workers: list[FleetWorker], fn) -> None:
        await asyncio.gather(*(fn(w) for w in workers))

    # ------------------------------------------------------------------ the lifecycle

    async def _run(self, target: Policy, *, step: int | None, fleet_wide: bool) -> RefreshResult:
        previous = self.current
        steps: list[dict[str, Any]] = []
        workers: dict[int, FleetWorker] = {}
        state = RefreshState.STARTED
        refresh_id = self.journal.begin(
            framework_step=step, update_path=self.path.value, target_path=target.path,
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
            try:
                if fleet_wide:
                    self.gate.close(f"policy refresh to {target.version}")
                move(RefreshState.GATED)
                found = await timed("resolve", self._discover(http))
                workers.update(found if fleet_wide else
                               {i: w for i, w in found.items() if i not in self.verified})
                self.journal.update(refresh_id, intended_workers=sorted(workers))
                if not active():
                    raise RefreshHeld("no worker to refresh" if fleet_wide
                                      else "no new worker to admit")
                move(RefreshState.RESOLVED)
                await timed("gate", self._each(list(workers.values()),
                                               lambda w: self._close(http, w, target)))
                await timed("pause", self._each(active(), lambda w: self._pause(http, w)))
                await self._membership(http, workers, target)
                move(RefreshState.PAUSED)
                try:
                    await timed("apply", self._apply_with_policy(http, active(), target))
                    move(RefreshState.APPLIED)
                    await timed("reset_cache", self._each(active(), lambda w: self._flush(http, w)))
                    move(RefreshState.CACHE_RESET)
                    await timed("verify", self._verify_all(http, active(), target))
                    move(RefreshState.VERIFIED)
                    await timed("resume", self._each(active(), lambda w: self._resume(http, w)))
                    move(RefreshState.RESUMED)
                    await timed("probe", self._each(active(), lambda w: self._probe(http, w, target)))
                    move(RefreshState.PROBED)
                except _Rollback as e:
                    if previous is None:
                        raise RefreshHeld(f"{e}; no previous policy to roll back to") from e
                    move(RefreshState.ROLLING_BACK)
                    await timed("rollback", self._rollback(http, workers, previous, str(e)))
                    target = previous
                    move(RefreshState.ROLLED_BACK)
                    decision, reason = "rolled_back", f"{e}; rolled back to {previous.version}"
                ok_workers = active()
                if len(ok_workers) < self.min_workers:
                    raise RefreshHeld(f"only {len(ok_workers)} worker(s) verified on "
                                      f"{target.version}; need {self.min_workers}")
                await timed("reopen", self._each(ok_workers, lambda w: self._open(http, w)))
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

    # ------------------------------------------------------------------ per-worker steps

    async def _close(self, http, w: FleetWorker, target: Policy) -> None:
        if self.path is UpdatePath.SGLANG_DISK or "set_admission" in w.routes:
            await self._call(http, w, "gate", "set_admission",
                             {"open": False, "reason": f"policy refresh to {target.version}"})

    async def _open(self, http, w: FleetWorker) -> None:
        if self.path is UpdatePath.SGLANG_DISK or "set_admission" in w.routes:
            ok, body = await self._call(http, w, "reopen", "set_admission", {"open": True})
            if not ok and self.path is not UpdatePath.SGLANG_DISK:
                w.exclude(f"reopen failed: {body.get('message', body)}")

    async def _pause(self, http, w: FleetWorker) -> None:
        body = {} if self.path is UpdatePath.SGLANG_DISK else \
            {"mode": self.pause_mode, "clear_cache": False}
        ok, data = await self._call(http, w, "pause", "pause_generation", body)
        if not ok:
            w.exclude(f"pause failed: {data.get('message', data)}",
                      "missing" if data.get("unreachable") else "excluded")

    async def _membership(self, http, workers: dict[int, FleetWorker], target: Policy) -> None:
        """Membership changes before transfer: refresh the set."""
        if self.path is UpdatePath.SGLANG_DISK:
            return
        now = await self._discover(http)
        for iid, w in workers.items():
            if iid not in now and w.active:
                w.exclude("left discovery before the transfer", "missing")
        for iid, w in now.items():
            if iid not in workers and w.active and iid not in self.verified:
                workers[iid] = w
                await self._close(http, w, target)
                await self._pause(http, w)
                self.on_event(f"worker {iid} joined during the refresh: included")

    async def _apply(self, http, ws: list[FleetWorker], target: Policy) -> list[FleetWorker]:
        """Transfer and apply; returns the workers whose transfer failed."""
        failed: list[FleetWorker] = []
        if self.path is UpdatePath.VLLM_DISTRIBUTED:
            return await self._apply_distributed(ws, target)

        async def one(w: FleetWorker) -> None:
            if self.path is UpdatePath.SGLANG_DISK:
                route, body = "control/update_weights_from_disk", {
                    "model_path": target.path, "weight_version": target.version,
                    "flush_cache": True, "keep_pause": True}
            else:
                route, body = "update_weights_from_disk", {
                    "model_path": target.path, "weight_version": target.version}
            ok, data = await self._call(http, w, "apply", route, body)
            if not ok:
                if data.get("unreachable"):
                    w.exclude(f"unreachable at transfer: {data.get('message')}", "missing")
                else:
                    w.reason = f"transfer failed: {data.get('message', data)}"
                    failed.append(w)
        await self._each(ws, one)
        return failed

    async def _apply_distributed(self, ws: list[FleetWorker], target: Policy
                                 ) -> list[FleetWorker]:
        from rlfleet.weights.broadcast import TransferError, push_weights

        tensors = await asyncio.to_thread(target.tensors)
        try:
            results = await push_weights([w.system_url for w in ws], tensors, target.version,
                                         timeout=self.timeout, admin_token=self.admin_token)
        except TransferError as e:
            for w, r in zip(ws, e.results or [{}] * len(ws), strict=False):
                w.record("apply", "update_weights_from_distributed", r.get("http_status"), r)
                w.reason = f"transfer failed: {e}"
            return list(ws)
        failed = []
        for w, r in zip(ws, results, strict=True):
            w.record("apply", "update_weights_from_distributed", r.get("http_status"), r)
            if r.get("status") != "ok":
                w.reason = f"transfer failed: {r.get('message')}"
                failed.append(w)
        return failed

    async def _apply_with_policy(self, http, ws: list[FleetWorker], target: Policy) -> None:
        failed = await self._apply(http, ws, target)
        tries = 0
        while failed and self.on_failure is OnFailure.RETRY and tries < self.retries:
            tries += 1
            self.on_event(f"retrying the transfer to {len(failed)} worker(s) ({tries}/{self.retries})")
            # a distributed group is rebuilt around the workers that still need it
            failed = await self._apply(http, failed, target)
        if not failed:
            return
        why = (f"transfer failed on {len(failed)} of {len(ws)} worker(s): "
               + "; ".join(f"{w.instance_id}: {w.reason}" for w in failed))
        if self.on_failure is OnFailure.ROLLBACK:
            raise _Rollback(why)
        raise RefreshHeld(why + f" (policy {self.on_failure.value}: the fleet stays gated)")

    async def _flush(self, http, w: FleetWorker) -> None:
        if self.path is UpdatePath.SGLANG_DISK:
            return  # the update itself flushed (flush_cache: true), checked in its body
        ok, data = await self._call(http, w, "reset_cache", "flush_cache")
        if not ok:
            w.exclude(f"cache reset failed: {data.get('message', data)}")

    async def _verify_all(self, http, ws: list[FleetWorker], target: Policy) -> None:
        mismatched: list[str] = []

        async def one(w: FleetWorker) -> None:
            if self.path is UpdatePath.SGLANG_DISK:
                return  # no version route on SGLang: the probe checks the digest
            (ok, v), (alive, live) = await asyncio.gather(
                self._call(http, w, "verify", "get_weight_version"),
                self._call(http, w, "verify", "liveness_probe"))
            if not ok:
                w.exclude(f"version check failed: {v.get('message', v)}")
                return
            if v.get("version") != target.version or v.get("weight_digest") != target.digest:
                mismatched.append(f"{w.instance_id} reports {v.get('version')!r} / "
                                  f"{v.get('weight_digest')}")
                w.exclude("version or digest differs from the target")
                return
            if not alive:
                w.exclude(f"liveness probe failed: {live.get('message', live)}")
        await self._each(ws, one)
        if mismatched:
            raise RefreshHeld(f"version check differs on {', '.join(mismatched)}: a synchronous "
                              f"fleet does not reopen (target {target.version} / {target.digest})")

    async def _resume(self, http, w: FleetWorker) -> None:
        if self.path is UpdatePath.SGLANG_DISK:
            ok, data = await self._call(http, w, "resume", "continue_generation",
                                        {"torch_empty_cache": False})
        else:
            ok, data = await self._call(http, w, "resume", "resume_generation")
        if not ok:
            w.exclude(f"resume failed: {data.get('message', data)}")

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

    async def _rollback(self, http, workers: dict[int, FleetWorker], previous: Policy,
                        why: str) -> None:
        """Reapply the previous policy to every worker still in the set and verify it the
        same way; a worker that fails any step stays out."""
        ws = [w for w in workers.values() if w.active]
        self.on_event(f"rolling back {len(ws)} worker(s) to {previous.version}: {why}")
        failed = await self._apply(http, ws, previous)
        for w in failed:
            w.exclude(f"rollback transfer failed: {w.reason}")
        ws = [w for w in ws if w.active]
        await self._each(ws, lambda w: self._flush(http, w))
        await self._verify_all(http, [w for w in ws if w.active], previous)
        await self._each([w for w in ws if w.active], lambda w: self._resume(http, w))
        await self._each([w for w in ws if w.active], lambda w: self._probe(http, w, previous))
