"""vLLM's own benchmark client (`vllm bench serve`: random dataset, 32 in /
64 out tokens, 160 prompts, concurrency 32, --ignore-eos) through the rlfleet frontend +
one rlfleet vLLM worker, against plain `vllm serve`, on the same tiny model (made with
`rlfleet make-model`), the same engine flags and the same cores, stacks alternated.

    python bench/vs_vllm_serve.py [--rounds 2] [--repeats 1] [--model DIR] [--prompts 160]

A round starts `vllm serve`, runs the client `--repeats` times, stops it, then does the same
with the rlfleet stack. Prints each run's output tok/s, mean TPOT and the CPU seconds each
serving process spent in it (the engine core apart: on these cores whatever the processes
around it spend is taken from it), then the ratio of the best output tok/s (rlfleet / vllm
serve) and of the medians; the last line is one JSON object: {"rlfleet_tok_s": [...],
"vllm_tok_s": [...], "ratio": r, "ratio_median": r, "rlfleet_tpot_ms": [...],
"vllm_tpot_ms": [...], "rlfleet_cpu_s": {...}, "vllm_cpu_s": {...}} (the CPU seconds
medians, per process)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

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


def _role(p: psutil.Process) -> str:
    """What a serving process is: the engine core (vLLM names its process), or the module
    the process runs (rlfleet.frontend, rlfleet.vllm, vllm's API server)."""
    argv = p.cmdline()
    if "EngineCore" in p.name() or any("EngineCore" in a for a in argv[:1]):
        return "engine_core"
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1]
    return p.name()


def serving_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds so far of each process this one started (and theirs), by pid."""
    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            t = p.cpu_times()
            out[p.pid] = (_role(p), t.user + t.system)
        except psutil.Error:
            continue
    return out


def bench_client(args: argparse.Namespace, url: str, work: Path, tag: str) -> dict:
    """vLLM's benchmark client against `url`; its result JSON, with the CPU seconds each
    serving process spent meanwhile (by role)."""
    name = f"{tag}-{time.monotonic_ns()}.json"
    argv = [sys.executable, "-c", BENCH_SERVE, "--backend", "vllm",
            "--base-url", url, "--endpoint", "/v1/completions", "--model", SERVED,
            "--tokenizer", str(args.model), "--dataset-name", "random",
            "--random-input-len", "32", "--random-output-len", "64",
            "--num-prompts", str(args.prompts), "--max-concurrency", str(args.concurrency),
            "--ignore-eos", "--seed", "0", "--save-result", "--result-dir", str(work),
            "--result-filename", name]
    before = serving_cpu()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=900,
                         env=engine_env())
    cpu: dict[str, float] = {}
    for pid, (role, t) in serving_cpu().items():
        cpu[role] = round(cpu.get(role, 0.0) + t - before.get(pid, (role, 0.0))[1], 2)
    if out.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    d = json.loads((work / name).read_text())
    res = {"stack": tag, "output_tok_s": round(d["output_throughput"], 1),
           "mean_tpot_ms": round(d["mean_tpot_ms"], 2), "completed": d["completed"],
           "cpu_s": cpu}
    print(json.dumps(res), flush=True)
    return res


def run_vllm_serve(args: argparse.Namespace, work: Path) -> list[dict]:
    with vllm_serve(args.model, SERVED, work, *ENGINE_FLAGS) as url:
        wait_serving(url)
        return [bench_client(args, url, work, "vllm-serve") for _ in range(args.repeats)]


def run_rlfleet(args: argparse.Namespace, work: Path) -> list[dict]:
    with LocalFleet(Path(tempfile.mkdtemp(dir=work, prefix="fleet-"))) as fleet:
        fleet.start_frontend(*args.frontend_flag)
        fleet.start_worker("--model", str(args.model), "--served-model-name", SERVED,
                           *ENGINE_FLAGS, kind="vllm")
        wait_serving(fleet.url)
        return [bench_client(args, fleet.url, work, "rlfleet") for _ in range(args.repeats)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None,
                   help="a model directory (default: a tiny one made with rlfleet make-model)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1,
                   help="client runs per server start, back to back")
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
        runs["vllm"] += run_vllm_serve(args, work)
        runs["rlfleet"] += run_rlfleet(args, work)
    report(runs)


def report(runs: dict[str, list[dict]]) -> None:
    tok = {k: [r["output_tok_s"] for r in v] for k, v in runs.items()}
    tpot = {k: [r["mean_tpot_ms"] for r in v] for k, v in runs.items()}
    cpu = {k: {role: statistics.median(r["cpu_s"].get(role, 0.0) for r in v)
               for role in {role for r in v for role in r["cpu_s"]}} for k, v in runs.items()}
    ratio = max(tok["rlfleet"]) / max(tok["vllm"])
    ratio_median = statistics.median(tok["rlfleet"]) / statistics.median(tok["vllm"])
    print(f"output tok/s: rlfleet {tok['rlfleet']} vs vllm serve {tok['vllm']}: "
          f"ratio {ratio:.3f} (best of {len(tok['vllm'])}), {ratio_median:.3f} (medians); "
          f"mean TPOT ms: rlfleet {tpot['rlfleet']} vs {tpot['vllm']}; CPU s per run "
          f"(medians): rlfleet {cpu['rlfleet']} vs {cpu['vllm']}")
    print(json.dumps({"rlfleet_tok_s": tok["rlfleet"], "vllm_tok_s": tok["vllm"],
                      "ratio": round(ratio, 3), "ratio_median": round(ratio_median, 3),
                      "rlfleet_tpot_ms": tpot["rlfleet"], "vllm_tpot_ms": tpot["vllm"],
                      "rlfleet_cpu_s": cpu["rlfleet"], "vllm_cpu_s": cpu["vllm"],
                      "cores": os.cpu_count()}))


if __name__ == "__main__":
    main()
