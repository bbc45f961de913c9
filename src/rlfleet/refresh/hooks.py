"""Named points of a refresh's lifecycle where a test can act (stop or kill the
coordinator's process, see tests/refresh_hooked.py) to interrupt a coordinator at one step
deterministically. `PolicyRefresh` takes a `RefreshHooks`; the default one does nothing.
Only refreshes reach the points (recoveries and admissions do not)."""

from __future__ import annotations

#: the points, in lifecycle order: the workers closed; paused (the transfer comes next);
#: verified; probed, just before the reopen
POINTS = ("gated", "paused", "verified", "before_reopen")


class RefreshHooks:
    """What a refresh does at each point: nothing."""

    def wants(self, point: str) -> bool:
        """Whether `reached(point)` does anything (a refresh that wants any point runs step
        by step, a call per worker per step, so that each point falls between two steps)."""
        return False

    def reached(self, point: str) -> None:
        """The refresh has reached `point`."""


NO_HOOKS = RefreshHooks()
