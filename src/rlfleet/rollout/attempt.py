"""One try at generating a sample, and its state machine.

    ACCEPTED ──▶ STREAMING ──▶ SUCCEEDED | CANCELED | FAILED
        └──────────────────────▶ SUCCEEDED | CANCELED | FAILED

ACCEPTED: recorded in the ledger and handed to the frontend (before the first byte is
sent, so that no attempt can run unrecorded). STREAMING: the first generated tokens
arrived on a stream. SUCCEEDED: a verified terminal result, admitted to training.
CANCELED: stopped before a terminal result, by the caller, a client timeout or the
server (an aborted request). FAILED: an error, or a result that failed an admission
check. The three terminal states have no way out.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from enum import StrEnum


class AttemptState(StrEnum):
    ACCEPTED = "accepted"
    STREAMING = "streaming"
    SUCCEEDED = "succeeded"
    CANCELED = "canceled"
    FAILED = "failed"


TRANSITIONS: dict[AttemptState, frozenset[AttemptState]] = {
    AttemptState.ACCEPTED: frozenset({AttemptState.STREAMING, AttemptState.SUCCEEDED,
                                      AttemptState.CANCELED, AttemptState.FAILED}),
    AttemptState.STREAMING: frozenset({AttemptState.SUCCEEDED, AttemptState.CANCELED,
                                       AttemptState.FAILED}),
    AttemptState.SUCCEEDED: frozenset(),
    AttemptState.CANCELED: frozenset(),
    AttemptState.FAILED: frozenset(),
}

OPEN_STATES = frozenset(s for s, nxt in TRANSITIONS.items() if nxt)
TERMINAL_STATES = frozenset(s for s, nxt in TRANSITIONS.items() if not nxt)


class IllegalTransition(Exception):
    """A move the transition table does not allow (a bug in the caller, never retried)."""

    def __init__(self, current: AttemptState, target: AttemptState) -> None:
        allowed = ", ".join(sorted(TRANSITIONS[current])) or "nothing (terminal)"
        super().__init__(f"an attempt in state {current} cannot move to {target}; "
                         f"allowed: {allowed}")
        self.current, self.target = current, target


def transition(current: AttemptState, target: AttemptState) -> AttemptState:
    """Return `target` if the table allows current -> target; raise IllegalTransition if not."""
    if target not in TRANSITIONS[current]:
        raise IllegalTransition(current, target)
    return target


def new_request_id() -> str:
    return secrets.token_hex(16)


def new_span_id() -> str:
    return secrets.token_hex(8)


@dataclass
class Attempt:
    """Identity and progress of one attempt. `number` counts from 1 per sample (the ledger
    hands it out); `request_id` goes out as X-Request-Id (and SGLang `rid`)."""

    sample_id: str
    number: int
    request_id: str
    span_id: str = field(default_factory=new_span_id)
    state: AttemptState = AttemptState.ACCEPTED
    reason: str | None = None
    started: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    finished: float | None = None

    def move(self, target: AttemptState, reason: str | None = None) -> None:
        self.state = transition(self.state, target)
        if target is AttemptState.STREAMING:
            self.first_token = time.monotonic()
        else:
            self.finished = time.monotonic()
            self.reason = reason

    @property
    def open(self) -> bool:
        return self.state in OPEN_STATES

    @property
    def seconds(self) -> float:
        return (self.finished or time.monotonic()) - self.started
