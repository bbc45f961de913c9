"""TRL's GRPOTrainer, sampling through an rlfleet fleet.

    fleet = Fleet(frontend_url, "tiny", rl_url=rl_url, ledger="ledger.sqlite")
    rollout = FleetRollout(fleet, checkpoints="checkpoints")
    trainer = GRPOTrainer(model=model_dir, reward_funcs=reward, train_dataset=dataset,
                          args=GRPOConfig(...), rollout_func=rollout, callbacks=[rollout.callback])
    trainer.train()

`FleetRollout` is the `rollout_func`: TRL hands it the batch's prompts (each prompt
repeated `num_generations` times, in order) and gets back, per prompt × generation and in
the same order, the engine's prompt IDs, completion IDs and sampled-token logprobs. Each
group of identical prompts is one sample of `n = num_generations` sequences, admitted as a
whole by the ledger (all five admission checks, the expected policy), so that a group
never loses a member: a sample that is not admitted is tried again (`retries` more rounds,
same sample ID, every attempt in the ledger) and then the step fails with `RolloutFailed`
naming the samples and why. Text prompts go as text, conversational prompts as chat
messages (TRL's `chat_template_kwargs` included): the worker tokenises them, and the
prompt IDs TRL trains on are the engine's.

Extra columns for the reward functions: `rlfleet_sample_id` ("<sample>#<sequence>") and
`rlfleet_policy` (the policy version that generated the sequence).

`FleetRollout.callback` saves the policy after every optimizer step (and once at the start
of training) as `checkpoints/step-N` and refreshes the fleet to it with `Fleet.refresh`
(a PEFT model, as GRPOTrainer makes with `peft_config`: its LoRA adapter alone, not a merged
model, refreshed on a Fleet of `path="vllm-adapter", adapter=NAME` whose model is NAME, the
base model and other adapters serving on);
the post-update probe is the trainer's own greedy continuation, computed from the model in
memory. A refresh that does not verify every selected worker stops training
(`RefreshNotVerified`). The fleet then admits only samples of the new policy.

With `check_logprobs` (default on) every rollout is also scored by the trainer's model
(log-softmax of logits / temperature, as TRL computes it): `max_abs_logprob_diff` is the
largest difference from the engine's logprobs, and `max_logprob_diff`, when set, fails the
step above it. One trainer process: several processes would each need the fleet's policy.
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from rlfleet.refresh.probe import Probe
from rlfleet.refresh.transaction import RefreshResult
from rlfleet.rl.fleet import Fleet
from rlfleet.rollout.sample import Chat, SampleRequest, SamplingSpec
from rlfleet.train.checkpoint import save_checkpoint

#: a probe whose best and second-best logits are closer than this could flip on float noise
PROBE_MARGIN = 1e-3
#: probe prompts before the first rollout (afterwards: the latest rollout's engine prompt IDs)
PROBE_PROMPTS = ([100, 101, 102, 103], [1000, 1001, 1002, 1003], [5000, 5001, 5002, 5003])
#: generation_kwargs that have a SamplingSpec field of the same meaning
_SPEC_FIELDS = {f.name for f in fields(SamplingSpec)} - {"prompt_logprobs"}


class RolloutFailed(RuntimeError):
    """Samples of a step could not be admitted; `failures` maps sample ID → reason."""

    def __init__(self, failures: dict[str, str]) -> None:
        listed = "; ".join(f"{s}: {r}" for s, r in list(failures.items())[:5])
        super().__init__(f"{len(failures)} sample(s) of this step could not be admitted "
                         f"(the step would train on shifted groups): {listed}")
        self.failures = failures


class RefreshNotVerified(RuntimeError):
    """The fleet did not move to the trainer's new policy as a whole."""

    def __init__(self, result: RefreshResult) -> None:
        out = [f"{w['instance_id']}: {w['status']} ({w['reason']})" for w in result.workers
               if w["status"] != "verified"]
        super().__init__(f"refresh {result.refresh_id} to {result.policy.version} ended "
                         f"{result.decision}: {result.reason}" +
                         (f"; not verified: {', '.join(out)}" if out else ""))
        self.result = result


