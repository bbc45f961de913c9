"""The fan-out's pure parts: the chunk table both sides compute, the chain and tree a
coordinator lays out, a chunk board's marks, and the typed `fanout` of a peer source."""

from __future__ import annotations

import numpy as np
import pytest

from rlfleet.protocol.admin_vllm import FanoutOrigin, PeerFanout
from rlfleet.weights.artifacts import TensorSpec
from rlfleet.weights.fanout import ChunkBoard, chunk_table, fanout_sources
from rlfleet.weights.stage_transfer import StageRequestError, parse_source

ORIGIN = FanoutOrigin(uri="s3://weights/run/v1", endpoint_url="http://s3:9000")
URLS = [f"http://w{i}:8081" for i in range(7)]


def test_chunk_table_cuts_each_tensor_in_order():
    specs = [TensorSpec("a", "U8", (10,)), TensorSpec("empty", "U8", (0,)),
             TensorSpec("b", "F32", (2,))]
    got = [(c.index, c.name, c.start, c.end) for c in chunk_table(specs, 4)]
    assert got == [(0, "a", 0, 4), (1, "a", 4, 8), (2, "a", 8, 10), (3, "empty", 0, 0),
                   (4, "b", 0, 4), (5, "b", 4, 8)]


def test_a_chain_names_each_upstream_and_the_holders_above_it():
    sources = fanout_sources(URLS[:4], "v1", ORIGIN, timeout=30)
    assert sources[0] == {"kind": "s3", "uri": ORIGIN.uri, "endpoint_url": ORIGIN.endpoint_url,
                          "timeout": 30}
    assert [s["url"] for s in sources[1:]] == URLS[:3]
    assert [s["fanout"]["holders"] for s in sources[1:]] == [[], [URLS[0]], [URLS[1], URLS[0]]]
    assert all(s["fanout"]["origin"]["uri"] == ORIGIN.uri for s in sources[1:])


def test_a_binary_tree_halves_the_depth():
    sources = fanout_sources(URLS, "v1", ORIGIN, degree=2)
    assert [s["url"] for s in sources[1:]] == [URLS[i] for i in (0, 0, 1, 1, 2, 2)]
    assert sources[6]["fanout"]["holders"] == [URLS[0]]  # 6 <- 2 <- 0
    assert sources[0]["kind"] == "s3"
    disk = fanout_sources(URLS[:2], "v1", FanoutOrigin(uri="file:///data/v1"))
    assert disk[0] == {"kind": "disk", "path": "/data/v1"}
    with pytest.raises(ValueError, match="degree"):
        fanout_sources(URLS, "v1", ORIGIN, degree=0)


def test_a_board_serves_only_what_has_landed():
    specs = [TensorSpec("a", "U8", (10,)), TensorSpec("b", "U8", (4,))]
    slots = {"a": np.arange(10, dtype=np.uint8), "b": np.zeros(4, dtype=np.uint8)}
    board = ChunkBoard(specs, slots, {"a": "x"}, chunk_bytes=4)
    assert board.count == 0 and board.stats.chunks_total == 4
    board.advance("a", 5)  # the first chunk of a, not yet the second
    assert [board.is_ready(i) for i in range(4)] == [True, False, False, False]
    assert board.read(0) == bytes([0, 1, 2, 3]) and board.stats.chunks_served == 1
    board.advance("a", 10)
    board.withdraw("a")  # written again: none of it is served meanwhile
    assert board.count == 0
    board.complete()
    assert board.count == 4 and board.stats.chunks_ready == 4
    m = board.manifest("v1", "STAGING", None)
    assert m.chunks_total == 4 and m.tensors[0].checksum == "x" and m.tensors[1].checksum is None
    board.close()
    assert not board.is_ready(0)


def test_the_fanout_of_a_peer_source_is_typed():
    src = parse_source({"kind": "peer", "url": URLS[1], "fanout": {
        "holders": [URLS[0]], "origin": {"uri": ORIGIN.uri}, "stall": 2}}, "v1")
    assert src.fanout == PeerFanout(holders=[URLS[0]], origin=FanoutOrigin(uri=ORIGIN.uri),
                                    stall=2.0)
    assert src.describe()["fanout"]["holders"] == [URLS[0]]
    for raw, message in (
            ({"kind": "peer", "fanout": {}}, "source.url is required with source.fanout"),
            ({"kind": "peer", "url": URLS[0], "fanout": {"holders": "x"}}, "source.fanout: "),
            ({"kind": "peer", "url": URLS[0], "fanout": {"stall": -1}}, "stall must be"),
            ({"kind": "peer", "url": URLS[0], "fanout": {"origin": {}}}, "source.fanout: "),
            ({"kind": "s3", "uri": "s3://b/v1", "fanout": {}}, "unknown field fanout")):
        with pytest.raises(StageRequestError, match=message):
            parse_source(raw, "v1")


