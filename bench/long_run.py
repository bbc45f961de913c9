"""A run that lasts a week, compressed (issue 43): thousands of steps, each a published
policy version and a fleet refresh to it, with rollouts admitted all along and a worker
killed and replaced on the way; does anything grow with the run?

The fleet: one frontend and WORKERS mocker workers (the declared simulator: the weight plane,
the journal, the ledger and the processes are what is measured, not an engine) over one
etcd (discovery, the refresh journal, the version catalog) and an S3 server (SeaweedFS: the
versions). Each step:

- the trainer publishes a version to S3: an XOR delta on the one before, a full version
  every FULL_EVERY steps (the mocker's seed and MIB of ballast tensors, one tensor of which
  changes per step), and retention collects (`--retain-versions`, with the journal's pins);
- a coordinator (a process of its own) refreshes the fleet to it on the staged path: every
  worker pulls it from S3 (replaying the chain from the last full version when it lacks the
  base: the replaced worker), then one commit per worker;
- the rollout client admits samples all the while (ledger with a retry window in steps),
  and retries one sample of the step before (the ledger must refuse it) and, now and then,
  one older than the window (refused by name).

At 10 % and at 100 % of the steps it records: the store's bytes and the bytes of the
versions retention keeps, etcd's database size, the journal's and the ledger's sizes, the
RSS of the frontend, the coordinator and each worker; at the end, samples lost and admitted
twice. Time-based windows are compressed with the run: runs are kept for retries
RLFLEET_KEPT_WINDOW=30 s (not 600), and the frontend's kept runs are bounded at 16 MiB.

    python bench/long_run.py [--steps 2000] [--workers 2] [--full-every 8]
                             [--retain-versions 3] [--ballast-mib 1] [--window-steps 20]

The JSON last line: `store_over_retained` (at 100 %), `etcd_db_growth`, `journal_growth`,
`ledger_growth` (100 % ÷ 10 %), `rss_growth` (per process, 100 % ÷ 10 %), `samples_lost`,
`samples_doubled`, and the figures behind them."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODEL = "soak"
PREFIX = "soak"  # the versions' prefix in the S3 bucket
PROMPT = [1101, 1102, 1103, 1104]


# ---------------------------------------------------------------- the coordinator process


def coordinator(args: argparse.Namespace) -> None:
    """The coordinator's process: one refresh per JSON line on stdin ({"version", "digest",
    "step", "source"}), its outcome as one JSON line on stdout."""
    from rlfleet.refresh.coordinator import PolicyRefresh

    async def serve() -> None:
        refresh = PolicyRefresh(args.rl_url, model=MODEL, path="vllm-staged",
                                journal=args.journal, timeout=60, phase_timeout=60,
                                probe_tokens=2)
        refresh.control.poll = 0.03  # a mocker stages in milliseconds
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            cmd = json.loads(line)
            t0 = time.monotonic()
            res = await refresh.refresh(None, cmd["version"], digest=cmd["digest"],
                                        step=cmd["step"], source=cmd["source"])
            statuses: dict[str, int] = {}
            for w in res.workers:
                statuses[w["status"]] = statuses.get(w["status"], 0) + 1
            print(json.dumps({"decision": res.decision, "reason": res.reason,
                              "workers": statuses, "seconds": time.monotonic() - t0,
                              "phases": res.step_seconds()}), flush=True)
        refresh.close()
    asyncio.run(serve())


class Coordinator:
    """The coordinator process, driven over its stdin and stdout."""

    def __init__(self, rl_url: str, journal: str, env: dict[str, str], log: Path) -> None:
        self.log = open(log, "wb")
        self.popen = subprocess.Popen(
            [sys.executable, __file__, "--coordinator", "--rl-url", rl_url, "--journal",
             journal], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
            env=env, start_new_session=True, text=True)

    def refresh(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.popen.stdin.write(json.dumps(cmd) + "\n")
        self.popen.stdin.flush()
        line = self.popen.stdout.readline()
        if not line:
            raise RuntimeError(f"the coordinator exited ({self.popen.poll()}): see {self.log.name}")
        return json.loads(line)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.popen.stdin.close()
            self.popen.wait(10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(10)
        self.log.close()


# ---------------------------------------------------------------- what is measured


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def cpu_s(pid: int) -> float | None:
    """CPU seconds a process has used."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return round((int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK"), 1)


