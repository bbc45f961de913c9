"""A rollback after a retention collection reinstalls the last verified policy (issue 43), on
a fleet of mocker workers (the declared simulator: what is checked is the weight plane and
the refresh lifecycle) refreshed on the staged path from a directory store: the fleet is
verified on v3, every worker is replaced (the new ones hold nothing), versions v4..v8 are
published with retention keeping one version (v5 full: v4 goes), and a refresh to v8 fails
on one worker: the coordinator rolls the fleet back to v3, staged again from the store, its
chain replayed.
Retention kept v3 (and the versions its chain needs) because the journal names it; without
the journal it would have been evicted."""

from __future__ import annotations

import asyncio
import time

import httpx
import torch

from rlfleet.journal import SqliteJournal
from rlfleet.refresh.coordinator import PolicyRefresh
from rlfleet.weights.catalog import Catalog
from rlfleet.weights.publish import Publisher
from rlfleet.weights.retention import Retention, journal_pins, plan
from tests.fleets import RL_MOCK_MODEL as MODEL
from tests.fleets import fault, mock_args, start_workers, weight_versions


def _tensors(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"mock.seed": torch.tensor([100 + step], dtype=torch.int64),
            **{f"mock.ballast.{i}": torch.rand(4096, generator=g) for i in range(4)}}


def test_a_rollback_after_gc_reinstalls_the_last_verified_policy(start_fleet, tmp_path):
    store, catalog = tmp_path / "versions", f"sqlite://{tmp_path / 'catalog.sqlite'}"
    journal = SqliteJournal(tmp_path / "journal.sqlite")
    args = mock_args(store, "--weights-catalog", catalog)
    fleet = start_fleet([args] * 2, model=MODEL, enable_rl=True)
    refresh = PolicyRefresh(fleet.rl_url, model=MODEL, path="vllm-staged", journal=journal,
                            on_failure="rollback", timeout=60)
    pub = Publisher(f"file://{store}", catalog=catalog, model=MODEL,
                    retention=Retention(retain=1, tombstones=0),
                    pins=lambda: journal_pins(journal))
    digests = {}

    def source(v: str) -> dict:
        return {"kind": "disk", "path": str(store / v), "chain": True}

    def publish(step: int) -> str:
        v = f"v{step}"
        out = pub.publish(_tensors(step), v, base=None if step in (1, 5) else f"v{step - 1}")
        digests[v] = out["digest"]
        return v

    for step in (1, 2, 3):
        v = publish(step)
        res = asyncio.run(refresh.refresh(None, v, digest=digests[v], step=step,
                                          source=source(v)))
        assert res.fleet_moved, res
    # every worker replaced: the new ones hold nothing, no catalog holder names v3
    for p in list(fleet.workers):
        p.stop()
        fleet.workers.remove(p)
    start_workers(fleet, [args] * 2, kind="mocker")  # gated: they joined a controlled fleet
    deadline = time.monotonic() + 30
    while len(httpx.get(f"{fleet.rl_url}/v1/rl/workers", timeout=5).json()["workers"]) != 2:
        assert time.monotonic() < deadline, "the new workers never showed in discovery"
        time.sleep(0.2)
    for step in range(4, 9):
        publish(step)  # each collects: keep one, and what the journal pins
    kept = pub.collect(dry_run=True)["kept"]
    assert "last verified policy" in kept["v3"] and kept["v2"] == "a base of v3", kept
    assert "v4" not in kept and not (store / "v4").exists()  # v5 is full: v8's chain
    assert kept["v5"] == "a base of v8"
    async def listing() -> list:
        async with Catalog(catalog) as cat:
            return await cat.list()
    assert "v3" in plan(asyncio.run(listing()), Retention(retain=1)).evict  # without the journal

    fault(fleet.workers[1], "apply_staged_weights")
    res = asyncio.run(refresh.refresh(None, "v8", digest=digests["v8"], step=8,
                                      source=source("v8")))
    assert res.decision == "rolled_back", res
    assert {d for _, d in weight_versions(fleet)} == {digests["v3"]}
    assert journal.last_served(refresh.control.fleet, MODEL).served.version == "v3"
    pub.close()
    journal.close()
