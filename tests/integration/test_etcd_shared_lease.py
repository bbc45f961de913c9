"""The etcd store's registrations of one TTL share one lease per client, kept alive by one
keep-alive loop whatever their number (a real etcd of this module's own, so that its
leases can be counted exactly)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from aetcd import rpc

from rlfleet.runtime.discovery import DiscoveryError, EtcdDiscovery
from rlfleet.testing.etcd import discovery_entry, run_etcd

TTL = 3.0  # a keep-alive every second; above etcd's shortest lease


@pytest.fixture(scope="module")
def etcd_url() -> Iterator[str]:
    with run_etcd() as url:
        yield url


async def leases(d: EtcdDiscovery) -> set[int]:
    """Every lease etcd holds now."""
    await d.list("-")  # connected
    reply = await d._call("leases", lambda c: c.leasestub.LeaseLeases(rpc.LeaseLeasesRequest()))
    return {lease.ID for lease in reply.leases}


async def leases_of_keys(d: EtcdDiscovery, ns: str) -> dict[str, int]:
    """etcd key -> the lease it is attached to, for every key of `ns`."""
    prefix = d._etcd_key(f"{ns}/")
    result = await d._call("list", lambda c: c.get_prefix(prefix))
    return {kv.key.decode(): kv.lease for kv in result.kvs}


async def lease_ttl(d: EtcdDiscovery, lease_id: int) -> int:
    """The lease's remaining seconds (-1: etcd does not know it)."""
    return (await d._call("ttl", lambda c: c.get_lease_info(lease_id, keys=False))).TTL


async def register_many(d: EtcdDiscovery, ns: str, n: int, ttl: float = TTL) -> list[Any]:
    return list(await asyncio.gather(*(d.register(discovery_entry(ns, i=i), ttl=ttl)
                                       for i in range(n))))


