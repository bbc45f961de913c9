"""LoRA adapters as policies on one vLLM worker, against the base model on the same worker,
measured in one run:

- the gated window of an adapter refresh (PolicyRefresh, path vllm-adapter: the version is
  loaded beside the serving one and probed through it before the gate, `stage` and
  `probe_beside`; the window is gate → apply (the switch) → verify → probe (the answer from
  before the gate) → reopen of that adapter) ÷ the gated window of a full-model refresh
  (path vllm-disk: gate → pause → reload → cache reset → verify → resume → probe → reopen);
  bytes an adapter version moves ÷ bytes a model version moves;
- the base model's tok/s (and another adapter's) while an adapter is refreshed over and
  over ÷ the same load without refreshes;
- serving tok/s with the request mix spread over 4 loaded adapters ÷ the same mix on the
  base model alone.

    python bench/lora.py [--size tiny|small] [--rounds 3] [--seconds 6] [--concurrency 8]
                         [--source dir|trainer]

`--source trainer`: every adapter version is published to a trainer's publisher
(rlfleet.weights.publish.TrainerServer) and each worker stages it from there while it serves
(stage_lora_adapter) before the refresh's gate; `dir` (default): loaded from its directory.

The last line is one JSON object: {"gated_window_ratio", "bytes_ratio",
"base_tps_during_refresh_ratio", "tps_4_adapters_ratio"}."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from rlfleet.models import make_adapter, make_model
from rlfleet.refresh.coordinator import PolicyRefresh
from rlfleet.testing.fleet import LocalFleet
from rlfleet.weights.adapters import publish_adapter
from rlfleet.weights.digest import checkpoint_digest, checkpoint_files
from rlfleet.weights.publish import TrainerServer

MODEL = "bench"
#: the lifecycle steps inside the gated window (the rest: resolving the workers, staging)
WINDOW = ("gate", "pause", "apply", "reset_cache", "verify", "resume", "probe", "reopen")


def window(result) -> float:
    return sum(v for k, v in result.step_seconds().items() if k in WINDOW)


def size_of(path: Path) -> int:
    return sum(f.stat().st_size for f in checkpoint_files(path))


async def load(url: str, models: list[str], seconds: float, concurrency: int,
               tokens: int) -> dict[str, float]:
    """Completions (ignore_eos, `tokens` each) from `concurrency` loops over `models` in
    turn for `seconds`: generated tokens per second, per model."""
    done: dict[str, int] = dict.fromkeys(models, 0)
    deadline = time.monotonic() + seconds

    async def one(i: int, http: httpx.AsyncClient) -> None:
        k = i
        while time.monotonic() < deadline:
            model = models[k % len(models)]
            k += 1
            r = await http.post(f"{url}/v1/completions", json={
                "model": model, "prompt": f"Count with me {i} {k}:", "max_tokens": tokens,
                "temperature": 1.0, "ignore_eos": True})
            r.raise_for_status()
            done[model] += r.json()["usage"]["completion_tokens"]
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=120) as http:
        await asyncio.gather(*(one(i, http) for i in range(concurrency)))
    secs = time.monotonic() - t0
    return {m: n / secs for m, n in done.items()}


class Versions:
    """How an adapter version reaches the workers: from its directory, or published to a
    trainer's publisher and staged from there."""

    def __init__(self, trainer: TrainerServer | None) -> None:
        self.trainer = trainer

    async def refresh(self, coordinator: PolicyRefresh, path: Path, version: str):
        if self.trainer is None:
            return await coordinator.refresh(path, version)
        await asyncio.to_thread(publish_adapter, path, self.trainer.dir, version)
        digest = await asyncio.to_thread(checkpoint_digest, path)
        return await coordinator.refresh(None, version, digest=digest, source={
            "kind": "trainer", "url": self.trainer.url})


async def refresh_loop(coordinator: PolicyRefresh, versions: Versions, paths: list[Path],
                       stop: asyncio.Event, results: list) -> None:
    i = 0
    while not stop.is_set():
        res = await versions.refresh(coordinator, paths[i % len(paths)], f"loop-{i}")
        assert res.ok, res.reason
        results.append(res)
        i += 1


