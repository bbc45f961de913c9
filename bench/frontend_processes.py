"""The frontend as K processes on one port (`python -m rlfleet.frontend --processes K`)
against one process, side by side, in front of one mocker worker with no engine cost (the
declared simulator: this measures the serving layer, not an engine).

    python bench/frontend_processes.py [--rounds 2] [--concurrency 64] [--requests 4000]

Per K, stacks alternated over `--rounds`: req/s at C = `--concurrency` for unary
completions of 16 tokens and the frontend's CPU (every process of its group, from /proc)
per request, from the side-by-side harness's closed-loop `loadgen.py`
(when `--loadgen` names one that exists; else this script's own client);
then the frontend's CPU per streamed token, from streamed completions of 64 tokens each
with its own X-Request-Id (as rollout clients send them: the worker keeps each run).
The last line is one JSON object: {"processes": [1, K],
"req_per_s": {K: r}, "ratio_req_per_s": r, "cpu_ms_per_req": {K: ms},
"ratio_cpu_per_req": r, "cpu_us_per_token": {K: us}}."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp

from rlfleet.runtime.launch import spawn

MODEL = "tiny"
PROMPT = list(range(1, 17))
MOCKER = ["--served-model-name", MODEL, "--vocab-size", "4096", "--eos-prob", "1e-9",
          "--token-delay", "0", "--ttft", "0", "--host", "127.0.0.1", "--log-level", "warning"]


def group_cpu(pgid: int) -> float:
    """CPU seconds (user + system) of every live process in process group `pgid`."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(rest[2]) == pgid:
            total += int(rest[11]) + int(rest[12])
    return total / tick


async def closed_loop(url: str, concurrency: int, requests: int, body: dict, stream: bool
                      ) -> tuple[int, int, float]:
    """`requests` completions, `concurrency` in flight, each with a new X-Request-Id:
    (ok, completion tokens, seconds)."""
    ok = tokens = 0
    left = requests
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=120)) as s:
        async def worker() -> None:
            nonlocal ok, tokens, left
            while left > 0:
                left -= 1
                headers = {"X-Request-Id": uuid.uuid4().hex}
                async with s.post(f"{url}/v1/completions", json=body, headers=headers) as r:
                    if r.status != 200:
                        await r.read()
                        continue
                    if stream:
                        last = b""
                        async for line in r.content:
                            if line.startswith(b"data: {"):
                                last = line
                        tokens += json.loads(last[6:])["usage"]["completion_tokens"]
                    else:
                        tokens += (await r.json())["usage"]["completion_tokens"]
                    ok += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return ok, tokens, time.perf_counter() - t0


def unary_rps(args: argparse.Namespace, url: str) -> tuple[float, int]:
    """(req/s, ok) of unary 16-token completions at --concurrency."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    if args.loadgen and Path(args.loadgen).exists():
        out = subprocess.run([sys.executable, args.loadgen, "--url", url, "--model", MODEL,
                              "-c", str(args.concurrency), "-n", str(args.requests), "-t", "16",
                              "--prompt-len", str(len(PROMPT))],
                             capture_output=True, text=True, timeout=600, check=True)
        d = json.loads(out.stdout.strip().splitlines()[-1])
        return d["req_per_s"], d["ok"]
    asyncio.run(closed_loop(url, args.concurrency, args.concurrency * 2, body, False))  # warm
    ok, _, secs = asyncio.run(closed_loop(url, args.concurrency, args.requests, body, False))
    return ok / secs, ok


def measure(args: argparse.Namespace, k: int, work: Path, discovery: str) -> dict:
    fe = spawn(f"frontend-k{k}-{time.monotonic_ns()}",
               [sys.executable, "-m", "rlfleet.frontend", "--http-port", "0",
                "--discovery", discovery, "--router-mode", "round-robin",
                "--processes", str(k)], work / "logs")
    try:
        fields = fe.wait_ready(120)
        url = fields["url"]
        warm = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
        asyncio.run(closed_loop(url, 8, 64, warm, False))
        c0 = group_cpu(fe.pid)
        rps, ok = unary_rps(args, url)
        c1 = group_cpu(fe.pid)
        sbody = {"model": MODEL, "prompt": PROMPT, "max_tokens": 64, "stream": True,
                 "ignore_eos": True, "stream_options": {"include_usage": True}}
        sok, stokens, _ = asyncio.run(closed_loop(url, args.concurrency, args.stream_requests,
                                                  sbody, True))
        c2 = group_cpu(fe.pid)
        out = {"processes": k, "req_per_s": round(rps, 1),
               "cpu_ms_per_req": round(1000 * (c1 - c0) / max(ok, 1), 3),
               "cpu_us_per_token": round(1e6 * (c2 - c1) / max(stokens, 1), 2),
               "stream_ok": sok, "stream_tokens": stokens}
        print(json.dumps(out), flush=True)
        return out
    finally:
        fe.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=2, help="K, measured against 1")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--stream-requests", type=int, default=1000)
    p.add_argument("--loadgen", default="",
                   help="a closed-loop load generator script taking --url --model (e.g. the "
                        "side-by-side harness's loadgen.py); default: this script's own client")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rlfleet-bench-processes-"))
    discovery = f"file://{work}/discovery"
    mocker = spawn("mocker", [sys.executable, "-m", "rlfleet.mocker", *MOCKER,
                              "--discovery", discovery], work / "logs")
    try:
        mocker.wait_ready(120)
        runs: dict[int, list[dict]] = {1: [], args.processes: []}
        for _ in range(args.rounds):
            for k in runs:
                runs[k].append(measure(args, k, work, discovery))
    finally:
        mocker.stop()

    def best(k: int, key: str, low: bool = False) -> float:
        vals = [r[key] for r in runs[k]]
        return min(vals) if low else max(vals)

    k = args.processes
    rps = {n: best(n, "req_per_s") for n in runs}
    cpu = {n: best(n, "cpu_ms_per_req", low=True) for n in runs}
    tok = {n: best(n, "cpu_us_per_token", low=True) for n in runs}
    print(f"req/s at C={args.concurrency}: K=1 {rps[1]}, K={k} {rps[k]} "
          f"(x{rps[k] / rps[1]:.2f}); frontend CPU ms/req: {cpu[1]} vs {cpu[k]}; "
          f"us/streamed token: {tok[1]} vs {tok[k]}")
    print(json.dumps({"processes": [1, k], "concurrency": args.concurrency,
                      "cores": os.cpu_count(), "req_per_s": rps,
                      "ratio_req_per_s": round(rps[k] / rps[1], 3), "cpu_ms_per_req": cpu,
                      "ratio_cpu_per_req": round(cpu[k] / cpu[1], 3),
                      "cpu_us_per_token": tok}))


if __name__ == "__main__":
    main()
