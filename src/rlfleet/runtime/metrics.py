"""Prometheus metrics of the serving side. Labels are bounded sets (model, route, status,
outcome, kind, phase): request, attempt and sample IDs never become labels (they are in
the log lines and traces instead).

Where each metric lives:
- `FRONTEND`: the frontend's series, exported on the frontend's /metrics;
- `WORKER`: a worker's series (every one labelled with the model it serves), exported on
  its request plane's and its system server's /metrics;
- the process registry (prometheus_client's default): vLLM's own `vllm:*` series in a vLLM
  worker, the process and Python collectors everywhere, and the trainer side (rollouts:
  rlfleet.rollout.telemetry; policy refreshes: rlfleet.refresh.telemetry) in the process
  that runs a RolloutClient or a PolicyRefresh. Both /metrics routes add it to their own
  registry, so a worker never exports zeroed frontend series, nor a frontend worker series.

End-to-end latencies have buckets up to hours (an RL generation may take minutes, a held
request longer).
"""

from __future__ import annotations

import itertools
import os
import time
import weakref
from collections import deque
from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily
from starlette.responses import Response

from rlfleet.protocol.identity import PolicyIdentity

# prometheus_client's multiprocess mode: its directory (set by the parent of a process group)
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

# seconds: from 10 ms to 4 h
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                   300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0, 14400.0)
# seconds: from 1 ms to 10 min (a request held while the fleet is gated waits that long)
FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                       30.0, 60.0, 120.0, 300.0, 600.0)

FRONTEND = CollectorRegistry(auto_describe=True)
WORKER = CollectorRegistry(auto_describe=True)

# ---------------------------------------------------------------------------- frontend
# `model` is a model some worker served (set once a worker took the request), else ""
FRONTEND_REQUESTS = Counter("rlfleet_frontend_requests_total",
                            "Requests answered by the frontend, by model, route and HTTP status",
                            ["model", "route", "status"], registry=FRONTEND)
FRONTEND_INFLIGHT = Gauge("rlfleet_frontend_inflight_requests", "Requests in flight, by route",
                          ["route"], registry=FRONTEND,
                          multiprocess_mode="livesum")  # summed over a frontend's processes
FRONTEND_LATENCY = Histogram("rlfleet_frontend_request_seconds",
                             "Request latency to the last byte, by model and route",
                             ["model", "route"], buckets=LATENCY_BUCKETS, registry=FRONTEND)
FRONTEND_TTFT = Histogram("rlfleet_frontend_time_to_first_token_seconds",
                          "Time from sending a request to a worker to its first generated token",
                          ["model"], buckets=FIRST_TOKEN_BUCKETS, registry=FRONTEND)
FRONTEND_WORKER_ERRORS = Counter("rlfleet_frontend_worker_errors_total",
                                 "Requests that failed because of a worker, by model and kind",
                                 ["model", "kind"], registry=FRONTEND)
FRONTEND_GENERATED_TOKENS = Counter("rlfleet_frontend_generated_tokens_total",
                                    "Completion tokens the workers produced for this frontend",
                                    ["model"], registry=FRONTEND)
FRONTEND_REPLAYS = Counter("rlfleet_frontend_request_id_replays_total",
                           "Requests answered from an earlier attempt with the same X-Request-Id",
                           registry=FRONTEND)
FRONTEND_RESTARTS = Counter("rlfleet_frontend_request_id_restarts_total",
                            "Requests whose earlier attempt (same X-Request-Id) failed with its "
                            "worker and that started anew", registry=FRONTEND)
FRONTEND_OWNER_ASKS = Counter("rlfleet_frontend_request_id_owner_asks_total",
                              "Requests with an X-Request-Id placed elsewhere than on the ID's "
                              "top-ranked worker, after asking the workers ranked above whether "
                              "they own its run (found: attached there)", ["outcome"],
                              registry=FRONTEND)
FRONTEND_ROUTE_PROBES = Counter("rlfleet_frontend_route_probes_total",
                                "Probes of a worker's /engine route list by the RL listener (once "
                                "per worker life; again after a failed one), by outcome (ok, "
                                "failed)", ["outcome"], registry=FRONTEND)


class FleetCollector:
    """What the frontend sees of the fleet in discovery, read at scrape time:
    `rlfleet_frontend_workers{model}` (registered), `rlfleet_frontend_gated_workers{model}`
    (closed to rollouts by a coordinator) and `rlfleet_fleet_gated{model}`: 1 while every
    worker of the model is gated (a policy refresh holds the fleet; requests wait).
    Registered once; each frontend's worker pool is added (`watch`)."""

    def __init__(self) -> None:
        self.pools: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def watch(self, pool) -> None:
        """Count `pool`'s workers (anything with `.workers: {id: worker(model, entry)}`)."""
        self.pools[id(pool)] = pool

    def collect(self):
        total: dict[str, int] = {}
        gated: dict[str, int] = {}
        for pool in list(self.pools.values()):
            for w in list(pool.workers.values()):
                total[w.model] = total.get(w.model, 0) + 1
                gated[w.model] = gated.get(w.model, 0) + bool(w.entry.get("gated"))
        known = GaugeMetricFamily("rlfleet_frontend_workers", "Workers registered in discovery",
                                  labels=["model"])
        closed = GaugeMetricFamily("rlfleet_frontend_gated_workers",
                                   "Workers closed to rollouts (gated by a coordinator)",
                                   labels=["model"])
        fleet = GaugeMetricFamily("rlfleet_fleet_gated",
                                  "1 while every worker of the model is gated (a policy refresh "
                                  "holds the fleet), else 0", labels=["model"])
        for m in sorted(total):
            known.add_metric([m], total[m])
            closed.add_metric([m], gated[m])
            fleet.add_metric([m], float(gated[m] == total[m]))
        yield from (known, closed, fleet)


