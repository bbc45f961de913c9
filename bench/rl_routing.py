"""Routing on the workloads RL runs, side by side: the same replayable traces (GRPO groups,
multi-turn agent episodes, a mix of both arriving over time; rlfleet.testing.traces) through
each stack at the same concurrency:

- `mocker`: rlfleet's frontend in `--router-mode kv` and `round-robin` over 2 rlfleet mockers
  with the engine-iteration timing model (`--engine-steps`, bench/rl_stacks.Timing);
- `dynamo`: NVIDIA Dynamo 1.6.1's frontend (`--router-mode kv` with its best settings for the
  workload, and `round-robin`) over `dynamo.mocker --num-workers 2` given the same timing
  model (block size, cache blocks, prefill cost per uncached token, decode cost per step);
- `sglang`: sglang-router 0.3.2 (`cache_aware` and `round_robin`) in front of one rlfleet
  frontend per mocker worker, the same mockers;
- `vllm`: rlfleet's frontend (`kv`, `round-robin`, `least-loaded`) over 2 vLLM workers of the
  0.6B geometry (`rlfleet make-model --size small`), the same engine flags for every mode,
  one core each (OMP_NUM_THREADS=1), each worker's prefix cache flushed before each run.

    python bench/rl_routing.py [--stacks mocker,dynamo,sglang,vllm]
        [--workloads grpo,grpo16,agent,mix] [--dynamo-venv /work/wt/dynamo-venv]
        [--vllm-workloads grpo,agent] [--vllm-modes kv,round-robin,least-loaded]
        [--dynamo-sweep] [--quick] [--traces DIR] [--work DIR] [--kv-cache-gib 1]
        [--rounds 1] [--after-step]

Measured per run: output tok/s over the replay, TTFT p50/p90 (client side), the prefix-cache
hit rate (cached / prompt tokens, from each engine's own counters: rlfleet's mocker and vLLM
/metrics, Dynamo's mocker per answer `usage.prompt_tokens_details.cached_tokens`), and the
load imbalance (max / mean over workers of their requests in flight, time-averaged). With
`--rounds N` the mocker stacks replay each trace N times each (every stack and mode in turn,
a round at a time) and each mode's figures are those of its median run by tok/s. With
`--after-step` each mocker-stack run first replays the previous RL step (the workload at
another seed) through the same stack, unmeasured: every step of a training run but the
first meets a fleet that has served one (caches full of other prompts, sessions finished).

The last line is one JSON object: `vllm_<workload>_tok_s_kv_vs_rr`, `..._ttft_p90_kv_vs_rr`,
`..._tok_s_kv_vs_ll`; `vs_dynamo` and `vs_sglang_router`: {workload: {"gain": rlfleet's kv
tok/s / its round-robin, divided by the peer's cache-aware tok/s / its round-robin;
"hit_rate": rlfleet kv's / the peer's; "tok_s": rlfleet kv's / the peer's}}, with
`sim_rr_tok_s` (rlfleet's round-robin tok/s / Dynamo's: what the two simulators' difference
alone moves) and the Dynamo settings used. Runs inside a private network namespace (only
loopback) when started as root."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from rl_stacks import (
    DYNAMO_MODEL,
    MODEL,
    Timing,
    dynamo_stack,
    rlfleet_stack,
    sglang_stack,
    start_workers,
)

from rlfleet.models import make_model
from rlfleet.testing import traces
from rlfleet.testing.fleet import LocalFleet

# the workloads: the mocker's (2 workers of Timing) and vLLM's (2 workers of the 0.6B
# geometry, one core each: an uncached prefill of 1,000 tokens takes ~30 s there), each
# (trace maker, its parameters); --quick: 2 prompts or episodes of 2 turns, to try a set-up
MOCK_WORKLOADS: dict[str, tuple[Callable[..., traces.Trace], dict]] = {
    "grpo": (traces.grpo, dict(seed=1, prompts=16, n=8, families=2, preamble=2048,
                               question=512, max_tokens=64)),
    "grpo16": (traces.grpo, dict(seed=2, prompts=8, n=16, families=2, preamble=2048,
                                 question=512, max_tokens=64)),
    "agent": (traces.agent, dict(seed=3, episodes=16, turns=6, system=1024, task=512,
                                 tool=256, max_tokens=48, spread=4.0, think=0.5)),
    "mix": (traces.mix, dict(seed=4, episodes=8, turns=5, groups=6, n=8, system=1024,
                             task=512, tool=256, preamble=2048, question=512, max_tokens=48,
                             duration=10.0, think=0.5)),
}
# vLLM on 2 cores: small enough that the three modes of the agent and GRPO workloads run
# in ~30 minutes, big enough that reuse matters: an episode's context grows from 1,024 to
# ~2,500 tokens over 10 turns (2 episodes fit one worker's cache, 4 do not; the 4 cold
# first turns are a tenth of the requests, so the TTFT p90 reads the continuations), a
# GRPO prompt is 896
VLLM_WORKLOADS: dict[str, tuple[Callable[..., traces.Trace], dict]] = {
    "grpo": (traces.grpo, dict(seed=1, prompts=4, n=8, families=1, preamble=512,
                               question=384, max_tokens=24)),
    "grpo16": (traces.grpo, dict(seed=2, prompts=2, n=16, families=1, preamble=512,
                                 question=384, max_tokens=24)),
    "agent": (traces.agent, dict(seed=3, episodes=4, turns=10, system=512, task=512, tool=128,
                                 max_tokens=32, spread=2.0, think=0.2)),
    "mix": (traces.mix, dict(seed=4, episodes=2, turns=4, groups=2, n=8, system=512,
                             task=384, tool=128, preamble=512, question=384, max_tokens=32,
                             duration=20.0, think=0.2)),
}
QUICK = {"prompts": 2, "episodes": 2, "groups": 2, "turns": 2}


def workload(table: dict, name: str, quick: bool) -> traces.Trace:
    make, params = table[name]
    return make(**({**params, **{k: v for k, v in QUICK.items() if k in params}}
                   if quick else params))


# (the CPU build's block size must be a multiple of 32)
VLLM_FLAGS = ["--dtype", "float32", "--max-model-len", "4096", "--enforce-eager",
              "--block-size", "32"]
# Dynamo's router settings tried (--dynamo-sweep: all of them; else round-robin and those
# the sweep found best for the workload, BENCHMARKS.md: its defaults for GRPO groups, which
# carry no session, soft session affinity for agents); its best of those run is compared
DYNAMO_VARIANTS = {
    "round-robin": ["--router-mode", "round-robin"],
    "kv": ["--router-mode", "kv"],
    "kv+affinity-soft": ["--router-mode", "kv", "--router-session-affinity-ttl-secs", "300",
                         "--router-session-affinity-mode", "soft"],
    "kv+affinity-hard": ["--router-mode", "kv", "--router-session-affinity-ttl-secs", "300",
                         "--router-session-affinity-mode", "hard"],
    "kv+credit-2": ["--router-mode", "kv", "--router-kv-overlap-score-credit", "2"],
    "kv+decode-weight-8": ["--router-mode", "kv", "--router-decode-active-request-weight", "8"],
}
DYNAMO_RUN = {"grpo": ("round-robin", "kv"), "grpo16": ("round-robin", "kv"),
              "agent": ("round-robin", "kv+affinity-soft"),
              "mix": ("round-robin", "kv", "kv+affinity-soft")}
CONCURRENCY = 256
OUTCOMES: Path | None = None  # --work DIR: each run's outcomes in DIR/outcomes
# --after-step: workload -> the RL step before it (the same workload at another seed),
# replayed through each stack before the measured replay
PREVIOUS: dict[str, traces.Trace] = {}
# the peer-dynamo set-up's tiny model (config and tokenizer, no weights)
PEER_DYNAMO_MODEL = next((p for p in (Path(__file__).resolve().parents[2] / "shared",
                                      Path("/work/shared")) if p.is_dir()),
                         Path("/work/shared")) / "bench" / "peer-dynamo" / "model-tiny"


def run(trace: traces.Trace, stack_cm, client: Callable[[str], traces.Client],
        label: str, before: traces.Trace | None = None) -> dict:
    """One replay of `trace` through the stack `stack_cm` starts: its summary and hit rate
    (after a replay of `before`, not measured, where given)."""
    with stack_cm as st:
        if before is not None:
            asyncio.run(traces.replay(before, client(st.url), CONCURRENCY))
        c0 = st.counters() if st.counters else None
        b0 = st.busy() if st.busy else None
        outs = asyncio.run(traces.replay(trace, client(st.url), CONCURRENCY))
        c1 = st.counters() if st.counters else None
        busy = {k: v - b0.get(k, 0.0) for k, v in st.busy().items()} if b0 is not None else None
    res = traces.summary(outs, busy)
    if OUTCOMES is not None:  # each request's outcome, for a closer look
        OUTCOMES.mkdir(parents=True, exist_ok=True)
        (OUTCOMES / f"{label.replace(' ', '_')}.json").write_text(json.dumps(
            [{k: v for k, v in vars(o).items() if k != "output"} for o in outs]))
    if c0 is not None:
        res["hit_rate"] = (c1[0] - c0[0]) / max(c1[1] - c0[1], 1.0)
    else:
        res["hit_rate"] = sum(o.cached or 0 for o in outs) / sum(o.prompt_len for o in outs)
    print(f"  {label:34} {res['tok_s']:9.1f} tok/s  TTFT p50 {res['ttft_p50']:6.2f} s  "
          f"p90 {res['ttft_p90']:6.2f} s  hit {res['hit_rate']:.3f}  "
          f"imbalance {res['imbalance']:.2f}  ({res['seconds']:.1f} s)", flush=True)
    return res


def rlfleet_client(url: str) -> traces.Client:
    return traces.OpenAIClient(url, MODEL, "X-Session-ID",
                               finish_sessions=not os.environ.get("RL_ROUTING_NO_FINISH"))


def mocker_runs(a: argparse.Namespace, wl: str, trace: traces.Trace, work: Path) -> dict:
    return {mode: run(trace, rlfleet_stack(work / f"mock-{wl}-{mode}", mode, [],
                                           timing=a.timing), rlfleet_client,
                      f"rlfleet mocker {wl} {mode}", PREVIOUS.get(wl))
            for mode in ("kv", "round-robin")}


def dynamo_runs(a: argparse.Namespace, wl: str, trace: traces.Trace, work: Path) -> dict:
    names = list(DYNAMO_VARIANTS) if a.dynamo_sweep else list(DYNAMO_RUN[wl])
    model = Path(a.dynamo_model)
    if not (model / "tokenizer.json").exists():
        raise FileNotFoundError(f"{model}: no tokenizer.json (give --dynamo-model a model "
                                "directory Dynamo's mocker reads: config and tokenizer)")

    def client(url: str) -> traces.Client:
        return traces.OpenAIClient(url, DYNAMO_MODEL, "X-Dynamo-Session-ID")
    return {n: run(trace, dynamo_stack(Path(a.dynamo_venv), work / f"dyn-{wl}-{n}", a.timing,
                                       model, DYNAMO_VARIANTS[n]), client,
                   f"dynamo {wl} {n}", PREVIOUS.get(wl)) for n in names}


def sglang_runs(a: argparse.Namespace, wl: str, trace: traces.Trace, work: Path) -> dict:
    return {p: run(trace, sglang_stack(work / f"sgl-{wl}-{p}", a.timing, p),
                   traces.SglangClient, f"sglang-router {wl} {p}", PREVIOUS.get(wl))
            for p in ("cache_aware", "round_robin")}


def flush(workers: list) -> None:
    """Empty every worker's prefix cache (each run starts cold)."""
    for p in workers:
        httpx.post(f"{p.ready['system_url']}/engine/flush_cache", json={},
                   timeout=120).raise_for_status()


