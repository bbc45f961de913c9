"""`rlfleet demo --async`: the demo's task, trainer and fleet, with the asynchronous loop.

Rollouts never stop (rlfleet.rl.stream): while the trainer runs a GRPO step on one batch,
the fleet generates the next; every sample handed to the trainer has all its tokens from
policies at most `max_staleness` steps behind the trainer's (checked span by span); after
each step the trainer publishes step-N and a rolling refresh moves the two workers one at
a time while the other serves. The trainer/engine logprob check compares each token with
the trainer's recomputation under the policy that token came from (the trainer keeps the
last few policies' weights), and the update is decoupled PPO (the clip around the
trainer's current policy, each token weighted by current / behaviour probability), so that
a token one step old still moves the policy.

The report adds, per step: each sample's staleness, the handed tokens per staleness, the
seconds the trainer waited; and over the run: the trainer's and the fleet's idle
fractions (rlfleet.rl.stream.StreamStats).
"""

from __future__ import annotations

import asyncio
import copy
import shutil
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import torch

from rlfleet.demo import (
    MODEL_NAME,
    DemoFailed,
    DemoRun,
    check_refresh,
    choose_probe,
    refresh_record,
    wait_listed,
)
from rlfleet.protocol.nvext import PolicyBound
from rlfleet.refresh.coordinator import PolicyRefresh
from rlfleet.refresh.probe import Probe
from rlfleet.rl import Fleet, PartialRolloutPolicy, RetryPolicy, SampleRequest, SamplingSpec
from rlfleet.rl.stream import StreamedSample, numbered
from rlfleet.testing.fleet import LocalFleet
from rlfleet.train.checkpoint import save_checkpoint
from rlfleet.train.grpo import GrpoTrainer, Rollout
from rlfleet.train.task import SevensTask
from rlfleet.weights.digest import checkpoint_digest


class PolicyScorer:
    """The trainer's recent policies (weights kept in memory, by fleet step) and the
    logprobs each gives a completion's tokens: what the engine's logprobs must match, token
    by token, under the policy its span names."""

    def __init__(self, trainer: GrpoTrainer, keep: int) -> None:
        self.trainer, self.keep = trainer, keep
        self.model = copy.deepcopy(trainer.model).eval()
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self._loaded: int | None = None

    def remember(self, step: int) -> None:
        self.weights[step] = {k: v.detach().clone() for k, v in self.trainer.state_dict().items()}
        for old in sorted(self.weights)[:-self.keep]:
            del self.weights[old]

    @torch.no_grad()
    def logprobs(self, step: int, prompt: list[int], completion: list[int]) -> list[float]:
        if self._loaded != step:
            self.model.load_state_dict(self.weights[step])
            self._loaded = step
        model, self.trainer.model = self.trainer.model, self.model
        try:  # the trainer's own recomputation, on the scorer's copy of the weights
            return self.trainer.completion_logprobs([prompt], [completion])[0].tolist()
        finally:
            self.trainer.model = model

    def mismatch(self, batch: list[StreamedSample]) -> tuple[float, float, int]:
        """(max, mean) |trainer - engine| over every token, each under its span's policy."""
        diffs: list[float] = []
        for x in batch:
            for c in x.sample.completions:
                for sp in c.weight_spans or []:
                    lps = self.logprobs(sp.step, x.sample.prompt_ids, list(c.token_ids))
                    diffs += [abs(a - b) for a, b in zip(lps[sp.start:sp.end],
                                                         c.logprobs[sp.start:sp.end], strict=True)]
        return max(diffs, default=0.0), sum(diffs) / max(1, len(diffs)), len(diffs)


def to_rollouts(batch: list[StreamedSample], task: SevensTask) -> list[Rollout]:
    return [Rollout(g, x.sample.prompt_ids, list(c.token_ids), list(c.logprobs),
                    task.reward(c.token_ids))
            for g, x in enumerate(batch) for c in x.sample.completions]


