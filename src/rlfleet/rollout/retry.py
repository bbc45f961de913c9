"""How often and how soon a sample is tried again."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    """At most `max_attempts` attempts per sample (per `generate` call). Before attempt
    k+1 the client waits backoff_initial * 2**(k-1), capped at backoff_max, plus up to
    `jitter` of that at random. `attempt_timeout` bounds one attempt (None: no bound);
    an attempt that hits it is canceled and, with `reuse_request_id_on_timeout`, retried
    under the same request ID, so that a frontend that remembers request IDs can return
    the first attempt's result instead of generating again.

    An attempt that could not reach the frontend at all (the connection was refused or
    timed out: a frontend restarting, a load balancer moving it) sent nothing anywhere, so
    it does not count against `max_attempts` while the sample has found the frontend
    unreachable for less than `unreachable_for` seconds in all (0: it counts like any
    other): the default rides out a frontend restart of several seconds, backing off up to
    `backoff_max` between tries, within the sample's deadline."""

    max_attempts: int = 3
    backoff_initial: float = 0.05
    backoff_max: float = 2.0
    jitter: float = 0.5
    attempt_timeout: float | None = 120.0
    reuse_request_id_on_timeout: bool = True
    unreachable_for: float = 30.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if min(self.backoff_initial, self.backoff_max, self.jitter) < 0:
            raise ValueError("backoff and jitter must not be negative")
        if self.attempt_timeout is not None and self.attempt_timeout <= 0:
            raise ValueError("attempt_timeout must be positive (or None)")
        if not self.unreachable_for >= 0:
            raise ValueError("unreachable_for must not be negative (seconds; 0: connect "
                             "errors count as attempts)")

    def backoff(self, attempts_done: int) -> float:
        """Seconds to wait before the next attempt, after `attempts_done` (>= 1) attempts."""
        base = min(self.backoff_max, self.backoff_initial * 2 ** max(0, attempts_done - 1))
        return base + random.uniform(0, base * self.jitter) if self.jitter else base
