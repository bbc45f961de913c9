"""Retention over a real catalog (SQLite) and real artifacts in a directory store: what a
collection keeps (leases, workers staging and serving, the journal's last verified policy,
the chains all of those need), what it releases, evicts and forgets, and what a reader of
an evicted version is told (rlfleet.weights.retention)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from rlfleet.journal import SqliteJournal
from rlfleet.protocol.identity import PolicyIdentity
from rlfleet.weights import artifacts as art
from rlfleet.weights.catalog import Catalog, CatalogError, VersionState
from rlfleet.weights.publish import Publisher
from rlfleet.weights.retention import Retention, collect, journal_pins, plan
from rlfleet.weights.stage_transfer import StageRequestError, StageState
from rlfleet.weights.staging import StagingArea


def _tensors(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {f"layer.{i}": torch.randn(64, 64, generator=g) for i in range(4)}


@pytest.fixture
def store(tmp_path):
    """A directory store and a SQLite catalog; `publish(n, full_every)` writes versions
    v1..vn, a full one every `full_every`, the others XOR deltas on the one before."""
    root, url = tmp_path / "versions", f"sqlite://{tmp_path / 'catalog.sqlite'}"
    pub = Publisher(f"file://{root}", catalog=url, model="m")

    def publish(n: int, full_every: int = 4, start: int = 1) -> None:
        for i in range(start, start + n):
            base = None if (i - 1) % full_every == 0 else f"v{i - 1}"
            pub.publish(_tensors(i), f"v{i}", base=base)
    yield root, url, publish
    pub.close()


def _on_disk(root: Path) -> set[str]:
    return {d.name for d in root.iterdir() if (d / art.INDEX).is_file()}


async def _states(cat: Catalog) -> dict[str, str]:
    return {v.version: v.state.value for v in await cat.list()}


async def test_keeps_the_last_k_and_the_chains_they_need(store):
    root, url, publish = store
    publish(10, full_every=4)  # v1 full, v2-v4 deltas, v5 full, v6-v8, v9 full, v10
    async with Catalog(url) as cat:
        report = await collect(cat, Retention(retain=3))
        # the last three READY: v8, v9, v10; v8 needs v7, v6, v5 (its full version)
        assert set(report["kept"]) == {"v5", "v6", "v7", "v8", "v9", "v10"}, report
        assert report["kept"]["v6"] == "a base of v8" and "last 3 READY" in report["kept"]["v9"]
        assert sorted(report["evicted"]) == ["v1", "v2", "v3", "v4"], report
        states = await _states(cat)
    assert _on_disk(root) == set(report["kept"])
    assert {v for v, s in states.items() if s == "EVICTED"} == {"v1", "v2", "v3", "v4"}
    # every kept version still reads back whole, its chain replayed from the store
    storage = art.FileStorage(root)
    specs, data = art.read_version(storage, "v8")
    assert torch.equal(art.as_tensors(specs, data)["layer.0"], _tensors(8)["layer.0"])


async def test_a_delta_whose_base_was_needed_is_never_left_without_it(store):
    """A delta kept for any reason (here a worker serving it, long after newer versions
    came) keeps every link of its chain, however old, through every later collection."""
    root, url, publish = store
    publish(4, full_every=8)  # v1 full, v2..v4 deltas
    async with Catalog(url) as cat:
        await cat.add_holder("v3", "worker-7", system_url="http://127.0.0.1:1")
        publish(12, full_every=4, start=5)  # v5 full ... v16
        for _ in range(2):
            report = await collect(cat, Retention(retain=2))
            assert {"v1", "v2", "v3"} <= set(report["kept"]), report
            assert report["kept"]["v1"] == "a base of v3" and not report["broken"]
        assert "v4" in report["evicted"] or (await cat.get("v4")).state is VersionState.EVICTED
    storage = art.FileStorage(root)
    specs, data = art.read_version(storage, "v3")  # the chain v1 -> v2 -> v3 is whole
    assert torch.equal(art.as_tensors(specs, data)["layer.3"], _tensors(3)["layer.3"])


async def test_a_lease_held_across_a_gc_keeps_its_versions_bytes(store):
    root, url, publish = store
    publish(6, full_every=1)  # every version full
    async with Catalog(url) as cat:
        lease = await cat.acquire_lease("v2", "reader", ttl=30)
        report = await collect(cat, Retention(retain=2))
        assert report["kept"]["v2"] == "leased by reader", report
        assert "v2" in _on_disk(root)
        # released by hand while the lease is held: the lease stays valid, the bytes stay
        await cat.delete("v2", reason="an operator")
        report = await collect(cat, Retention(retain=2))
        assert report["kept"]["v2"] == "leased by reader" and "v2" not in report["evicted"]
        assert (await cat.renew_lease("v2", lease.lease_id, ttl=30)).expires_at > 0
        assert "v2" in _on_disk(root)
        specs, data = art.read_version(art.FileStorage(root), "v2")  # still whole
        assert len(specs) == 4
        await cat.release_lease("v2", lease.lease_id)
        report = await collect(cat, Retention(retain=2))
        assert "v2" in report["evicted"], report
        assert (await cat.get("v2")).removed_at is not None
    assert "v2" not in _on_disk(root) and not (root / "v2").exists()


async def test_a_staging_workers_version_survives_gc(store, tmp_path):
    """A worker pulling a version from the store holds a lease on it for as long as its
    transfer reads the store (rlfleet.weights.staging); a collection meanwhile keeps the
    version's bytes, and the worker ends READY with the version's digest."""
    root, url, publish = store
    publish(3, full_every=1)
    async with Catalog(url) as cat:
        digest = (await cat.get("v1")).digest
        area = StagingArea(tmp_path / "staging", catalog=cat, worker_id="w1",
                           allowed_roots=[str(root)])
        h = await area.stage("v1", {"kind": "disk", "path": str(root / "v1"),
                                    "max_bytes_per_s": 40_000}, applied=(None, None))
        for _ in range(200):  # until the worker's lease is there
            if (await cat.get("v1")).live_leases():
                break
            await asyncio.sleep(0.01)
        assert h.state is StageState.STAGING
        report = await collect(cat, Retention(retain=1))
        assert report["kept"]["v1"] == "leased by w1", report
        assert "v2" in report["evicted"] and "v1" in _on_disk(root)
        await asyncio.wait_for(h.done.wait(), 30)
        assert h.state is StageState.READY and h.digest == digest, h.error
        assert not (await cat.get("v1")).live_leases()  # let go once its transfer ended
        report = await collect(cat, Retention(retain=1))
        assert "v1" in report["evicted"], report
        await area.close()


async def test_an_evicted_version_still_listed_is_refused_by_name(store, tmp_path):
    root, url, publish = store
    publish(3, full_every=1)
    async with Catalog(url) as cat:
        await collect(cat, Retention(retain=1))
        assert (await cat.get("v1")).state is VersionState.EVICTED
        area = StagingArea(tmp_path / "staging", catalog=cat, worker_id="w1",
                           allowed_roots=[str(root)])
        with pytest.raises(StageRequestError, match="version v1 is EVICTED in the catalog"):
            await area.stage("v1", {"kind": "disk", "path": str(root / "v1")},
                             applied=(None, None))
        with pytest.raises(CatalogError, match="lease is granted only on a READY"):
            await cat.acquire_lease("v1", "w1")
        await area.close()


async def test_dry_run_changes_nothing_and_tombstones_are_bounded(store):
    root, url, publish = store
    publish(8, full_every=1)
    async with Catalog(url) as cat:
        before = await _states(cat)
        dry = await collect(cat, Retention(retain=2), dry_run=True)
        assert sorted(dry["evict"]) == [f"v{i}" for i in range(1, 7)] and not dry["evicted"]
        assert await _states(cat) == before and _on_disk(root) == set(before)
        await collect(cat, Retention(retain=2, tombstones=2))
        report = await collect(cat, Retention(retain=2, tombstones=2))
        # six evicted; the newest two stay as tombstones, the rest are forgotten
        assert sorted(report["forgotten"]) == ["v1", "v2", "v3", "v4"], report
        assert await _states(cat) == {"v5": "EVICTED", "v6": "EVICTED", "v7": "READY",
                                      "v8": "READY"}


async def test_a_collection_cut_short_is_finished_by_the_next(store):
    """Marked EVICTED, its bytes not yet removed (the process died between the two): the next
    collection removes them and records it."""
    root, url, publish = store
    publish(3, full_every=1)
    async with Catalog(url) as cat:
        await cat.delete("v1")
        assert await cat.evict("v1")  # no remover: as if the process stopped right there
        assert "v1" in _on_disk(root) and (await cat.get("v1")).removed_at is None
        report = await collect(cat, Retention(retain=2))
        assert report["finished"] == ["v1"] and "v1" not in _on_disk(root)


def test_journal_pins_name_the_last_verified_policy_and_holdings(tmp_path):
    with SqliteJournal(tmp_path / "j.sqlite") as j:
        rid, _ = j.open_transaction(fleet="f", model="m", update_path="vllm-staged",
                                    target=PolicyIdentity(version="v3", digest="d3"))
        j.update(rid, ended_at=1.0, decision="reopened",
                 served=PolicyIdentity(version="v3", digest="d3"),
                 workers={"1": {"holds": {"version": "v3", "digest": "d3"}},
                          "2": {"holds": {"version": "v2", "digest": "d2"}}})
        j.open_transaction(fleet="f", model="m", update_path="vllm-staged",
                           target=PolicyIdentity(version="v4", digest="d4"),
                           previous=PolicyIdentity(version="v3", digest="d3"))
        pins = journal_pins(j)
    assert "last verified policy" in pins["v3"] and "worker 2" in pins["v2"]
    assert "unfinished refresh" in pins["v4"]


def test_plan_keeps_a_pinned_version_and_its_chain(store):
    root, url, publish = store
    publish(6, full_every=3)  # v1 full, v2, v3; v4 full, v5, v6

    async def listing():
        async with Catalog(url) as cat:
            return await cat.list()
    p = plan(asyncio.run(listing()), Retention(retain=1),
             pins={"v2": "the last verified policy"})
    assert p.kept == {"v6": "one of the last 1 READY versions", "v2": "the last verified policy",
                      "v5": "a base of v6", "v4": "a base of v6", "v1": "a base of v2"}
    assert sorted(p.release) == ["v3"] and p.evict == ["v3"]
    with pytest.raises(ValueError, match="at least 1"):
        Retention(retain=0)


def test_rlfleet_weights_gc_and_list(store, capsys):
    import json

    from rlfleet.cli import main

    root, url, publish = store
    publish(4, full_every=1)
    assert main(["weights", "gc", "--catalog", url, "--retain-versions", "2", "--dry-run"]) == 0
    dry = json.loads(capsys.readouterr().out)
    assert dry["dry_run"] and sorted(dry["evict"]) == ["v1", "v2"] and not dry["evicted"]
    assert main(["weights", "gc", "--catalog", url, "--retain-versions", "2"]) == 0
    assert sorted(json.loads(capsys.readouterr().out)["evicted"]) == ["v1", "v2"]
    assert main(["weights", "list", "--catalog", url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["v1", "EVICTED"] and "retention: not kept" in lines[0]
    assert lines[3].split()[:2] == ["v4", "READY"]
    assert _on_disk(root) == {"v3", "v4"}


async def test_a_holder_the_journal_no_longer_sees_keeps_nothing(store, tmp_path):
    """A worker killed without a clean stop never takes its name off the versions it held;
    given the workers the journal saw lately, such a holder is not counted."""
    from rlfleet.weights.retention import journal_workers

    root, url, publish = store
    publish(4, full_every=1)
    async with Catalog(url) as cat:
        await cat.add_holder("v1", "111", system_url="http://127.0.0.1:1")  # killed long ago
        await cat.add_holder("v2", "222", system_url="http://127.0.0.1:2")  # serving
        with SqliteJournal(tmp_path / "j.sqlite") as j:
            rid, _ = j.open_transaction(fleet="f", model="m", update_path="vllm-staged")
            j.update(rid, ended_at=1.0, decision="reopened",
                     workers={"222": {"holds": {"version": "v2", "digest": "d2"}}})
            alive = journal_workers(j)
        assert alive == {"222"}
        report = await collect(cat, Retention(retain=1), workers=alive)
        assert "v1" in report["evicted"] and report["kept"]["v2"].startswith("held applied")



async def test_a_handle_applied_while_its_lease_is_let_go_keeps_its_copy(store, tmp_path):
    """The soak's four held refreshes: a READY handle applied while its transfer still let go
    of the catalog lease (an etcd round trip on a loaded box) had its directory, now the
    resident copy, removed, and the next delta found no base."""
    root, url, publish = store
    publish(1)
    gate = asyncio.Event()

    class SlowRelease(Catalog):
        async def release_lease(self, version: str, lease_id: str) -> None:
            await gate.wait()
            await super().release_lease(version, lease_id)

    async with SlowRelease(url) as cat:
        area = StagingArea(tmp_path / "staging", catalog=cat, worker_id="w1",
                           allowed_roots=[str(root)])
        h = await area.stage("v1", {"kind": "disk", "path": str(root / "v1")},
                             applied=(None, None))
        for _ in range(500):
            if h.state is StageState.READY:
                break
            await asyncio.sleep(0.01)
        assert h.state is StageState.READY and not h.done.is_set()  # the lease still held
        await area.applied(h.handle)
        gate.set()
        await asyncio.wait_for(h.done.wait(), 10)
        assert (area.resident.dir / art.INDEX).is_file()
        await area.close()
