"""The asynchronous loop (Fleet.stream_rollouts) on two real vLLM workers with the demo's
GRPO trainer (real optimizer steps, float32): rollouts go on while the trainer trains,
each step is published with a rolling refresh. The run admits every sample once, never
hands the trainer a token beyond the bound (checked from the spans), survives its
coordinator dying mid-refresh (a new one takes over and recovers the transaction from the
journal) and a worker killed mid-run, and the trainer's recomputed logprobs match the
engine's, token by token, for the policy each token came from (< 1e-4 in float32)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections import defaultdict

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlfleet.demo_async import PolicyScorer
from rlfleet.integrations.trl_async import FleetAsyncLink, FleetRolloutWorker, FleetWeightTransfer
from rlfleet.rl import (
    Fleet,
    PartialRolloutPolicy,
    PolicyRefresh,
    RefreshHooks,
    RetryPolicy,
    SampleRequest,
    SamplingSpec,
)
from rlfleet.rl.stream import numbered
from rlfleet.train.checkpoint import save_checkpoint
from rlfleet.train.grpo import GrpoTrainer, Rollout
from tests.fleets import MODEL_NAME, RL_PROBE_ENV, vllm_worker_args

pytestmark = pytest.mark.engine

STEPS = 6
BATCH = 2  # requests per batch, each with n = GROUP choices
GROUP = 4
TOKENS = 8
MAX_STALENESS = 1
SPEC = SamplingSpec(max_tokens=TOKENS, temperature=1.0, ignore_eos=True)
PROMPTS = [[151644, 872, 198, 40 + i, 1079, 264] for i in range(16)]


class CoordinatorDied(BaseException):
    """The coordinator's process ends here (nothing after this point runs, as in a kill)."""


class DieOnce(RefreshHooks):
    """At `point` of the `nth` refresh: a new coordinator takes over the Fleet (the
    restarted process, same journal) and the old one dies."""

    def __init__(self, fleet_box: list, point: str, nth: int) -> None:
        self.box, self.point, self.nth, self.seen, self.died = fleet_box, point, nth, 0, False

    def wants(self, point: str) -> bool:
        return point == self.point and not self.died

    def reached(self, point: str) -> None:
        self.seen += 1
        if self.seen == self.nth:
            self.died = True
            fleet = self.box[0]
            old = fleet.coordinator
            fleet.coordinator = PolicyRefresh(config=old.config, journal=old.config.journal,
                                              rollout_gate=fleet.rollout_gate)
            raise CoordinatorDied(f"coordinator died at {point}")


@pytest.fixture(scope="module")
def af(tmp_path_factory, start_module_fleet, tiny_model):
    tmp = tmp_path_factory.mktemp("async-vllm")
    root = tmp / "checkpoints"
    root.mkdir()
    fleet = start_module_fleet(
        [vllm_worker_args(tiny_model, MODEL_NAME, "--allowed-weights-root", str(root))] * 2,
        kind="vllm", model=MODEL_NAME, enable_rl=True, frontend_env=RL_PROBE_ENV)
    fleet.root, fleet.tmp = root, tmp
    return fleet


def publish_sync(f, trainer: GrpoTrainer, base, journal: str) -> int:
    path = save_checkpoint(trainer.state_dict(), base, f.root / "main" / "step-0")
    r = PolicyRefresh(f.rl_url, model=MODEL_NAME, journal=journal, timeout=120)
    try:  # the next step above whatever the fleet serves
        res = asyncio.run(r.refresh(path, "main-0", probe=trainer.probe(PROMPTS[0], 8)[0]))
    finally:
        r.close()
    assert res.fleet_moved, res.reason
    return res.policy.step


