"""What keeps N etcd registrations of one process alive: the etcd calls it makes per
keep-alive period, and whether the entries stay alive while the process's event loop is
busy (a simulator of many workers in the middle of a refresh), on a throw-away etcd.

    python bench/etcd_leases.py [--registrations 2048] [--ttl 6] [--seconds 30] [--busy 0.6]

--busy: the share of each 100 ms the event loop is blocked (a synchronous sleep), as if
the process were computing. Counted: the keep-alive calls, their slowest, the discovery
warnings (a keep-alive failing, a lease lapsing or lost), the entries a second client
lists at the end, and the process's CPU seconds. The last line is one JSON object."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
import uuid
from typing import Any

from rlfleet.runtime.discovery import EtcdDiscovery, new_instance_id, open_discovery
from rlfleet.testing.etcd import run_etcd


class Warnings(logging.Handler):
    """Counts the discovery warnings by what they say."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts = {"failed": 0, "lapsed": 0, "lost": 0}

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        for word, needle in (("failed", "failed"), ("lapsed", "lapsed"),
                             ("lapsed", "not kept alive"), ("lost", "was lost")):
            if needle in text:
                self.counts[word] += 1
                return


async def busy(share: float) -> None:
    """Block the event loop for `share` of every 100 ms."""
    while True:
        time.sleep(0.1 * share)
        await asyncio.sleep(0.1 * (1 - share))


async def run(url: str, a: argparse.Namespace) -> dict[str, Any]:
    d, reader = open_discovery(url), open_discovery(url)
    assert isinstance(d, EtcdDiscovery)
    ns = f"bench-{uuid.uuid4().hex[:8]}"
    for start in range(0, a.registrations, 128):
        await asyncio.gather(*(d.register({"namespace": ns, "component": "worker",
                                           "endpoint": "generate",
                                           "instance_id": new_instance_id()}, ttl=a.ttl)
                               for _ in range(start, min(a.registrations, start + 128))))
    calls: dict[str, int] = {}
    slowest = 0.0
    real = d._call

    async def counting(what: str, fn: Any) -> Any:
        nonlocal slowest
        word = what.split()[0]
        calls[word] = calls.get(word, 0) + 1
        t0 = time.monotonic()
        try:
            return await real(what, fn)
        finally:
            if word == "keep-alive":
                slowest = max(slowest, time.monotonic() - t0)
    d._call = counting  # type: ignore[method-assign]
    warned = Warnings()
    logger = logging.getLogger("rlfleet.runtime.discovery")
    logger.setLevel(logging.WARNING)
    logger.propagate = False  # counted, not printed
    logger.addHandler(warned)
    hog = asyncio.get_running_loop().create_task(busy(a.busy)) if a.busy > 0 else None
    c0 = time.process_time()
    await asyncio.sleep(a.seconds)
    cpu = time.process_time() - c0
    if hog is not None:
        hog.cancel()
    listed = len(await reader.list(ns))
    await d.close()
    await reader.close()
    periods = a.seconds / (a.ttl / 3)
    return {"registrations": a.registrations, "ttl": a.ttl, "seconds": a.seconds,
            "busy": a.busy, "calls": calls,
            "keepalive_calls_per_period": round(calls.get("keep-alive", 0) / periods, 1),
            "slowest_keepalive_s": round(slowest, 3), "warnings": warned.counts,
            "listed_at_end": listed, "cpu_s": round(cpu, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--registrations", type=int, default=2048)
    p.add_argument("--ttl", type=float, default=6.0)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--busy", type=float, default=0.6)
    a = p.parse_args()
    logging.basicConfig(level=logging.ERROR)
    with run_etcd() as url:
        print(json.dumps(asyncio.run(run(url, a))))


if __name__ == "__main__":
    main()