def count_calls(d: EtcdDiscovery, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count `d`'s etcd calls by their first word (keep-alive, put, grant, ...)."""
    counts: dict[str, int] = {}
    real = d._call

    async def counting(what: str, fn: Any) -> Any:
        word = what.split()[0]
        counts[word] = counts.get(word, 0) + 1
        return await real(what, fn)
    monkeypatch.setattr(d, "_call", counting)
    return counts


async def test_two_hundred_registrations_share_one_lease(etcd_pair, ns: str) -> None:
    writer, other = etcd_pair
    before = await leases(other)
    regs = await register_many(writer, ns, 200)
    on_keys = await leases_of_keys(other, ns)
    assert len(on_keys) == 200
    assert set(on_keys.values()) == {regs[0]._lease.id}
    assert await leases(other) - before == {regs[0]._lease.id}  # one lease granted, not 200
    info = await other._call("keys", lambda c: c.get_lease_info(regs[0]._lease.id))
    assert len(info.keys) == 200
    await writer.close()  # closing the client revokes it
    assert not await leases(other) - before
    assert await leases_of_keys(other, ns) == {}


async def test_one_keep_alive_per_period_whatever_the_number(etcd_pair, ns: str,
                                                             monkeypatch) -> None:
    writer, other = etcd_pair
    regs = await register_many(writer, ns, 200)
    lease_id = regs[0]._lease.id
    calls = count_calls(writer, monkeypatch)
    await asyncio.sleep(2 * TTL + 0.5)  # six periods of ttl/3, past two whole ttls
    print(f"etcd calls by 200 registrations over {2 * TTL + 0.5:g} s: {calls}")
    assert 5 <= calls.get("keep-alive", 0) <= 7, calls  # one per period, not one per entry
    assert set(calls) == {"keep-alive"}, calls  # nothing put again, nothing granted
    assert len(await other.list(ns)) == 200
    assert set((await leases_of_keys(other, ns)).values()) == {lease_id}


@pytest.mark.parametrize("how", ["revoked", "not kept alive for a whole ttl"])
async def test_a_lost_lease_brings_every_entry_back_under_a_new_one(etcd_pair, ns: str,
                                                                    how: str) -> None:
    writer, other = etcd_pair
    regs = await register_many(writer, ns, 50)
    lapsed: list[int] = []

    async def rejoin(e: dict[str, Any]) -> dict[str, Any]:
        lapsed.append(e["i"])
        return {**e, "rejoined": True}
    for reg in regs:
        reg.on_lapse = rejoin
    lease = regs[0]._lease
    old = lease.id
    if how == "revoked":  # from another client: etcd deletes the 50 keys at once
        await other._call("revoke", lambda c: c.revoke_lease(old))
        assert await other.list(ns) == []
    else:  # as if the process had been stopped (SIGSTOP) for longer than its ttl
        lease.kept -= 2 * TTL

    async def back() -> bool:
        got = await other.list(ns)
        return len(got) == 50 and all(e.get("rejoined") for e in got)
    for _ in range(100):
        if await back():
            break
        await asyncio.sleep(0.1)
    assert await back()
    assert sorted(lapsed) == list(range(50))  # each one's on_lapse, once
    assert lease.id not in (0, old)
    assert set((await leases_of_keys(other, ns)).values()) == {lease.id}
    assert all(reg._lease_id == lease.id and not reg._lost for reg in regs)


async def test_an_update_after_the_lease_is_gone_grants_a_new_one(etcd_pair, ns: str) -> None:
    writer, other = etcd_pair
    a, b = await register_many(writer, ns, 2)
    old = a._lease.id
    await other._call("revoke", lambda c: c.revoke_lease(old))
    await a.update({**a.entry, "load": 1})  # put under a new lease at once
    assert a._lease.id not in (0, old)
    assert list((await leases_of_keys(other, ns)).values()) == [a._lease.id]
    await asyncio.sleep(TTL / 3 + 0.5)  # the keep-alive puts the other one under it too
    assert set((await leases_of_keys(other, ns)).values()) == {a._lease.id}
    assert len(await other.list(ns)) == 2


async def test_closing_one_keeps_the_other_and_the_last_revokes(etcd_pair, ns: str) -> None:
    writer, other = etcd_pair
    a, b = await register_many(writer, ns, 2)
    lease_id = a._lease.id
    await a.close()
    assert [e["i"] for e in await other.list(ns)] == [b.entry["i"]]  # its key only
    assert await lease_ttl(other, lease_id) > 0
    await asyncio.sleep(2 * TTL)
    assert [e["i"] for e in await other.list(ns)] == [b.entry["i"]]  # kept alive
    await b.close()
    assert await other.list(ns) == []
    assert await lease_ttl(other, lease_id) == -1  # revoked
    assert lease_id not in await leases(other)
    assert writer._leases == {}
    c = await writer.register(discovery_entry(ns, i=2), ttl=TTL)  # a new lease for it
    assert c._lease.id not in (0, lease_id)
    await c.close()


async def test_each_ttl_has_a_lease_of_its_own(etcd_pair, ns: str) -> None:
    writer, other = etcd_pair
    short = await register_many(writer, ns, 2, ttl=TTL)
    long = await register_many(writer, ns, 2, ttl=2 * TTL)
    assert short[0]._lease is short[1]._lease and long[0]._lease is long[1]._lease
    assert short[0]._lease.id != long[0]._lease.id
    assert len(set((await leases_of_keys(other, ns)).values())) == 2
    assert await lease_ttl(other, long[0]._lease.id) > TTL
    short_id = short[0]._lease.id
    for reg in short:
        await reg.close()
    assert await lease_ttl(other, short_id) == -1
    await asyncio.sleep(TTL + 0.5)
    assert len(await other.list(ns)) == 2  # the long ones, kept alive by their own lease


async def test_a_call_that_ignores_its_cancellation_still_ends_at_its_deadline(
        etcd_pair, ns: str, monkeypatch) -> None:
    """`asyncio.wait_for` waits for a cancelled call to end; a gRPC call that does not
    (one held a keep-alive, and the test closing it, for 20 minutes on CI) must not hold
    the caller past the deadline, nor the client's close."""
    writer, _ = etcd_pair
    monkeypatch.setattr(writer, "deadline", 0.3)
    release = asyncio.Event()

    async def deaf() -> None:  # swallows every cancellation until released
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(DiscoveryError, match="timed out after 0.3s"):
        await writer._call("a deaf call", lambda c: deaf())
    assert loop.time() - started < 0.3 + 0.5 + 0.5  # the deadline, the grace, slack
    assert len(writer._stuck) == 1  # left running, not awaited
    reg = await writer.register(discovery_entry(ns, i=0), ttl=TTL)
    real = writer._call

    async def keepalive_goes_deaf(what: str, fn: Any) -> Any:
        return await real(what, (lambda c: deaf()) if what.startswith("keep-alive") else fn)
    monkeypatch.setattr(writer, "_call", keepalive_goes_deaf)
    await asyncio.sleep(TTL / 3 + 0.1)  # a keep-alive is in its deaf call now
    started = loop.time()
    await reg.close()  # cancels that keep-alive, deletes the key, revokes the lease
    assert loop.time() - started < 1.0
    release.set()
    await asyncio.sleep(0.05)
    assert not writer._stuck  # each ended once it listened


async def test_a_watch_that_ignores_its_cancellation_does_not_hold_its_follower(
        etcd_pair, ns: str, monkeypatch) -> None:
    """A follower that stops (a frontend's pool, a test's) drops its watch; a watch stream
    that does not end once cancelled held a pool's stop for 20 minutes in a fresh-clone
    run. Dropping it waits at most a second for it."""
    from rlfleet.runtime.discovery.etcd import _EtcdView

    reader, writer = etcd_pair
    release = asyncio.Event()

    async def deaf_pump(self: Any, watch: Any) -> None:  # swallows every cancellation
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue
    monkeypatch.setattr(_EtcdView, "_run", deaf_pump)
    await writer.register(discovery_entry(ns, i=0), ttl=TTL)
    follow = reader.follow(ns)
    first = await asyncio.wait_for(follow.__anext__(), 10)  # listed, and watching
    assert len(first.entries) == 1
    loop = asyncio.get_running_loop()
    started = loop.time()
    await asyncio.wait_for(follow.aclose(), 10)
    assert loop.time() - started < 1.0 + 0.5 + 0.5  # the bound, the grace, slack
    assert len(reader._stuck) == 1  # left running, not awaited
    release.set()
    await asyncio.sleep(0.05)
    assert not reader._stuck
