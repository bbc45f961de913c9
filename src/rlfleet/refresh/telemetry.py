"""Policy refresh metrics, in the process that runs the coordinator (a PolicyRefresh or the
`rlfleet control` service): each phase's duration and each refresh's outcome. Labels are
small fixed sets (phase, outcome)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from rlfleet.runtime.metrics import LATENCY_BUCKETS

REFRESH_SECONDS = Histogram("rlfleet_refresh_seconds",
                            "Duration of each phase of a policy refresh (stage, resolve, gate, "
                            "pause, apply, reset_cache, verify, resume, probe, reopen, "
                            "rollback)", ["phase"], buckets=LATENCY_BUCKETS)
REFRESH_TOTAL = Counter("rlfleet_refresh_total",
                        "Policy refreshes that ended, by outcome (reopened, rolled_back, held)",
                        ["outcome"])
