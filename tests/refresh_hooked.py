"""`rlfleet refresh`, with a coordinator that SIGKILLs or SIGSTOPs its own process when the
refresh reaches a named point of its lifecycle (rlfleet.rl.hooks.POINTS), so that a test can
interrupt a coordinator at one step deterministically:

    python tests/refresh_hooked.py POINT=kill|stop [rlfleet refresh arguments]

It prints "RLFLEET_TEST_HOOK <point> <action>" just before it acts."""

from __future__ import annotations

import os
import signal
import sys

from rlfleet.cli import build_parser, run_refresh
from rlfleet.rl.hooks import POINTS, RefreshHooks
from rlfleet.runtime.logs import setup_logging

ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


class SignalHooks(RefreshHooks):
    """At `point`, send this process `action`'s signal."""

    def __init__(self, point: str, action: str) -> None:
        if point not in POINTS or action not in ACTIONS:
            raise ValueError(f"want POINT=ACTION with POINT in {POINTS} and ACTION in "
                             f"{sorted(ACTIONS)}, not {point}={action}")
        self.point, self.action = point, action

    def wants(self, point: str) -> bool:
        return point == self.point

    def reached(self, point: str) -> None:
        if point == self.point:
            print(f"RLFLEET_TEST_HOOK {point} {self.action}", flush=True)
            os.kill(os.getpid(), ACTIONS[self.action])


def main(argv: list[str]) -> int:
    point, _, action = argv[0].partition("=")
    hooks = SignalHooks(point, action)
    args = build_parser().parse_args(["refresh", *argv[1:]])
    setup_logging(args.log_level, args.log_format)
    return run_refresh(args, hooks)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