def test_the_staged_coordinator_lays_a_chain_over_discovery_order():
    from rlfleet.protocol.identity import PolicyIdentity
    from rlfleet.refresh.control import FleetWorker
    from rlfleet.refresh.policy import Policy
    from rlfleet.refresh.staged import VllmStagedControl

    ws = [FleetWorker(i, URLS[i], None) for i in (3, 1, 2)]
    target = Policy(PolicyIdentity(version="v1"), source={
        "kind": "s3", "uri": ORIGIN.uri, "endpoint_url": ORIGIN.endpoint_url})
    control = VllmStagedControl("http://frontend:8001", fanout=1, stage_timeout=30)
    control._plan_fanout(ws, target)
    first = {w.instance_id: control._sources(target, w)[0] for w in ws}
    assert first[1]["kind"] == "s3"  # the lowest instance id pulls from S3
    assert first[2]["url"] == URLS[1] and first[3]["url"] == URLS[2]
    assert first[3]["fanout"]["holders"] == [URLS[1]] and first[3]["timeout"] == 30
    # the version's own source stays the fallback of every worker
    assert control._sources(target, ws[0])[-1]["kind"] == "s3"
    off = VllmStagedControl("http://frontend:8001")
    off._plan_fanout(ws, target)
    assert all(off._sources(target, w)[0]["kind"] == "s3" for w in ws)


def test_a_trainer_source_fans_out_like_s3():
    """The first worker stages from the trainer's publisher, the others from their peers,
    with the publisher's copy of the version as the origin they fall back to."""
    from rlfleet.protocol.identity import PolicyIdentity
    from rlfleet.refresh.control import FleetWorker
    from rlfleet.refresh.policy import Policy
    from rlfleet.refresh.staged import VllmStagedControl

    trainer = FanoutOrigin(uri="http://trainer:9100/v1")
    sources = fanout_sources(URLS, "v1", trainer, degree=2)
    assert sources[0] == {"kind": "trainer", "url": "http://trainer:9100"}
    assert parse_source(sources[0], "v1").location == "http://trainer:9100"
    assert [s["url"] for s in sources[1:]] == [URLS[i] for i in (0, 0, 1, 1, 2, 2)]
    assert all(s["fanout"]["origin"] == {"uri": trainer.uri, "endpoint_url": None}
               for s in sources[1:])
    with pytest.raises(ValueError, match="names version v1, not v2"):
        fanout_sources(URLS, "v2", trainer)

    ws = [FleetWorker(i, URLS[i], None) for i in (2, 0, 1)]
    target = Policy(PolicyIdentity(version="v1"),
                    source={"kind": "trainer", "url": "http://trainer:9100/"})
    control = VllmStagedControl("http://frontend:8001", fanout=2, stage_timeout=30)
    control._plan_fanout(ws, target)
    first = {w.instance_id: control._sources(target, w)[0] for w in ws}
    assert first[0] == {"kind": "trainer", "url": "http://trainer:9100", "timeout": 30}
    assert first[1]["url"] == first[2]["url"] == URLS[0]
    assert first[2]["fanout"]["origin"]["uri"] == "http://trainer:9100/v1"
    assert control._sources(target, ws[0])[-1]["kind"] == "trainer"  # the fallback


def test_a_worker_staging_inside_the_window_that_cannot_swap_installs_from_disk():
    """A worker with no staged handle at the transfer (its staging went unheard, or it
    joined) stages then; an engine that cannot stage to swap installs from disk instead of
    failing the wave (the CI failure of a rolling refresh on mocker workers)."""
    import asyncio

    from rlfleet.protocol import admin
    from rlfleet.protocol.admin_vllm import InstallReply, StageReply
    from rlfleet.protocol.identity import PolicyIdentity
    from rlfleet.refresh.control import FleetWorker
    from rlfleet.refresh.policy import Policy
    from rlfleet.refresh.staged import VllmStagedControl
    from rlfleet.runtime.admin_client import CallResult

    class Calls:
        def __init__(self):
            self.routes: list[str] = []

        async def on(self, w, step, route, request=None, timeout=None):
            self.routes.append(route.name)
            if route is admin.STAGE_WEIGHTS:
                body = {"status": "error", "message": "cannot stage v1 to swap it in",
                        "cannot_stage": "this engine does not prepare a staged version"}
                return CallResult(route, 200, body, StageReply(**body))
            assert route is admin.UPDATE_WEIGHTS_FROM_DISK and request.model_path == "/ck/v1"
            body = {"status": "ok", "version": "v1", "weight_digest": "d1"}
            return CallResult(route, 200, body, InstallReply(**body))

    w = FleetWorker(1, URLS[0], None, routes=frozenset(
        r.name for r in (*admin.STAGED, admin.UPDATE_WEIGHTS_FROM_DISK)))
    target = Policy(PolicyIdentity(version="v1", digest="d1"), path="/ck/v1",
                    source={"kind": "disk", "path": "/ck/v1"})
    control, ch = VllmStagedControl("http://frontend:8001"), Calls()
    failed = asyncio.run(control.transfer(ch, [w], target))
    assert failed == [] and w.reason is None, w.reason
    assert ch.routes == ["stage_weights", "update_weights_from_disk"]
    assert w.holds is not None and w.holds.digest == "d1"
    assert [c["route"] for c in w.calls if c["step"] == "stage"] == ["fallback"]
