"""The recipe for RL frameworks that take an OpenAI-compatible base URL for their rollouts
and call a weight-sync hook after every optimizer step (the verl / prime-rl / NeMo RL
shape): give the framework rlfleet's frontend as its base URL, and refresh the fleet from
the hook with `Fleet.refresh`. Runnable against a local fleet of mocker workers:

    python examples/openai_url_recipe.py [--steps 3] [--workers 2]

The mocker is a declared simulator (no model): its "checkpoint" is a directory naming a
seed, and its weight digest is "mock:<seed>". Against vLLM workers the hook gets the
checkpoint directory the trainer wrote and the same code refreshes them (the digest is
then computed from the checkpoint). Last line of output, one JSON object:
{"steps", "requests", "refreshes_verified", "policies"}."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import httpx

from rlfleet.mocker.engine import write_mock_checkpoint

MODEL = "mock-policy"


def wait_listed(rl_url: str, count: int, timeout: float = 60.0) -> None:
    """Until the RL listener lists `count` workers of the model with their admin routes."""
    deadline = time.monotonic() + timeout
    while True:
        workers = httpx.get(f"{rl_url}/v1/rl/workers", timeout=10).json().get("workers", [])
        if sum(1 for w in workers if w.get("model") == MODEL and w.get("routes")) >= count:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the RL listener lists {len(workers)} worker(s), expected {count}")
        time.sleep(0.1)


def run(frontend_url: str, rl_url: str, checkpoints: Path, steps: int) -> dict:
    # --- README: generic recipe (begin) ---
    import openai

    from rlfleet.rl import Fleet

    fleet = Fleet(frontend_url, MODEL, rl_url=rl_url)  # the trainer side: refreshes
    client = openai.OpenAI(base_url=f"{frontend_url}/v1", api_key="unused")  # the framework's

    def sync_weights(checkpoint_dir: Path, step: int, digest: str | None = None) -> None:
        """The framework's weight-sync hook: the whole fleet moves to the new policy, or the
        step stops (rollouts wait at the frontend while the fleet is gated)."""
        result = fleet.refresh(checkpoint_dir, f"step-{step}", digest=digest, step=step)
        if not result.fleet_moved:
            raise RuntimeError(f"the fleet did not move to step-{step}: {result.reason}")

    def generate(prompt: str) -> dict:
        """A rollout request as the framework sends it, asking for the engine's token IDs,
        logprobs and the policy that produced them (nvext)."""
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, logprobs=0, timeout=60,
            extra_body={"return_tokens_as_token_ids": True, "nvext": {"extra_fields": [
                "prompt_token_ids", "completion_token_ids", "engine_data"]}})
        return {"logprobs": r.choices[0].logprobs.token_logprobs, **r.model_extra["nvext"]}
    # --- README: generic recipe (end) ---

    requests, policies = 0, []
    try:
        for step in range(steps):
            seed = step + 1  # the trainer's step-N policy, as a mocker checkpoint
            sync_weights(write_mock_checkpoint(checkpoints / f"step-{step}", seed), step,
                         digest=f"mock:{seed}")
            for k in range(4):
                out = generate(f"rollout {k} of step {step}")
                requests += 1
                served = (out["engine_data"]["weight_version"], out["engine_data"]["weight_digest"])
                if served != (f"step-{step}", f"mock:{seed}"):
                    raise RuntimeError(f"step {step}: served by {served}, not the new policy")
                if len(out["completion_token_ids"]) != len(out["logprobs"]) or \
                        not out["prompt_token_ids"]:
                    raise RuntimeError(f"step {step}: no token authority in {out}")
            policies.append(f"step-{step}")
        verified = sum(1 for r in fleet.coordinator.journal.recent(1000)
                       if r["decision"] == "reopened")
    finally:
        fleet.close()
    return {"steps": steps, "requests": requests, "refreshes_verified": verified,
            "policies": policies}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    a = p.parse_args()

    from rlfleet.testing.fleet import LocalFleet

    with tempfile.TemporaryDirectory(prefix="rlfleet-recipe-") as tmp:
        root = Path(tmp)
        checkpoints = root / "checkpoints"
        checkpoints.mkdir()
        with LocalFleet(root / "fleet", lease_ttl=5) as local:
            local.start_frontend(enable_rl=True)
            for _ in range(a.workers):
                local.start_worker("--served-model-name", MODEL, "--enable-rl", "--system-port",
                                   "0", "--start-gated", "--allowed-weights-root",
                                   str(checkpoints), "--seed", "0", "--token-delay", "0.001",
                                   kind="mocker")
            wait_listed(local.rl_url, a.workers)
            summary = run(local.url, local.rl_url, checkpoints, a.steps)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