@dataclass
class StepRecord:
    """One rollout_func call: the samples TRL got and how they compared with the trainer."""

    step: int
    mode: str  # train | eval
    sample_ids: list[str]
    sequences: int
    policy: tuple[Any, Any]  # (version, digest) every sequence came from
    max_abs_logprob_diff: float | None


@dataclass
class FleetRolloutStats:
    samples_admitted: int = 0  # sequences (prompt × generation) handed to TRL
    refreshes_verified: int = 0
    max_abs_logprob_diff: float | None = None
    steps: list[StepRecord] = field(default_factory=list)
    refreshes: list[RefreshResult] = field(default_factory=list)


def _unwrap(model: Any) -> Any:
    while hasattr(model, "module"):  # DDP / accelerate wrappers
        model = model.module
    return model


def _spec_from_trainer(args: Any, overrides: SamplingSpec | None) -> SamplingSpec:
    """TRL's sampling settings as a SamplingSpec; generation_kwargs must name SamplingSpec
    fields (anything else is refused rather than silently dropped)."""
    if overrides is not None:
        return overrides
    extra = args.generation_kwargs or {}
    if isinstance(extra, str):
        extra = json.loads(extra)
    unknown = sorted(set(extra) - _SPEC_FIELDS)
    if unknown:
        raise ValueError(f"generation_kwargs {unknown} have no rlfleet equivalent; rlfleet "
                         f"honours {sorted(_SPEC_FIELDS)} (pass sampling=SamplingSpec(...) "
                         f"to FleetRollout to set them exactly)")
    spec = SamplingSpec(max_tokens=args.max_completion_length or 256,
                        temperature=args.temperature, top_p=args.top_p,
                        top_k=args.top_k if args.top_k and args.top_k > 0 else None,
                        min_p=args.min_p or 0.0, repetition_penalty=args.repetition_penalty)
    return replace(spec, **extra)


@torch.no_grad()
def policy_probe(model: Any, prompts: Sequence[list[int]], n: int = 8) -> Probe:
    """The greedy `n` tokens of the in-memory `model` and their logprobs, from the first of
    `prompts` whose continuation has no near tie (else the clearest one): what every worker
    must reproduce after a refresh to this policy. Computed at the weights' own precision
    (outside the mixed-precision autocast a trainer may have wrapped the model's forward in)."""
    model = _unwrap(model)
    forward = getattr(model, "_original_forward", model)  # accelerate keeps it there
    device = next(model.parameters()).device
    best: tuple[Probe, float] | None = None
    for prompt in prompts:
        seq, lps, margin = list(prompt), [], float("inf")
        for _ in range(n):
            logits = forward(torch.tensor([seq], device=device)).logits[0, -1].float()
            lsm = torch.log_softmax(logits, -1)
            top = torch.topk(lsm, 2)
            margin = min(margin, float(top.values[0] - top.values[1]))
            seq.append(int(top.indices[0]))
            lps.append(float(top.values[0]))
        probe = Probe(list(prompt), seq[len(prompt):], lps)
        if best is None or margin > best[1]:
            best = (probe, margin)
        if margin >= PROBE_MARGIN:
            break
    if best is None:
        raise ValueError("no probe prompt")
    return best[0]


@torch.no_grad()
def trainer_logprobs(model: Any, prompt_ids: Sequence[list[int]],
                     completion_ids: Sequence[list[int]], temperature: float) -> list[list[float]]:
    """log p(completion token | prefix) under `model`, from logits / temperature (TRL's
    recomputation), one sequence at a time (no padding)."""
    model = _unwrap(model)
    device = next(model.parameters()).device
    out = []
    for p, c in zip(prompt_ids, completion_ids, strict=True):
        if not c:
            out.append([])
            continue
        ids = torch.tensor([list(p) + list(c)], device=device)
        logits = model(ids).logits[0, len(p) - 1:-1].float() / (temperature or 1.0)
        lps = torch.log_softmax(logits, -1).gather(1, torch.tensor(c, device=device)[:, None])
        out.append(lps[:, 0].tolist())
    return out