def vllm_runs(a: argparse.Namespace, work: Path) -> dict:
    """One set of vLLM workers; per workload, a frontend per mode in turn, caches flushed
    before each run."""
    model = Path(a.model) if a.model else work / a.vllm_size
    if not (model / "config.json").exists():
        print(f"writing a {a.vllm_size} model to {model} ...", flush=True)
        make_model(model, a.vllm_size)
    # one core each (two engines' OpenMP threads spinning on both cores slow each other)
    env = {"VLLM_CPU_KVCACHE_SPACE": str(a.kv_cache_gib), "OMP_NUM_THREADS": "1"}
    out: dict = {}
    with LocalFleet(work / "vllm", lease_ttl=10) as fleet:
        workers = start_workers(fleet, 2, ["--model", str(model), *VLLM_FLAGS], "vllm", env)
        if not a.quick:
            # the engines' first replay runs slower whatever the router (the agent trace's
            # first mode took 361 s where the same placement took 288 s later): a short
            # replay of each workload first, not measured
            for wl in a.workloads:
                cm = rlfleet_stack(work / f"vllm-warmup-{wl}", "round-robin", [], workers,
                                   fleet, kind="vllm")
                run(workload(VLLM_WORKLOADS, wl, True), cm, rlfleet_client,
                    f"rlfleet vLLM {wl} warm-up")
        for wl in a.workloads:
            trace = workload(VLLM_WORKLOADS, wl, a.quick)
            save(a, f"vllm-{wl}", trace)
            print(f"vLLM {wl}: {len(trace.requests)} requests ({trace.params})", flush=True)
            out[wl] = {}
            for mode in a.vllm_modes:
                flush(workers)
                cm = rlfleet_stack(work / f"vllm-{wl}-{mode}", mode, [], workers, fleet,
                                   kind="vllm")
                out[wl][mode] = run(trace, cm, rlfleet_client, f"rlfleet vLLM {wl} {mode}")
    return out


