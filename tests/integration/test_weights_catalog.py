"""The version catalog's lifecycle, the same tests on the SQLite store and on a real etcd."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from rlfleet.weights.catalog import (
    TRANSITIONS,
    Catalog,
    CatalogConflict,
    CatalogError,
    PayloadFormat,
    VersionState,
    open_store,
)

DIGEST = "blake3:" + "ab" * 32


@pytest.fixture(params=["sqlite", "etcd"])
async def catalog(request, tmp_path):
    if request.param == "sqlite":
        url = f"sqlite://{tmp_path / 'catalog.sqlite'}"
    else:
        url = request.getfixturevalue("etcd_url")
    store = open_store(url)
    if request.param == "etcd":  # one etcd serves every test: a fresh key space each
        store.prefix = f"/rlfleet-test/{uuid.uuid4().hex}/"
    cat = Catalog(store)
    yield cat
    await cat.close()


async def _full(cat: Catalog, version: str = "v1", parts=("shard", "index"), **kw):
    return await cat.create(model="m", version=version, format="full", digest=DIGEST,
                            locations=[f"s3://b/p/{version}"], size=100, parts=parts, **kw)


def test_every_state_has_its_transitions():
    assert set(TRANSITIONS) == set(VersionState)
    assert TRANSITIONS[VersionState.EVICTED] == frozenset()
    assert VersionState.READY not in TRANSITIONS[VersionState.RELEASING]


async def test_create_replay_and_conflicts(catalog):
    v = await _full(catalog, idempotency_key="k1")
    assert v.state is VersionState.STAGING and v.format is PayloadFormat.FULL
    again = await _full(catalog, idempotency_key="k1")  # the same request: replayed
    assert again.to_json() == v.to_json()
    with pytest.raises(CatalogConflict, match="different request.*digest"):
        await catalog.create(model="m", version="v1", format="full", digest="blake3:" + "cd" * 32,
                             locations=["s3://b/p/v1"], size=100, parts=("shard", "index"),
                             idempotency_key="k1")
    with pytest.raises(CatalogConflict, match="already created version v1"):
        await _full(catalog, "v2", idempotency_key="k1")
    with pytest.raises(CatalogConflict, match="already exists"):
        await _full(catalog, idempotency_key="k2")
    with pytest.raises(CatalogError, match="needs its base_version"):
        await catalog.create(model="m", version="d", format="xor-delta", digest=DIGEST)
    assert [x.version for x in await catalog.list()] == ["v1"]


async def test_concurrent_creates_under_one_key_make_one_version(catalog):
    results = await asyncio.gather(*(_full(catalog, f"v{i}", idempotency_key="same")
                                     for i in range(4)), return_exceptions=True)
    made = [r for r in results if not isinstance(r, BaseException)]
    assert len(made) == 1
    assert all(isinstance(r, CatalogConflict) for r in results if isinstance(r, BaseException))
    assert len(await catalog.list()) == 1


async def test_ready_only_when_every_part_is_published(catalog):
    await _full(catalog, parts=("a", "b", "index"))
    for part in ("a", "b"):
        v = await catalog.publish_part("v1", part)
        assert v.state is VersionState.STAGING
    with pytest.raises(CatalogError, match="is STAGING: a lease is granted only on a READY"):
        await catalog.acquire_lease("v1", "w0")
    with pytest.raises(CatalogError, match="no part 'c'"):
        await catalog.publish_part("v1", "c")
    v = await catalog.publish_part("v1", "index")
    assert v.state is VersionState.READY and v.ready_at is not None
    ready_at = v.ready_at
    v = await catalog.publish_part("v1", "index")  # a replay changes nothing
    assert v.state is VersionState.READY and v.ready_at == ready_at


async def test_parts_published_concurrently_flip_ready_once(catalog):
    parts = [f"p{i}" for i in range(6)]
    await _full(catalog, parts=parts)
    results = await asyncio.gather(*(catalog.publish_part("v1", p) for p in parts))
    assert sum(r.state is VersionState.READY for r in results) >= 1
    v = await catalog.get("v1")
    assert v.state is VersionState.READY and all(v.parts.values())


async def test_a_lease_protects_a_version_from_eviction(catalog):
    await _full(catalog, parts=("index",))
    await catalog.publish_part("v1", "index")
    lease = await catalog.acquire_lease("v1", "worker-1", ttl=30)
    removed = []
    with pytest.raises(CatalogError, match="delete it first"):
        await catalog.evict("v1", removed.append)
    v = await catalog.delete("v1")
    assert v.state is VersionState.RELEASING
    assert not await catalog.evict("v1", removed.append)  # the lease holds it
    assert removed == [] and (await catalog.get("v1")).state is VersionState.RELEASING
    await catalog.release_lease("v1", lease.lease_id)
    await catalog.release_lease("v1", lease.lease_id)  # idempotent
    assert await catalog.evict("v1", removed.append)
    assert [v.version for v in removed] == ["v1"]
    assert (await catalog.get("v1")).state is VersionState.EVICTED
    assert not await catalog.evict("v1", removed.append)
    assert len(removed) == 1


async def test_releasing_never_breaks_an_install_under_way(catalog):
    """An install holds a lease; deleting the version meanwhile keeps the lease valid and
    renewable, refuses new leases, and the bytes stay until the install lets go."""
    await _full(catalog, parts=("index",))
    await catalog.publish_part("v1", "index")
    install = await catalog.acquire_lease("v1", "installing-worker", ttl=30)
    await catalog.delete("v1")
    await catalog.delete("v1")  # idempotent
    renewed = await catalog.renew_lease("v1", install.lease_id, ttl=30)
    assert renewed.expires_at >= install.expires_at
    with pytest.raises(CatalogError, match="RELEASING: a lease is granted only on a READY"):
        await catalog.acquire_lease("v1", "another-worker")
    assert not await catalog.evict("v1")
    await catalog.release_lease("v1", install.lease_id)
    assert await catalog.evict("v1")
    with pytest.raises(CatalogError, match="EVICTED: leases can be renewed only"):
        await catalog.renew_lease("v1", install.lease_id)


async def test_an_expired_lease_neither_renews_nor_protects(catalog):
    await _full(catalog, parts=("index",))
    await catalog.publish_part("v1", "index")
    lease = await catalog.acquire_lease("v1", "w", ttl=0.2)
    await catalog.delete("v1")
    time.sleep(0.3)
    with pytest.raises(CatalogError, match="expired"):
        await catalog.renew_lease("v1", lease.lease_id)
    assert await catalog.evict("v1")


async def test_holders_and_delta_chains(catalog):
    await _full(catalog, "f0", parts=("index",))
    await catalog.publish_part("f0", "index")
    base = "f0"
    for i in range(1, 4):
        await catalog.create(model="m", version=f"d{i}", format="xor-delta", digest=DIGEST,
                             base_version=base, parts=("index",))
        await catalog.publish_part(f"d{i}", "index")
        base = f"d{i}"
    chain = await catalog.chain("d3")
    assert [v.version for v in chain] == ["f0", "d1", "d2", "d3"]
    with pytest.raises(CatalogError, match="longer than 2"):
        await catalog.chain("d3", max_length=2)
    await catalog.add_holder("d3", "w1", system_url="http://127.0.0.1:1")
    await catalog.add_holder("d3", "w2", system_url="http://127.0.0.1:2")
    await catalog.remove_holder("d3", "w1")
    assert list((await catalog.get("d3")).holders) == ["w2"]
    await catalog.create(model="m", version="d4", format="xor-delta", digest=DIGEST,
                         base_version="d3", parts=("index",))
    with pytest.raises(CatalogError, match="needs d4, which is STAGING"):
        await catalog.chain("d4")
    with pytest.raises(CatalogError, match="not in the catalog"):
        await catalog.get("nope")
