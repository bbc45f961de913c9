"""TRL's GRPOTrainer on the tiny model, sampling through a local rlfleet fleet.

    python examples/trl_grpo.py --steps 4 [--out DIR] [--workers 2] [--lora]

Makes the tiny test model (float32), starts a frontend with the RL listener and vLLM
workers (gated until the first refresh verifies them; they read policies from
DIR/checkpoints), and trains for N steps with `rlfleet.integrations.trl`: every sample
TRL trains on is admitted by the ledger (DIR/ledger.sqlite), and the fleet is refreshed to
the trainer's policy after every optimizer step. A toy task with a signal from the first
step: after a chat prompt, write 8 tokens; the smaller their token IDs, the higher the
reward. Everything it started is stopped on the way out. Last line of output, one JSON object:
{"steps", "samples_admitted", "refreshes_verified", "max_abs_logprob_diff"}.
DIR also holds trained.jsonl (what TRL handed its reward function, per sequence) and the
refresh journal.

With --lora, TRL trains a LoRA adapter (GRPOTrainer's `peft_config`): the workers serve the
base model with vLLM's --enable-lora, and after every step the callback publishes the
adapter alone and refreshes only it (`Fleet(..., path="vllm-adapter", adapter=LORA)`,
requests naming the adapter `LORA`), the base model serving throughout."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import httpx

MODEL = "tiny"
LORA = "tiny-lora"  # the adapter's name with --lora (what its requests' `model` names)
LORA_FLAGS = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "16")
WORKER_FLAGS = ("--dtype", "float32", "--max-model-len", "512", "--enforce-eager")
VOCAB = 151936  # logits of the tiny model


def wait_listed(rl_url: str, count: int, timeout: float = 120.0) -> None:
    """Until the RL listener lists `count` workers of the model with their admin routes."""
    deadline = time.monotonic() + timeout
    while True:
        workers = httpx.get(f"{rl_url}/v1/rl/workers", timeout=10).json().get("workers", [])
        if sum(1 for w in workers if w.get("model") == MODEL and w.get("routes")) >= count:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the RL listener lists {len(workers)} worker(s), expected {count}")
        time.sleep(0.2)


def train(frontend_url: str, rl_url: str, model_dir: Path, out: Path, steps: int,
          group: int, prompts: int, lora: bool = False) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig

    log = open(out / "trained.jsonl", "w")  # noqa: SIM115  (closed below)

    def reward(completion_ids, rlfleet_sample_id, rlfleet_policy, trainer_state, **_):
        """1 - mean token ID / vocabulary size; also records what TRL trains on."""
        for sid, ids, policy in zip(rlfleet_sample_id, completion_ids, rlfleet_policy,
                                    strict=True):
            log.write(json.dumps({"step": trainer_state.global_step, "sample": sid,
                                  "policy": policy, "completion_ids": ids}) + "\n")
        return [1.0 - sum(ids) / max(1, len(ids)) / VOCAB for ids in completion_ids]

    dataset = Dataset.from_dict({"prompt": [
        [{"role": "user", "content": f"Write 8 digits. Seed {i % 10} {i // 10 % 10} {i % 7}."}]
        for i in range(64)]})
    args = GRPOConfig(output_dir=str(out / "trl"), max_steps=steps, num_generations=group,
                      per_device_train_batch_size=group * prompts, max_completion_length=8,
                      learning_rate=1e-3, beta=0.0, temperature=1.0, logging_steps=1,
                      save_strategy="no", report_to="none", use_cpu=True, bf16=False, seed=0,
                      disable_tqdm=True)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype="float32")
    if lora:
        trainer, rollout = train_lora(frontend_url, rl_url, model, dataset, args, reward, out)
        return _summary(trainer, rollout, log)

    # --- README: TRL integration (begin) ---
    from trl import GRPOTrainer

    from rlfleet.integrations.trl import FleetRollout
    from rlfleet.rl import Fleet

    fleet = Fleet(frontend_url, MODEL, rl_url=rl_url, ledger=out / "ledger.sqlite",
                  journal=out / "journal.sqlite")
    rollout = FleetRollout(fleet, checkpoints=out / "checkpoints")
    trainer = GRPOTrainer(model=model, reward_funcs=reward, train_dataset=dataset, args=args,
                          rollout_func=rollout, callbacks=[rollout.callback])
    trainer.train()
    fleet.close()
    # --- README: TRL integration (end) ---
    return _summary(trainer, rollout, log)


def train_lora(frontend_url: str, rl_url: str, model: object, dataset: object, args: object,
               reward: object, out: Path) -> tuple:
    """The same run, training a LoRA adapter (--lora)."""
    from peft import LoraConfig
    from trl import GRPOTrainer

    from rlfleet.integrations.trl import FleetRollout
    from rlfleet.rl import Fleet

    # --- README: TRL with PEFT (begin) ---
    fleet = Fleet(frontend_url, LORA, rl_url=rl_url, ledger=out / "ledger.sqlite",
                  journal=out / "journal.sqlite", path="vllm-adapter", adapter=LORA)
    rollout = FleetRollout(fleet, checkpoints=out / "checkpoints")
    trainer = GRPOTrainer(model=model, reward_funcs=reward, train_dataset=dataset, args=args,
                          rollout_func=rollout, callbacks=[rollout.callback],
                          peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=[
                              "q_proj", "k_proj", "v_proj", "o_proj"]))
    trainer.train()
    fleet.close()
    # --- README: TRL with PEFT (end) ---
    return trainer, rollout


def _summary(trainer: object, rollout: object, log: object) -> dict:
    log.close()
    return {"steps": trainer.state.global_step,
            "samples_admitted": rollout.stats.samples_admitted,
            "refreshes_verified": rollout.stats.refreshes_verified,
            "max_abs_logprob_diff": rollout.stats.max_abs_logprob_diff}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", type=Path, default=None, help="default: a temporary directory")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--prompts", type=int, default=2, help="prompts per step")
    p.add_argument("--lora", action="store_true", help="train a LoRA adapter (peft)")
    a = p.parse_args()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL

    from rlfleet.models import make_model
    from rlfleet.testing.fleet import LocalFleet

    with tempfile.TemporaryDirectory(prefix="rlfleet-trl-") as tmp:
        out = (a.out or Path(tmp)).resolve()
        out.mkdir(parents=True, exist_ok=True)
        (out / "checkpoints").mkdir(exist_ok=True)
        model_dir = make_model(out / "model", size="tiny", seed=0, dtype="float32")
        with LocalFleet(out / "fleet", lease_ttl=5) as local:
            local.start_frontend(enable_rl=True)
            # with --lora the base model serves from the start; its adapter is refreshed
            flags = LORA_FLAGS if a.lora else ("--start-gated",)
            procs = [local.start_worker("--model", str(model_dir), "--served-model-name", MODEL,
                                        "--enable-rl", "--system-port", "0", *flags,
                                        "--allowed-weights-root", str(out / "checkpoints"),
                                        *WORKER_FLAGS, wait=False) for _ in range(a.workers)]
            for w in procs:
                w.wait_ready(600)
            wait_listed(local.rl_url, a.workers)
            summary = train(local.url, local.rl_url, model_dir, out, a.steps, a.group_size,
                            a.prompts, a.lora)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
