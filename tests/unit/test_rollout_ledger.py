"""The sample ledger: attempt numbering, at most one admission per sample, refusals of
late completions, and the same guarantees after reopening the file."""

from __future__ import annotations

import sqlite3

import pytest

from rlfleet.rl import (
    AlreadyAdmitted,
    AttemptClosed,
    AttemptState,
    RetryWindow,
    RetryWindowPassed,
    SampleLedger,
)


@pytest.fixture
def path(tmp_path):
    return tmp_path / "ledger.db"


def test_attempts_are_numbered_per_sample(path):
    with SampleLedger(path) as led:
        assert [led.start("a", "r1"), led.start("b", "r2"), led.start("a", "r3")] == [1, 1, 2]
        recs = led.attempts("a")
        assert [(r.attempt, r.request_id) for r in recs] == [(1, "r1"), (2, "r3")]
        # starting attempt 2 closed attempt 1, which was still open
        assert (recs[0].state, recs[0].reason) == (AttemptState.CANCELED, "abandoned")
        assert recs[1].state is AttemptState.ACCEPTED and not recs[1].admitted


def test_the_wal_journal_is_used(path):
    with SampleLedger(path) as led:
        assert led._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_sample_is_admitted_once(path):
    with SampleLedger(path) as led:
        led.start("s", "r1")
        assert led.streaming("s", 1)
        led.admit("s", 1)
        rec = led.attempt("s", 1)
        assert rec.admitted and rec.state is AttemptState.SUCCEEDED
        assert rec.first_token_at is not None and rec.finished_at >= rec.started_at
        with pytest.raises(AlreadyAdmitted) as info:
            led.start("s", "r2")  # no new attempt of an admitted sample
        assert info.value.admitted_attempt == 1
        with pytest.raises(AttemptClosed):
            led.admit("s", 1)  # twice
        assert led.admitted() == {"s": (1, "r1")}


def test_a_late_completion_of_an_abandoned_attempt_is_refused(path):
    with SampleLedger(path) as led:
        led.start("s", "r1")
        assert led.close_attempt("s", 1, AttemptState.CANCELED, "timeout")
        led.start("s", "r2")
        led.admit("s", 2)
        with pytest.raises(AttemptClosed) as info:
            led.admit("s", 1)  # the first attempt's result arrives after all
        assert info.value.state == AttemptState.CANCELED
        assert not led.close_attempt("s", 1, AttemptState.FAILED, "late")  # terminal stays
        assert led.admitted() == {"s": (2, "r2")}


def test_the_database_refuses_a_second_admitted_attempt(path):
    """Even if two attempts are open at once (two processes), one admission wins."""
    with SampleLedger(path) as led:
        led.start("s", "r1")
        led.start("s", "r2")
        led._db.execute("UPDATE attempts SET state = 'accepted', reason = NULL WHERE attempt = 1")
        led.admit("s", 2)
        with pytest.raises(AlreadyAdmitted):
            led.admit("s", 1)
        rec = led.attempt("s", 1)
        assert (rec.state, rec.reason, rec.admitted) == (AttemptState.FAILED, "already_admitted",
                                                         False)
        with pytest.raises(sqlite3.IntegrityError):
            led._db.execute("UPDATE attempts SET admitted = 1 WHERE sample_id = 's'")


def test_a_reopened_ledger_keeps_refusing(path):
    with SampleLedger(path) as led:
        led.start("done", "r1")
        led.admit("done", 1)
        led.start("open", "r2")
        led.start("open2", "r3")
        led.streaming("open2", 1)
    with SampleLedger(path) as led:  # the trainer restarted
        assert led.admitted() == {"done": (1, "r1")}
        with pytest.raises(AlreadyAdmitted):
            led.start("done", "r4")
        assert led.start("open", "r5") == 2  # numbering continues; attempt 1 is abandoned
        with pytest.raises(AttemptClosed):
            led.admit("open", 1)  # the dead process's attempt completes late: refused
        led.admit("open", 2)
        assert led.counts() == {"succeeded": 2, "canceled": 1, "streaming": 1}


