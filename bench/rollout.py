"""What the rollout client's bookkeeping costs: samples/s of `RolloutClient.rollout`
(ledger on a temp file, every admission check on, unary OpenAI route) against raw
concurrent httpx POSTs of the same requests (same body, an X-Request-Id each, the JSON
parsed, nothing checked or recorded), through one frontend and two mocker workers with no
token delay, at the same concurrency and sample count, in one run.

    python bench/rollout.py [--samples 2000] [--concurrency 64] [--max-tokens 16] [--rounds 3]

Rounds alternate raw and client after a warm-up; prints each round, the medians, the ratio
(client / raw) and this process's CPU time per sample (the trainer side only: the servers
are other processes), which a busy machine disturbs less than the rates. The mocker is a
simulator: this measures the client, not an engine."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from rlfleet.rl import RolloutClient, SampleLedger, SampleRequest, SamplingSpec
from rlfleet.rollout.client import request_body
from rlfleet.testing.fleet import LocalFleet

MODEL = "mock-model"


def requests(n: int, tag: str, spec: SamplingSpec) -> list[SampleRequest]:
    return [SampleRequest(f"{tag}-{i}", [1000 + i % 97, 1001, 1002 + i % 13, 1003], spec)
            for i in range(n)]


def raw_body(r: SampleRequest) -> bytes:
    """The body RolloutClient sends for this sample (unary OpenAI completions)."""
    return request_body("openai", r.prompt_ids, r.sampling, r.n, False, MODEL, "")[1]


async def raw(url: str, reqs: list[SampleRequest], concurrency: int) -> tuple[float, float]:
    """(samples/s, CPU seconds of this process per sample)"""
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), limits=httpx.Limits(
            max_connections=1024, max_keepalive_connections=1024)) as http:
        queue = iter(reqs)
        ok = 0

        async def work() -> None:
            nonlocal ok
            for r in queue:
                resp = await http.post(f"{url}/v1/completions", content=raw_body(r), headers={
                    "content-type": "application/json", "x-request-id": uuid.uuid4().hex})
                ok += resp.status_code == 200 and bool(resp.json()["choices"])

        t0, c0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(work() for _ in range(concurrency)))
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert ok == len(reqs), f"raw: {len(reqs) - ok} requests failed"
    return len(reqs) / dt, cpu / len(reqs)


async def client(url: str, reqs: list[SampleRequest], concurrency: int, ledger: Path
                 ) -> tuple[float, float]:
    with SampleLedger(ledger) as led:
        async with RolloutClient(url, MODEL, ledger=led) as c:
            t0, c0 = time.perf_counter(), time.process_time()
            out = await c.rollout(reqs, concurrency)
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    bad = [o for o in out if not o.admitted]
    assert not bad, f"client: {len(bad)} samples not admitted, e.g. {bad[0].reason}"
    return len(reqs) / dt, cpu / len(reqs)


async def measure(url: str, args: argparse.Namespace, work: Path) -> None:
    spec = SamplingSpec(max_tokens=args.max_tokens)
    ledger = work / "ledger.db"
    await raw(url, requests(200, "warm-raw", spec), args.concurrency)
    await client(url, requests(200, "warm", spec), args.concurrency, ledger)
    rates: dict[str, list[float]] = {"raw": [], "client": []}
    cpus: dict[str, list[float]] = {"raw": [], "client": []}
    for k in range(args.rounds):
        r, r_cpu = await raw(url, requests(args.samples, f"raw{k}", spec), args.concurrency)
        c, c_cpu = await client(url, requests(args.samples, f"r{k}", spec), args.concurrency,
                                ledger)
        for name, rate, cpu in (("raw", r, r_cpu), ("client", c, c_cpu)):
            rates[name].append(rate)
            cpus[name].append(cpu)
        print(f"round {k + 1}: raw {r:7.1f} samples/s ({r_cpu * 1e3:.2f} ms CPU each)   "
              f"client {c:7.1f} samples/s ({c_cpu * 1e3:.2f} ms CPU each)   ratio {c / r:.3f}",
              flush=True)
    med = {name: statistics.median(v) for name, v in rates.items()}
    cpu = {name: statistics.median(v) * 1e3 for name, v in cpus.items()}
    print(f"\n{args.samples} samples x {args.rounds} rounds, concurrency {args.concurrency}, "
          f"max_tokens {args.max_tokens}, frontend + 2 mocker workers")
    print(f"raw httpx POST      {med['raw']:8.1f} samples/s  {cpu['raw']:.2f} ms client CPU/sample")
    print(f"RolloutClient       {med['client']:8.1f} samples/s  {cpu['client']:.2f} ms client "
          f"CPU/sample (ledger file, all checks)")
    print(f"ratio client / raw  {med['client'] / med['raw']:.3f}  (median rates; bookkeeping "
          f"{cpu['client'] - cpu['raw']:+.2f} ms CPU/sample in the trainer process)")


def wait_for_workers(url: str, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        workers = httpx.get(f"{url}/health", timeout=5).json()["workers"]
        if sum(w["usable"] for w in workers) >= count:
            return
        time.sleep(0.2)
    raise TimeoutError(f"the frontend did not see {count} workers in {timeout:.0f}s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp, LocalFleet(Path(tmp) / "fleet") as fleet:
        fleet.start_frontend()
        for _ in range(2):
            fleet.start_worker(kind="mocker")
        wait_for_workers(fleet.url, 2)
        asyncio.run(measure(fleet.url, args, Path(tmp)))


if __name__ == "__main__":
    main()
