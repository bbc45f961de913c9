"""A GRPO trainer on a transformers float32 model: supervised warm-up, logprob recomputation
of the fleet's samples, one policy-gradient step per batch, and the refresh probe.

GRPO (group-relative policy optimisation): each prompt is sampled G times; a completion's
advantage is its reward minus its group's mean, divided by the group's standard deviation;
the loss is the PPO-clipped policy gradient with the engine's logprobs as the behaviour
policy. With one update per batch the trainer's policy equals the behaviour policy, so the
ratio is 1 up to the engine/trainer numerical mismatch, which is measured on every token."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from rlfleet.models.tokenizer import ENDOFTEXT_ID
from rlfleet.refresh.probe import Probe


@dataclass(frozen=True)
class Rollout:
    """One admitted completion: what the engine generated and how likely it said it was."""

    group: int  # completions of the same prompt share a group
    prompt: list[int]
    completion: list[int]
    logprobs: list[float]  # the engine's (behaviour policy)
    reward: float


@dataclass(frozen=True)
class StepStats:
    loss: float
    max_abs_logprob_diff: float  # trainer vs engine, over every token of the batch
    mean_abs_logprob_diff: float
    tokens: int
    groups_with_signal: int  # groups whose rewards were not all equal
    grad_norm: float


def group_advantages(rollouts: Sequence[Rollout], eps: float = 1e-6) -> list[float]:
    """(reward - group mean) / (group std + eps); zero for a group whose rewards are equal."""
    groups: dict[int, list[float]] = {}
    for r in rollouts:
        groups.setdefault(r.group, []).append(r.reward)
    stats = {}
    for g, rs in groups.items():
        t = torch.tensor(rs, dtype=torch.float64)
        stats[g] = (float(t.mean()), float(t.std(unbiased=False)) if len(rs) > 1 else 0.0)
    out = []
    for r in rollouts:
        mean, std = stats[r.group]
        out.append(0.0 if std < eps else (r.reward - mean) / (std + eps))
    return out


class GrpoTrainer:
    """Owns the trainable policy (a transformers model loaded in float32 from `base`) and its
    Adam optimiser. `rl_params`: "all", or "layers" to keep the (tied) embeddings fixed
    during the RL steps."""

    def __init__(self, base: Path, *, lr: float = 2e-3, clip: float = 0.2, seed: int = 0,
                 rl_params: str = "all", threads: int | None = None) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.base = Path(base)
        self.model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        self.model.train()
        self.clip = clip
        self.lr = lr
        if rl_params not in ("all", "layers"):
            raise ValueError(f"rl_params must be 'all' or 'layers', not {rl_params!r}")
        params = [p for n, p in self.model.named_parameters()
                  if rl_params == "all" or "embed_tokens" not in n]
        self.optimizer = torch.optim.Adam(params, lr=lr)

    # ------------------------------------------------------------------ forward passes

    def completion_logprobs(self, prompts: Sequence[list[int]], completions: Sequence[list[int]]
                            ) -> list[torch.Tensor]:
        """log p(completion token | prefix) for each sequence (log-softmax over the full
        vocabulary at temperature 1), one tensor per sequence, with gradients."""
        seqs = [list(p) + list(c) for p, c in zip(prompts, completions, strict=True)]
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), ENDOFTEXT_ID, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        rows, cols, targets, sizes = [], [], [], []
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            ids[i, :len(p) + len(c)] = torch.tensor(seqs[i])
            mask[i, :len(p) + len(c)] = 1
            rows += [i] * len(c)
            cols += range(len(p) - 1, len(p) + len(c) - 1)  # the position that predicts c[j]
            targets += c
            sizes.append(len(c))
        hidden = self.model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        logits = self.model.lm_head(hidden[torch.tensor(rows), torch.tensor(cols)]).float()
        lps = torch.log_softmax(logits, -1).gather(1, torch.tensor(targets)[:, None])[:, 0]
        return list(torch.split(lps, sizes))

    @torch.no_grad()
    def probe(self, prompt: list[int], n: int = 8) -> tuple[Probe, float]:
        """Greedy `n` tokens from `prompt` with their log-softmax logprobs (what every worker
        must reproduce after a refresh), and the smallest gap between the best and the
        second-best logit along the way (a near tie would make greedy decoding fragile)."""
        seq, lps, margin = list(prompt), [], float("inf")
        for _ in range(n):
            logits = self.model(torch.tensor([seq])).logits[0, -1].float()
            lsm = torch.log_softmax(logits, -1)
            top = torch.topk(lsm, 2)
            margin = min(margin, float(top.values[0] - top.values[1]))
            t = int(top.indices[0])
            seq.append(t)
            lps.append(float(lsm[t]))
        return Probe(list(prompt), seq[len(prompt):], lps), margin

    # ------------------------------------------------------------------ updates

    def warm_up(self, batch: Callable[[], tuple[list[list[int]], list[list[int]]]], steps: int,
                lr: float = 1e-2, on_step: Callable[[int, float], None] | None = None
                ) -> list[float]:
        """Supervised cross-entropy on (prompt, target completion) batches: `steps` Adam
        steps with their own optimiser, all parameters. Returns the losses."""
        opt = torch.optim.Adam(self.model.parameters(), lr=lr)
        losses = []
        for i in range(steps):
            prompts, targets = batch()
            lps = torch.cat(self.completion_logprobs(prompts, targets))
            loss = -lps.mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if on_step:
                on_step(i, losses[-1])
        self.model.zero_grad(set_to_none=True)
        return losses

    def step(self, rollouts: Sequence[Rollout], *, decoupled: bool = False,
             max_weight: float = 2.0) -> StepStats:
        """One GRPO update on the admitted rollouts (token-level mean of the clipped
        surrogate), after measuring the trainer/engine logprob mismatch on every token.
        `decoupled` (for samples of older policies, the asynchronous loop): the clip is
        around the trainer's current policy (the proximal one) and each token is weighted
        by current / behaviour probability, capped at `max_weight` (decoupled PPO), so that
        a stale token still moves the policy instead of being clipped away."""
        if not rollouts:
            raise ValueError("no rollouts to train on")
        adv = group_advantages(rollouts)
        lps = self.completion_logprobs([r.prompt for r in rollouts],
                                       [r.completion for r in rollouts])
        terms, diffs = [], []
        for r, a, lp in zip(rollouts, adv, lps, strict=True):
            old = torch.tensor(r.logprobs, dtype=torch.float32)
            if old.shape != lp.shape:
                raise ValueError(f"{len(r.logprobs)} engine logprobs for {lp.numel()} tokens")
            diffs.append((lp.detach() - old).abs())
            anchor, weight = (lp.detach(), torch.exp(lp.detach() - old).clamp(max=max_weight)) \
                if decoupled else (old, 1.0)
            ratio = torch.exp(lp - anchor)
            terms.append(-weight * torch.minimum(
                ratio * a, ratio.clamp(1 - self.clip, 1 + self.clip) * a))
        loss = torch.cat(terms).mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, float("inf")))
        self.optimizer.step()
        d = torch.cat(diffs)
        groups = {r.group for r, a in zip(rollouts, adv, strict=True) if a != 0.0}
        return StepStats(loss.item(), float(d.max()), float(d.mean()), d.numel(), len(groups),
                         grad_norm)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()
