"""The refresh journal as a later coordinator reads it: the last verified policy of one
fleet, what each worker was last seen holding, unfinished transactions, the fleet epoch
taken with a compare-and-set, the policies a record names as PolicyIdentity, in both stores
(SQLite, etcd), journals written before those columns, and the status page as a reader."""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from rlfleet.frontend.status import FleetStatus
from rlfleet.journal import (
    POLICY_ROLES,
    EtcdJournal,
    JournalMissing,
    RefreshJournal,
    SqliteJournal,
    open_journal,
)
from rlfleet.journal.record import COLUMNS, IDENTITY_FIELDS, policy_column
from rlfleet.protocol.identity import PolicyIdentity

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
    rid = j.begin(update_path="vllm-disk", fleet=fleet, model=model,
                  target=PolicyIdentity(version=version))
    j.update(rid, decision="reopened", served=PolicyIdentity(version=version,
                                                             digest=f"d:{version}"),
             served_path=f"/ckpt/{version}", verified_workers=list(verified),
             workers=workers or {})
    return rid


def test_last_served_skips_held_refreshes_and_other_fleets(journal) -> None:
    j = journal
    assert j.last_served(FLEET, "m") is None
    first = served(j, "A")
    served(j, "Z", fleet="http://elsewhere:8001")
    served(j, "Y", model=None)
    held = j.begin(update_path="vllm-disk", fleet=FLEET, model="m",
                   target=PolicyIdentity(version="B"))
    j.update(held, decision="held", workers={
        "1": {"holds": {"version": "B", "digest": "d:B"}},
        "2": {"holds": None}})
    row = j.last_served(FLEET, "m")
    assert row["id"] == first and (row["served_version"], row["served_path"]) == ("A", "/ckpt/A")
    assert row["verified_workers"] == [1, 2]
    assert j.last_served(FLEET, None).served.version == "Y"


def test_holdings_are_the_newest_seen_per_worker(journal) -> None:
    j = journal
    served(j, "A", workers={"1": {"holds": {"version": "A", "digest": "d:A"}},
                            "2": {"holds": {"version": "A", "digest": "d:A"}}})
    held = j.begin(update_path="vllm-disk", fleet=FLEET, model="m")
    j.update(held, decision="held", workers={"1": {"holds": {"version": "B", "digest": "d:B"}},
                                             "3": {"holds": None}})
    assert j.holdings(FLEET, "m") == {1: PolicyIdentity(version="B", digest="d:B"),
                                      2: PolicyIdentity(version="A", digest="d:A")}
    assert j.holdings("other", "m") == {}


def holds(version: str) -> dict:
    return {"holds": {"version": version, "digest": f"d:{version}"}}


def test_holdings_follow_this_journals_writes_and_another_coordinators(journal) -> None:
    """What a journal read once (and keeps) changes with its own later writes and with
    another journal's on the same store (another coordinator's)."""
    j = journal
    served(j, "A", workers={"1": holds("A"), "2": holds("A")})
    assert j.holdings(FLEET, "m") == {1: PolicyIdentity(version="A", digest="d:A"),
                                      2: PolicyIdentity(version="A", digest="d:A")}
    mine = j.begin(update_path="vllm-disk", fleet=FLEET, model="m")
    j.update(mine, workers={"1": holds("B"), "3": holds("B")})
    assert j.holdings(FLEET, "m") == {1: PolicyIdentity(version="B", digest="d:B"),
                                      2: PolicyIdentity(version="A", digest="d:A"),
                                      3: PolicyIdentity(version="B", digest="d:B")}
    other = open_journal(j.path)
    try:
        served(other, "C", workers={"2": holds("C")})
        assert other.holdings(FLEET, "m")[2] == PolicyIdentity(version="C", digest="d:C")
    finally:
        other.close()
    assert j.holdings(FLEET, "m") == {1: PolicyIdentity(version="B", digest="d:B"),
                                      2: PolicyIdentity(version="C", digest="d:C"),
                                      3: PolicyIdentity(version="B", digest="d:B")}
    assert j.last_served(FLEET, "m").served.version == "C"


