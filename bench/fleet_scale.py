"""How rlfleet's costs grow with the fleet, on simulated fleets of N = 8, 64, 256, 1,024
workers (one `python -m rlfleet.mocker --replicas N` process: the declared simulator; what
is measured is discovery, routing and the coordinator, never an engine).

For each N: a frontend (with the RL listener) and the N workers over file discovery; the
mocker's resident memory; a synchronous policy refresh and then a rolling one (waves of
N/4) through `PolicyRefresh` (admin calls in flight:
--admin-concurrency), each one's wall time, its time
per phase, and the CPU per worker the coordinator, the simulated workers and the frontend
spent on it. At the largest N, the discovery figures: time from a new worker's registration
(its discovery file written) to the first request the frontend routes to it, the
frontend's CPU while nothing changes, and how long after a worker is stopped (SIGSTOP)
the frontend drops it, against its lease TTL.

    python bench/fleet_scale.py [--workers 8,64,256,1024] [--admin-concurrency 64] [--lease-ttl 10]
                                [--discovery file|etcd] [--relay-threshold 256]
                                [--relay-fanout K]

With --discovery etcd the fleets run over a throw-away etcd (the test suite's launcher, the
`etcd` next to the interpreter): the frontend follows etcd's watch events; a joining
worker's registration time is when a watch of the bench's own saw its first entry.

What belongs to rlfleet's control, per N, for the synchronous refresh (the simulated
workers share the bench's cores, so wall time cannot show it): the coordinator's CPU ms per
worker, the frontend's CPU ms per worker, the admin calls each worker answered (counted by
the workers' system servers, rlfleet_worker_admin_calls_total; the relay route's own calls
counted apart), the RL listener's route probes (rlfleet_frontend_route_probes_total), and
the sequential round trips on the critical path: the discovery listings, each phase's
admin calls (ceil(N / admin concurrency) rounds called directly; through relays, one round
to the relays and ceil(subtree / relay concurrency) from them: rlfleet.refresh.relay's hops) and
the probe's ceil(N / admin concurrency) rounds. `projected_control_s_1024`: the control time
of a 1,024-worker refresh on hosts of their own at 1 ms RTT, round trips × 1 ms + the
coordinator's CPU (at the largest N, its CPU per worker × 1,024). Every worker must be
verified at every N (else the bench fails).

Baseline: the smallest N, side by side (ratio = time at N ÷ time at the smallest N). The
last line is one JSON object: {"workers", "refresh_s", "ratio_refresh", "join_to_route_s",
"idle_cpu_frac", "mib_per_worker", "coordinator_cpu_ms_per_worker",
"frontend_cpu_ms_per_worker", "admin_calls_per_worker", "route_probes_per_refresh",
"round_trips", "projected_control_s_1024", ...} (the control figures at the largest N)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx

from rlfleet.mocker.engine import write_mock_checkpoint
from rlfleet.refresh.coordinator import PolicyRefresh
from rlfleet.refresh.relay import DEFAULT_THRESHOLD as DEFAULT_RELAY_THRESHOLD
from rlfleet.runtime.discovery import EtcdDiscovery, open_discovery
from rlfleet.testing.etcd import run_etcd
from rlfleet.testing.fleet import LocalFleet

MODEL = "bench-scale"


def proc_stats(pid: int) -> tuple[float, float]:
    """(CPU seconds, resident MiB) of a process."""
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    rss = next(int(line.split()[1]) for line in open(f"/proc/{pid}/status")
               if line.startswith("VmRSS:"))
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK"), rss / 1024


def usable(url: str, model: str) -> set[int]:
    workers = httpx.get(f"{url}/health", timeout=30).json()["workers"]
    return {w["instance_id"] for w in workers if w["model"] == model and w["usable"]}


def wait_usable(url: str, model: str, n: int, timeout: float) -> float:
    t0 = time.monotonic()
    while len(usable(url, model)) < n:
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"the frontend routes to {len(usable(url, model))} of {n}")
        time.sleep(0.25)
    return time.monotonic() - t0


def mock_argv(root: Path, model: str, replicas: int) -> list[str]:
    return ["--served-model-name", model, "--enable-rl", "--system-port", "0",
            "--allowed-weights-root", str(root), "--replicas", str(replicas),
            "--log-level", "warning"]


RTT_S = 0.001  # the projection's round-trip time between hosts
PROJECTED_N = 1024


def counter(url: str, name: str, exclude: frozenset[str] = frozenset()) -> float:
    """The sum of a Prometheus counter's series at `url`/metrics (series whose first label
    value is in `exclude` left out)."""
    text = httpx.get(f"{url}/metrics", timeout=60).text
    total = 0.0
    for m in re.finditer(rf"^{name}(?:{{[^=]*=\"([^\"]*)\"[^}}]*}})? (\S+)$", text, re.M):
        if m.group(1) not in exclude:
            total += float(m.group(2))
    return total


def admin_calls(mock_url: str) -> tuple[float, float]:
    """(calls the workers answered but the relay route, relay calls): the mocker process's
    system servers share one registry."""
    name = "rlfleet_worker_admin_calls_total"
    every = counter(mock_url, name)
    relays = every - counter(mock_url, name, frozenset({"relay"}))
    return every - relays, relays


class Counted:
    """Counts a PolicyRefresh's discovery listings and probes (wrapping its own methods),
    for the round trips on the critical path."""

    def __init__(self, r: PolicyRefresh) -> None:
        self.listings = self.probes = 0
        discover, probe_one = r.control.discover, r.waves.probe_one

        async def listed(ch):
            self.listings += 1
            return await discover(ch)

        async def probed(*args, **kw):
            self.probes += 1
            return await probe_one(*args, **kw)
        r.control.discover, r.waves.probe_one = listed, probed


def phases(res) -> dict[str, float]:
    out: dict[str, float] = {}  # seconds per phase (summed over waves)
    for s in res.steps:
        out[s["name"]] = round(out.get(s["name"], 0.0) + s["seconds"], 3)
    return out


def refresh(fleet: LocalFleet, journal: Path, ckpt: Path, version: str, seed: int,
            a: argparse.Namespace, **mode) -> tuple[float, dict[str, float], dict]:
    """Wall seconds of one refresh; its phases; and what its control cost: the CPU
    milliseconds per worker the coordinator (this process), the simulated workers and the
    frontend spent on it, the admin calls per worker, the route probes and the round trips
    on the critical path. Every worker must end verified."""
    r = PolicyRefresh(fleet.rl_url, model=MODEL, journal=str(journal), timeout=120,
                      concurrency=a.admin_concurrency, relay_threshold=a.relay_threshold,
                      relay_fanout=a.relay_fanout, **mode)
    counted = Counted(r)
    ready = fleet.workers[0].ready
    mock_url = ready.get("first_system_url") or ready["system_url"]
    pids = {"mocker": fleet.workers[0].popen.pid, "frontend": fleet.frontend.popen.pid}
    before = {k: proc_stats(pid)[0] for k, pid in pids.items()}
    calls0, relays0 = admin_calls(mock_url)
    probes0 = counter(fleet.url, "rlfleet_frontend_route_probes_total")
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        res = asyncio.run(r.refresh(ckpt, version, digest=f"mock:{seed}"))
        wall, coordinator = time.perf_counter() - t0, time.process_time() - c0
    finally:
        r.journal.close()
    n = max(1, len(res.workers))
    cpu = {"coordinator": coordinator, **{k: proc_stats(pid)[0] - before[k]
                                          for k, pid in pids.items()}}
    calls1, relays1 = admin_calls(mock_url)
    hops = r.relays.hops if r.relays is not None else []
    rounds = counted.listings + sum(h.rounds for h in hops) + \
        math.ceil(counted.probes / a.admin_concurrency)
    control = {"coordinator_cpu_ms_per_worker": round(cpu["coordinator"] / n * 1e3, 3),
               "frontend_cpu_ms_per_worker": round(cpu["frontend"] / n * 1e3, 3),
               "workers_cpu_ms_per_worker": round(cpu["mocker"] / n * 1e3, 3),
               "admin_calls_per_worker": round((calls1 - calls0) / n, 3),
               "relay_calls": int(relays1 - relays0),
               "relays": max((len(h.relays) for h in hops), default=0),
               "route_probes_per_refresh": int(counter(fleet.url,
                                                       "rlfleet_frontend_route_probes_total")
                                               - probes0),
               "round_trips": rounds, "listings": counted.listings}
    print(f"refresh to {version} ({n} workers): {wall:.2f} s; CPU ms per worker: "
          + ", ".join(f"{k} {v / n * 1e3:.2f}" for k, v in cpu.items())
          + f"; admin calls per worker {control['admin_calls_per_worker']} (+"
          f"{control['relay_calls']} relay calls through {control['relays']} relays); route "
          f"probes {control['route_probes_per_refresh']}; round trips on the critical path "
          f"{rounds} ({counted.listings} listings, "
          + ", ".join(f"{h.route} {h.rounds}" for h in hops)
          + f", probe {math.ceil(counted.probes / a.admin_concurrency)})", flush=True)
    if not res.ok:
        raise RuntimeError(f"refresh to {version} did not reopen the fleet: {res.reason}")
    out = [w for w in res.workers if w["status"] != "verified"]
    if out:  # every worker is verified at every N, or the figures are not the fleet's
        raise RuntimeError(f"refresh to {version}: {len(out)} of {n} worker(s) kept out: "
                           + "; ".join(f"{w['instance_id']}: {w['reason']}" for w in out[:5]))
    return wall, phases(res), control


class EtcdJoinClock:
    """When each etcd discovery key was first put, as a watch in a thread of its own sees
    it (a few milliseconds after the put)."""

    def __init__(self, url: str) -> None:
        self.first_put: dict[str, float] = {}
        self.events = 0  # every event the watch saw
        self._url, self._ready = url, threading.Event()
        threading.Thread(target=lambda: asyncio.run(self._follow()), daemon=True).start()
        if not self._ready.wait(30):
            raise TimeoutError("the bench's etcd watch did not start")

    async def _follow(self) -> None:
        d = open_discovery(self._url)
        assert isinstance(d, EtcdDiscovery)
        prefix = d.prefix.encode()
        watch = await d._call("watch", lambda c: c.watch_prefix(prefix))
        self._ready.set()
        with contextlib.suppress(Exception):  # etcd stops at the end of the bench
            async for event in watch:
                self.events += 1
                if event.kind == "PUT" and event.kv.version == 1:
                    self.first_put.setdefault(event.kv.key.decode(), time.time())

    def registered(self, instance_id: int) -> float:
        return min(t for k, t in self.first_put.items() if k.endswith(f"/{instance_id}"))


def one_size(n: int, a: argparse.Namespace, work: Path) -> dict:
    root = work / "weights"
    ckpts = {v: write_mock_checkpoint(root / v, s) for v, s in (("A", 2), ("B", 3))}
    with LocalFleet(work / f"n{n}", discovery=a.discovery_url, namespace=f"scale{n}",
                    lease_ttl=a.lease_ttl) as fleet:
        fleet.start_frontend(enable_rl=True, env={"DYN_RL_REQUEST_TIMEOUT_SECS": "60"})
        t0 = time.monotonic()
        mock = fleet.start_worker(*mock_argv(root, MODEL, n), kind="mocker", timeout=900)
        started = time.monotonic() - t0
        wait_usable(fleet.url, MODEL, n, 120)
        # the RL listener has seen the fleet (as a trainer's earlier refresh would have): a
        # refresh's route probes are then those of the workers that changed since
        httpx.get(f"{fleet.rl_url}/v1/rl/workers", timeout=300).raise_for_status()
        _, rss = proc_stats(mock.popen.pid)
        out = {"n": n, "start_s": round(started, 2), "rss_mib": round(rss, 1)}
        if not a.skip_refresh:
            journal = work / f"journal-{n}.sqlite"
            sync_s, sync_ph, control = refresh(fleet, journal, ckpts["A"], "A", 2, a)
            roll_s, roll_ph, _ = refresh(fleet, journal, ckpts["B"], "B", 3, a,
                                         mode="rolling", wave_size=max(1, n // 4))
            out |= {"refresh_s": round(sync_s, 3), "phases": sync_ph,
                    "rolling_s": round(roll_s, 3), "rolling_phases": roll_ph,
                    "control": control}
        if n == max(a.sizes):
            out.update(discovery_figures(fleet, root, a))
        print(json.dumps(out), flush=True)
        return out


def join_once(fleet: LocalFleet, root: Path, model: str, ttl: float,
              clock: EtcdJoinClock | None) -> tuple[float, object]:
    """Start one worker of its own model; seconds from its discovery entry being written
    to the first request the frontend routes to it."""
    p = fleet.start_worker(*mock_argv(root, model, 1), "--lease-ttl", str(ttl), kind="mocker",
                           wait=False)
    body = {"model": model, "prompt": [1101, 1102], "max_tokens": 1}
    with httpx.Client(timeout=30) as c:
        deadline = time.monotonic() + 120
        while c.post(f"{fleet.url}/v1/completions", json=body).status_code != 200:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no request reached {model}")
            time.sleep(0.01)
        routed_at = time.time()
    ready = p.wait_ready(60)
    if clock is not None:
        return routed_at - clock.registered(int(ready["instance_id"])), p
    files = list((Path(fleet.discovery.removeprefix("file://"))).glob(
        f"*{ready['instance_id']}.json"))
    registered = min(f.stat().st_mtime for f in files)  # written once, touched ttl/3 later
    return routed_at - registered, p


def discovery_figures(fleet: LocalFleet, root: Path, a: argparse.Namespace) -> dict:
    joins, procs = [], []
    clock = EtcdJoinClock(fleet.discovery) if fleet.discovery.startswith("etcd://") else None
    for i in range(3):
        s, p = join_once(fleet, root, f"{MODEL}-join{i}", a.join_lease_ttl, clock)
        joins.append(round(s, 3))
        procs.append(p)
    time.sleep(3)  # nothing changes from here on
    front = fleet.frontend.popen.pid
    events = clock.events if clock else 0
    c0, _ = proc_stats(front)
    t0 = time.monotonic()
    time.sleep(a.idle_seconds)
    c1, _ = proc_stats(front)
    idle = (c1 - c0) / (time.monotonic() - t0)
    if clock is not None:
        print(f"etcd events while idle: {clock.events - events}", flush=True)
    victim = procs[0]
    iid = int(victim.ready["instance_id"])
    victim.signal(signal.SIGSTOP)
    t_stop = time.monotonic()
    while iid in {w["instance_id"] for w in
                  httpx.get(f"{fleet.url}/health", timeout=30).json()["workers"]}:
        time.sleep(0.05)
    lapse = time.monotonic() - t_stop
    victim.signal(signal.SIGCONT)
    return {"join_to_route_s": joins, "idle_cpu_frac": round(idle, 4),
            "discovery": fleet.discovery.partition(":")[0],
            "lapse_noticed_s": round(lapse, 2), "lease_ttl_s": a.join_lease_ttl}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="8,64,256,1024")
    p.add_argument("--admin-concurrency", type=int, default=64)
    p.add_argument("--relay-threshold", type=int, default=DEFAULT_RELAY_THRESHOLD,
                   help="phases over more workers than this go through relays "
                        "(rlfleet.refresh.relay)")
    p.add_argument("--relay-fanout", type=int, default=None,
                   help="relays per relayed phase (default: the square root of the workers)")
    p.add_argument("--lease-ttl", type=float, default=30.0,
                   help="the simulated fleet's lease TTL (long: N workers on two busy cores "
                        "must not lapse while they are refreshed)")
    p.add_argument("--join-lease-ttl", type=float, default=5.0,
                   help="the TTL of the workers that join (and the one stopped) at the end")
    p.add_argument("--idle-seconds", type=float, default=15.0)
    p.add_argument("--workdir", default=None,
                   help="keep the fleets' logs and discovery here (default: a temporary "
                        "directory, removed)")
    p.add_argument("--discovery", choices=("file", "etcd"), default="file",
                   help="the store the fleets register in: a directory, or a throw-away etcd")
    p.add_argument("--skip-refresh", action="store_true",
                   help="the discovery figures alone (no refresh at any N)")
    a = p.parse_args()
    a.sizes = sorted(int(x) for x in a.workers.split(","))
    with (contextlib.nullcontext(a.workdir) if a.workdir else
          tempfile.TemporaryDirectory(prefix="rlfleet-fleet-scale-")) as tmp, \
            (run_etcd() if a.discovery == "etcd" else contextlib.nullcontext(None)) as url:
        a.discovery_url = url
        rows = [one_size(n, a, Path(tmp)) for n in a.sizes]
    base, top = rows[0], rows[-1]
    if a.skip_refresh:
        print(json.dumps({"workers": a.sizes, **{k: top[k] for k in (
            "join_to_route_s", "idle_cpu_frac", "lapse_noticed_s", "lease_ttl_s")},
            "discovery": a.discovery}))
        return
    print(f"\n{'N':>6} {'start s':>8} {'RSS MiB':>8} {'sync s':>8} {'x base':>7} "
          f"{'rolling s':>9} {'x base':>7}")
    for r in rows:
        print(f"{r['n']:>6} {r['start_s']:>8} {r['rss_mib']:>8} {r['refresh_s']:>8} "
              f"{r['refresh_s'] / base['refresh_s']:>7.2f} {r['rolling_s']:>9} "
              f"{r['rolling_s'] / base['rolling_s']:>7.2f}")
    print("sync phases (s):", {r["n"]: r["phases"] for r in rows})
    print(f"\ncontrol of the synchronous refresh (every worker verified at every N; "
          f"projection: {PROJECTED_N} workers, {RTT_S * 1e3:g} ms RTT)")
    print(f"{'N':>6} {'coord ms/w':>10} {'front ms/w':>10} {'calls/w':>8} {'relay calls':>11} "
          f"{'probes':>7} {'round trips':>11} {'projected s':>11}")
    for r in rows:
        c = r["control"]
        c["projected_control_s_1024"] = round(
            c["round_trips"] * RTT_S + c["coordinator_cpu_ms_per_worker"] * PROJECTED_N / 1e3, 3)
        print(f"{r['n']:>6} {c['coordinator_cpu_ms_per_worker']:>10} "
              f"{c['frontend_cpu_ms_per_worker']:>10} {c['admin_calls_per_worker']:>8} "
              f"{c['relay_calls']:>11} {c['route_probes_per_refresh']:>7} "
              f"{c['round_trips']:>11} {c['projected_control_s_1024']:>11}")
    if top["n"] != PROJECTED_N:
        print(f"(the projection takes the round trips measured at N = {top['n']}, not "
              f"{PROJECTED_N})")
    mib = (top["rss_mib"] - base["rss_mib"]) / max(1, top["n"] - base["n"])
    c = top["control"]
    print(json.dumps({
        "workers": a.sizes, "refresh_s": {r["n"]: r["refresh_s"] for r in rows},
        "ratio_refresh": round(top["refresh_s"] / base["refresh_s"], 2),
        "rolling_s": {r["n"]: r["rolling_s"] for r in rows},
        "join_to_route_s": max(top["join_to_route_s"]),
        "idle_cpu_frac": top["idle_cpu_frac"], "lapse_noticed_s": top["lapse_noticed_s"],
        "lease_ttl_s": a.join_lease_ttl, "mib_per_worker": round(mib, 3),
        "discovery": a.discovery, "all_verified": True,
        **{k: c[k] for k in ("coordinator_cpu_ms_per_worker", "frontend_cpu_ms_per_worker",
                             "admin_calls_per_worker", "route_probes_per_refresh",
                             "round_trips", "projected_control_s_1024")},
        "relay_calls": c["relay_calls"], "relays": c["relays"],
        "control_by_n": {r["n"]: r["control"] for r in rows}}))


if __name__ == "__main__":
    main()