def initial_policy(run: DemoRun, lf: LocalFleet, trainer: GrpoTrainer, base: Path, ids: set[int],
                   probe: Probe) -> dict[str, Any]:
    """step-0 on every worker, synchronously (it admits the gated workers, and a rolling
    refresh needs workers that declare a step)."""
    out = run.out
    path = save_checkpoint(trainer.state_dict(), base, out / "checkpoints" / "step-0")
    digest = checkpoint_digest(path)
    coordinator = PolicyRefresh(lf.rl_url, model=MODEL_NAME, journal=out / "journal.sqlite",
                                min_workers=len(ids), timeout=120, on_event=run.events.append)

    async def go():
        async with httpx.AsyncClient() as http:
            await wait_listed(http, lf.rl_url, ids)
        return await coordinator.refresh(path, "step-0", digest=digest, probe=probe, step=0)

    try:
        t0 = time.monotonic()
        result = asyncio.run(go())
    finally:
        coordinator.close()
    check_refresh(result, "step-0", digest, ids)
    run.versions.append({"version": "step-0", "digest": digest, "path": str(path)})
    return refresh_record(result, time.monotonic() - t0)


def make_fleet(run: DemoRun, lf: LocalFleet) -> Fleet:
    cfg, out = run.cfg, run.out
    return Fleet(lf.url, MODEL_NAME, rl_url=lf.rl_url, ledger=out / "ledger.sqlite",
                 journal=out / "journal.sqlite", mode="rolling", max_lag=cfg.max_staleness + 1,
                 min_serving=1, timeout=120, pause_mode="keep",
                 partial=PartialRolloutPolicy("resume"), on_event=run.events.append,
                 retry=RetryPolicy(max_attempts=4, backoff_initial=0.2, attempt_timeout=120))


def step_record(step: int, batch: list[StreamedSample], rollouts: list[Rollout], stats,
                mismatch: tuple[float, float, int], waited: float, t_train: float) -> dict:
    steps = sorted({st for x in batch for st in x.steps})
    tokens: dict[str, int] = {}
    for x in batch:
        for c in x.sample.completions:
            for sp in c.weight_spans or []:
                k = str(x.trainer_step - sp.step)
                tokens[k] = tokens.get(k, 0) + sp.end - sp.start
    return {"step": step, "mean_reward": sum(r.reward for r in rollouts) / len(rollouts),
            "policy_version": f"step-{step - 1}", "token_policy_steps": steps,
            "admitted": len(rollouts), "rejected": 0,
            "sample_staleness": [x.staleness for x in batch],
            "tokens_by_staleness": tokens, "trainer_wait_seconds": waited,
            "max_abs_logprob_diff": mismatch[0], "mean_abs_logprob_diff": mismatch[1],
            "tokens_checked": mismatch[2],
            "policy_change_max_abs_logprob": stats.max_abs_logprob_diff,
            "loss": stats.loss, "grad_norm": stats.grad_norm,
            "groups_with_signal": stats.groups_with_signal, "train_seconds": t_train}


