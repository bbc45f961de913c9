"""The trainer-side rollout gate: closed while the fleet's policy is being refreshed.
`RolloutClient` waits on it before starting any attempt."""

from __future__ import annotations

import asyncio


class RolloutGate:
    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self.reason: str | None = None

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def close(self, reason: str) -> None:
        self.reason = reason
        self._open.clear()

    def open(self) -> None:
        self.reason = None
        self._open.set()

    async def wait_open(self, timeout: float | None = None) -> None:
        """Return once the gate is open; TimeoutError after `timeout` seconds."""
        if not self._open.is_set():
            await asyncio.wait_for(self._open.wait(), timeout)