def test_trl_async_grpo_hooks_with_real_steps(af, tiny_model):
    """TRL 1.16's AsyncGRPOTrainer hooks (rollout worker, weight transfer) driven in the
    order its trainer calls them, TRL's own RolloutQueueDataset (and its max_staleness
    drop) feeding real Adam steps of the tiny model; the trainer itself needs a CUDA
    flash-attention kernel, so its training loop cannot run here."""
    from accelerate import PartialState
    from trl.experimental.async_grpo.async_grpo_trainer import (
        RolloutQueueDataset,
        _iter_vllm_named_params,
    )

    # TRL's RolloutQueueDataset logs through accelerate's logger (a long wait, a stale drop),
    # which raises without the state the trainer's Accelerator sets up: set it up the same way
    PartialState()

    f = af
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    dataset = [{"prompt": "Write digits:", "target": "7"}, {"prompt": "Count up:", "target": "1"}]

    def reward(prompts, completions, completion_ids, target, **kw):
        return [c.count(t) / max(1, len(c)) for c, t in zip(completions, target, strict=True)]

    fleet = Fleet(f.url, MODEL_NAME, rl_url=f.rl_url, journal=str(f.tmp / "trl.sqlite"),
                  mode="rolling", max_lag=3, min_serving=1, timeout=120, pause_mode="keep",
                  retry=RetryPolicy(4, backoff_initial=0.2, attempt_timeout=120))
    link = FleetAsyncLink(fleet, f.root / "trl", tiny_model, max_staleness=2)
    worker = FleetRolloutWorker(link, dataset, [reward], tokenizer, num_generations=GROUP,
                                sampling=SPEC, batch_size=2)
    transfer = FleetWeightTransfer(link)
    version = [0]
    metrics = defaultdict(list)

    def sync_weight():  # AsyncGRPOTrainer._sync_weight_merged, main process, no PEFT
        transfer.pause()
        transfer.send_weights((n, p.detach()) for n, p in _iter_vllm_named_params(model))
        transfer.resume()
        version[0] += 1
        worker.update_model_version(version[0])

    first_diff = None
    try:
        transfer.init_weight_transfer()
        sync_weight()  # at train begin, then the worker starts
        worker.start()
        data = iter(RolloutQueueDataset(worker.rollout_buffer, lambda: version[0],
                                        worker.check_health, 120, metrics, max_staleness=2,
                                        poll_interval_s=1.0))
        for step in range(4):
            items = [next(data) for _ in range(2 * GROUP)]
            terms, diffs = [], []
            for it in items:
                ids = torch.as_tensor(it["input_ids"])
                logits = model(ids[None]).logits[0, :-1].float()
                lp = torch.log_softmax(logits, -1).gather(1, ids[1:, None])[:, 0]
                mask = torch.as_tensor(it["completion_mask"][1:]) == 1
                old = torch.as_tensor(it["old_log_probs"][1:])[mask]
                diffs.append((lp[mask].detach() - old).abs().max().item())
                ratio = torch.exp(lp[mask] - old)
                terms.append(-(ratio.clamp(0.8, 1.2) * it["advantage"]))
            if step == 0:
                first_diff = max(diffs)
            loss = torch.cat(terms).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sync_weight()
        link.stream.wait_refreshed(300)
        stats = link.stream.stats
    finally:
        transfer.destroy()
        worker.stop()
        fleet.close()
    # before the first update the trainer's model is the policy that generated the samples
    assert first_diff is not None and first_diff < 1e-4, first_diff
    assert link.version == 5 and version[0] == 5
    assert stats.max_staleness_seen is not None and stats.max_staleness_seen <= 2
    assert max(metrics["sample/staleness_max"]) <= 2
    steps = [r for r in stats.refreshes if r["decision"] == "reopened"]
    assert [r["step"] for r in steps] == [link.first_step + v for v in range(1, 5)], stats.refreshes


