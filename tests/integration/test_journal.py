"""The refresh journal as a later coordinator reads it: the last verified policy of one
fleet, what each worker was last seen holding, unfinished transactions, the fleet epoch
taken with a compare-and-set, in both stores (SQLite, etcd), and journals written before
those columns."""

from __future__ import annotations

import sqlite3
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from rlfleet.rl.journal import EtcdJournal, Journal, RefreshJournal, open_journal

FLEET = "http://127.0.0.1:8001"


@pytest.fixture(params=["sqlite", "etcd"])
def journal(request, tmp_path):
    if request.param == "sqlite":
        j = open_journal(tmp_path / "j.sqlite")
    else:
        j = open_journal(f"{request.getfixturevalue('etcd_url')}/{uuid.uuid4().hex[:8]}")
    yield j
    j.close()


def served(j: RefreshJournal, version: str, *, fleet: str = FLEET, model: str | None = "m",
           workers: dict | None = None, verified: list[int] = (1, 2)) -> int:
    rid = j.begin(update_path="vllm-disk", fleet=fleet, model=model, target_version=version)
    j.update(rid, decision="reopened", served_version=version, served_digest=f"d:{version}",
             served_path=f"/ckpt/{version}", verified_workers=list(verified),
             workers=workers or {})
    return rid


def test_last_served_skips_held_refreshes_and_other_fleets(journal) -> None:
    j = journal
    assert j.last_served(FLEET, "m") is None
    first = served(j, "A")
    served(j, "Z", fleet="http://elsewhere:8001")
    served(j, "Y", model=None)
    held = j.begin(update_path="vllm-disk", fleet=FLEET, model="m", target_version="B")
    j.update(held, decision="held", workers={
        "1": {"holds": {"version": "B", "digest": "d:B"}},
        "2": {"holds": None}})
    row = j.last_served(FLEET, "m")
    assert row["id"] == first and (row["served_version"], row["served_path"]) == ("A", "/ckpt/A")
    assert row["verified_workers"] == [1, 2]
    assert j.last_served(FLEET, None)["served_version"] == "Y"


def test_holdings_are_the_newest_seen_per_worker(journal) -> None:
    j = journal
    served(j, "A", workers={"1": {"holds": {"version": "A", "digest": "d:A"}},
                            "2": {"holds": {"version": "A", "digest": "d:A"}}})
    held = j.begin(update_path="vllm-disk", fleet=FLEET, model="m")
    j.update(held, decision="held", workers={"1": {"holds": {"version": "B", "digest": "d:B"}},
                                             "3": {"holds": None}})
    assert j.holdings(FLEET, "m") == {1: {"version": "B", "digest": "d:B"},
                                      2: {"version": "A", "digest": "d:A"}}
    assert j.holdings("other", "m") == {}


def test_a_journal_from_before_gets_the_new_columns(tmp_path) -> None:
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE refreshes (id INTEGER PRIMARY KEY AUTOINCREMENT, started_at REAL "
               "NOT NULL, ended_at REAL, framework_step INTEGER, update_path TEXT NOT NULL, "
               "target_path TEXT, target_version TEXT, target_digest TEXT, previous_version "
               "TEXT, previous_digest TEXT, intended_workers TEXT NOT NULL DEFAULT '[]', "
               "decision TEXT, reason TEXT, steps TEXT NOT NULL DEFAULT '[]', workers TEXT NOT "
               "NULL DEFAULT '{}')")
    db.execute("INSERT INTO refreshes (started_at, update_path, decision) "
               "VALUES (1.0, 'vllm-disk', 'reopened')")
    db.commit()
    db.close()
    j = Journal(path)
    assert j.get(1)["decision"] == "reopened" and j.get(1)["verified_workers"] == []
    assert j.last_served(FLEET, "m") is None
    served(j, "A")
    assert j.last_served(FLEET, "m")["served_version"] == "A"


def test_each_transaction_takes_the_next_epoch_of_its_fleet(journal) -> None:
    j = journal
    assert j.fleet_epoch(FLEET) == 0
    first, e1 = j.open_transaction(fleet=FLEET, model="m", update_path="vllm-disk")
    _, e2 = j.open_transaction(fleet=FLEET, model="m", update_path="vllm-disk")
    _, other = j.open_transaction(fleet="http://elsewhere:8001", model="m",
                                  update_path="vllm-disk")
    assert (e1, e2, other) == (1, 2, 1) and j.fleet_epoch(FLEET) == 2
    # a store behind its fleet (the workers report epoch 9) catches up
    _, e3 = j.open_transaction(fleet=FLEET, model="m", floor_epoch=9, update_path="vllm-disk")
    assert e3 == 10 and j.get(first)["fleet_epoch"] == 1 and j.get(first)["state"] == "started"


def test_concurrent_coordinators_never_share_an_epoch(journal, tmp_path) -> None:
    """Eight coordinators (threads, each with its own connection to the store) opening
    transactions at once: every epoch is taken exactly once."""
    where = journal.path

    def take(_: int) -> list[int]:
        j = open_journal(where) if where != ":memory:" else journal
        try:
            return [j.open_transaction(fleet=FLEET, model="m", update_path="p")[1]
                    for _ in range(5)]
        finally:
            j.close()

    with ThreadPoolExecutor(8) as pool:
        epochs = [e for batch in pool.map(take, range(8)) for e in batch]
    assert sorted(epochs) == list(range(1, 41))


def test_unfinished_transactions_and_updates_only_while_open(journal) -> None:
    j = journal
    done, _ = j.open_transaction(fleet=FLEET, model="m", update_path="p")
    j.update(done, ended_at=1.0, decision="reopened")
    crashed, e = j.open_transaction(fleet=FLEET, model="m", update_path="p", state="paused")
    j.open_transaction(fleet=FLEET, model="other", update_path="p")
    newer, e_new = j.open_transaction(fleet=FLEET, model="m", update_path="p")
    assert [r["id"] for r in j.unfinished(FLEET, "m", e_new)] == [crashed]
    assert j.unfinished(FLEET, "m", e) == []
    # the successor records the recovery; the taken-over coordinator cannot overwrite it
    assert j.update(crashed, ended_at=2.0, decision="recovered", reason="by the next one")
    assert not j.update(crashed, only_open=True, decision="held", reason="late")
    assert j.get(crashed)["decision"] == "recovered"
    assert j.update(newer, only_open=True, state="paused") and j.get(newer)["state"] == "paused"
    assert j.unfinished(FLEET, "m", e_new + 1) == [j.get(newer)]
    assert [r["id"] for r in j.recent(2)] == [newer, newer - 1]


def test_open_journal_names(tmp_path, etcd_url) -> None:
    assert isinstance(open_journal(tmp_path / "a.sqlite"), Journal)
    assert isinstance(open_journal(f"sqlite://{tmp_path}/b.sqlite"), Journal)
    assert (tmp_path / "b.sqlite").exists()
    assert open_journal(":memory:").path == ":memory:"
    j = open_journal(etcd_url)
    assert isinstance(j, EtcdJournal) and j.path == etcd_url
    j.close()
    with pytest.raises(ValueError, match="unsupported journal"):
        open_journal("s3://bucket/journal")
