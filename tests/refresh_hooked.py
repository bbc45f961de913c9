"""`rlfleet refresh`, with a coordinator that SIGKILLs or SIGSTOPs its own process when the
refresh reaches a named point of its lifecycle (rlfleet.refresh.hooks.POINTS), so that a test can
interrupt a coordinator at one step deterministically:

    python tests/refresh_hooked.py POINT=kill|stop [rlfleet refresh arguments]

POINT is one of the coordinator's points or "apply_half", this script's own: the refresh's
transfer goes to half its workers, then the hook acts, then the transfer goes to the rest
(it wraps the coordinator's worker control, which sends the transfer to all at once).
It prints "RLFLEET_TEST_HOOK <point> <action>" just before it acts."""

from __future__ import annotations

import os
import signal
import sys

from rlfleet.cli import build_parser, run_refresh
from rlfleet.refresh import coordinator
from rlfleet.refresh.hooks import POINTS, RefreshHooks
from rlfleet.runtime.logs import setup_logging

ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
#: the refresh's transfer applied to half of its workers (a mixed fleet)
APPLY_HALF = "apply_half"
HOOK_POINTS = (*POINTS, APPLY_HALF)


class SignalHooks(RefreshHooks):
    """At `point`, send this process `action`'s signal."""

    def __init__(self, point: str, action: str) -> None:
        if point not in HOOK_POINTS or action not in ACTIONS:
            raise ValueError(f"want POINT=ACTION with POINT in {HOOK_POINTS} and ACTION in "
                             f"{sorted(ACTIONS)}, not {point}={action}")
        self.point, self.action = point, action
        self.halving = False  # apply_half: the refresh paused, its transfer comes next

    def wants(self, point: str) -> bool:
        return point == self.point or (self.point == APPLY_HALF and point == "paused")

    def reached(self, point: str) -> None:
        if point == "paused" and self.point == APPLY_HALF:
            self.halving = True  # only a refresh reaches "paused" (not a recovery)
        elif point == self.point:
            print(f"RLFLEET_TEST_HOOK {point} {self.action}", flush=True)
            os.kill(os.getpid(), ACTIONS[self.action])


def transfer_in_halves(hooks: SignalHooks) -> None:
    """Every coordinator this process makes sends the transfer that follows a refresh's
    pause to half of its workers, reaches apply_half, then sends it to the rest."""
    make_control = coordinator.make_control

    def make(config):
        control = make_control(config)
        whole = control.transfer

        async def transfer(ch, ws, target):
            if not hooks.halving:
                return await whole(ch, ws, target)
            hooks.halving = False
            if len(ws) < 2:
                return await whole(ch, ws, target)
            half = len(ws) // 2
            failed = await whole(ch, ws[:half], target)
            hooks.reached(APPLY_HALF)
            return failed + await whole(ch, ws[half:], target)

        control.transfer = transfer
        return control

    coordinator.make_control = make


def main(argv: list[str]) -> int:
    point, _, action = argv[0].partition("=")
    hooks = SignalHooks(point, action)
    if point == APPLY_HALF:
        transfer_in_halves(hooks)
    args = build_parser().parse_args(["refresh", *argv[1:]])
    setup_logging(args.log_level, args.log_format)
    return run_refresh(args, hooks)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