def store_bytes(s3) -> dict[str, int]:
    """Bytes under each version's prefix in the store."""
    out: dict[str, int] = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket="weights",
                                                             Prefix=f"{PREFIX}/"):
        for o in page.get("Contents", []):
            version = o["Key"].split("/")[1]
            out[version] = out.get(version, 0) + int(o["Size"])
    return out


def snapshot(run: Run) -> dict[str, Any]:
    from rlfleet.testing.etcd import etcd_status

    by_version = store_bytes(run.s3)
    kept = set(run.last_retention.get("kept", {})) if run.last_retention else set(by_version)
    status = etcd_status(run.etcd)
    procs = {"frontend": run.fleet.frontend.pid, "coordinator": run.coordinator.popen.pid,
             **{w.name: w.pid for w in run.fleet.workers if w.popen.poll() is None}}
    return {
        "step": run.step,
        "store_bytes": sum(by_version.values()),
        "retained_bytes": sum(b for v, b in by_version.items() if v in kept),
        "versions_stored": len(by_version), "versions_kept": len(kept),
        "etcd_db_bytes": status["dbSize"], "etcd_db_in_use": status["dbSizeInUse"],
        "etcd_revision": status["revision"],
        "journal": run.journal.size(), "ledger": run.ledger.size(),
        "rss_mib": {name: rss_mib(pid) for name, pid in procs.items()},
        "cpu_s": {name: cpu_s(pid) for name, pid in procs.items()},
        "samples": dict(run.counts),
    }


# ---------------------------------------------------------------- the run


class Run:
    """Everything one soak holds: the servers, the fleet, the trainer's side."""

    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args, self.tmp = args, tmp
        self.step = 0
        self.last_retention: dict[str, Any] | None = None
        self.last_workers: dict[str, int] = {}  # the last refresh's workers, by status
        self.counts = {"requested": 0, "admitted": 0, "lost": 0, "doubled": 0,
                       "refused_retries": 0, "refused_pruned": 0}
        self.admitted: dict[str, int] = {}  # sample -> times admitted
        self.by_step: dict[int, list[str]] = {}  # step -> samples admitted in it
        self.refreshes: dict[str, int] = {}
        self.seconds = {"publish": 0.0, "refresh": 0.0, "retention": 0.0}
        self.phases: dict[str, float] = {}  # the refreshes' timed phases
        self.stop = asyncio.Event()

    def tensors(self, step: int) -> dict[str, Any]:
        """The trainer's model at `step`: the mocker's seed, and ballast of which one tensor
        changes per step."""
        import torch

        n = self.args.ballast_tensors
        size = (self.args.ballast_mib << 20) // n // 4
        if not hasattr(self, "_ballast"):
            g = torch.Generator().manual_seed(0)
            self._ballast = [torch.rand(size, generator=g) for _ in range(n)]
        if step:
            g = torch.Generator().manual_seed(step)
            self._ballast[step % n] = torch.rand(size, generator=g)
        return {"mock.seed": torch.tensor([1000 + step], dtype=torch.int64),
                **{f"mock.ballast.{i}": t for i, t in enumerate(self._ballast)}}

    async def sampler(self, client, lane: int) -> None:
        from rlfleet.rl import AlreadyAdmitted, SampleFailed, SamplingSpec

        n = 0
        while not self.stop.is_set():
            sid, step = f"s{lane}-{n}", self.step
            n += 1
            self.counts["requested"] += 1
            try:
                await client.generate(sid, PROMPT, SamplingSpec(max_tokens=4, seed=n),
                                      origin=step)
            except SampleFailed as e:
                self.counts["lost"] += 1
                print(f"lost {sid}: {e}", file=sys.stderr)
                continue
            except AlreadyAdmitted:
                continue
            self.admitted[sid] = self.admitted.get(sid, 0) + 1
            self.counts["admitted"] += 1
            self.by_step.setdefault(step, []).append(sid)
            await asyncio.sleep(self.args.sample_pause)

    async def retry_old(self, client, step: int) -> None:
        """A retry of a sample admitted in the step before (refused: admitted already) and,
        every 50 steps, of one older than the ledger's window (refused by name)."""
        from rlfleet.rl import AlreadyAdmitted, RetryWindowPassed, SamplingSpec

        picks = [(step - 1, AlreadyAdmitted, "refused_retries")]
        if step % 50 == 0:
            picks.append((step - self.args.window_steps - 5, RetryWindowPassed,
                          "refused_pruned"))
        for old, expected, counter in picks:
            done = self.by_step.get(old)
            if not done:
                continue
            try:
                await client.generate(done[0], PROMPT, SamplingSpec(max_tokens=4), origin=old)
            except expected:
                self.counts[counter] += 1
                continue
            self.counts["doubled"] += 1
            print(f"admitted twice: {done[0]} (step {old})", file=sys.stderr)
        for gone in [s for s in self.by_step if s < step - self.args.window_steps - 10]:
            del self.by_step[gone]  # the bench's own memory stays flat too


