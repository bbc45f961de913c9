"""Rollout telemetry: W3C trace context per request, structured log records, and Prometheus
metrics in the trainer process (a policy refresh's metrics: rlfleet.refresh.telemetry).

Correlation with the serving side goes through the request (X-Request-Id, `traceparent`)
and the log records (fields `sample_id`, `attempt`, `request_id`, `trace_id`), never
through metric labels: every label below is a small fixed set.
"""

from __future__ import annotations

import hashlib
import logging

from prometheus_client import Counter, Histogram

from rlfleet.rollout.attempt import Attempt
from rlfleet.runtime.metrics import LATENCY_BUCKETS

log = logging.getLogger("rlfleet.rl.rollout")

ATTEMPTS = Counter("rlfleet_rollout_attempts_total",
                   "Rollout attempts that ended, by end state and kind of reason", ["state", "kind"])
SAMPLES = Counter("rlfleet_rollout_samples_total",
                  "Samples whose generate call ended, by outcome", ["outcome"])
REJECTIONS = Counter("rlfleet_rollout_rejections_total",
                     "Responses refused by an admission check, by check", ["check"])
ATTEMPT_SECONDS = Histogram("rlfleet_rollout_attempt_seconds",
                            "Time from sending an attempt to its end", buckets=LATENCY_BUCKETS)
SAMPLE_SECONDS = Histogram("rlfleet_rollout_sample_seconds",
                           "Time from asking for a sample to its admission, retries included",
                           buckets=LATENCY_BUCKETS)

# the bounded set of `kind` labels; a reason outside it counts as "other"
KINDS = frozenset({"admitted", "timeout", "aborted", "cancelled", "transport", "http", "stream_error",
                   "already_admitted", "attempt_closed", "token_ids_present", "logprobs_aligned",
                   "prompt_logprobs_unshifted", "terminal_state", "identity", "single_policy"})


def trace_id(sample_id: str) -> str:
    """The sample's trace ID: the same for every attempt, in every trainer process."""
    return hashlib.blake2b(sample_id.encode(), digest_size=16).hexdigest()


def traceparent(sample_trace_id: str, span_id: str) -> str:
    """A W3C `traceparent` header value (version 00, sampled)."""
    return f"00-{sample_trace_id}-{span_id}-01"


def reason_kind(reason: str | None) -> str:
    head = (reason or "other").split(":", 1)[0]
    return head if head in KINDS else "other"


def attempt_ended(a: Attempt) -> None:
    ATTEMPTS.labels(str(a.state), reason_kind(a.reason)).inc()
    ATTEMPT_SECONDS.observe(a.seconds)


def fields(a: Attempt, trace: str) -> dict[str, object]:
    """The `extra=` fields of a log record about an attempt."""
    return {"sample_id": a.sample_id, "attempt": a.number, "request_id": a.request_id,
            "trace_id": trace}
