"""`rlfleet demo`: make the test model, start a local fleet (frontend + 2 vLLM workers, file
discovery), send a token-ID completion through it, print the result, shut everything down."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from rlfleet.models import make_model
from rlfleet.runtime.launch import Fleet

WORKER_FLAGS = ("--dtype", "float32", "--max-model-len", "2048", "--enforce-eager")


def run_demo(out: Path, workers: int = 2) -> dict:
    out = out.resolve()
    model = make_model(out / "model", size="tiny", seed=0, dtype="float32")
    print(f"model: {model}")
    with Fleet(out / "fleet") as fleet:
        fleet.start_frontend()
        print(f"frontend: {fleet.url}")
        procs = [fleet.start_worker("--model", str(model), "--served-model-name", "rlfleet-tiny",
                                    *WORKER_FLAGS, wait=False) for _ in range(workers)]
        for p in procs:
            p.wait_ready(600)
            print(f"worker {p.ready['instance_id']} ready at {p.ready['url']}")
        body = {"model": "rlfleet-tiny", "prompt": [151644, 8948, 198], "max_tokens": 16,
                "temperature": 0, "logprobs": 0, "ignore_eos": True,
                "nvext": {"extra_fields": ["completion_token_ids", "worker_id", "timing"]}}
        with httpx.Client(timeout=120) as http:
            for _ in range(60):  # the frontend sees workers through discovery within a second
                if http.get(f"{fleet.url}/v1/models").json()["data"]:
                    break
            r = http.post(f"{fleet.url}/v1/completions", json=body)
        r.raise_for_status()
        result = r.json()
        choice = result["choices"][0]
        print("completion_token_ids:", result["nvext"]["completion_token_ids"])
        print("token_logprobs:      ", [round(x, 4) for x in choice["logprobs"]["token_logprobs"]])
        print("served by worker:    ", result["nvext"]["worker_id"]["decode_worker_id"])
        (out / "result.json").write_text(json.dumps(result, indent=2))
        print(f"full response: {out / 'result.json'}")
    print("fleet stopped")
    return result
