"""The etcd store's watch applies etcd's events in revision order to one listing: it lists
the prefix once, and again only when the watch is lost or compacted (a real etcd)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from rlfleet.runtime.discovery import open_discovery
from rlfleet.testing.etcd import discovery_entry, free_port, run_etcd

Entries = list[dict[str, Any]]


async def until(watch: AsyncIterator[Entries], pred: Callable[[Entries], bool],
                timeout: float, seen: list[Entries] | None = None) -> Entries:
    """The first list the watch yields that satisfies `pred` (each one is kept in `seen`)."""
    async def loop() -> Entries:
        async for entries in watch:
            if seen is not None:
                seen.append(entries)
            if pred(entries):
                return entries
        raise AssertionError("the watch ended")
    return await asyncio.wait_for(loop(), timeout)


async def test_events_are_applied_in_order_without_listing_again(etcd_pair, ns: str) -> None:
    reader, writer = etcd_pair
    async with contextlib.aclosing(reader.watch(ns, interval=0.02)) as watch:
        assert await until(watch, lambda _: True, 10) == []
        lists = reader.lists
        assert lists == 1
        regs = [await writer.register(discovery_entry(ns, load=0), ttl=10) for _ in range(12)]
        hot = regs[0]
        seen: list[Entries] = []
        for load in range(1, 60):  # one key replaced 59 times in a row
            await hot.update({**hot.entry, "load": load})
        for reg in regs[8:]:
            await reg.close()
        bad = writer._etcd_key(f"{ns}/worker/generate/7")
        await writer._call("put", lambda c: c.put(bad, b'{"namespace": 3}'))
        final = await writer.list(ns)
        got = await until(watch, lambda es: es == final, 10, seen)
        assert [e["load"] for e in got if e["instance_id"] == hot.entry["instance_id"]] == [59]
        # every view the watch yielded is a state etcd went through: the hot key's load
        # never goes back (events applied in revision order)
        loads = [e["load"] for es in seen for e in es
                 if e["instance_id"] == hot.entry["instance_id"]]
        assert loads == sorted(loads)
        skipped = (await reader.listing(ns)).skipped
        assert [s.key for s in skipped] == [f"{ns}/worker/generate/7"]
        assert reader.lists == lists + 1  # that listing() was the only other one
        await writer._call("delete", lambda c: c.delete(bad))
        for reg in regs[:8]:
            await reg.close()
        assert await until(watch, lambda es: es == [], 10) == []
        assert reader.lists == lists + 1


async def test_a_compaction_before_the_watch_starts_costs_one_listing(etcd_pair, ns: str,
                                                                      monkeypatch) -> None:
    """The revisions after the first listing are compacted before its watch is created:
    the watch is refused (compacted), the store is listed once more, and the watch from
    that listing's revision carries on with events only."""
    reader, writer = etcd_pair
    early, late = discovery_entry(ns, n=1), discovery_entry(ns, n=2)
    real_range = reader._range
    compacted: list[int] = []

    async def range_then_compact(prefix: bytes) -> Any:
        result = await real_range(prefix)
        if not compacted:  # etcd moves on and compacts between the listing and the watch
            await writer._call("put", lambda c: c.put(writer._etcd_key(
                f"{ns}/worker/generate/{early['instance_id']}"), _json(early)))
            put = await writer._call("put", lambda c: c.put(writer._etcd_key(
                f"{ns}/worker/generate/{late['instance_id']}"), _json(late)))
            await writer._call("compact", lambda c: c.compact(put.header.revision))
            compacted.append(put.header.revision)
        return result

    monkeypatch.setattr(reader, "_range", range_then_compact)
    async with contextlib.aclosing(reader.watch(ns, interval=0.02)) as watch:
        got = await until(watch, lambda es: len(es) == 2, 15)
        assert sorted(e["n"] for e in got) == [1, 2]
        assert compacted and reader.lists == 2  # the first listing, and one after the compaction
        reg = await writer.register(discovery_entry(ns, n=3), ttl=10)
        got = await until(watch, lambda es: len(es) == 3, 10)
        assert reader.lists == 2  # the new entry came as an event
        await reg.close()
        await writer._call("delete", lambda c: c.delete_prefix(writer._etcd_key(f"{ns}/")))
        assert await until(watch, lambda es: es == [], 10) == []
        assert reader.lists == 2


