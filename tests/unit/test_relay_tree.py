"""The coordinator's relay tree (rlfleet.refresh.relay) over an in-memory HTTP transport that
answers as workers and relays do: a phase's calls to many workers meet in one batch and go
out as one call per relay; a relay that fails has its subtree called directly and is not
used again; a stale epoch refused by a relay fences the coordinator; a small phase is
called directly; the layout follows the workers' order."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from rlfleet.protocol import admin
from rlfleet.protocol.admin_vllm import PauseRequest
from rlfleet.refresh.control import Channel, FleetFenced, FleetWorker, for_each
from rlfleet.refresh.relay import RelayTree


def worker(i: int, relays: bool = True) -> FleetWorker:
    routes = {"pause_generation", "get_weight_version"} | ({"relay"} if relays else set())
    return FleetWorker(i, f"http://w{i}:80", None, routes=frozenset(routes))


class Fleet:
    """Answers POST /engine/<route> for hosts w<i>; `dead` relays fail, `stale` ones 409."""

    def __init__(self, dead: frozenset[int] = frozenset(), stale: frozenset[int] = frozenset()
                 ) -> None:
        self.dead, self.stale = dead, stale
        self.calls: list[tuple[int, str, int]] = []  # (host, route, targets)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host = int(request.url.host[1:])
        route = request.url.path.removeprefix("/engine/")
        body = json.loads(request.content)
        if route != "relay":
            self.calls.append((host, route, 1))
            return httpx.Response(200, json={"status": "ok", "message": f"w{host}"})
        self.calls.append((host, route, len(body["targets"])))
        if host in self.dead:
            raise httpx.ConnectError("connection refused", request=request)
        if host in self.stale:
            return httpx.Response(409, json={"error": admin.STALE_EPOCH, "message": "old",
                                             "fleet_epoch": 1, "newest_fleet_epoch": 2})
        assert request.headers[admin.EPOCH_HEADER] == "7"
        return httpx.Response(200, json={"status": "ok", "results": [
            {"instance_id": t["instance_id"], "http_status": 200,
             "body": {"status": "ok", "message": f"via {host}"}} for t in body["targets"]]})


def pause_all(fleet: Fleet, ws: list[FleetWorker], tree: RelayTree) -> list:
    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(fleet)) as http:
            ch = Channel(http, 5.0, None, 7, None, concurrency=8, relay=tree)
            return await for_each(ws, lambda w: ch.on(w, "pause", admin.PAUSE_GENERATION,
                                                      PauseRequest(mode="wait")), 10.0)
    return asyncio.run(run())


def test_a_phase_over_the_threshold_goes_out_as_one_call_per_relay():
    ws = [worker(i) for i in range(20)]
    fleet, tree = Fleet(), RelayTree(threshold=10, fanout=4)
    results = pause_all(fleet, ws, tree)
    assert all(r.ok for r in results)
    assert sorted(fleet.calls) == [(0, "relay", 5), (1, "relay", 5), (2, "relay", 5),
                                   (3, "relay", 5)]
    assert {w.calls[-1]["relay"] for w in ws} == {0, 1, 2, 3}
    assert all(w.calls[-1]["http_status"] == 200 and w.calls[-1]["step"] == "pause" for w in ws)
    (hop,) = tree.hops
    assert hop.relays == [0, 1, 2, 3] and hop.workers == 20 and hop.rounds == 2


def test_the_layout_takes_the_first_workers_that_relay_each_first_in_its_subtree():
    ws = [worker(0, relays=False)] + [worker(i) for i in range(1, 10)]
    tree = RelayTree(threshold=1, fanout=3)
    layout = tree.layout(ws)
    assert [r.instance_id for r, _ in layout] == [1, 2, 3]
    assert [[w.instance_id for w in sub] for _, sub in layout] == \
        [[1, 0, 4, 5], [2, 6, 7], [3, 8, 9]]
    assert RelayTree(threshold=1).layout(ws[:1]) == []  # no worker can relay
    assert len(RelayTree(threshold=1).layout([worker(i) for i in range(1024)])) == 32


def test_a_failed_relay_has_its_subtree_called_directly_and_is_not_used_again():
    ws = [worker(i) for i in range(12)]
    fleet, tree = Fleet(dead=frozenset({1})), RelayTree(threshold=4, fanout=3)
    events: list[str] = []
    tree.on_event = events.append
    assert all(r.ok for r in pause_all(fleet, ws, tree))
    subtree = {w.instance_id for w in ws if "relay" not in w.calls[-1]}
    assert subtree == {1, 6, 7, 8}  # the dead relay and its subtree, each called directly
    assert {(h, r) for h, r, _ in fleet.calls if h in subtree and r != "relay"} == \
        {(h, "pause_generation") for h in subtree}
    assert any("relay 1 failed" in e for e in events)
    assert tree.failed == {1} and tree.hops[0].failed == [1]
    fleet.calls.clear()
    pause_all(fleet, ws, tree)  # the next phase lays the tree out without it
    assert 1 not in {h for h, r, _ in fleet.calls if r == "relay"}


def test_a_relay_that_refuses_the_epoch_fences_the_coordinator():
    ws = [worker(i) for i in range(12)]
    with pytest.raises(FleetFenced, match="refused pause_generation"):
        pause_all(Fleet(stale=frozenset({2})), ws, RelayTree(threshold=4, fanout=3))


def test_a_phase_at_the_threshold_calls_each_worker_directly():
    ws = [worker(i) for i in range(10)]
    fleet, tree = Fleet(), RelayTree(threshold=10)
    assert all(r.ok for r in pause_all(fleet, ws, tree))
    assert sorted(fleet.calls) == [(i, "pause_generation", 1) for i in range(10)]
    assert not any("relay" in w.calls[-1] for w in ws)
    assert tree.hops[0].relays == [] and tree.hops[0].rounds == 2  # 10 calls, 8 at once


@pytest.mark.parametrize("threshold, fanout", [(0, None), (-1, None), (4, 0), (4, 1.5)])
def test_bad_settings_say_what_to_fix(threshold, fanout):
    with pytest.raises(ValueError, match="positive integer"):
        RelayTree(threshold, fanout)