async def measure(fleet: LocalFleet, work: Path, ckpt: dict[str, Path],
                  adapters: dict[str, Path], args: argparse.Namespace,
                  versions: Versions) -> dict:
    full = PolicyRefresh(fleet.rl_url, model=MODEL, timeout=600)
    lora = PolicyRefresh(fleet.rl_url, model=MODEL, path="vllm-adapter", adapter="r",
                         timeout=600)
    others = [PolicyRefresh(fleet.rl_url, model=MODEL, path="vllm-adapter", adapter=f"o{k}",
                            timeout=600) for k in range(3)]
    for k, o in enumerate(others):  # 3 more adapters, for the 4-adapter mix
        assert (await o.refresh(adapters[f"o{k}"], f"o{k}-v0")).ok
    full_w, lora_w, full_s, lora_s = [], [], [], []
    for i in range(args.rounds):
        res = await full.refresh(ckpt["B" if i % 2 == 0 else "A"], f"full-{i}")
        assert res.ok, res.reason
        full_w.append(window(res))
        full_s.append(res.step_seconds())
        res = await versions.refresh(lora, adapters["r1" if i % 2 == 0 else "r2"], f"r-{i}")
        assert res.ok, res.reason
        lora_w.append(window(res))
        lora_s.append(res.step_seconds())
    await asyncio.sleep(2)  # discovery settles on the last versions

    url, c, n = fleet.url, args.concurrency, args.tokens
    quiet = await load(url, [MODEL, "o0"], args.seconds, c, n)
    stop, during = asyncio.Event(), []
    loop = asyncio.create_task(refresh_loop(lora, versions, [adapters["r1"], adapters["r2"]],
                                            stop, during))
    busy = await load(url, [MODEL, "o0"], args.seconds, c, n)
    stop.set()
    await loop
    base_alone = await load(url, [MODEL], args.seconds, c, n)
    four = await load(url, ["r", "o0", "o1", "o2"], args.seconds, c, n)
    for r in (full, lora, *others):
        r.close()
    return {"full_windows": full_w, "lora_windows": lora_w, "full_steps": full_s,
            "lora_steps": lora_s, "quiet": quiet, "busy": busy,
            "refreshes_during": len(during), "base_alone": base_alone, "four": four,
            "full_bytes": size_of(ckpt["A"]), "lora_bytes": size_of(adapters["r1"])}


def report(m: dict, args: argparse.Namespace) -> dict:
    fw, lw = statistics.median(m["full_windows"]), statistics.median(m["lora_windows"])
    print(f"model={args.size} float32, 1 vLLM worker (CPU), adapters from {args.source}, "
          f"rounds={args.rounds}, "
          f"load {args.concurrency} x {args.tokens} tokens for {args.seconds} s")
    print(f"gated window: full-model refresh median {fw:.3f} s "
          f"{[round(x, 3) for x in m['full_windows']]}; adapter refresh median {lw:.3f} s "
          f"{[round(x, 3) for x in m['lora_windows']]}")
    for kind in ("full", "lora"):
        steps = m[f"{kind}_steps"]
        print(f"  {kind} refresh steps (median s): " + ", ".join(
            f"{k} {statistics.median(s.get(k, 0.0) for s in steps):.3f}"
            for k in ("stage", "probe_beside", *WINDOW)))
    print(f"bytes per version: model {m['full_bytes']:,}, adapter {m['lora_bytes']:,}")
    q, b = m["quiet"], m["busy"]
    print(f"tok/s without refreshes: base {q[MODEL]:.0f}, other adapter {q['o0']:.0f}; "
          f"during {m['refreshes_during']} adapter refreshes: base {b[MODEL]:.0f}, "
          f"other adapter {b['o0']:.0f} (ratio {b['o0'] / q['o0']:.3f})")
    alone, four = sum(m["base_alone"].values()), sum(m["four"].values())
    print(f"tok/s same mix: base model alone {alone:.0f}, over 4 adapters {four:.0f}")
    return {"gated_window_ratio": round(lw / fw, 4),
            "bytes_ratio": round(m["lora_bytes"] / m["full_bytes"], 6),
            "base_tps_during_refresh_ratio": round(b[MODEL] / q[MODEL], 4),
            "tps_4_adapters_ratio": round(four / alone, 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="tiny", choices=["tiny", "small"])
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--source", default="dir", choices=["dir", "trainer"],
                   help="adapter versions loaded from their directories, or staged from a "
                        "trainer's publisher")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-lora-") as tmp:
        work = Path(tmp)
        ckpt = {name: make_model(work / "w" / name, size=args.size, seed=seed)
                for name, seed in (("A", 0), ("B", 1))}
        adapters = {name: make_adapter(work / "w" / name, size=args.size, rank=args.rank,
                                       seed=seed)
                    for seed, name in enumerate(("r1", "r2", "o0", "o1", "o2"))}
        flags = ["--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
                 "--enable-rl", "--system-port", "0", "--served-model-name", MODEL,
                 "--allowed-weights-root", str(work / "w"), "--enable-lora",
                 "--max-loras", "5", "--max-lora-rank", str(max(16, args.rank))]
        trainer = TrainerServer(work / "published") if args.source == "trainer" else None
        try:
            with LocalFleet(work / "fleet") as fleet:
                fleet.start_frontend(enable_rl=True)
                fleet.start_worker("--model", str(ckpt["A"]), *flags,
                                   wait=False).wait_ready(900)
                measured = asyncio.run(measure(fleet, work, ckpt, adapters, args,
                                               Versions(trainer)))
        finally:
            if trainer is not None:
                trainer.close()
    print(json.dumps(report(measured, args)), flush=True)


if __name__ == "__main__":
    main()