def _json(e: dict[str, Any]) -> bytes:
    return json.dumps(e).encode()


async def test_a_lapsed_lease_leaves_the_view_within_its_ttl(etcd_pair, ns: str) -> None:
    reader, writer = etcd_pair
    ttl = 2.0  # etcd's shortest lease
    async with contextlib.aclosing(reader.watch(ns, interval=0.02)) as watch:
        reg = await writer.register(discovery_entry(ns), ttl=ttl)
        await until(watch, lambda es: len(es) == 1, 10)
        task = reg._lease._task  # the keep-alive of the lease it shares (alone here)
        assert task is not None
        task.cancel()  # the owner stops (hangs, or its host goes away): no keep-alive
        stopped = time.monotonic()
        await until(watch, lambda es: es == [], 3 * ttl)
        took = time.monotonic() - stopped
        print(f"lease of {ttl:g} s lapsed: out of the view {took:.2f} s after the last "
              "keep-alive could have been sent")
        assert reader.lists == 1  # etcd's delete event, no listing
        with contextlib.suppress(Exception):
            await reg.close()


async def test_a_thousand_entries_put_make_the_view_equal_etcds(etcd_pair, ns: str) -> None:
    reader, writer = etcd_pair
    n = 1024
    async with contextlib.aclosing(reader.watch(ns, interval=0.05)) as watch:
        assert await until(watch, lambda _: True, 10) == []
        regs = []
        for start in range(0, n, 128):
            regs += await asyncio.gather(*(writer.register(discovery_entry(ns, i=i), ttl=30)
                                           for i in range(start, start + 128)))
        in_etcd = await writer.list(ns)
        assert len(in_etcd) == n
        assert await until(watch, lambda es: es == in_etcd, 30) == in_etcd
        assert reader.lists == 1
        # a frontend that starts now lists the 1,024 once and agrees
        late = open_discovery(reader.url)
        try:
            async with contextlib.aclosing(late.watch(ns, interval=0.05)) as second:
                assert await until(second, lambda _: True, 10) == in_etcd
            assert late.lists == 1
        finally:
            await late.close()
        for start in range(0, n, 128):
            await asyncio.gather(*(reg.close() for reg in regs[start:start + 128]))
        assert await until(watch, lambda es: es == [], 30) == []
        assert reader.lists == 1


async def test_a_lost_watch_costs_one_listing_then_events_again(tmp_path, ns: str) -> None:
    """etcd restarts (same data): the watch breaks, the view is listed once when etcd is
    back, and the changes after that come by event."""
    port = free_port()
    with run_etcd(client_port=port, data_dir=tmp_path / "etcd") as url:
        reader, writer = open_discovery(url), open_discovery(url)
        first = discovery_entry(ns, n=1)
        reg = await writer.register(first, ttl=30)
        watch = reader.watch(ns, interval=0.05)
        assert await until(watch, lambda es: len(es) == 1, 10) == [first]
        assert reader.lists == 1
    try:
        with run_etcd(client_port=port, data_dir=tmp_path / "etcd"):
            second = await writer.register(discovery_entry(ns, n=2), ttl=30)
            got = await until(watch, lambda es: len(es) == 2, 20)
            assert sorted(e["n"] for e in got) == [1, 2]
            lists = reader.lists
            assert lists == 2, lists  # one listing after the watch was lost
            await second.close()
            assert await until(watch, lambda es: len(es) == 1, 10) == [first]
            assert reader.lists == lists
            await reg.close()
    finally:
        await watch.aclose()
        await writer.close()
        await reader.close()