def test_async_run_on_vllm(af, tiny_model):
    f = af
    journal = str(f.tmp / "journal.sqlite")
    trainer = GrpoTrainer(tiny_model, lr=3e-3, seed=0, threads=1)
    scorer = PolicyScorer(trainer, keep=STEPS + 1)  # every policy, for the checks
    start = publish_sync(f, trainer, tiny_model, journal)
    scorer.remember(start)
    box: list = []
    hooks = DieOnce(box, "paused", nth=2)  # during the refresh to the second step
    fleet = Fleet(f.url, MODEL_NAME, rl_url=f.rl_url, journal=journal, mode="rolling",
                  max_lag=MAX_STALENESS + 1, min_serving=1, timeout=120, pause_mode="keep",
                  partial=PartialRolloutPolicy("resume"), hooks=hooks,
                  retry=RetryPolicy(4, backoff_initial=0.2, attempt_timeout=120))
    box.append(fleet)
    requests = numbered(lambda i: SampleRequest(f"a-{i}", PROMPTS[i % len(PROMPTS)], SPEC,
                                                n=GROUP))
    handed = []
    killed = None
    try:
        stream = fleet.stream_rollouts(requests, BATCH, max_staleness=MAX_STALENESS,
                                       start_step=start)
        for k in range(1, STEPS + 1):
            batch = stream.next_batch(timeout=300)
            handed += batch
            trainer.step([Rollout(g, x.sample.prompt_ids, list(c.token_ids), list(c.logprobs),
                                  float(sum(t % 2 for t in c.token_ids)))
                          for g, x in enumerate(batch) for c in x.sample.completions])
            path = save_checkpoint(trainer.state_dict(), tiny_model, f.root / "main" / f"step-{k}")
            scorer.remember(start + k)
            stream.publish(path, f"main-{k}", probe=trainer.probe(PROMPTS[0], 8)[0],
                           step=start + k)
            if k == 4:  # a worker dies while rollouts are in flight
                killed = f.workers[-1]
                os.killpg(killed.pid, signal.SIGKILL)
        stream.wait_refreshed(300)
        stream.close()
        stats = stream.stats
        admitted = fleet.ledger.admitted()
    finally:
        fleet.close()
    assert killed is not None and killed.popen.wait(30) is not None

    # every sample handed once, each one admitted once in the ledger
    ids = [x.sample.sample_id for x in handed]
    assert len(ids) == STEPS * BATCH and len(set(ids)) == len(ids) and set(ids) <= set(admitted)
    # no token beyond the bound, from the spans (and the stream's own count agrees)
    tokens = 0
    for x in handed:
        for c in x.sample.completions:
            assert sum(sp.end - sp.start for sp in c.weight_spans) == len(c.token_ids) == TOKENS
            assert all(x.trainer_step - sp.step <= MAX_STALENESS for sp in c.weight_spans)
            tokens += len(c.token_ids)
    assert sum(stats.tokens_by_staleness.values()) == tokens
    assert max(stats.tokens_by_staleness) <= MAX_STALENESS
    # the run overlapped: some tokens were trained a step after their policy
    assert stats.tokens_by_staleness.get(1, 0) > 0, stats.tokens_by_staleness

    # the trainer's recomputed logprobs, under each token's own policy, match the engine's
    worst, mean, n = scorer.mismatch(handed)
    assert n == tokens and worst < 1e-4, (worst, mean)
    # and the check can fail: under the policy one step off, stale tokens differ clearly
    off = max(abs(a - b) for x in handed if x.staleness == 1 for c in x.sample.completions
              for a, b in zip(scorer.logprobs(x.trainer_step, x.sample.prompt_ids,
                                              list(c.token_ids)), c.logprobs, strict=True))
    assert off > 1e-3, off

    # every step's refresh reopened the fleet in the end: the coordinator that died mid-refresh
    # was replaced and its transaction recovered; after the kill the one worker left is
    # refreshed synchronously
    refreshes = stats.refreshes
    final = {r["step"]: r for r in refreshes}
    assert sorted(final) == [start + k for k in range(1, STEPS + 1)]
    assert all(r["decision"] == "reopened" for r in final.values()), refreshes
    died = [r for r in refreshes if r["decision"] == "error"]
    assert len(died) == 1 and "coordinator died at paused" in died[0]["reason"]
    retried = [r for r in refreshes if r["step"] == died[0]["step"] and r["attempt"] > 1]
    assert retried and "recovered" in retried[-1], refreshes
    assert any(r.get("mode") == "sync" for r in final.values() if r["step"] > start + 4), refreshes
