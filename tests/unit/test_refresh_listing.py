"""The refresh coordinator reads the RL listener's reply through its schema
(rlfleet.protocol.rl.RlWorkers): a listing of another protocol version, or one that does
not follow the schema, holds the refresh with a message that says which."""

from __future__ import annotations

import json

import pytest

from rlfleet.rl.control import RefreshHeld, _listing

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
