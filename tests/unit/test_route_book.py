"""The RL listener probes a worker's /engine route list once per worker life: once per
(instance ID, system URL), again only when either changes or after a failed probe, and
concurrent listings share one probe (rlfleet.frontend.rl.RouteBook)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rlfleet.frontend.rl import RouteBook


def counting_probe(fail: set[str]) -> tuple[Any, list[str]]:
    """A probe answered here: the system URLs in `fail` fail as an HTTP error would, the
    others list their routes; each probe's host is recorded."""
    asked: list[str] = []

    async def probe(system_url: str) -> list[str]:
        host = system_url.removeprefix("http://")
        asked.append(host)
        await asyncio.sleep(0.01)  # long enough for concurrent listings to overlap
        if host in fail:
            raise ValueError(f"GET {system_url}/engine answered HTTP 500")
        return sorted({"pause_generation", "get_weight_version"})
    return probe, asked


async def test_a_worker_is_probed_once_per_instance_and_system_url() -> None:
    probe, asked = counting_probe(set())
    book = RouteBook(timeout=5, concurrency=4, probe=probe)
    for _ in range(3):  # three listings of the same two workers (a refresh's three phases)
        got = await asyncio.gather(book.routes(1, "http://a"), book.routes(2, "http://b"))
        assert got == [["get_weight_version", "pause_generation"]] * 2
    assert sorted(asked) == ["a", "b"] and book.probes == 2
    await book.routes(1, "http://a2")  # the same instance moved its system server
    await book.routes(3, "http://b")  # a new life behind the same URL
    assert sorted(asked) == ["a", "a2", "b", "b"]


async def test_concurrent_listings_share_one_probe() -> None:
    probe, asked = counting_probe(set())
    book = RouteBook(timeout=5, concurrency=4, probe=probe)
    await asyncio.gather(*(book.routes(7, "http://w") for _ in range(10)))
    assert asked == ["w"]


async def test_a_failed_probe_is_tried_again_at_the_next_listing() -> None:
    fail = {"w"}
    probe, asked = counting_probe(fail)
    book = RouteBook(timeout=5, concurrency=4, probe=probe)
    for _ in range(2):
        with pytest.raises(ValueError, match="HTTP 500"):
            await book.routes(7, "http://w")
    assert asked == ["w", "w"]
    fail.clear()  # the worker answers now
    assert await book.routes(7, "http://w") == ["get_weight_version", "pause_generation"]
    assert await book.routes(7, "http://w") == ["get_weight_version", "pause_generation"]
    assert asked == ["w", "w", "w"]


async def test_a_worker_no_longer_listed_is_forgotten() -> None:
    probe, asked = counting_probe(set())
    book = RouteBook(timeout=5, concurrency=4, probe=probe)
    await book.routes(1, "http://a")
    await book.routes(2, "http://b")
    book.keep({(2, "http://b")})  # worker 1 left the listing
    await book.routes(2, "http://b")
    await book.routes(1, "http://a")  # it is back (listed again): probed again
    assert sorted(asked) == ["a", "a", "b"]