class FleetRollout:
    """TRL `rollout_func` through `fleet` (a `rlfleet.rl.Fleet` with an `rl_url`), and
    `callback`, which refreshes the fleet to the trainer's policy after every optimizer step.

    checkpoints: where policies are written (the workers must be allowed to read it:
    `--allowed-weights-root`); base: the model's checkpoint directory, whose config and
    tokenizer files go next to each saved policy (default: the model's `name_or_path`);
    sampling: a SamplingSpec instead of TRL's settings; retries: extra rounds for samples
    not admitted; keep_checkpoints: saved policies kept on disk (the one served and the one
    before it, for rollback); run_id: prefix of the sample IDs (default: random). The probe
    has the fleet's `RefreshConfig.probe_tokens` tokens."""

    def __init__(self, fleet: Fleet, checkpoints: str | Path, *, base: str | Path | None = None,
                 sampling: SamplingSpec | None = None, retries: int = 1,
                 check_logprobs: bool = True, max_logprob_diff: float | None = None,
                 keep_checkpoints: int = 2, run_id: str | None = None) -> None:
        if fleet.coordinator is None:
            raise ValueError("the Fleet needs an rl_url to refresh the policy after each step")
        self.fleet = fleet
        self.checkpoints = Path(checkpoints).resolve()
        self.base = Path(base) if base is not None else None
        self.sampling, self.retries = sampling, retries
        self.check_logprobs, self.max_logprob_diff = check_logprobs, max_logprob_diff
        self.keep_checkpoints = max(1, keep_checkpoints)
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self.stats = FleetRolloutStats()
        self.callback = _RefreshEachStep(self)
        self._calls = 0
        self._probe_prompts: list[list[int]] = []
        self._saved: list[Path] = []

    # ------------------------------------------------------------ rollout_func

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list]:
        if trainer.accelerator.num_processes > 1:
            raise NotImplementedError("FleetRollout drives the fleet from one trainer process")
        training = trainer.model.training
        mode = "train" if training else "eval"
        g = trainer.num_generations if training else trainer.num_generations_eval
        spec = _spec_from_trainer(trainer.args, self.sampling)
        kwargs = trainer.args.chat_template_kwargs
        if isinstance(kwargs, str):
            kwargs = json.loads(kwargs)
        # TRL repeats each prompt G times in a row: one sample with n = G per group
        grouped = g > 1 and spec.temperature > 0 and len(prompts) % g == 0 and all(
            prompts[i] == prompts[i - i % g] for i in range(len(prompts)))
        size = g if grouped else 1
        self._calls += 1
        tag = f"{self.run_id}/step{trainer.state.global_step}/{mode}{self._calls}"
        requests = [SampleRequest(f"{tag}/p{j}", self._prompt(prompts[j * size], kwargs), spec,
                                  n=size) for j in range(len(prompts) // size)]
        samples = self._admit_all(requests)

        out: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "logprobs": [],
                                "rlfleet_sample_id": [], "rlfleet_policy": []}
        for s in samples:
            for k, c in enumerate(s.completions):
                out["prompt_ids"].append(list(s.prompt_ids))
                out["completion_ids"].append(list(c.token_ids))
                out["logprobs"].append(list(c.logprobs))
                out["rlfleet_sample_id"].append(f"{s.sample_id}#{k}")
                out["rlfleet_policy"].append(s.policy.version)
        if len(out["completion_ids"]) != len(prompts):  # never a silent gap or shift
            raise RolloutFailed({tag: f"{len(out['completion_ids'])} sequences for "
                                      f"{len(prompts)} prompts"})
        diff = None
        if self.check_logprobs:
            ref = trainer_logprobs(trainer.model, out["prompt_ids"], out["completion_ids"],
                                   trainer.temperature)
            diff = max((abs(a - b) for r, e in zip(ref, out["logprobs"], strict=True)
                        for a, b in zip(r, e, strict=True)), default=0.0)
            self.stats.max_abs_logprob_diff = max(diff, self.stats.max_abs_logprob_diff or 0.0)
            if self.max_logprob_diff is not None and diff > self.max_logprob_diff:
                raise RuntimeError(f"the engine's logprobs differ from the trainer's by up to "
                                   f"{diff:.2e} (limit {self.max_logprob_diff:g}): the fleet "
                                   f"does not serve the trainer's policy")
        self.stats.samples_admitted += len(out["completion_ids"])
        self.stats.steps.append(StepRecord(trainer.state.global_step, mode,
                                           [s.sample_id for s in samples],
                                           len(out["completion_ids"]), self.fleet.expected, diff))
        self._probe_prompts = [list(samples[0].prompt_ids)] if samples else []
        return out

    @staticmethod
    def _prompt(prompt: Any, kwargs: dict[str, Any] | None) -> Any:
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            return Chat(prompt, kwargs)
        return prompt  # text (or token IDs)

    def _admit_all(self, requests: list[SampleRequest]):
        """Every sample admitted, in order, or RolloutFailed."""
        admitted: dict[str, Any] = {}
        failures: dict[str, str] = {}
        pending = requests
        for _ in range(1 + max(0, self.retries)):
            failures = {}
            for o in self.fleet.rollout(pending):
                if o.sample is not None:
                    admitted[o.sample_id] = o.sample
                else:
                    failures[o.sample_id] = o.reason or "not admitted"
            pending = [r for r in pending if r.sample_id in failures]
            if not pending:
                break
        if failures:
            raise RolloutFailed(failures)
        return [admitted[r.sample_id] for r in requests]

    # ------------------------------------------------------------ the policy after a step

    def publish(self, model: Any, step: int) -> RefreshResult:
        """Save `model` as checkpoints/step-N and move the whole fleet to it; raise
        RefreshNotVerified unless every selected worker is verified on it."""
        model = _unwrap(model)
        version = f"step-{step}"
        if hasattr(model, "peft_config"):  # a PEFT model: its adapter is the policy
            path = self._save_adapter(model, self.checkpoints / version)
        else:
            path = self._save_model(model, self.checkpoints / version)
        was_training = model.training
        model.eval()
        try:
            vocab = model.get_input_embeddings().weight.shape[0]
            prompts = self._probe_prompts or [[t % vocab for t in p] for p in PROBE_PROMPTS]
            probe = policy_probe(model, prompts, self.fleet.coordinator.config.probe_tokens)
        finally:
            model.train(was_training)
        result = self.fleet.refresh(path, version, probe=probe, step=step)
        self.stats.refreshes.append(result)
        if not result.fleet_moved:
            raise RefreshNotVerified(result)
        self.stats.refreshes_verified += 1
        if path not in self._saved:
            self._saved.append(path)
        while len(self._saved) > self.keep_checkpoints:
            shutil.rmtree(self._saved.pop(0), ignore_errors=True)
        return result


    def _save_model(self, model: Any, out: Path) -> Path:
        base = self.base or Path(getattr(model, "name_or_path", "") or ".")
        if not (base / "config.json").exists():
            raise ValueError(f"{base} is not the model's checkpoint directory: pass base= to "
                             f"FleetRollout (its config and tokenizer go next to each policy)")
        return save_checkpoint(model.state_dict(), base, out)

    def _save_adapter(self, model: Any, out: Path) -> Path:
        """The adapter alone (peft's save_pretrained), not a merged model; the fleet must
        refresh that adapter (`Fleet(..., path="vllm-adapter", adapter=NAME)`)."""
        cfg = self.fleet.coordinator.config
        if not cfg.adapter:
            raise ValueError("the trainer's model is a PEFT model: its policy is the LoRA "
                             "adapter; make the Fleet refresh an adapter: Fleet(url, NAME, "
                             "rl_url=..., path=\"vllm-adapter\", adapter=NAME)")
        tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            model.save_pretrained(str(tmp))
            if out.exists():
                shutil.rmtree(out)
            tmp.rename(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return out


class _RefreshEachStep(TrainerCallback):
    """Publishes the policy at the start of training and after every optimizer step."""

    def __init__(self, owner: FleetRollout) -> None:
        self.owner = owner

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.owner.publish(model, state.global_step)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.owner.publish(model, state.global_step)