def save(a: argparse.Namespace, name: str, trace: traces.Trace) -> None:
    if a.traces:
        Path(a.traces).mkdir(parents=True, exist_ok=True)
        trace.dump(Path(a.traces) / f"{name}.jsonl")


def _r(x: float) -> float:
    return round(x, 4)


def versus(ours: dict, peer: dict, peer_best: str, peer_rr: str) -> dict:
    """rlfleet's kv against the peer's cache-aware policy (see the module doc)."""
    kv, rr, pk, pr = ours["kv"], ours["round-robin"], peer[peer_best], peer[peer_rr]
    return {"gain": _r((kv["tok_s"] / rr["tok_s"]) / (pk["tok_s"] / pr["tok_s"])),
            "hit_rate": _r(kv["hit_rate"] / pk["hit_rate"]) if pk["hit_rate"] else None,
            "tok_s": _r(kv["tok_s"] / pk["tok_s"]),
            "ours_gain": _r(kv["tok_s"] / rr["tok_s"]),
            "peer_gain": _r(pk["tok_s"] / pr["tok_s"]),
            "ours_hit_rate": _r(kv["hit_rate"]), "peer_hit_rate": _r(pk["hit_rate"]),
            "peer_setting": peer_best}


def report(res: dict) -> dict:
    out: dict = {}
    for wl, modes in res.get("vllm", {}).items():
        kv = modes.get("kv")
        for base, tag in (("round-robin", "rr"), ("least-loaded", "ll")):
            if kv is None or base not in modes:
                continue
            out[f"vllm_{wl}_tok_s_kv_vs_{tag}"] = _r(kv["tok_s"] / modes[base]["tok_s"])
            out[f"vllm_{wl}_ttft_p90_kv_vs_{tag}"] = _r(kv["ttft_p90"] / modes[base]["ttft_p90"])
            out[f"vllm_{wl}_hit_rate_kv_{tag}"] = [_r(kv["hit_rate"]),
                                                   _r(modes[base]["hit_rate"])]
    for peer, key in (("dynamo", "vs_dynamo"), ("sglang", "vs_sglang_router")):
        for wl, runs in res.get(peer, {}).items():
            ours = res.get("mocker", {}).get(wl)
            if ours is None:
                continue
            if peer == "dynamo":
                best = max((n for n in runs if n != "round-robin"),
                           key=lambda n: runs[n]["tok_s"])
                v = versus(ours, runs, best, "round-robin")
                v["sim_rr_tok_s"] = _r(ours["round-robin"]["tok_s"] / runs["round-robin"]["tok_s"])
            else:
                v = versus(ours, runs, "cache_aware", "round_robin")
            out.setdefault(key, {})[wl] = v
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stacks", default="mocker,dynamo,sglang,vllm")
    p.add_argument("--workloads", default="grpo,grpo16,agent,mix")
    p.add_argument("--vllm-workloads", default="grpo,agent,mix")
    p.add_argument("--vllm-modes", default="kv,round-robin,least-loaded")
    p.add_argument("--dynamo-venv", default=os.environ.get("DYNAMO_VENV", "/work/wt/dynamo-venv"),
                   help="a venv with ai-dynamo 1.6.1 (../shared/bench/peer-dynamo/setup.sh)")
    p.add_argument("--dynamo-model", default=os.environ.get("DYNAMO_MODEL_DIR", str(
        PEER_DYNAMO_MODEL)), help="config and tokenizer for Dynamo's mocker (a 4,096-token "
                                   "vocabulary: its tokenizer loads in both workers at once)")
    p.add_argument("--dynamo-sweep", action="store_true",
                   help="run every Dynamo router setting (DYNAMO_VARIANTS), not only its "
                        "defaults and its best one for the workload")
    p.add_argument("--model", help="vLLM: a checkpoint of the 0.6B geometry (default: made)")
    p.add_argument("--vllm-size", default="small", choices=["small", "tiny"],
                   help="the model made when --model is not given (tiny: to try the set-up)")
    p.add_argument("--kv-cache-gib", type=int, default=1,
                   help="vLLM: VLLM_CPU_KVCACHE_SPACE (GiB) of each worker (1: ~4,680 tokens "
                        "of the 0.6B geometry in float32, the agent workload's episodes of one "
                        "worker under kv, not all four)")
    p.add_argument("--kv-blocks", type=int, default=Timing.kv_blocks,
                   help="mockers: cache blocks per worker")
    p.add_argument("--traces", help="write each trace here as JSONL")
    p.add_argument("--quick", action="store_true",
                   help="2 prompts or episodes of 2 turns per workload: to try the set-up")
    p.add_argument("--work", help="keep logs here (default: a temporary directory)")
    p.add_argument("--after-step", action="store_true",
                   help="mocker stacks: each run first replays the previous RL step (the "
                        "same workload, another seed: other prompts, as long episodes) "
                        "through the same stack, not measured, as every step of a run but "
                        "the first finds the fleet")
    p.add_argument("--rounds", type=int, default=1,
                   help="mocker stacks: replay each workload this many times through every "
                        "stack and mode, in turn, and take each mode's median run")
    a = p.parse_args()
    a.stacks = a.stacks.split(",")
    a.timing = Timing(kv_blocks=a.kv_blocks)
    a.vllm_modes = a.vllm_modes.split(",")
    enter_private_network()
    global OUTCOMES
    with contextlib.ExitStack() as stack:
        work = Path(a.work) if a.work else Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="rl-routing-")))
        OUTCOMES = work / "outcomes" if a.work else None
        res = measure(a, work)
    print(json.dumps(report(res)))


