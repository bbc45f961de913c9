"""A journal that stays the same size however long the run (rlfleet.journal.base
.JournalBounds), in both stores: old transactions compacted to summaries, then folded into
the history; never an unfinished one (recovery finds every one) nor a fleet's last verified
one; workers' entries in etcd kept in batches of their own; and an etcd with a small quota
that never reaches NOSPACE over many transactions (the journal compacts etcd's history)."""

from __future__ import annotations

import uuid

import pytest

from rlfleet.journal import EtcdJournal, JournalBounds, SqliteJournal, open_journal
from rlfleet.protocol.identity import PolicyIdentity
from rlfleet.testing.etcd import etcd_status, run_etcd

FLEET = "http://127.0.0.1:8001"
BOUNDS = JournalBounds(keep_full=3, keep_summaries=4)


@pytest.fixture(params=["sqlite", "etcd"])
def journal(request, tmp_path):
    if request.param == "sqlite":
        j = SqliteJournal(tmp_path / "j.sqlite", bounds=BOUNDS)
    else:
        host, port = request.getfixturevalue("etcd_url").removeprefix("etcd://").split(":")
        j = EtcdJournal(host, int(port), uuid.uuid4().hex[:8], bounds=BOUNDS)
    yield j
    j.close()


def _workers(version: str, n: int = 2, calls: int = 1) -> dict:
    return {str(i): {"instance_id": i, "status": "verified",
                     "holds": {"version": version, "digest": f"d:{version}"},
                     "calls": [{"route": "commit_policy", "body": "x" * 200}] * calls}
            for i in range(1, n + 1)}


def _refresh(j, version: str, decision: str = "reopened", end: bool = True,
             workers: dict | None = None) -> int:
    rid, _ = j.open_transaction(fleet=FLEET, model="m", update_path="vllm-staged",
                                target=PolicyIdentity(version=version, digest=f"d:{version}"))
    j.update(rid, state="paused", steps=[{"name": "pause", "seconds": 0.1}])
    if end:
        served = PolicyIdentity(version=version, digest=f"d:{version}") \
            if decision == "reopened" else None
        j.update(rid, only_open=True, ended_at=2.0, decision=decision, served=served,
                 served_path=f"/ckpt/{version}" if served else None,
                 workers=workers if workers is not None else _workers(version))
    return rid


def test_old_transactions_are_compacted_then_folded(journal) -> None:
    j = journal
    verified = _refresh(j, "v0")  # the last verified one, for ever after
    stuck = _refresh(j, "v1", end=False)  # a coordinator died in it
    for i in range(2, 16):
        _refresh(j, f"v{i}", decision="held")
    size = j.size()
    # 16 transactions: the newest 3 whole, 4 summaries, the rest folded; the unfinished one
    # and the last verified one stay (as records) however old
    assert size["full"] <= BOUNDS.keep_full + 1 and size["summaries"] <= BOUNDS.keep_summaries + 2
    assert size["records"] + size["folded"] == 16 and size["folded"] >= 7, size
    [history] = j.history()
    assert history["fleet"] == FLEET and history["model"] == "m"
    assert history["decisions"] == {"held": size["folded"]} and history["first_id"] > verified
    # recovery still finds the unfinished one, and a rollback the last verified policy
    assert [r["id"] for r in j.unfinished(FLEET, "m", 1 << 62)] == [stuck]
    last = j.last_served(FLEET, "m", workers=False)
    assert last["id"] == verified and last.served.version == "v0" and last["compacted"] == 1
    assert last["served_path"] == "/ckpt/v0"
    recent = j.recent(20)
    assert [r["id"] for r in recent][:3] == [16, 15, 14]
    assert all(not r["compacted"] and r["workers"] and r["steps"] for r in recent[:3])
    summary = next(r for r in recent if r["compacted"])
    assert summary["workers"] == {} and summary["steps"] == [] and summary["decision"] == "held"
    # holdings come from the transactions kept whole
    assert j.holdings(FLEET, "m")[1] == PolicyIdentity(version="v15", digest="d:v15")
    # the unfinished one ends: it is compacted, then folded, like the others
    j.update(stuck, only_open=True, ended_at=3.0, decision="recovered")
    for i in range(16, 26):
        _refresh(j, f"v{i}", decision="held")
    assert stuck not in {r["id"] for r in j.recent(40)}
    assert sum(h["transactions"] for h in j.history()) == j.size()["folded"]
    assert j.history()[0]["decisions"]["recovered"] == 1


