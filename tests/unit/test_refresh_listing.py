"""The refresh coordinator reads the RL listener's reply through its schema
(rlfleet.protocol.rl.RlWorkers): a listing of another protocol version, or one that does
not follow the schema, holds the refresh with a message that says which."""

from __future__ import annotations

import json

import pytest

from rlfleet.refresh.control import RefreshHeld, _listing

WORKER = {"namespace": "dynamo", "component": "backend", "endpoint": "generate",
          "instance_id": 7, "transport": {"http": "http://127.0.0.1:9/generate"},
          "request_plane_url": "dyn://dynamo.backend.generate", "routes": ["pause_generation"],
          "system_url": "http://127.0.0.1:10", "model": "m", "fleet_epoch": 3}


def body(**over) -> bytes:
    return json.dumps({"protocol_version": 1, "namespace": "dynamo", "workers": [WORKER],
                       **over}).encode()


def test_a_listing_is_read_through_its_schema() -> None:
    listing = _listing(body(discovery="file:///tmp/d"))
    w, = listing.workers
    assert (w.instance_id, w.model, w.fleet_epoch, w.routes) == (7, "m", 3, ["pause_generation"])
    assert listing.discovery == "file:///tmp/d"


def test_another_protocol_version_is_refused_by_name() -> None:
    with pytest.raises(RefreshHeld, match="unsupported discovery protocol_version 2"):
        _listing(body(protocol_version=2))
    with pytest.raises(RefreshHeld, match="unsupported discovery protocol_version 'x'"):
        _listing(body(protocol_version="x"))


def test_a_listing_off_the_schema_is_refused_with_the_field() -> None:
    bad = {k: v for k, v in WORKER.items() if k != "transport"}
    with pytest.raises(RefreshHeld, match="transport"):
        _listing(body(workers=[bad]))
    with pytest.raises(RefreshHeld, match="schema"):
        _listing(b"not json")


def test_the_fast_reader_keeps_the_schemas_fields() -> None:
    """The coordinator reads listings with msgspec mirrors of RlWorkers and RlWorker: each
    names every field of its schema (a field added to the schema is read too)."""
    import msgspec

    from rlfleet.protocol.rl import RlWorker, RlWorkers, RlWorkerStrict, SkippedEntry
    from rlfleet.refresh.control import _Listing, _Skipped

    for fast, schema in ((RlWorkerStrict, RlWorker), (_Listing, RlWorkers),
                         (_Skipped, SkippedEntry)):
        assert {f.name for f in msgspec.structs.fields(fast)} == set(schema.model_fields)


def test_what_the_schema_refuses_is_refused_whichever_reader_reads_it() -> None:
    """Checks the msgspec reader cannot express (RlWorker's validators) still hold the
    refresh, with the schema's own message."""
    cases = [({"instance_id": 2**64}, "instance_id"),
             ({"transport": {"http": "a", "tcp": "b"}}, "exactly one transport"),
             ({"admin_base_url": "http://h:1", "world_size": None}, "requires world_size"),
             ({"admin_base_url": "ftp://h:1", "world_size": 1}, "admin_base_url"),
             ({"world_size": 0}, "world_size"),
             ({"fleet_epoch": -1}, "fleet_epoch")]
    for over, why in cases:
        with pytest.raises(RefreshHeld, match=why):
            _listing(body(workers=[{**WORKER, **over}]))


def test_routes_come_sorted_and_unique() -> None:
    w, = _listing(body(workers=[{**WORKER, "routes": ["b", "a", "b"]}])).workers
    assert w.routes == ["a", "b"]
