"""The refresh journal as a later coordinator reads it: the last verified policy of one
fleet, what each worker was last seen holding, and journals written before those columns."""

from __future__ import annotations

import sqlite3

from rlfleet.rl.journal import Journal

FLEET = "http://127.0.0.1:8001"


def served(j: Journal, version: str, *, fleet: str = FLEET, model: str | None = "m",
           workers: dict | None = None, verified: list[int] = (1, 2)) -> int:
    rid = j.begin(update_path="vllm-disk", fleet=fleet, model=model, target_version=version)
    j.update(rid, decision="reopened", served_version=version, served_digest=f"d:{version}",
             served_path=f"/ckpt/{version}", verified_workers=list(verified),
             workers=workers or {})
    return rid


def test_last_served_skips_held_refreshes_and_other_fleets(tmp_path) -> None:
    j = Journal(tmp_path / "j.sqlite")
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


def test_holdings_are_the_newest_seen_per_worker(tmp_path) -> None:
    j = Journal(tmp_path / "j.sqlite")
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