def test_two_connections_to_one_file_admit_once(path):
    a, b = SampleLedger(path), SampleLedger(path)
    try:
        a.start("s", "r1")
        b._db.execute("UPDATE attempts SET state = 'accepted'")  # both think attempt 1 is theirs
        a.admit("s", 1)
        with pytest.raises(AttemptClosed):
            b.admit("s", 1)
        assert b.admitted() == {"s": (1, "r1")}
    finally:
        a.close()
        b.close()


def test_an_in_memory_ledger_works_too():
    with SampleLedger() as led:
        assert led.start("s", "r") == 1
        led.admit("s", 1)
        assert led.admitted() == {"s": (1, "r")}


# ---------------------------------------------------------------- the retry window


def test_the_ledger_refuses_a_pruned_retry_by_name(path):
    """A window in steps: samples of steps the window no longer keeps are pruned; a retry of
    one (its admission pruned with it) is refused by name and never admitted again, also
    after the file is reopened, while samples inside the window are still deduplicated."""
    window = RetryWindow(steps=2)
    with SampleLedger(path, window=window) as led:
        led.advance(1)
        led.start("s1", "r1")  # belongs to step 1 (the current one)
        led.admit("s1", 1)
        led.advance(3)  # step 1 is still inside the window (3 - 2 = 1)
        with pytest.raises(AlreadyAdmitted):
            led.start("s1", "r2")
        assert led.advance(4) == 1  # now it is not: its one attempt is pruned
        assert led.attempts("s1") == [] and led.pruned_below == 2
        with pytest.raises(RetryWindowPassed, match=r"sample 's1' \(step 1\) is older than the "
                           r"ledger's retry window of 2 steps") as info:
            led.start("s1", "r3", origin=1)  # a restarted trainer retries it, naming its step
        assert info.value.reason == "retry_window_passed"
        assert isinstance(info.value, AlreadyAdmitted)  # handled as one: never admitted twice
        assert led.admitted() == {}
    with SampleLedger(path, window=window) as led:  # the watermark is in the file
        with pytest.raises(RetryWindowPassed):
            led.start("s1", "r4", origin=1)
        assert led.start("s2", "r5") == 1  # step 4's samples go on


def test_a_window_in_seconds_prunes_by_first_issue_and_stays_small(path, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("rlfleet.rollout.ledger.time.time", lambda: now[0])
    with SampleLedger(path, window=RetryWindow(seconds=60)) as led:
        for i in range(50):
            led.start(f"old-{i}", f"r{i}")
            led.admit(f"old-{i}", 1)
        now[0] += 30
        led.start("old-0-again", "x")  # first issued now
        now[0] += 40  # the first 50 are 70 s old, the last one 40 s
        assert led.prune() == 50
        assert led.size()["samples"] == 1
        with pytest.raises(RetryWindowPassed, match="issued"):
            led.start("old-3", "z", origin=1000.0)
        # an attempt of a sample still inside the window keeps its first issue time
        assert led.start("old-0-again", "x2") == 2
        assert led.attempt("old-0-again", 2) is not None


def test_an_attempt_open_when_its_sample_is_pruned_is_refused_at_admission(path):
    with SampleLedger(path, window=RetryWindow(steps=1)) as led:
        led.advance(0)
        led.start("slow", "r1")
        led.advance(2)
        with pytest.raises(AttemptClosed, match="retry window"):
            led.admit("slow", 1)


def test_a_window_needs_a_step_or_an_origin(path):
    with SampleLedger(path, window=RetryWindow(steps=3)) as led:
        with pytest.raises(ValueError, match="advance"):
            led.start("s", "r")
        assert led.start("s", "r", origin=7) == 1
    for bad in ({}, {"seconds": 1, "steps": 1}, {"steps": 0}):
        with pytest.raises(ValueError):
            RetryWindow(**bad)
