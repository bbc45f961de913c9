"""Two measures of the rollout client through mocker workers (a declared simulator: these
measure the client and the serving path, not an engine).

Bookkeeping (default): samples/s of `RolloutClient.rollout` (ledger on a temp file, every
admission check on, unary OpenAI route) against raw concurrent httpx POSTs of the same
requests (same body, an X-Request-Id each, the client's transport, the JSON parsed,
nothing checked or recorded), through one frontend and two mocker workers with no token
delay, at the same concurrency and sample count, in one run. Rounds alternate raw and
client after a warm-up; prints each round, the medians, the ratio (client / raw) and this
process's CPU time per sample (the trainer side only: the servers are other processes),
which a busy machine disturbs less than the rates.

    python bench/rollout.py [--samples 2000] [--concurrency 64] [--max-tokens 16] [--rounds 3]

Soak (--soak): samples a `Fleet` (its RolloutClient and PolicyRefresh) admits from a fleet
of 3 mocker workers in 300 s, with a policy refresh every 30 s and one worker killed
(SIGKILL) half-way and replaced; each sample is a request of its own (concurrency 64).
Reports samples/s, samples lost (never admitted) and doubled (admitted twice), the
frontend's RSS at the end (and its peak), and CPU ms per sample of the frontend, the
workers and the trainer's process. With --baseline DIR (a checkout of another commit, e.g.
`git worktree add /tmp/base f8c1453`) each round runs that tree and this one, alternated,
each in a process of its own with its src/ first on PYTHONPATH; the last line (JSON) has
the medians of each and `ratio` (this tree's samples/s over the baseline's).

    python bench/rollout.py --soak [--seconds 300] [--rounds 1] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

# what both trees a soak compares have (--baseline): the rest is imported where it is used
from rlfleet.rl import RolloutClient, SampleLedger, SampleRequest, SamplingSpec

MODEL = "mock-model"


def requests(n: int, tag: str, spec: SamplingSpec) -> list[SampleRequest]:
    return [SampleRequest(f"{tag}-{i}", [1000 + i % 97, 1001, 1002 + i % 13, 1003], spec)
            for i in range(n)]


def raw_body(r: SampleRequest) -> bytes:
    """The body RolloutClient sends for this sample (unary OpenAI completions)."""
    from rlfleet.rollout.client import request_body

    return request_body("openai", r.prompt_ids, r.sampling, r.n, False, MODEL, "")[1]


async def raw(url: str, reqs: list[SampleRequest], concurrency: int) -> tuple[float, float]:
    """(samples/s, CPU seconds of this process per sample), over the transport the client
    uses (rlfleet.rollout.transport)."""
    from rlfleet.rollout.transport import ShardedTransport

    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0),
                                 transport=ShardedTransport(1024)) as http:
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


# ---------------------------------------------------------------- soak (--soak)

SOAK_MODEL = "mock-soak"


def _local_fleet() -> Any:
    """LocalFleet from whichever tree is on the path (rlfleet.testing.fleet; a tree before
    it moved there has it in rlfleet.runtime.launch)."""
    try:
        from rlfleet.testing.fleet import LocalFleet
    except ImportError:
        from rlfleet.runtime.launch import LocalFleet  # type: ignore[no-redef]
    return LocalFleet


class ProcessWatch:
    """CPU seconds of the frontend, of the workers (every worker that ran, the killed one
    and its replacement too) and of this process, and the frontend's RSS, sampled once a
    second while the soak runs."""

    def __init__(self) -> None:
        import psutil

        self.psutil = psutil
        self.procs: dict[int, tuple[str, Any]] = {}
        self.last: dict[int, float] = {}
        self.rss_peak = self.rss_end = 0

    def add(self, kind: str, pid: int) -> None:
        p = self.psutil.Process(pid)
        self.procs[pid] = (kind, p)
        self.last[pid] = self._cpu(p) or 0.0

    def _cpu(self, p: Any) -> float | None:
        try:
            t = p.cpu_times()
            return t.user + t.system + t.children_user + t.children_system
        except self.psutil.Error:
            return None

    def sample(self) -> None:
        for pid, (kind, p) in self.procs.items():
            now = self._cpu(p)
            if now is not None:
                self.last[pid] = now
                if kind == "frontend":
                    self.rss_end = p.memory_info().rss
                    self.rss_peak = max(self.rss_peak, self.rss_end)

    def cpu(self, start: dict[int, float]) -> dict[str, float]:
        out: dict[str, float] = {"frontend": 0.0, "workers": 0.0}
        for pid, (kind, _) in self.procs.items():
            out[kind] += self.last[pid] - start.get(pid, 0.0)
        return out


async def _sampler(fleet: Any, spec: Any, k: int, deadline: float, tally: dict) -> None:
    """Samples one after another until the deadline: admitted, or lost (with its reason)."""
    i = 0
    while time.monotonic() < deadline:
        sid = f"s{k}-{i}"
        i += 1
        try:
            await fleet.agenerate(sid, [1000 + i % 97, 1001, 1002 + k % 13, 1003], spec)
        except Exception as e:  # noqa: BLE001 - counted and reported
            tally["lost"].append(f"{sid}: {getattr(e, 'reason', None) or repr(e)}")
        else:
            tally["admitted"] += 1


async def _refresher(fleet: Any, ckpts: list[Path], every: float, deadline: float,
                     tally: dict) -> None:
    """A policy refresh every `every` seconds, alternating two mock checkpoints."""
    k = 0
    while time.monotonic() + every < deadline:
        await asyncio.sleep(every)
        k += 1
        seed = 2 - k % 2  # A (seed 1) serves at start: B, A, B, ...
        res = await fleet.arefresh(ckpts[seed - 1], f"step-{k}", digest=f"mock:{seed}")
        tally["refreshes"].append(bool(res.ok))


async def _killer(lf: Any, watch: ProcessWatch, flags: list[str], at: float,
                  tally: dict) -> None:
    """At `at` seconds in, SIGKILL one worker and start a replacement."""
    await asyncio.sleep(at)
    victim = lf.workers[0]
    os.kill(victim.pid, signal.SIGKILL)
    tally["killed"] = victim.pid
    loop = asyncio.get_running_loop()
    p = await loop.run_in_executor(None, lambda: lf.start_worker(*flags, kind="mocker"))
    watch.add("workers", p.pid)


async def _soak(lf: Any, flags: list[str], ckpts: list[Path], args: argparse.Namespace,
                watch: ProcessWatch) -> dict:
    from rlfleet.rl import Fleet, SamplingSpec

    work = Path(lf.workdir)
    fleet = Fleet(lf.url, SOAK_MODEL, rl_url=lf.rl_url, ledger=work / "ledger.sqlite",
                  journal=str(work / "journal.sqlite"), concurrency=args.concurrency)
    spec = SamplingSpec(max_tokens=args.max_tokens)
    tally: dict[str, Any] = {"admitted": 0, "lost": [], "refreshes": [], "killed": None}
    start = dict(watch.last)
    c0, t0 = time.process_time(), time.monotonic()
    deadline = t0 + args.seconds
    jobs = [asyncio.ensure_future(_sampler(fleet, spec, k, deadline, tally))
            for k in range(args.concurrency)]
    side = [asyncio.ensure_future(_refresher(fleet, ckpts, args.refresh_every, deadline, tally)),
            asyncio.ensure_future(_killer(lf, watch, flags, args.seconds / 2, tally))]
    while time.monotonic() < deadline:
        await asyncio.sleep(1.0)
        watch.sample()
    await asyncio.gather(*jobs, *side)
    secs, client_cpu = time.monotonic() - t0, time.process_time() - c0
    watch.sample()
    admitted = fleet.ledger.admitted()
    doubled = tally["admitted"] - len(admitted)
    fleet.close()
    n = max(tally["admitted"], 1)
    cpu = {**watch.cpu(start), "client": client_cpu}
    return {"samples": tally["admitted"], "samples_s": round(tally["admitted"] / secs, 1),
            "lost": len(tally["lost"]), "lost_examples": tally["lost"][:3],
            "doubled": doubled, "refreshes_ok": sum(tally["refreshes"]),
            "refreshes": len(tally["refreshes"]), "killed": tally["killed"] is not None,
            "frontend_rss_mb": round(watch.rss_end / 2**20, 1),
            "frontend_rss_peak_mb": round(watch.rss_peak / 2**20, 1),
            "cpu_ms_per_sample": {k: round(v * 1e3 / n, 3) for k, v in cpu.items()}}


def soak_run(args: argparse.Namespace) -> None:
    """One soak of the tree on this process's path; its result as the last line (JSON)."""
    import rlfleet
    from rlfleet.mocker.engine import write_mock_checkpoint

    with tempfile.TemporaryDirectory(prefix="rlfleet-soak-") as tmp, \
            _local_fleet()(Path(tmp) / "fleet") as lf:
        weights = Path(tmp) / "weights"
        ckpts = [write_mock_checkpoint(weights / "A", 1), write_mock_checkpoint(weights / "B", 2)]
        lf.start_frontend(enable_rl=True)
        flags = ["--served-model-name", SOAK_MODEL, "--enable-rl", "--system-port", "0",
                 "--allowed-weights-root", str(weights), "--seed", "1",
                 "--token-delay", str(args.token_delay)]
        for _ in range(args.workers):
            lf.start_worker(*flags, kind="mocker")
        wait_for_workers(lf.url, args.workers)
        watch = ProcessWatch()
        watch.add("frontend", lf.frontend.pid)
        for w in lf.workers:
            watch.add("workers", w.pid)
        out = asyncio.run(_soak(lf, flags, ckpts, args, watch))
    out["tree"] = str(Path(rlfleet.__file__).resolve().parents[2])
    print(json.dumps(out), flush=True)


