"""GET /v1/rl/workers lists each `rl` entry as RlWorker lists it: the listener's fast path
(msgspec's strict types, rlfleet.frontend.rl._listed) gives the same JSON, byte for byte,
for every entry it takes, and leaves the others (values RlWorker coerces, entries it
refuses) to RlWorker, so a listing or a skipped entry's reason never differs."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from pydantic import ValidationError

from rlfleet.frontend import rl
from rlfleet.protocol.rl import STRICT_MIRRORS, RlWorker, RlWorkerStrict

BASE: dict[str, Any] = {
    "namespace": "ns", "component": "backend", "endpoint": "rl", "instance_id": 7,
    "transport": {"http": "http://127.0.0.1:9000"}, "request_plane_url": "dyn://ns.backend.rl",
    "system_url": "http://127.0.0.1:9100", "admin_base_url": "http://127.0.0.1:9100",
    "model": "m", "world_size": 1, "weight_transfer_backend": "nccl", "weight_version": "v3",
    "weight_digest": "sha256:ab", "weight_step": 3, "fleet_epoch": 2, "gated": False,
    "pid": 123, "stream_plane": "127.0.0.1:9200",  # not listed
}

ENTRIES: list[dict[str, Any]] = [
    BASE,
    {**BASE, "adapters": [{"adapter": "a", "version": "1", "open": True}], "gated": True},
    {**BASE, "instance_id": 2**64 - 1, "weight_step": None, "weight_version": None},
    {k: v for k, v in BASE.items() if k not in ("system_url", "admin_base_url", "world_size")},
    {**BASE, "routes": ["x"], "error": "ignored"},  # what the listener fills in, not the entry
    # values RlWorker coerces (msgspec's strict types do not take them)
    {**BASE, "instance_id": 7.0}, {**BASE, "world_size": True}, {**BASE, "weight_step": "4"},
    # entries RlWorker refuses
    {**BASE, "transport": {"http": "a", "tcp": "b"}}, {**BASE, "admin_base_url": "ftp://h"},
    {**BASE, "admin_base_url": "http://u:p@h"}, {**BASE, "world_size": None},
    {**BASE, "world_size": 0}, {**BASE, "weight_step": -1}, {**BASE, "instance_id": 2**64},
    {**BASE, "weight_transfer_backend": ""}, {**BASE, "gated": "maybe"},
    {k: v for k, v in BASE.items() if k != "request_plane_url"},
    {**BASE, "admin_base_url": "http://[::1"},
]


def pydantic_listing(entry: dict[str, Any]) -> bytes | str:
    try:
        return msgspec.json.encode(RlWorker.from_entry(entry).dump())
    except ValidationError as e:
        return str(e)


def test_the_fast_path_is_in_use_while_its_fields_are_rlworkers() -> None:
    # a field added to RlWorker turns the fast path off (and this test fails: add it there)
    assert STRICT_MIRRORS
    assert isinstance(rl._listed(BASE)[0], RlWorkerStrict)  # a worker's usual entry takes it


@pytest.mark.parametrize("entry", ENTRIES)
def test_an_entry_is_listed_as_rlworker_lists_it(entry: dict[str, Any]) -> None:
    want = pydantic_listing(entry)
    try:
        w, dumped = rl._listed(entry)
    except ValidationError as e:
        assert str(e) == want
        return
    assert msgspec.json.encode(dumped) == want
    assert (w.instance_id, w.system_url) == (dumped["instance_id"], dumped.get("system_url"))
