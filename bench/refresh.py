"""Policy refresh of a two-worker vLLM fleet: the time of each lifecycle step, and the whole
refresh against the bare weight reload of the same checkpoint (update_weights_from_disk on
both paused workers at once), measured in the same run.

    python bench/refresh.py [--size small|tiny] [--rounds 3]

Prints per-step times, both totals and the ratio (refresh / bare reload)."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from rlfleet.models import make_model
from rlfleet.refresh.coordinator import PolicyRefresh
from rlfleet.testing.fleet import LocalFleet


async def bare_reload(system_urls: list[str], path: Path, version: str) -> float:
    """Pause both workers, then time the two update_weights_from_disk calls, then resume."""
    async with httpx.AsyncClient(timeout=600) as http:
        await asyncio.gather(*(http.post(f"{u}/engine/pause_generation", json={"mode": "wait"})
                               for u in system_urls))
        t0 = time.perf_counter()
        rs = await asyncio.gather(*(http.post(f"{u}/engine/update_weights_from_disk",
                                              json={"model_path": str(path),
                                                    "weight_version": version})
                                    for u in system_urls))
        secs = time.perf_counter() - t0
        await asyncio.gather(*(http.post(f"{u}/engine/resume_generation", json={})
                               for u in system_urls))
    for r in rs:
        assert r.json()["status"] == "ok", r.text
    return secs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="small", choices=["tiny", "small"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-") as tmp:
        work = Path(tmp)
        ckpt = {name: make_model(work / "ckpt" / name, size=args.size, seed=seed,
                                 dtype=args.dtype) for name, seed in (("A", 0), ("B", 1))}
        flags = ["--dtype", args.dtype, "--max-model-len", "512", "--enforce-eager",
                 "--enable-rl", "--system-port", "0", "--served-model-name", "bench",
                 "--allowed-weights-root", str(work / "ckpt")]
        with LocalFleet(work / "fleet") as fleet:
            fleet.start_frontend(enable_rl=True)
            procs = [fleet.start_worker("--model", str(ckpt["A"]), *flags, wait=False)
                     for _ in range(2)]
            for proc in procs:
                proc.wait_ready(900)
            urls = [proc.ready["system_url"] for proc in procs]
            # defaults: probe tolerance by the workers' dtype, workers checked against each
            # other (no transformers copy of the checkpoint in the coordinator)
            coordinator = PolicyRefresh(fleet.rl_url, model="bench", timeout=600)

            async def run() -> tuple[list[float], list[float], list[dict]]:
                targets = {}
                for name in ("A", "B"):  # target identity (digest) outside the timing
                    t0 = time.perf_counter()
                    targets[name] = await coordinator._policy(ckpt[name], name, None, None, None)
                    print(f"target {name}: digest in "
                          f"{time.perf_counter() - t0:.2f} s")
                bare, full, steps = [], [], []
                for i in range(args.rounds):
                    name = "B" if i % 2 == 0 else "A"
                    bare.append(await bare_reload(urls, ckpt[name], f"bare-{i}"))
                    other = "A" if name == "B" else "B"
                    await bare_reload(urls, ckpt[other], f"back-{i}")
                    res = await coordinator.refresh(ckpt[name], name,
                                                    digest=targets[name].digest, step=i)
                    assert res.ok, res.reason
                    full.append(res.seconds)
                    steps.append(res.step_seconds())
                return bare, full, steps

            bare, full, steps = asyncio.run(run())
    print(f"model={args.size} dtype={args.dtype} workers=2 rounds={args.rounds}")
    for name in steps[0]:
        vals = [s.get(name, 0.0) for s in steps]
        print(f"  step {name:<12} median {statistics.median(vals):7.3f} s")
    b, f = statistics.median(bare), statistics.median(full)
    print(f"bare reload (both workers): median {b:.3f} s  {[round(x, 3) for x in bare]}")
    print(f"whole refresh             : median {f:.3f} s  {[round(x, 3) for x in full]}")
    print(f"ratio refresh/bare = {f / b:.3f} (lifecycle adds {100 * (f / b - 1):.0f}%)")
    other = statistics.median(sum(v for k, v in s.items() if k != "apply") for s in steps)
    print(f"steps other than apply: median {other:.3f} s = {100 * other / b:.0f}% of the bare "
          f"reload (the apply step itself is the bare reload, and varies run to run)")


if __name__ == "__main__":
    main()