def test_sqlite_holdings_kept_in_memory_are_what_the_records_say(tmp_path) -> None:
    """SQLite reads holdings from the records (the newest record with a worker's holds):
    a record rewritten without a worker's holds gives it back to older records, and a
    record moved to another model selection takes its holdings along."""
    j = SqliteJournal(tmp_path / "j.sqlite")
    served(j, "A", workers={"1": holds("A"), "2": holds("A")})
    mine = j.begin(update_path="vllm-disk", fleet=FLEET, model="m")
    j.update(mine, workers={"1": holds("B"), "3": holds("B")})
    assert set(j.holdings(FLEET, "m")) == {1, 2, 3}
    j.update(mine, workers={"1": {"holds": None}, "3": holds("B")})
    assert j.holdings(FLEET, "m") == {1: PolicyIdentity(version="A", digest="d:A"),
                                      2: PolicyIdentity(version="A", digest="d:A"),
                                      3: PolicyIdentity(version="B", digest="d:B")}
    assert j.holdings(FLEET, "other") == {}
    j.update(mine, model="other")
    assert j.holdings(FLEET, "other") == {3: PolicyIdentity(version="B", digest="d:B")}
    assert set(j.holdings(FLEET, "m")) == {1, 2}
    j.close()


def test_the_last_served_record_without_its_workers(journal) -> None:
    j = journal
    rid = served(j, "A", workers={"1": holds("A")})
    brief, full = j.last_served(FLEET, "m", workers=False), j.last_served(FLEET, "m")
    assert full["workers"] == {"1": holds("A")} and brief["workers"] == {}
    assert {k: v for k, v in brief.items() if k != "workers"} == \
        {k: v for k, v in full.items() if k != "workers"}
    assert brief["id"] == rid and brief.served == PolicyIdentity(version="A", digest="d:A")


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
    j = SqliteJournal(path)
    assert j.get(1)["decision"] == "reopened" and j.get(1)["verified_workers"] == []
    assert j.last_served(FLEET, "m") is None
    served(j, "A")
    assert j.last_served(FLEET, "m").served.version == "A"


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
    assert isinstance(open_journal(tmp_path / "a.sqlite"), SqliteJournal)
    assert isinstance(open_journal(f"sqlite://{tmp_path}/b.sqlite"), SqliteJournal)
    assert (tmp_path / "b.sqlite").exists()
    assert open_journal(":memory:").path == ":memory:"
    j = open_journal(etcd_url)
    assert isinstance(j, EtcdJournal) and j.path == etcd_url
    j.close()
    with pytest.raises(ValueError, match="unsupported journal"):
        open_journal("s3://bucket/journal")


def _full_identity(n: int) -> PolicyIdentity:
    """An identity with every field of PolicyIdentity known (a field added to it is too)."""
    kinds = {"TEXT": f"text-{n}", "INTEGER": n, "REAL": n + 0.5}
    return PolicyIdentity(**{f: kinds[t] for f, t in IDENTITY_FIELDS.items()})


def test_every_policy_of_a_record_round_trips_as_a_policy_identity(journal) -> None:
    """target, previous and served are written and read as PolicyIdentity, every field of it
    in its own column (`<role>_<field>`), in both stores."""
    j = journal
    assert set(IDENTITY_FIELDS) == set(PolicyIdentity.__struct_fields__)
    assert {policy_column(r, f) for r in POLICY_ROLES for f in IDENTITY_FIELDS} <= set(COLUMNS)
    target, previous = _full_identity(1), _full_identity(2)
    rid, _ = j.open_transaction(fleet=FLEET, model="m", update_path="p", target=target,
                                previous=previous)
    opened = j.get(rid)
    assert (opened.target, opened.previous) == (target, previous)
    assert not opened.served and opened.served == PolicyIdentity()
    assert j.last_served(FLEET, "m") is None  # not ended on a verified policy
    j.update(rid, ended_at=1.0, decision="reopened", served=target)
    for row in (j.get(rid), j.recent(1)[0], j.last_served(FLEET, "m")):
        assert (row.target, row.previous, row.served) == (target, previous, target)
        assert row["served_version"] == target.version  # the columns `rlfleet journal` prints
    # a held refresh: no served policy
    held, _ = j.open_transaction(fleet=FLEET, model="m", update_path="p", target=previous,
                                 previous=target)
    j.update(held, ended_at=2.0, decision="held", served=None)
    assert not j.get(held).served and j.last_served(FLEET, "m")["id"] == rid


def test_a_policy_is_written_through_its_role_only(journal) -> None:
    j = journal
    with pytest.raises(ValueError, match="served=PolicyIdentity"):
        j.open_transaction(fleet=FLEET, update_path="p", served_digest="d:A")
    rid = j.begin(update_path="p", fleet=FLEET)
    with pytest.raises(ValueError, match="target=PolicyIdentity"):
        j.update(rid, target_version="B")
    with pytest.raises(ValueError, match="no column 'colour'"):
        j.update(rid, colour="blue")
    assert j.get(rid).target == PolicyIdentity()


