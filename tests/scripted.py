"""A run's source of scripted events, for tests of the frontend's runs without workers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any


class Scripted:
    """A source of a run (rlfleet.frontend.runs.Source) that yields `events`: no worker
    serves it, nothing paces it; `reads` counts how often a run started reading it."""

    worker = None

    def __init__(self, events: AsyncIterator[Any]) -> None:
        self.events = events
        self.reads = 0

    def __aiter__(self) -> AsyncIterator[Any]:
        self.reads += 1
        return self.events

    def taken(self, n: int) -> None:
        pass
