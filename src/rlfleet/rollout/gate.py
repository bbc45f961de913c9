"""The trainer-side rollout gate (`RolloutGate`): closed while the fleet's policy is being
refreshed. `RolloutClient` waits on it before starting any attempt. (Not the workers' own
admission, which a refresh closes and opens per worker: rlfleet.refresh.control.)

A refresh that reopens the fleet hands the gate the policy the fleet serves now, and the
gate passes it to its clients before any waiting attempt starts: no attempt after the
reopen expects the old policy, whoever calls `expect` and when."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

VersionDigest = tuple[Any, Any]  # the policy the fleet serves: (version, digest)


class RolloutGate:
    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self.reason: str | None = None
        self.policy: VersionDigest | None = None  # what the fleet serves, since the last reopen
        self._subscribers: list[Callable[[Any, Any], None]] = []

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def subscribe(self, expect: Callable[[Any, Any], None]) -> None:
        """Call `expect(version, digest)` with the policy of every reopen, before any
        waiter resumes."""
        self._subscribers.append(expect)

    def close(self, reason: str) -> None:
        self.reason = reason
        self._open.clear()

    def open(self, policy: VersionDigest | None = None) -> None:
        """Reopen; with `policy` (version, digest), on that policy."""
        if policy is not None:
            self.policy = policy
            for expect in self._subscribers:
                expect(*policy)
        self.reason = None
        self._open.set()

    async def wait_open(self, timeout: float | None = None) -> None:
        """Return once the gate is open; TimeoutError after `timeout` seconds."""
        if not self._open.is_set():
            await asyncio.wait_for(self._open.wait(), timeout)