def train_async(run: DemoRun, lf: LocalFleet, trainer: GrpoTrainer, task: SevensTask,
                base: Path, ids: set[int]) -> None:
    cfg, out = run.cfg, run.out
    candidates = [task.prompt(a, b, c) for a, b, c in
                  ((0, 0, 0), (1, 2, 3), (4, 5, 6), (7, 8, 9), (3, 1, 4), (2, 7, 1))]
    scorer = PolicyScorer(trainer, keep=cfg.max_staleness + 2)
    scorer.remember(0)
    probe, _, _ = choose_probe(trainer, candidates, cfg.completion_tokens)
    run.initial_refresh = initial_policy(run, lf, trainer, base, ids, probe)
    print(f"step-0 (warmed-up policy) on {len(ids)} workers, verified in "
          f"{run.initial_refresh['seconds']:.2f} s; async loop, max_staleness "
          f"{cfg.max_staleness}, rolling refreshes", flush=True)
    print(f"{'step':>4} {'reward':>7} {'waited':>7} {'staleness':>10} {'max|Δlogprob|':>14}  "
          "token policies", flush=True)
    spec = SamplingSpec(max_tokens=cfg.completion_tokens, temperature=1.0, ignore_eos=True)
    tag = uuid.uuid4().hex[:8]
    requests = numbered(lambda i: SampleRequest(f"{tag}/s{i}", task.prompts(1)[0], spec,
                                                n=cfg.group_size))
    fleet = make_fleet(run, lf)
    try:
        stream = fleet.stream_rollouts(requests, cfg.prompts, max_staleness=cfg.max_staleness,
                                       start_step=0)
        for step in range(1, cfg.steps + 1):
            before = stream.stats.trainer_wait_seconds + stream.stats.refresh_wait_seconds
            batch = stream.next_batch(timeout=300)
            t0 = time.monotonic()
            mismatch = scorer.mismatch(batch)
            rollouts = to_rollouts(batch, task)
            stats = trainer.step(rollouts, decoupled=True)  # stale tokens: decoupled PPO
            version = f"step-{step}"
            path = save_checkpoint(trainer.state_dict(), base, out / "checkpoints" / version)
            digest = checkpoint_digest(path)
            probe, _, _ = choose_probe(trainer, candidates, cfg.completion_tokens)
            scorer.remember(step)
            t_train = time.monotonic() - t0
            stream.publish(path, version, digest=digest, probe=probe, step=step)
            run.versions.append({"version": version, "digest": digest, "path": str(path)})
            old = out / "checkpoints" / f"step-{step - cfg.max_staleness - 2}"
            shutil.rmtree(old, ignore_errors=True)  # kept: those a refresh may still need
            waited = stream.stats.trainer_wait_seconds + stream.stats.refresh_wait_seconds - before
            rec = step_record(step, batch, rollouts, stats, mismatch, waited, t_train)
            run.steps.append(rec)
            print(f"{step:>4} {rec['mean_reward']:>7.3f} {waited:>6.2f}s "
                  f"{max(rec['sample_staleness']):>10} {mismatch[0]:>14.2e}  "
                  f"{rec['token_policy_steps']}", flush=True)
        stream.wait_refreshed(300)
        stream.close()
        finish(run, stream, fleet, task, spec, tag)
    finally:
        fleet.close()


def finish(run: DemoRun, stream, fleet: Fleet, task: SevensTask, spec: SamplingSpec,
           tag: str) -> None:
    """The refresh records into the steps, the stream's totals, and the final policy's
    reward (measured the same way, no update)."""
    cfg = run.cfg
    summary = stream.stats.summary()
    by_step = {r["step"]: r for r in summary["refreshes"]}  # the last attempt of each
    for rec in run.steps:
        r = by_step.get(rec["step"], {})
        rec.update(refreshed_to=f"step-{rec['step']}", refresh=r,
                   refresh_seconds=r.get("seconds", 0.0),
                   refresh_phase_seconds=r.get("phase_seconds", {}))
    run.stream = summary
    failed = [r for r in by_step.values() if r.get("decision") != "reopened"]
    if failed:
        raise DemoFailed(f"refreshes that did not reopen the fleet: {failed}")
    rules = replace(fleet.client.rules, policy=PolicyBound(min_step=cfg.steps))
    outs = fleet.rollout([SampleRequest(f"{tag}/final{g}", p, spec, n=cfg.group_size)
                          for g, p in enumerate(task.prompts(cfg.prompts))], rules=rules)
    rewards = [task.reward(c.token_ids) for o in outs if o.sample for c in o.sample.completions]
    run.final_eval = {"step": cfg.steps + 1, "policy_version": f"step-{cfg.steps}",
                      "mean_reward": sum(rewards) / max(1, len(rewards)),
                      "admitted": len(rewards),
                      "rejected": cfg.prompts * cfg.group_size - len(rewards)}
    print(f"final policy step-{cfg.steps}: mean reward {run.final_eval['mean_reward']:.3f}; "
          f"trainer idle {summary['trainer_idle_fraction']:.0%}, fleet idle "
          f"{summary['fleet_idle_fraction']:.0%}, tokens by staleness "
          f"{summary['tokens_by_staleness']}", flush=True)
