"""What KV-aware routing buys RL rollouts: the same multi-turn, grouped workload under
`--router-mode round-robin` and `--router-mode kv`: two frontends over one set of workers,
rounds alternating between them (fresh tasks each round, every worker's prefix cache
flushed before it), so that both modes see the same machine.

    python bench/prefix_routing.py [--kind vllm|mocker] [--workers 2] [--prompts 8]
        [--group 4] [--turns 4] [--system-tokens 256] [--task-tokens 256]
        [--user-tokens 96] [--max-tokens 64]

The workload: `--prompts` tasks, each `--group` samples (a GRPO group, sent as separate
requests at once), each sample a rollout of `--turns` turns; every request starts with
one long system prompt shared by all tasks, then the task's own text, then (after turn 1)
the whole conversation so far, verbatim (the previous completion's token IDs and a new
user turn), as rlfleet's NextTurn re-sends it. Token-ID prompts, streamed, through one
frontend. Measured per mode: generated tokens per second over the whole workload, time to
first token (mean and p90, from the client), the prefix-cache hit rate (vLLM's own
`vllm:prefix_cache_hits` / `vllm:prefix_cache_queries` from each worker's /metrics over
the workload; with the mocker, its simulated cache's counters), and each worker's share
of the requests. vLLM workers run the tiny test model with `--kv-events-config` (both
modes, so only the routing differs); the mocker (a declared simulator: its prefix cache,
prefill time and events are simulated) serves larger N.

Prints both modes side by side and the ratios; the last line is one JSON object:
{"hit_rate_kv", "hit_rate_rr", "tps_ratio" (kv / round-robin), "max_load_over_mean"
(kv: the busiest worker's requests over the mean)}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import socket
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from rlfleet.models import make_model
from rlfleet.testing.fleet import LocalFleet

MODEL = "bench-model"
VLLM_FLAGS = ("--dtype", "float32", "--max-model-len", "4096", "--enforce-eager")
# the hit and query counters: vLLM's own, and the mocker's simulated cache's
COUNTERS = {"vllm": ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
            "mocker": ("rlfleet_mocker_prefix_cache_hits_total",
                       "rlfleet_mocker_prefix_cache_queries_total")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def events_config(port: int) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": f"tcp://*:{port}"})


def worker_args(a: argparse.Namespace, model_dir: Path | None) -> list[list[str]]:
    out = []
    for _ in range(a.workers):
        common = ["--served-model-name", MODEL, "--system-port", "0", "--block-size",
                  str(a.block_size), "--kv-events-config", events_config(free_port())]
        if a.kind == "vllm":
            out.append(["--model", str(model_dir), *common, *VLLM_FLAGS])
        else:
            out.append([*common, "--token-delay", str(a.mock_token_delay), "--prefill-delay",
                        str(a.mock_prefill_delay), "--max-batch", "16"])
    return out


def counters(fleet: LocalFleet, kind: str) -> tuple[float, float]:
    """(hits, queries) summed over the fleet's workers, from their /metrics."""
    hits_name, queries_name = COUNTERS[kind]
    hits = queries = 0.0
    for p in fleet.workers:
        text = httpx.get(f"{p.ready['system_url']}/metrics", timeout=10).text
        for line in text.splitlines():
            m = re.match(r"^([a-z_:]+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
            if m and m.group(1) == hits_name:
                hits += float(m.group(3))
            elif m and m.group(1) == queries_name:
                queries += float(m.group(3))
    return hits, queries


class Workload:
    def __init__(self, a: argparse.Namespace, seed: int) -> None:
        rng = random.Random(0)
        vocab = (1000, 4000)  # plain vocabulary entries of the test tokenizer
        self.system = [rng.randrange(*vocab) for _ in range(a.system_tokens)]
        rng = random.Random(seed)  # the same system prompt every round, new tasks
        self.tasks = [[rng.randrange(*vocab) for _ in range(a.task_tokens)]
                      for _ in range(a.prompts)]
        self.user = [[rng.randrange(*vocab) for _ in range(a.user_tokens)]
                     for _ in range(a.turns)]
        self.a = a


async def one(http: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int,
              seed: int) -> tuple[list[int], float, int]:
    """(completion token IDs, time to first token, worker) of one streamed request."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "seed": seed, "temperature": 1.0,
            "nvext": {"extra_fields": ["completion_token_ids", "worker_id"]}}
    t0 = time.perf_counter()
    ttft = None
    toks: list[int] = []
    worker = -1
    async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            nv = json.loads(line[6:]).get("nvext") or {}
            ids = nv.get("completion_token_ids") or []
            if ids and ttft is None:
                ttft = time.perf_counter() - t0
            toks += ids
            if "worker_id" in nv:
                worker = nv["worker_id"]["decode_worker_id"]
    return toks, ttft or (time.perf_counter() - t0), worker


async def run_workload(url: str, w: Workload) -> dict:
    a = w.a
    ttfts: list[float] = []
    served: Counter = Counter()
    generated = 0
    limit = asyncio.Semaphore(a.concurrency)

    async def rollout(http: httpx.AsyncClient, task: int, sample: int) -> None:
        nonlocal generated
        prompt = w.system + w.tasks[task]
        for turn in range(a.turns):
            async with limit:
                out, ttft, worker = await one(http, url, prompt, a.max_tokens,
                                              seed=task * 1000 + sample * 10 + turn)
            ttfts.append(ttft)
            served[worker] += 1
            generated += len(out)
            prompt = prompt + out + w.user[turn]

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(
            max_connections=512)) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(rollout(http, t, s) for t in range(a.prompts)
                               for s in range(a.group)))
        dt = time.perf_counter() - t0
    return {"tokens": generated, "seconds": dt, "ttfts": ttfts, "served": served}


def flush(fleet: LocalFleet) -> None:
    """Empty every worker's prefix cache (each round starts cold)."""
    for p in fleet.workers:
        httpx.post(f"{p.ready['system_url']}/engine/flush_cache", json={},
                   timeout=60).raise_for_status()


def start(fleet: LocalFleet, a: argparse.Namespace, model_dir: Path | None) -> dict:
    """One set of workers and two frontends on it: round-robin and kv."""
    urls = {"round-robin": fleet.start_frontend("--router-mode", "round-robin").ready["url"],
            "kv": fleet.start_frontend("--router-mode", "kv", "--kv-overlap-weight",
                                       str(a.overlap_weight), "--kv-overload-threshold",
                                       str(a.overload)).ready["url"]}
    procs = [fleet.start_worker(*args, kind=a.kind, wait=False, env={"PYTHONHASHSEED": "0"})
             for args in worker_args(a, model_dir)]
    for p in procs:
        p.wait_ready(900)
    deadline = time.monotonic() + 60
    for url in urls.values():
        while len(httpx.get(f"{url}/health").json()["workers"]) < a.workers:
            if time.monotonic() > deadline:
                raise TimeoutError("a frontend does not see every worker")
            time.sleep(0.2)
    return urls


def measure(a: argparse.Namespace, model_dir: Path | None, work: Path) -> dict:
    """Rounds alternate between the modes (fresh tasks each round, caches flushed before
    it): both see the same machine, whatever else runs on it."""
    with LocalFleet(work / "fleet", lease_ttl=5) as fleet:
        urls = start(fleet, a, model_dir)
        ids = [int(p.ready["instance_id"]) for p in fleet.workers]
        res = {m: {"tokens": 0, "seconds": 0.0, "ttfts": [], "hits": 0.0, "queries": 0.0,
                   "served": Counter()} for m in urls}
        for r in range(a.rounds):
            for mode, url in urls.items():
                flush(fleet)
                h0, q0 = counters(fleet, a.kind)
                out = asyncio.run(run_workload(url, Workload(a, seed=1 + r)))
                h1, q1 = counters(fleet, a.kind)
                m = res[mode]
                m["tokens"] += out["tokens"]
                m["seconds"] += out["seconds"]
                m["ttfts"] += out["ttfts"]
                m["hits"] += h1 - h0
                m["queries"] += q1 - q0
                m["served"] += out["served"]
                print(f"round {r + 1} {mode}: {out['tokens'] / out['seconds']:.1f} tok/s, "
                      f"hit rate {(h1 - h0) / max(q1 - q0, 1):.3f}", flush=True)
        views = {w["instance_id"]: w.get("kv") for w in
                 httpx.get(f"{urls['kv']}/health", timeout=10).json()["workers"]}
    for m in res.values():
        t = sorted(m["ttfts"])
        loads = [m["served"].get(i, 0) for i in ids]
        m.update(tok_s=m["tokens"] / m["seconds"], ttft_mean=statistics.fmean(t),
                 ttft_p90=t[int(0.9 * (len(t) - 1))], loads=loads,
                 hit_rate=m["hits"] / m["queries"] if m["queries"] else float("nan"),
                 max_load_over_mean=max(loads) / statistics.fmean(loads))
    res["kv"]["views"] = [views.get(i) for i in ids]
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", choices=["vllm", "mocker"], default="vllm")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8, help="tasks (GRPO prompts)")
    p.add_argument("--group", type=int, default=4, help="samples per prompt (G)")
    p.add_argument("--turns", type=int, default=4, help="turns per rollout")
    p.add_argument("--system-tokens", type=int, default=256, help="the shared system prompt")
    p.add_argument("--task-tokens", type=int, default=256, help="each task's own prompt")
    p.add_argument("--user-tokens", type=int, default=96, help="each new user turn")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per turn")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2, help="rounds per mode, alternating")
    p.add_argument("--block-size", type=int, default=32,
                   help="the workers' KV block size (vLLM's CPU build: a multiple of 32; "
                        "its default there is 128)")
    p.add_argument("--model", default=None, help="vLLM: a checkpoint (default: a tiny one "
                                                 "made with rlfleet make-model)")
    p.add_argument("--overlap-weight", type=float, default=2.0,
                   help="the kv run's --kv-overlap-weight")
    p.add_argument("--overload", type=float, default=1.5,
                   help="the kv run's --kv-overload-threshold")
    p.add_argument("--mock-token-delay", type=float, default=0.01)
    p.add_argument("--mock-prefill-delay", type=float, default=0.0005,
                   help="mocker: seconds per prompt token not in its simulated cache")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="prefix-routing-") as tmp:
        work = Path(tmp)
        model_dir = None
        if a.kind == "vllm":
            model_dir = Path(a.model) if a.model else make_model(work / "model", "tiny", 1)
        res = measure(a, model_dir, work)
    rr, kv = res["round-robin"], res["kv"]
    requests = a.prompts * a.group * a.turns
    print(f"{a.kind}: {a.workers} workers (block size {a.block_size}), {a.rounds} rounds per "
          f"mode of {a.prompts} prompts x {a.group} samples x {a.turns} turns = {requests} "
          f"requests; system {a.system_tokens} + task {a.task_tokens} tokens, user turns "
          f"{a.user_tokens}, {a.max_tokens} generated per turn")
    print(f"{'':24}{'round-robin':>14}{'kv':>14}{'kv / rr':>10}")
    for label, key, fmt in (("generated tok/s", "tok_s", "{:14.1f}"),
                            ("TTFT mean (ms)", "ttft_mean", "{:14.1f}"),
                            ("TTFT p90 (ms)", "ttft_p90", "{:14.1f}"),
                            ("prefix-cache hit rate", "hit_rate", "{:14.3f}"),
                            ("max load / mean", "max_load_over_mean", "{:14.2f}")):
        scale = 1000 if key.startswith("ttft") else 1
        x, y = rr[key] * scale, kv[key] * scale
        print(f"{label:24}{fmt.format(x)}{fmt.format(y)}{y / x if x else float('nan'):10.2f}")
    print(f"requests per worker: round-robin {rr['loads']}, kv {kv['loads']}")
    print("the kv frontend's view of each worker:", json.dumps(kv["views"]))
    print(json.dumps({"hit_rate_kv": round(kv["hit_rate"], 4),
                      "hit_rate_rr": round(rr["hit_rate"], 4),
                      "tps_ratio": round(kv["tok_s"] / rr["tok_s"], 4),
                      "max_load_over_mean": round(kv["max_load_over_mean"], 4)}))


if __name__ == "__main__":
    main()
