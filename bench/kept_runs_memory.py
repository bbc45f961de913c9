"""The frontend's memory at its bound on kept runs (issue 43): runs sent with an
X-Request-Id are kept for retries, up to --max-kept-bytes of counted events; beyond it the
oldest finished ones are forgotten. This fills a frontend to twice its bound with runs of
TOKENS tokens with LOGPROBS top logprobs each (one mocker worker: the declared simulator),
and compares the frontend's resident memory with the bound.

    python bench/kept_runs_memory.py [--bound-mib 256] [--tokens 512] [--logprobs 5]

Baseline: the same frontend's RSS after as many requests without an X-Request-Id (nothing
kept). The JSON last line: `bound_mib`, `rss_baseline_mib`, `rss_at_bound_mib`,
`kept_over_bound` ((RSS at the bound - baseline) / bound: what the counted bytes really
cost, allocator overhead included), `runs`."""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from rlfleet.testing.fleet import LocalFleet

MODEL = "bench-kept"


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


async def send(url: str, n: int, args: argparse.Namespace, keep: bool) -> None:
    sem = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=120) as http:
        async def one(i: int) -> None:
            headers = {"X-Request-Id": uuid.uuid4().hex} if keep else {}
            for attempt in range(6):  # a loaded box: the worker may be marked down a while
                async with sem:
                    r = await http.post(f"{url}/v1/completions", headers=headers, json={
                        "model": MODEL, "prompt": [1101 + i % 50, 1102, 1103], "seed": i,
                        "max_tokens": args.tokens, "ignore_eos": True,
                        "logprobs": args.logprobs})
                if r.status_code not in (429, 503) or attempt == 5:
                    r.raise_for_status()
                    return
                await asyncio.sleep(1 + attempt)
        await asyncio.gather(*(one(i) for i in range(n)))


def counted_per_run(args: argparse.Namespace) -> int:
    """What one run is counted as (rlfleet.runtime.runs.event_bytes), for events shaped
    as the mocker sends them (one token per step, `logprobs` alternatives)."""
    from rlfleet.protocol.engine import Delta, Done, Head, Step, TokenLogprob
    from rlfleet.runtime.runs import event_bytes

    step = Step(choices=[Delta(index=0, token_ids=[1234], text="<1234>", logprobs=[
        TokenLogprob(token_id=1234, logprob=-1.0, rank=1, decoded="<1234>",
                     top=[(1000 + j, -2.0, f"<{1000 + j}>") for j in range(args.logprobs)])])])
    head = Head(prompt_token_ids=[1101, 1102, 1103], weight_version=None, weight_digest="x")
    return event_bytes(head) + args.tokens * event_bytes(step) + event_bytes(Done())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bound-mib", type=int, default=256)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--logprobs", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=16)
    args = p.parse_args()
    per_run = counted_per_run(args)
    runs = 2 * (args.bound_mib << 20) // per_run
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rlfleet-kept-") as tmp, LocalFleet(Path(tmp)) as fleet:
        fleet.start_frontend("--max-kept-bytes", str(args.bound_mib << 20))
        fleet.start_worker("--model-name", MODEL, kind="mocker")
        deadline = time.monotonic() + 60
        while httpx.get(f"{fleet.url}/v1/models").json()["data"] == []:
            if time.monotonic() > deadline:
                raise TimeoutError("the worker never showed at the frontend")
            time.sleep(0.2)
        pid = fleet.frontend.pid
        asyncio.run(send(fleet.url, runs, args, keep=False))  # warm: nothing kept
        baseline = rss_mib(pid)
        asyncio.run(send(fleet.url, runs, args, keep=True))
        time.sleep(1)
        at_bound = rss_mib(pid)
    out = {"bound_mib": args.bound_mib, "tokens": args.tokens, "logprobs": args.logprobs,
           "runs": runs, "counted_per_run_kib": round(per_run / 1024, 1),
           "rss_baseline_mib": round(baseline, 1), "rss_at_bound_mib": round(at_bound, 1),
           "kept_over_bound": round((at_bound - baseline) / args.bound_mib, 3),
           "seconds": round(time.monotonic() - t0, 1)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
