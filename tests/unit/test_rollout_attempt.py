"""The attempt state machine: its transition table, move by move."""

from __future__ import annotations

import itertools

import pytest

from rlfleet.rl import AttemptState, IllegalTransition
from rlfleet.rollout.attempt import OPEN_STATES, TERMINAL_STATES, TRANSITIONS, Attempt, transition

S = AttemptState
LEGAL = {
    (S.ACCEPTED, S.STREAMING), (S.ACCEPTED, S.SUCCEEDED), (S.ACCEPTED, S.CANCELED),
    (S.ACCEPTED, S.FAILED), (S.STREAMING, S.SUCCEEDED), (S.STREAMING, S.CANCELED),
    (S.STREAMING, S.FAILED),
}


def test_the_table_covers_every_state_and_matches_the_design():
    assert set(TRANSITIONS) == set(S)
    assert {(a, b) for a, nxt in TRANSITIONS.items() for b in nxt} == LEGAL
    assert OPEN_STATES == {S.ACCEPTED, S.STREAMING}
    assert TERMINAL_STATES == {S.SUCCEEDED, S.CANCELED, S.FAILED}


@pytest.mark.parametrize("current,target", sorted(LEGAL))
def test_every_legal_move_is_allowed(current, target):
    assert transition(current, target) is target


@pytest.mark.parametrize("current,target",
                         [p for p in itertools.product(S, S) if p not in LEGAL])
def test_every_illegal_move_raises(current, target):
    with pytest.raises(IllegalTransition) as info:
        transition(current, target)
    assert (info.value.current, info.value.target) == (current, target)
    assert str(current) in str(info.value) and str(target) in str(info.value)


def test_an_attempt_records_its_moves():
    a = Attempt("s", 1, "r")
    assert a.state is S.ACCEPTED and a.open
    a.move(S.STREAMING)
    assert a.first_token is not None and a.finished is None
    a.move(S.CANCELED, "timeout")
    assert (a.state, a.reason, a.open) == (S.CANCELED, "timeout", False)
    assert a.finished is not None and a.seconds >= 0
    with pytest.raises(IllegalTransition):
        a.move(S.SUCCEEDED)  # a late completion of a canceled attempt
    assert a.state is S.CANCELED


def test_unary_attempts_go_straight_to_a_terminal_state():
    a = Attempt("s", 1, "r")
    a.move(S.SUCCEEDED)
    assert a.first_token is None and not a.open
