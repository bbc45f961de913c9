"""Staging one version onto N hosts: from S3 alone vs a pipelined peer fan-out (a chain).

Every "host" is a Linux network namespace (src/rlfleet/testing/netns.py) whose link is rate-limited by
`tc` in both directions (a token bucket on its interface and on its switch port): one host
runs the S3 server (SeaweedFS, src/rlfleet/testing/s3.py), one the coordinator (this script's
stage requests), and N = 1, 2, 4, 8 hosts each run a real `python -m rlfleet.mocker`
worker process, whose staging code and system server (stage_weights, the fan-out chunk
routes) are the real ones; the mocker only stands in for the engine, which plays no part in
staging (nothing is applied). The workers are found in discovery, the version (random fp32
tensors) is published to S3 once, then staged on the first N workers:

* S3 alone: every worker pulls the whole version from S3 (``{"kind": "s3"}``): the S3
  host's link carries N copies.
* fan-out: the first worker pulls from S3, worker i from worker i - 1 chunk by chunk while
  it still receives (rlfleet.weights.fanout.fanout_sources, degree 1: a chain).

Time is from the first stage request to the last worker READY (every digest checked); S3
bytes are what the S3 host's interface sent (tc-visible wire bytes, headers included).
Prints time(N=8) / time(N=1) for both and the S3 bytes over the version's size. Needs root
(namespaces, tc); everything it makes is removed at the end, also on failure.

    sudo python bench/fanout.py [--rate-mbit 100] [--mib 48] [--hosts 1,2,4,8]

The last line is one JSON object: {"hosts": [...], "s3_only_ratio": r, "fanout_ratio": r,
"s3_bytes_ratio": r} (s3_bytes_ratio: at the largest N, with fan-out)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from rlfleet.protocol.admin_vllm import FanoutOrigin
from rlfleet.runtime.discovery import open_discovery
from rlfleet.testing.fleet import LocalFleet
from rlfleet.testing.netns import Host, Lab, unavailable
from rlfleet.testing.s3 import BUCKET, S3Server
from rlfleet.weights.fanout import fanout_sources
from rlfleet.weights.publish import Publisher

POLL = 0.05


def tc(namespace: str, dev: str, rate_mbit: float) -> None:
    """A token bucket on `dev`'s egress (burst: a few max-size segments, for GSO)."""
    cmd = ["tc", "-n", namespace, "qdisc", "replace", "dev", dev, "root", "tbf",
           "rate", f"{rate_mbit}mbit", "burst", "256kb", "latency", "200ms"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")


def limit(lab: Lab, host: Host, rate_mbit: float) -> None:
    tc(host.name, "eth0", rate_mbit)  # what the host sends
    tc(lab.switch, host.port_link, rate_mbit)  # what it receives


def tx_bytes(host: Host) -> int:
    out = subprocess.run(["ip", "-n", host.name, "-s", "-j", "link", "show", "eth0"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])


def version(mib: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    per = 4 << 20  # 4 MiB tensors
    return {f"layers.{i}.weight": torch.randn(per // 4, generator=g)
            for i in range(max(1, (mib << 20) // per))}


HTTP = httpx.Client(timeout=30)  # one client for every call (a client per call costs CPU)


def post(url: str, route: str, body: dict) -> dict:
    r = HTTP.post(f"{url}/engine/{route}", json=body)
    r.raise_for_status()
    out = r.json()
    if out.get("status") != "ok":
        raise RuntimeError(f"{route} on {url}: {out}")
    return out


def stage(urls: list[str], sources: list[dict], digest: str, timeout: float,
          version_name: str = "v1") -> float:
    """Stage on every worker at once (the requests sent together, as a coordinator does);
    seconds until the last is READY (every digest checked)."""
    def one(u: str, s: dict) -> None:
        h = post(u, "stage_weights", {"version": version_name, "source": s,
                                      "digest": digest})["handle"]
        try:
            while True:
                [got] = post(u, "get_staged_weights", {"handle": h})["staged"]
                if got["state"] != "STAGING":
                    break
                if time.monotonic() - t0 > timeout:
                    raise RuntimeError(f"{u}: not READY within {timeout} s")
                time.sleep(POLL)
            if got["state"] != "READY" or got["digest"] != digest:
                raise RuntimeError(f"staging on {u} ended {got['state']}: {got}")
            done.append(time.monotonic())
        finally:
            with contextlib.suppress(Exception):
                post(u, "release_staged_weights", {"handle": h})

    done: list[float] = []
    t0 = time.monotonic()
    # threads started here are in the caller's network namespace (the coordinator's host)
    with ThreadPoolExecutor(len(urls)) as pool:
        for f in [pool.submit(one, u, s) for u, s in zip(urls, sources, strict=True)]:
            f.result()
    return max(done) - t0


def discovered(url: str, count: int) -> list[str]:
    """The workers' system URLs as discovery lists them (sorted by key)."""
    async def once() -> list[str]:
        d = open_discovery(url)
        try:
            deadline = time.monotonic() + 60
            while True:
                urls = [e["system_url"] for e in await d.list() if e.get("system_url")]
                if len(urls) >= count:
                    return urls
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{count} workers not in discovery: {urls}")
                await asyncio.sleep(0.2)
        finally:
            await d.close()
    return asyncio.run(once())


def run(args: argparse.Namespace) -> dict:
    hosts = [int(n) for n in args.hosts.split(",")]
    work = Path(tempfile.mkdtemp(prefix="rlfleet-fanout-"))
    with contextlib.ExitStack() as stack:
        lab = stack.enter_context(Lab(subnet="10.213.9"))
        s3h, ctl = lab.add_host("s3"), lab.add_host("ctl")
        workers = [lab.add_host(f"w{i}") for i in range(max(hosts))]
        for h in (s3h, ctl, *workers):
            limit(lab, h, args.rate_mbit)
        with s3h.entered():
            s3 = stack.enter_context(S3Server(host=s3h.ip))
        os.environ.update(s3.env)
        fleet = stack.enter_context(LocalFleet(work / "fleet", lease_ttl=10))
        for i, h in enumerate(workers):
            with h.entered():
                fleet.start_worker("--served-model-name", "mock", "--host", "0.0.0.0",
                                   "--advertise-host", h.ip, "--system-port", "0",
                                   kind="mocker", wait=False, name=f"worker-{i}")
        for p in fleet.workers:
            p.wait_ready(120)
        with ctl.entered():
            tensors = version(args.mib)
            size = sum(t.numel() * t.element_size() for t in tensors.values())
            pub = Publisher(f"s3://{BUCKET}/bench", endpoint_url=s3.endpoint_url)
            digest = pub.publish(tensors, "v1")["digest"]
            warm = pub.publish({"w": torch.zeros(1 << 16)}, "warm")["digest"]
            pub.close()
            del tensors
            urls = discovered(fleet.discovery, len(workers))
            origin = FanoutOrigin(uri=f"s3://{BUCKET}/bench/v1", endpoint_url=s3.endpoint_url)
            plain = {"kind": "s3", "uri": origin.uri, "endpoint_url": origin.endpoint_url}
            # every worker once through both paths first (imports, S3 clients, connections)
            w_origin = FanoutOrigin(uri=f"s3://{BUCKET}/bench/warm",
                                    endpoint_url=s3.endpoint_url)
            stage(urls, [{"kind": "s3", "uri": w_origin.uri, "endpoint_url": s3.endpoint_url}]
                  * len(urls), warm, timeout=args.timeout, version_name="warm")
            stage(urls, fanout_sources(urls, "warm", w_origin), warm, timeout=args.timeout,
                  version_name="warm")
            table: dict[str, dict[int, dict]] = {"s3_only": {}, "fanout": {}}
            for n in hosts:
                for mode in ("s3_only", "fanout"):
                    chosen = urls[:n]
                    sources = [plain] * n if mode == "s3_only" else \
                        fanout_sources(chosen, "v1", origin)
                    before = tx_bytes(s3h)
                    seconds = stage(chosen, sources, digest, timeout=args.timeout)
                    sent = tx_bytes(s3h) - before
                    table[mode][n] = {"s": seconds, "s3_bytes": sent}
                    print(f"N={n:<2} {mode:8} {seconds:7.2f} s   S3 sent {sent / 2**20:7.1f} MiB "
                          f"({sent / size:.2f} x the version)", flush=True)
        fleet.stop()  # every process ends before its namespace goes
        s3.close()
    shutil.rmtree(work, ignore_errors=True)  # kept (the workers' logs) when the run failed
    lo, hi = min(hosts), max(hosts)
    out = {"hosts": hosts, "rate_mbit": args.rate_mbit, "version_mib": round(size / 2**20, 1),
           "seconds": {m: {n: round(v["s"], 2) for n, v in t.items()} for m, t in table.items()},
           "s3_only_ratio": round(table["s3_only"][hi]["s"] / table["s3_only"][lo]["s"], 3),
           "fanout_ratio": round(table["fanout"][hi]["s"] / table["fanout"][lo]["s"], 3),
           "s3_bytes_ratio": round(table["fanout"][hi]["s3_bytes"] / size, 3)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate-mbit", type=float, default=100.0, help="every host's link rate")
    p.add_argument("--mib", type=int, default=48, help="the version's size (MiB)")
    p.add_argument("--hosts", default="1,2,4,8", help="worker host counts to stage onto")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per staging run")
    args = p.parse_args()
    if (why := unavailable()) is not None:
        sys.exit(f"bench/fanout.py needs network namespaces: {why}")
    # a SIGTERM (a timeout) unwinds like an error: the processes, namespaces and limits go
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = run(args)
    lo, hi = min(out["hosts"]), max(out["hosts"])
    print(f"time(N={hi}) / time(N={lo}): S3 alone {out['s3_only_ratio']:.2f} (baseline), "
          f"fan-out {out['fanout_ratio']:.2f}; S3 sent {out['s3_bytes_ratio']:.2f} x the "
          f"version with fan-out at N={hi}")
    print(json.dumps({k: out[k] for k in ("hosts", "s3_only_ratio", "fanout_ratio",
                                          "s3_bytes_ratio")}))


if __name__ == "__main__":
    main()