# the schema as the journal before one record mapping wrote it (issue 21): every column but
# target_step and previous_step
BEFORE_MAPPING = """CREATE TABLE refreshes (id INTEGER PRIMARY KEY AUTOINCREMENT,
    started_at REAL NOT NULL, ended_at REAL, framework_step INTEGER, fleet TEXT, model TEXT,
    update_path TEXT NOT NULL, target_path TEXT, target_version TEXT, target_digest TEXT,
    previous_version TEXT, previous_digest TEXT, served_version TEXT, served_digest TEXT,
    served_path TEXT, verified_workers TEXT NOT NULL DEFAULT '[]',
    intended_workers TEXT NOT NULL DEFAULT '[]', decision TEXT, reason TEXT,
    steps TEXT NOT NULL DEFAULT '[]', workers TEXT NOT NULL DEFAULT '{}', kind TEXT,
    fleet_epoch INTEGER, state TEXT, served_step INTEGER, target_source TEXT,
    served_source TEXT, recovery_of INTEGER)"""


def test_a_journal_written_before_the_record_mapping_opens(tmp_path) -> None:
    path = tmp_path / "before.sqlite"
    db = sqlite3.connect(path)
    db.execute(BEFORE_MAPPING)
    db.execute("CREATE TABLE fleet_epochs (fleet TEXT PRIMARY KEY, epoch INTEGER NOT NULL)")
    db.execute("INSERT INTO fleet_epochs VALUES (?, 3)", (FLEET,))
    db.execute("INSERT INTO refreshes (started_at, ended_at, fleet, model, update_path, "
               "target_version, target_digest, previous_version, served_version, "
               "served_digest, served_step, served_source, verified_workers, fleet_epoch, "
               "decision) VALUES (1.0, 2.0, ?, 'm', 'vllm-staged', 'B', 'd:B', 'A', 'B', 'd:B',"
               " 4, '{\"kind\": \"disk\"}', '[1]', 3, 'reopened')", (FLEET,))
    db.commit()
    db.close()
    with SqliteJournal(path) as j:
        row = j.last_served(FLEET, "m")
        assert row.served == PolicyIdentity(version="B", digest="d:B", step=4)
        assert row.target == PolicyIdentity(version="B", digest="d:B")
        assert row.previous == PolicyIdentity(version="A")
        assert row["served_source"] == {"kind": "disk"} and row["verified_workers"] == [1]
        _, epoch = j.open_transaction(fleet=FLEET, model="m", update_path="p",
                                      target=PolicyIdentity(version="C", step=5))
        assert epoch == 4 and j.recent(1)[0].target.step == 5


def test_a_reader_does_not_make_a_journal(tmp_path) -> None:
    """`rlfleet journal` and the status page open with create=False: a missing file is
    JournalMissing, and stays missing."""
    for spec in (tmp_path / "none.sqlite", f"sqlite://{tmp_path}/none2.sqlite"):
        with pytest.raises(JournalMissing, match="no journal at"):
            open_journal(spec, create=False)
    assert list(tmp_path.iterdir()) == []
    with open_journal(tmp_path / "made.sqlite") as j:
        j.begin(update_path="p")
    with open_journal(tmp_path / "made.sqlite", create=False) as j:
        assert [r["id"] for r in j.recent()] == [1]


class _NoWorkers:
    """A discovery store with no entries (the status page's other source)."""

    async def list(self, namespace: str, endpoint: str | None = None) -> list:
        return []


def _status(journal: str | None) -> dict:
    async def snap() -> dict:
        async with httpx.AsyncClient() as http:
            return await FleetStatus(_NoWorkers(), "ns", http, journal).snapshot()
    return asyncio.run(snap())


def test_the_status_page_reads_the_journal_it_is_given(tmp_path) -> None:
    """A SQLite journal here (the etcd one: tests/integration/test_observability.py): none
    yet shows no refreshes and makes no file; a store that fails is said in `error`."""
    path = tmp_path / "j.sqlite"
    assert _status(str(path))["refreshes"] == [] and not path.exists()
    with open_journal(path) as j:
        rid = j.begin(update_path="vllm-disk", model="m",
                      target=PolicyIdentity(version="B", digest="d:B"))
        j.update(rid, ended_at=2.0, decision="reopened", steps=[{"name": "apply",
                                                                "seconds": 0.12345}])
    snap = _status(str(path))
    assert snap["error"] is None and snap["journal"] == str(path)
    assert snap["refreshes"] == [{
        "id": rid, "started_at": snap["refreshes"][0]["started_at"], "ended_at": 2.0,
        "model": "m", "update_path": "vllm-disk", "target_version": "B",
        "target_digest": "d:B", "decision": "reopened", "reason": None,
        "steps": [{"name": "apply", "seconds": 0.123}]}]
    assert _status(None)["refreshes"] == []
    broken = _status("s3://bucket/journal")
    assert broken["refreshes"] == [] and "journal failed: unsupported journal" in broken["error"]