def soak(args: argparse.Namespace) -> None:
    """Rounds of soaks, the baseline tree and this one alternated, each in a process of its
    own with its tree's src/ first on PYTHONPATH; medians and the ratio."""
    here = Path(__file__).resolve().parents[1]
    trees = {"this": here}
    if args.baseline is not None:
        trees = {"baseline": args.baseline.resolve(), **trees}
    argv = [sys.executable, str(Path(__file__).resolve()), "--soak-run",
            "--seconds", str(args.seconds), "--refresh-every", str(args.refresh_every),
            "--workers", str(args.workers), "--concurrency", str(args.concurrency),
            "--max-tokens", str(args.max_tokens), "--token-delay", str(args.token_delay)]
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for k in range(args.rounds):
        for name, tree in (trees.items() if k % 2 == 0 else reversed(trees.items())):
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                [str(tree / "src"), *filter(None, [os.environ.get("PYTHONPATH", "")])])}
            out = subprocess.run(argv, env=env, capture_output=True, text=True,
                                 timeout=args.seconds + 600)
            if out.returncode != 0:
                raise RuntimeError(f"the soak of {tree} failed:\n{out.stderr[-3000:]}")
            res = json.loads(out.stdout.strip().splitlines()[-1])
            runs[name].append(res)
            print(f"round {k + 1} {name:8s} {res['samples']:7d} samples, {res['samples_s']:7.1f}/s, "
                  f"lost {res['lost']}, doubled {res['doubled']}, killed {res['killed']}, refreshes "
                  f"{res['refreshes_ok']}/{res['refreshes']}, frontend RSS "
                  f"{res['frontend_rss_mb']} MB (peak {res['frontend_rss_peak_mb']}), "
                  f"CPU ms/sample {res['cpu_ms_per_sample']}", flush=True)
    summary: dict[str, Any] = {}
    for name, rs in runs.items():
        summary[name] = {
            "tree": str(trees[name]), "samples": [r["samples"] for r in rs],
            "samples_s_median": statistics.median(r["samples_s"] for r in rs),
            "lost": sum(r["lost"] for r in rs), "doubled": sum(r["doubled"] for r in rs),
            "frontend_rss_mb_median": statistics.median(r["frontend_rss_mb"] for r in rs),
            "cpu_ms_per_sample_median": {k: round(statistics.median(
                r["cpu_ms_per_sample"][k] for r in rs), 3) for k in rs[0]["cpu_ms_per_sample"]}}
    if "baseline" in summary:
        summary["ratio"] = round(summary["this"]["samples_s_median"]
                                 / summary["baseline"]["samples_s_median"], 3)
    print(json.dumps(summary))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=None,
                   help="default 3 (bookkeeping), 1 (soak: a round runs each tree once)")
    g = p.add_argument_group("soak")
    g.add_argument("--soak", action="store_true", help="the long run (see above)")
    g.add_argument("--seconds", type=float, default=300.0)
    g.add_argument("--refresh-every", type=float, default=30.0)
    g.add_argument("--workers", type=int, default=3)
    g.add_argument("--token-delay", type=float, default=0.0,
                   help="the mocker workers' seconds per token")
    g.add_argument("--baseline", type=Path, default=None,
                   help="another checkout to soak beside this one (its src/ on PYTHONPATH)")
    g.add_argument("--soak-run", action="store_true", help=argparse.SUPPRESS)  # one soak
    args = p.parse_args()
    if args.soak_run:
        soak_run(args)
        return
    if args.soak:
        args.rounds = args.rounds or 1
        soak(args)
        return
    args.rounds = args.rounds or 3
    with tempfile.TemporaryDirectory() as tmp, _local_fleet()(Path(tmp) / "fleet") as fleet:
        fleet.start_frontend()
        for _ in range(2):
            fleet.start_worker(kind="mocker")
        wait_for_workers(fleet.url, 2)
        asyncio.run(measure(fleet.url, args, Path(tmp)))


if __name__ == "__main__":
    main()