def measure(a: argparse.Namespace, work: Path) -> dict:
    res: dict = {}
    t0 = time.monotonic()
    mock_stacks = [n for n in ("mocker", "dynamo", "sglang") if n in a.stacks]
    for wl in a.workloads.split(",") if mock_stacks else ():
        trace = workload(MOCK_WORKLOADS, wl, a.quick)
        save(a, f"mock-{wl}", trace)
        if a.after_step:
            make, params = MOCK_WORKLOADS[wl]
            PREVIOUS[wl] = workload({wl: (make, {**params, "seed": params["seed"] + 100})}, wl,
                                    a.quick)
        print(f"{wl}: {len(trace.requests)} requests ({trace.params})", flush=True)
        rounds: dict[str, dict[str, list[dict]]] = {}
        for i in range(a.rounds):  # every stack once a round: each sees the box's same hour
            for name, fn in (("mocker", mocker_runs), ("dynamo", dynamo_runs),
                             ("sglang", sglang_runs)):
                if name in a.stacks:
                    for mode, r in fn(a, wl, trace, work / f"round-{i}").items():
                        rounds.setdefault(name, {}).setdefault(mode, []).append(r)
        for name, modes in rounds.items():
            res.setdefault(name, {})[wl] = {m: median_run(rs) for m, rs in modes.items()}
    if "vllm" in a.stacks:
        a.workloads = a.vllm_workloads.split(",")
        res["vllm"] = vllm_runs(a, work)
    print(f"all runs: {time.monotonic() - t0:.0f} s", flush=True)
    return res


def median_run(runs: list[dict]) -> dict:
    """Of one mode's runs, the one of the median output tok/s (the lower middle of an even
    count), with every run's tok/s beside it."""
    ranked = sorted(runs, key=lambda r: r["tok_s"])
    return {**ranked[(len(ranked) - 1) // 2], "rounds_tok_s": [round(r["tok_s"], 1) for r in runs]}


def enter_private_network() -> None:
    """Re-run this script inside a private network namespace (loopback only) when root."""
    if os.environ.get("RL_ROUTING_NETNS") or os.geteuid() != 0:
        if os.environ.get("RL_ROUTING_NETNS"):
            subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
        return
    os.environ["RL_ROUTING_NETNS"] = "1"
    os.execvp("unshare", ["unshare", "--net", "--", sys.executable, *sys.argv])


if __name__ == "__main__":
    main()
