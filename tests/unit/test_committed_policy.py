"""The committed policy (issue 23): the record a refresh coordinator publishes per model in
the discovery store, and the frontend's pool routing only to workers that serve it."""

from __future__ import annotations

import pytest

from rlfleet.frontend.router import NoWorker, WorkerPool
from rlfleet.protocol.identity import PolicyIdentity
from rlfleet.protocol.rl import CommittedPolicy
from rlfleet.refresh import committed
from rlfleet.runtime.discovery import FileDiscovery, open_discovery

OLD = PolicyIdentity(version="A", digest="d-a", step=0)
NEW = PolicyIdentity(version="B", digest="d-b", step=1)


def entry(iid: int, policy: PolicyIdentity, model: str = "m") -> dict:
    return {"namespace": "ns", "component": "backend", "endpoint": "generate",
            "instance_id": iid, "model": model, "transport": {"http": f"http://w{iid}"},
            "stream_plane": f"127.0.0.1:{iid}", "gated": False, **policy.stamped()}


def test_a_worker_serves_the_committed_policy_by_digest_and_step():
    rec = CommittedPolicy(model="m", epoch=3, refresh_id=7, committed=NEW)
    assert rec.binding and rec.serves(NEW)
    assert not rec.serves(OLD)
    # the same weights without the step (started from the committed checkpoint): served
    assert rec.serves(PolicyIdentity(version="B", digest="d-b", step=None))
    assert not rec.serves(PolicyIdentity())  # says nothing about its weights
    rolling = CommittedPolicy(model="m", epoch=4, refresh_id=8, committed=OLD, admitting=NEW)
    assert rolling.serves(OLD) and rolling.serves(NEW)
    assert CommittedPolicy(model="m", epoch=1, refresh_id=1, admitting=NEW).serves(OLD)
    assert CommittedPolicy.from_record(rolling.to_record()) == rolling
    assert "epoch 4" in rolling.describe() and "admitting B" in rolling.describe()


async def test_records_live_beside_the_entries_and_never_in_listings(tmp_path):
    async with FileDiscovery(tmp_path) as d:
        assert await d.get_record("ns/committed-policy/Qwen/Qwen3") is None
        await d.register(entry(1, OLD), ttl=30)
        await d.put_record("ns/committed-policy/Qwen/Qwen3", {"x": 1})
        await d.put_record("ns/committed-policy/Qwen/Qwen3", {"x": 2})  # replaced
        assert await d.get_record("ns/committed-policy/Qwen/Qwen3") == {"x": 2}
        listing = await d.listing()
        assert [e["instance_id"] for e in listing.entries] == [1] and not listing.skipped
        for bad in ("", "a//b", "../x", "/abs"):
            with pytest.raises(ValueError, match="record name"):
                await d.put_record(bad, {})
        with pytest.raises(TypeError):
            await d.put_record("ns/x", ["not", "an", "object"])
        path = d._record_path("ns/broken")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\xff not json")
        assert await d.get_record("ns/broken") is None  # logged, not fatal


async def test_the_pool_routes_only_to_workers_on_the_committed_policy(tmp_path):
    url = tmp_path.as_uri()
    async with open_discovery(url) as d:
        pool = WorkerPool(d, "ns")
        pool.update([entry(1, NEW), entry(2, OLD)])
        await pool.read_committed({"m"})
        pool.update([entry(1, NEW), entry(2, OLD)])
        assert {pool.pick("m").instance_id for _ in range(4)} == {1, 2}  # nothing published

        async def publish(epoch: int, committed_: PolicyIdentity | None,
                          admitting: PolicyIdentity | None = None, seen: int = 0) -> bool:
            return await committed.publish(url, "ns", ["m"], epoch=epoch, refresh_id=epoch,
                                           committed=committed_, admitting=admitting,
                                           seen_epoch=seen, on_event=events.append)

        events: list[str] = []
        assert await publish(2, OLD, NEW)  # a transaction under way: both serve
        await pool.read_committed({"m"})
        pool.update([entry(1, NEW), entry(2, OLD)])
        assert {pool.pick("m").instance_id for _ in range(4)} == {1, 2}
        assert await publish(2, NEW)  # committed: worker 2 was left out
        await pool.read_committed({"m"})
        pool.update([entry(1, NEW), entry(2, OLD)])
        assert {pool.pick("m").instance_id for _ in range(6)} == {1}
        assert pool.workers[2].off_policy and not pool.workers[2].usable
        assert "committed policy B" in pool.workers[2].off_policy
        with pytest.raises(NoWorker) as e:
            pool.pick("m", exclude={1})
        assert e.value.status == 503 and "other than the committed one" in e.value.message
        assert await publish(1, OLD, seen=2)  # a taken-over coordinator's: left as it is
        assert any("newer fleet epoch" in m for m in events)
        await pool.read_committed({"m"})
        assert pool.committed["m"].committed == NEW
        pool.update([entry(1, NEW), entry(2, NEW)])  # worker 2 admitted onto the policy
        assert {pool.pick("m").instance_id for _ in range(4)} == {1, 2}


async def test_publishing_without_a_store_or_into_a_broken_one_never_fails_a_refresh(tmp_path):
    events: list[str] = []
    kw = dict(epoch=1, refresh_id=1, committed=NEW, admitting=None, on_event=events.append)
    assert not await committed.publish(None, "ns", ["m"], **kw)
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert not await committed.publish((blocker / "sub").as_uri(), "ns", ["m"], **kw)
    assert events and "could not publish the committed policy" in events[-1]


async def test_a_record_of_an_epoch_no_worker_has_seen_is_an_earlier_fleets(tmp_path):
    """A new fleet with a new journal counts epochs from 1 again: the record an earlier
    fleet left (epoch 9, which no worker of this one reports) is replaced."""
    url, events = tmp_path.as_uri(), []
    kw = dict(refresh_id=1, admitting=None, on_event=events.append)
    assert await committed.publish(url, "ns", ["m"], epoch=9, committed=OLD, seen_epoch=9, **kw)
    assert await committed.publish(url, "ns", ["m"], epoch=1, committed=NEW, seen_epoch=0, **kw)
    async with open_discovery(url) as d:
        raw = await d.get_record(CommittedPolicy.record_name("ns", "m"))
    assert CommittedPolicy.from_record(raw).committed == NEW
    assert any("an earlier fleet's" in m for m in events)


async def test_a_commit_read_with_one_workers_change_re_judges_the_workers_left_unchanged(
        tmp_path):
    """The refreshed worker's reopen is the change that brings the new record in: the
    worker left out of the commit (its entry unchanged) is taken out of routing then too,
    and the poller, reading the same record later, finds nothing new to re-judge."""
    url = tmp_path.as_uri()
    async with open_discovery(url) as d:
        pool = WorkerPool(d, "ns")
        await pool._apply_changes({"k1": entry(1, OLD), "k2": entry(2, OLD)})
        assert pool.workers[1].usable and pool.workers[2].usable
        assert await committed.publish(url, "ns", ["m"], epoch=1, refresh_id=1,
                                       committed=NEW, admitting=None, on_event=[].append)
        await pool._apply_changes({"k1": entry(1, NEW)})  # only worker 1 reopened
        assert pool.workers[1].usable
        assert not pool.workers[2].usable
        assert "committed policy B" in pool.workers[2].off_policy
        assert await pool.read_committed({"m"}) == set()  # nothing new for the poller
        with pytest.raises(NoWorker):
            pool.pick("m", exclude={1})
        await pool._apply_changes({"k2": None})  # worker 2 leaves: the others untouched
        assert set(pool.workers) == {1} and pool.workers[1].usable