def test_the_journal_url_sets_the_bounds(tmp_path, etcd_url) -> None:
    j = open_journal(f"sqlite://{tmp_path}/j.sqlite?keep_full=5&keep_summaries=7")
    assert j.bounds == JournalBounds(5, 7)
    j.close()
    e = open_journal(f"{etcd_url}/x?keep_full=2&keep_revisions=0")
    assert e.bounds == JournalBounds(2, JournalBounds().keep_summaries)
    assert e.keep_revisions is None
    e.close()
    for bad in ("?keep_full=x", "?keep=1", "?keep_full=0"):
        with pytest.raises(ValueError, match="keep"):
            open_journal(f"sqlite://{tmp_path}/k.sqlite{bad}")


def test_a_record_of_many_workers_is_kept_in_batches(etcd_url) -> None:
    """etcd refuses a value (and a request) over 1.5 MiB; a thousand workers' entries are
    about 3 MB: kept in batches of their own, and a record read without them reads none."""
    host, port = etcd_url.removeprefix("etcd://").split(":")
    with EtcdJournal(host, int(port), uuid.uuid4().hex[:8]) as j:
        many = _workers("big", n=1024, calls=12)
        rid = _refresh(j, "big", workers=many)
        assert j.get(rid)["workers"] == many
        assert j.last_served(FLEET, "m", workers=False)["workers"] == {}
        assert len(j.holdings(FLEET, "m")) == 1024
        fewer = _workers("big", n=3)
        j.update(rid, workers=fewer)  # rewritten smaller: the batches past it go
        assert j.get(rid)["workers"] == fewer and j.recent(1)[0]["workers"] == fewer


def test_an_etcd_with_a_small_quota_never_reaches_nospace() -> None:
    """Many transactions of 64 workers each through an etcd whose quota is 6 MiB: the
    journal writes four times the quota, keeps its records bounded and compacts etcd's
    history behind it, so no write is refused (NOSPACE would raise JournalError; without
    the compaction it comes after about 25 of these transactions)."""
    quota = 6 << 20
    with run_etcd(extra_args=["--quota-backend-bytes", str(quota)]) as url:
        host, port = url.removeprefix("etcd://").split(":")
        j = EtcdJournal(host, int(port), "quota", bounds=JournalBounds(8, 16),
                        keep_revisions=20, compact_every=2)
        written = 0
        try:
            for i in range(130):
                workers = _workers(f"v{i}", n=64, calls=6)
                rid = _refresh(j, f"v{i}", workers=workers)
                j.update(rid, reason="x" * 100, workers=workers)  # written twice
                written += 2 * len(str(workers))
            status = etcd_status(url)
        finally:
            j.close()
    assert written > 4 * quota, written  # without compaction this fills the quota 4 times
    assert status["dbSize"] < quota, status


def test_rlfleet_journal_says_what_was_compacted(tmp_path, capsys) -> None:
    from rlfleet.cli import main

    with SqliteJournal(tmp_path / "j.sqlite", bounds=JournalBounds(2, 3)) as j:
        for i in range(10):
            _refresh(j, f"v{i}", decision="held")
    assert main(["journal", "--journal", str(tmp_path / "j.sqlite"), "--limit", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("#10 ") and "(summary)" not in out[0]
    assert out[2].startswith("#8 ") and "(summary)" in out[2]
    assert "marked (summary)" in out[4] and "5 older folded into the history" in out[4]
    assert out[5] == f"  fleet {FLEET} model m: 5 transaction(s) #1-#5 (held 5)"