FLEET = FleetCollector()
FRONTEND.register(FLEET)


# ---------------------------------------------------------------------------- worker
WORKER_OUTCOMES = ("ok", "error", "rejected", "abandoned")
WORKER_REQUESTS = Counter("rlfleet_worker_requests_total",
                          "Generate requests finished by this worker, by model and outcome",
                          ["model", "outcome"], registry=WORKER)
WORKER_REQUEST_SECONDS = Histogram("rlfleet_worker_request_seconds",
                                   "Time from admission to the end of a generate request",
                                   ["model"], buckets=LATENCY_BUCKETS, registry=WORKER)
WORKER_GENERATED_TOKENS = Counter("rlfleet_worker_generated_tokens_total",
                                  "Tokens generated by this worker's engine", ["model"],
                                  registry=WORKER)
WORKER_PROMPT_TOKENS = Counter("rlfleet_worker_prompt_tokens_total",
                               "Prompt tokens admitted by this worker's engine", ["model"],
                               registry=WORKER)
WORKER_ATTACHES = Counter("rlfleet_worker_request_id_attaches_total",
                          "Requests that attached to a run this worker keeps by X-Request-Id "
                          "(a retry through any frontend) instead of generating again",
                          ["model"], registry=WORKER)
WORKER_RUNNING = Gauge("rlfleet_worker_running_requests", "Requests running in the engine",
                       ["model"], registry=WORKER)
WORKER_ADMIN_CALLS = Counter("rlfleet_worker_admin_calls_total",
                             "Admin calls this process's system servers answered (POST "
                             "/engine/<route> of the route table), by route", ["route"],
                             registry=WORKER)


class WorkerSeries:
    """One worker's series, bound to the model it serves (an engine holds one)."""

    __slots__ = ("model", "requests", "seconds", "generated", "prompt", "running", "attaches")

    def __init__(self, model: str) -> None:
        self.model = model
        self.requests = {o: WORKER_REQUESTS.labels(model, o) for o in WORKER_OUTCOMES}
        self.seconds = WORKER_REQUEST_SECONDS.labels(model)
        self.generated = WORKER_GENERATED_TOKENS.labels(model)
        self.prompt = WORKER_PROMPT_TOKENS.labels(model)
        self.running = WORKER_RUNNING.labels(model)
        self.attaches = WORKER_ATTACHES.labels(model)


class WorkerStateCollector:
    """Each worker's state, read at scrape time: `rlfleet_worker_policy_info{model, version,
    digest}` (the weights it serves) and `rlfleet_worker_gated{model}` (closed to
    rollouts). Registered once; each worker in the process is added (`add`)."""

    def __init__(self) -> None:
        self.workers: dict[int, tuple[str, Callable[[], dict], Callable[[], bool]]] = {}
        self._keys = itertools.count()

    def add(self, model: str, identity: Callable[[], PolicyIdentity], gated: Callable[[], bool]) -> int:
        key = next(self._keys)
        self.workers[key] = (model, identity, gated)
        return key

    def remove(self, key: int) -> None:
        self.workers.pop(key, None)

    def collect(self):
        info = InfoMetricFamily("rlfleet_worker_policy", "The policy this worker serves",
                                labels=["model"])
        gate = GaugeMetricFamily("rlfleet_worker_gated",
                                 "1 while this worker is closed to rollouts", labels=["model"])
        for model, identity, gated in list(self.workers.values()):
            policy = identity()
            info.add_metric([model], {"version": str(policy.version or ""),
                                      "digest": str(policy.digest or "")})
            gate.add_metric([model], float(gated()))
        yield from (info, gate)


WORKER_STATE = WorkerStateCollector()
WORKER.register(WORKER_STATE)


class TokenRate:
    """Tokens per second generated by this worker over the last `window` seconds, from a
    sample of its token counter taken every second (nothing on the request path)."""

    def __init__(self, series: WorkerSeries, window: float = 10.0) -> None:
        self.series = series
        self.samples: deque[tuple[float, float]] = deque(maxlen=int(window) + 1)

    def _total(self) -> float:
        # this worker's counter alone: collecting the registry would read every worker's
        # series and state (a process of many simulated workers samples N times a second)
        for family in self.series.generated.collect():
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    return sample.value
        return 0.0

    def sample(self) -> None:
        self.samples.append((time.monotonic(), self._total()))

    def rate(self) -> float | None:
        if not self.samples:
            return None
        t0, n0 = self.samples[0]
        now, n = time.monotonic(), self._total()
        return round((n - n0) / (now - t0), 3) if now - t0 >= 0.5 else None


# ---------------------------------------------------------------------------- exposition

# what each registry reads at scrape time (no prometheus_client values behind it)
_LIVE = {id(FRONTEND): FLEET, id(WORKER): WORKER_STATE}


def exposition(registry: CollectorRegistry) -> bytes:
    """The text exposition of `registry` and of the process registry. In a process of a
    group that shares its series (prometheus_client's multiprocess mode, $MULTIPROC_ENV
    set: `python -m rlfleet.frontend --processes K`), every process's series summed
    instead, and what `registry` reads at scrape time as this process sees it."""
    path = os.environ.get(MULTIPROC_ENV)
    if not path:
        return generate_latest(registry) + generate_latest(REGISTRY)
    summed = CollectorRegistry()
    multiprocess.MultiProcessCollector(summed, path)
    live = CollectorRegistry()
    if id(registry) in _LIVE:
        live.register(_LIVE[id(registry)])
    return generate_latest(summed) + generate_latest(live)


def metrics_response(registry: CollectorRegistry) -> Response:
    return Response(exposition(registry), media_type=CONTENT_TYPE_LATEST)