def replace_worker(run: Run, flags: tuple[str, ...], env: dict[str, str]) -> None:
    victim = run.fleet.workers[0]
    os.killpg(victim.popen.pid, signal.SIGKILL)
    victim.popen.wait(10)
    run.fleet.workers.remove(victim)
    run.fleet.start_worker(*flags, kind="mocker", name="mocker-replacement", env=env)


async def steps(run: Run, client, pub, flags: tuple[str, ...], env: dict[str, str]
                ) -> list[dict[str, Any]]:
    args = run.args
    snaps = []
    marks = {max(1, args.steps // 10): "10%", args.steps: "100%"}
    for step in range(1, args.steps + 1):
        run.step = step
        version = f"step-{step:06d}"
        base = None if step == 1 or step % args.full_every == 0 else f"step-{step - 1:06d}"
        t0 = time.monotonic()
        out = await asyncio.to_thread(pub.publish, run.tensors(step), version, base=base)
        run.seconds["publish"] += time.monotonic() - t0
        run.last_retention = out.get("retention") or run.last_retention
        run.seconds["retention"] += (out.get("retention") or {}).get("seconds", 0.0)
        run.ledger.advance(step)
        source = {"kind": "s3", "uri": f"s3://weights/{PREFIX}/{version}",
                  "endpoint_url": run.s3_url, "chain": True}
        t0 = time.monotonic()
        res = await asyncio.to_thread(run.coordinator.refresh, {
            "version": version, "digest": out["digest"], "step": step, "source": source})
        run.seconds["refresh"] += time.monotonic() - t0
        for phase, secs in res.get("phases", {}).items():
            run.phases[phase] = run.phases.get(phase, 0.0) + secs
        run.refreshes[res["decision"]] = run.refreshes.get(res["decision"], 0) + 1
        run.last_workers = res["workers"]
        if res["decision"] != "reopened":
            print(f"step {step}: {res}", file=sys.stderr)
        await run.retry_old(client, step)
        if step == int(args.steps * args.kill_at):
            await asyncio.to_thread(replace_worker, run, flags, env)
        if step in marks:
            snaps.append({"at": marks[step], **await asyncio.to_thread(snapshot, run)})
            print(json.dumps(snaps[-1]), file=sys.stderr)
        if step % 100 == 0:
            print(f"step {step}: {run.counts} {run.refreshes} {run.seconds}", file=sys.stderr)
    return snaps


def growth(a: float | None, b: float | None) -> float | None:
    return None if not a or b is None else round(b / a, 3)


def report(run: Run, snaps: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    early, last = snaps[0], snaps[-1]
    rss = {name: growth(early["rss_mib"].get(name), mib)
           for name, mib in last["rss_mib"].items() if name in early["rss_mib"]}
    return {
        "store_over_retained": round(last["store_bytes"] / max(1, last["retained_bytes"]), 3),
        "etcd_db_growth": growth(early["etcd_db_bytes"], last["etcd_db_bytes"]),
        "journal_growth": growth(early["journal"]["bytes"], last["journal"]["bytes"]),
        "ledger_growth": growth(early["ledger"]["bytes"], last["ledger"]["bytes"]),
        "rss_growth": rss,
        "samples_lost": run.counts["lost"], "samples_doubled": run.counts["doubled"],
        "samples": run.counts, "refreshes": run.refreshes, "steps": run.args.steps,
        "last_refresh_workers": run.last_workers,
        "step_seconds": {k: round(v / run.args.steps, 4) for k, v in run.seconds.items()},
        "refresh_phase_seconds": {k: round(v / run.args.steps, 4) for k, v in run.phases.items()},
        "seconds": round(seconds, 1), "at_10": early, "at_100": last,
    }


async def soak(run: Run) -> dict[str, Any]:
    from rlfleet.journal import EtcdJournal
    from rlfleet.rl import RetryPolicy, RetryWindow, RolloutClient, SampleLedger
    from rlfleet.testing.fleet import LocalFleet
    from rlfleet.weights.publish import Publisher
    from rlfleet.weights.retention import Retention, journal_pins, journal_workers

    args, tmp = run.args, run.tmp
    env = {**os.environ, **run.s3_env, "RLFLEET_KEPT_WINDOW": str(args.kept_window)}
    journal_url = (f"{run.etcd}/soak?keep_full={args.journal_keep_full}"
                   f"&keep_summaries={args.journal_keep_summaries}")
    flags = ("--served-model-name", MODEL, "--enable-rl", "--system-port", "0",
             "--weights-catalog", run.etcd, "--token-delay", "0", "--seed", "1")
    with LocalFleet(tmp / "fleet", discovery=run.etcd, lease_ttl=5) as fleet:
        run.fleet = fleet
        fleet.start_frontend("--max-kept-bytes", str(16 << 20), "--gated-hold", "120",
                             enable_rl=True, env=env)
        for _ in range(args.workers):
            fleet.start_worker(*flags, kind="mocker", env=env)
        run.coordinator = Coordinator(fleet.rl_url, journal_url, env, tmp / "coordinator.log")
        host, port = run.etcd.removeprefix("etcd://").split(":")
        run.journal = EtcdJournal(host, int(port), "soak")
        run.ledger = SampleLedger(tmp / "ledger.sqlite", window=RetryWindow(steps=args.window_steps))
        pub = Publisher(f"s3://weights/{PREFIX}", catalog=run.etcd, model=MODEL,
                        endpoint_url=run.s3_url,
                        retention=Retention(args.retain_versions, tombstones=args.tombstones),
                        pins=lambda: journal_pins(run.journal, recent=8),
                        workers=lambda: journal_workers(run.journal, recent=8))
        client = RolloutClient(fleet.url, MODEL, ledger=run.ledger,
                               retry=RetryPolicy(max_attempts=8))
        t0 = time.monotonic()
        lanes = [asyncio.create_task(run.sampler(client, i)) for i in range(args.lanes)]
        try:
            snaps = await steps(run, client, pub, flags, env)
        finally:
            run.stop.set()
            await asyncio.gather(*lanes, return_exceptions=True)
            await client.aclose()
            pub.close()
            run.coordinator.close()
        seconds = time.monotonic() - t0
        doubled = [s for s, n in run.admitted.items() if n > 1]
        run.counts["doubled"] += len(doubled)
        out = report(run, snaps, seconds)
        run.journal.close()
        run.ledger.close()
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--coordinator", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rl-url", help=argparse.SUPPRESS)
    p.add_argument("--journal", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--full-every", type=int, default=8)
    p.add_argument("--retain-versions", type=int, default=3)
    p.add_argument("--tombstones", type=int, default=64)
    p.add_argument("--ballast-mib", type=int, default=1)
    p.add_argument("--ballast-tensors", type=int, default=8)
    p.add_argument("--window-steps", type=int, default=20)
    p.add_argument("--journal-keep-full", type=int, default=16)
    p.add_argument("--journal-keep-summaries", type=int, default=64)
    p.add_argument("--kept-window", type=float, default=30.0)
    p.add_argument("--lanes", type=int, default=1, help="samples in flight at once")
    p.add_argument("--sample-pause", type=float, default=0.1,
                   help="seconds between one lane's samples")
    p.add_argument("--kill-at", type=float, default=0.5,
                   help="the fraction of the steps after which a worker is killed and replaced")
    args = p.parse_args()
    if args.coordinator:
        coordinator(args)
        return
    from rlfleet.testing.etcd import run_etcd
    from rlfleet.testing.s3 import S3Server

    with tempfile.TemporaryDirectory(prefix="rlfleet-soak-") as d, run_etcd() as etcd, \
            S3Server() as s3:
        run = Run(args, Path(d))
        run.etcd, run.s3, run.s3_url, run.s3_env = etcd, s3.client(timeout=30), \
            s3.endpoint_url, s3.env
        os.environ.update(s3.env)
        out = asyncio.run(soak(run))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
