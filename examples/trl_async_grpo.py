"""TRL's asynchronous GRPO trainer (TRL 1.16 `trl.experimental.async_grpo.AsyncGRPOTrainer`)
sampling from a running rlfleet fleet, its weight syncs as rolling refreshes.

    python examples/trl_async_grpo.py --frontend-url http://HOST:8000 --rl-url http://HOST:8001 \\
        --model DIR --served-model-name NAME --checkpoints DIR [--max-staleness 2] [--steps 20]

The fleet: a frontend with the RL listener and vLLM workers serving DIR as NAME, allowed to
read policies from the checkpoints directory (`--allowed-weights-root`). TRL's own trainer
needs a CUDA GPU (its tree attention is a flash-attention kernel); the rollouts and the
refreshes are rlfleet's. The task: after a chat prompt, write digits; the reward is the
fraction that are "7". Last line of output, one JSON object:
{"steps", "samples_handed", "max_staleness_seen", "refreshes_reopened"}.
(tests/integration/test_async_rl_vllm.py drives the same two hooks on CPU, in the order the
trainer calls them, with TRL's own rollout queue and real optimizer steps.)"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def reward(prompts, completions, completion_ids, **kwargs) -> list[float]:
    return [c.count("7") / max(1, len(c)) for c in completions]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frontend-url", required=True)
    p.add_argument("--rl-url", required=True)
    p.add_argument("--model", required=True, help="the model's checkpoint directory")
    p.add_argument("--served-model-name", required=True)
    p.add_argument("--checkpoints", required=True, help="where policies are written")
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()

    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from rlfleet.integrations.trl_async import (
        FleetAsyncLink,
        FleetRolloutWorker,
        FleetWeightTransfer,
    )
    from rlfleet.rl import Fleet, SamplingSpec

    dataset = [{"prompt": [{"role": "user", "content": f"Write 8 digits. Seed {i}."}]}
               for i in range(64)]
    # --- README: TRL async (begin) ---
    fleet = Fleet(a.frontend_url, a.served_model_name, rl_url=a.rl_url, mode="rolling",
                  max_lag=a.max_staleness + 1, min_serving=1)
    link = FleetAsyncLink(fleet, a.checkpoints, a.model, max_staleness=a.max_staleness)
    worker = FleetRolloutWorker(link, dataset, [reward], AutoTokenizer.from_pretrained(a.model),
                                num_generations=8, sampling=SamplingSpec(max_tokens=8))
    args = AsyncGRPOConfig(output_dir=str(Path(a.checkpoints) / "trl"), max_steps=a.steps,
                           num_generations=8, max_staleness=a.max_staleness)
    trainer = AsyncGRPOTrainer(model=a.model, reward_funcs=[reward], args=args,
                               train_dataset=dataset, rollout_worker=worker,
                               weight_transfer=FleetWeightTransfer(link))
    trainer.train()
    # --- README: TRL async (end) ---
    stats = link.stream.stats
    fleet.close()
    print(json.dumps({"steps": a.steps, "samples_handed": stats.handed,
                      "max_staleness_seen": stats.max_staleness_seen,
                      "refreshes_reopened": sum(r["decision"] == "reopened"
                                                for r in stats.refreshes)}))


if __name__ == "__main__":
    main()
