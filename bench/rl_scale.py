"""RL-scale shapes through one frontend to a fleet of mocker workers (the declared
simulator: what is measured is the serving layer under RL load, not an engine).

1. streams: STREAMS concurrent streamed completions of TOKENS tokens each (default
   2,000 × 1,024 through one frontend to 4 workers): errors, tokens/s, frontend CPU per
   token, frontend memory (peak and after).
2. groups: PROMPTS requests of n=N samples each (default 256 × 16), unary, all at once:
   samples/s, tokens/s, p50 and p99 latency.
3. disconnects: STREAMS streams of which half close their connection mid-way: every
   worker must see every abort (the workers' `abandoned` count equals the callers that
   left, nothing keeps running).

    python bench/rl_scale.py [--streams 2000] [--tokens 1024] [--workers 4]
                             [--token-delay 0.05] [--prompts 256] [--n 16]

Prints one JSON line per shape. The client reads the bytes of each stream and parses
only its final usage chunk, so that the client is not what limits the run."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

import httpx

MODEL = "bench-rl"


def proc_stats(pid: int) -> dict:
    """CPU seconds, current and peak resident memory (MiB) of a process."""
    import os

    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status") if ":" in line)
    mib = lambda k: int(status[k].split()[0]) / 1024  # noqa: E731
    return {"cpu_s": (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK"),
            "rss_mib": mib("VmRSS"), "peak_rss_mib": mib("VmHWM")}


def worker_metric(fleet, name: str, label: str = "") -> float:
    total = 0.0
    for p in fleet.workers:
        text = httpx.get(f"{p.ready['url']}/metrics", timeout=30).text
        for m in re.finditer(rf"^{name}(?:{{([^}}]*)}})? ([0-9.e+-]+)$", text, re.M):
            if label in (m.group(1) or ""):
                total += float(m.group(2))
    return total


def body(args: argparse.Namespace, i: int, **kw) -> dict:
    return {"model": MODEL, "prompt": [1101 + i % 50, 1102, 1103, 1104], "seed": i,
            "max_tokens": args.tokens, "ignore_eos": True, "logprobs": 0, **kw}


async def streams(fleet, args: argparse.Namespace, leave_after: int | None = None) -> dict:
    """STREAMS concurrent streams; with `leave_after`, every other one closes its
    connection after that many bytes of events."""
    import aiohttp

    errors: list[str] = []
    completion_tokens: list[int] = []
    peak = {"rss": 0.0}
    pid = fleet.frontend.pid
    c0 = proc_stats(pid)
    stop = asyncio.Event()

    async def sample_memory() -> None:
        while not stop.is_set():
            peak["rss"] = max(peak["rss"], proc_stats(pid)["rss_mib"])
            await asyncio.sleep(0.5)

    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=1800)) as http:
        async def one(i: int) -> None:
            leave = leave_after is not None and i % 2 == 0
            try:
                async with http.post(f"{fleet.url}/v1/completions", json=body(
                        args, i, stream=True, stream_options={"include_usage": True})) as r:
                    if r.status != 200:
                        errors.append(f"HTTP {r.status}: {(await r.text())[:200]}")
                        return
                    got = 0
                    tail = b""
                    async for chunk in r.content.iter_any():
                        got += len(chunk)
                        tail = (tail + chunk)[-4096:]
                        if leave and got >= leave_after:
                            r.close()
                            return
                    if not tail.endswith(b"data: [DONE]\n\n"):
                        errors.append(f"no [DONE]: {tail[-300:]!r}")
                        return
                    usage = json.loads(tail.rsplit(b"data: ", 2)[-2])["usage"]
                    completion_tokens.append(usage["completion_tokens"])
            except Exception as e:  # noqa: BLE001 - every failure is counted
                errors.append(f"{type(e).__name__}: {e}")

        watcher = asyncio.create_task(sample_memory())
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(args.streams)))
        secs = time.perf_counter() - t0
        stop.set()
        await watcher
    c1 = proc_stats(pid)
    tokens = sum(completion_tokens)
    wrong = sum(1 for t in completion_tokens if t != args.tokens)
    return {"streams": args.streams, "tokens": tokens, "seconds": round(secs, 1),
            "tokens_per_s": round(tokens / secs), "errors": len(errors),
            "wrong_length": wrong, "error_samples": errors[:3],
            "frontend_cpu_us_per_token": round(1e6 * (c1["cpu_s"] - c0["cpu_s"]) / max(1, tokens), 1),
            "frontend_rss_mib_before": round(c0["rss_mib"]),
            "frontend_rss_mib_peak_during": round(peak["rss"]),
            "frontend_rss_mib_after": round(c1["rss_mib"])}


async def groups(fleet, args: argparse.Namespace) -> dict:
    import aiohttp

    lat: list[float] = []
    errors: list[str] = []
    tokens = 0
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=1800)) as http:
        async def one(i: int) -> None:
            nonlocal tokens
            t = time.perf_counter()
            async with http.post(f"{fleet.url}/v1/completions",
                                 json=body(args, i, n=args.n, max_tokens=args.group_tokens)) as r:
                data = await r.json()
                if r.status != 200:
                    errors.append(str(data)[:200])
                    return
            lat.append(time.perf_counter() - t)
            assert len(data["choices"]) == args.n
            tokens += data["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(args.prompts)))
        secs = time.perf_counter() - t0
    lat.sort()
    q = lambda p: round(1000 * lat[min(len(lat) - 1, int(p * len(lat)))], 1)  # noqa: E731
    return {"prompts": args.prompts, "n": args.n, "max_tokens": args.group_tokens,
            "errors": len(errors), "seconds": round(secs, 1),
            "samples_per_s": round(args.prompts * args.n / secs, 1),
            "tokens_per_s": round(tokens / secs), "p50_ms": q(0.5), "p99_ms": q(0.99),
            "median_ms": round(1000 * statistics.median(lat), 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=2000)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--token-delay", type=float, default=0.05,
                   help="seconds per token of each stream on the mocker (its pace)")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--group-tokens", type=int, default=128)
    p.add_argument("--shapes", default="streams,groups,disconnects")
    args = p.parse_args()

    from rlfleet.testing.fleet import LocalFleet

    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-rl-") as tmp, \
            LocalFleet(Path(tmp) / "fleet", lease_ttl=30) as fleet:
        fleet.start_frontend("--log-level", "warning")
        for _ in range(args.workers):
            fleet.start_worker("--served-model-name", MODEL, "--token-delay",
                               str(args.token_delay), "--max-model-len", str(args.tokens + 64),
                               "--log-level", "warning", kind="mocker")
        while len(httpx.get(f"{fleet.url}/health", timeout=10).json()["workers"]) < args.workers:
            time.sleep(0.2)
        shapes = args.shapes.split(",")
        if "streams" in shapes:
            print(json.dumps({"shape": "streams", **asyncio.run(streams(fleet, args))}), flush=True)
        if "groups" in shapes:
            print(json.dumps({"shape": "groups", **asyncio.run(groups(fleet, args))}), flush=True)
        if "disconnects" in shapes:
            gone0 = worker_metric(fleet, "rlfleet_worker_requests_total", 'outcome="abandoned"')
            out = asyncio.run(streams(fleet, args, leave_after=20_000))
            deadline = time.monotonic() + 60
            while worker_metric(fleet, "rlfleet_worker_running_requests") > 0:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            out["left_mid_stream"] = args.streams - args.streams // 2
            out["aborts_seen_by_workers"] = round(worker_metric(
                fleet, "rlfleet_worker_requests_total", 'outcome="abandoned"') - gone0)
            out["still_running"] = round(worker_metric(fleet, "rlfleet_worker_running_requests"))
            print(json.dumps({"shape": "disconnects", **out}), flush=True)


if __name__ == "__main__":
    main()
