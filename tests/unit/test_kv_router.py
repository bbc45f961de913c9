"""The KV router's scoring and views (frontend/kv.py), fed by the mocker's simulated cache
and by events built with vLLM's own event classes."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import pytest

from rlfleet.frontend import kv as kvr
from rlfleet.frontend.kv import KvRouter, Prefix, PrefixView, block_keys
from rlfleet.frontend.router import WorkerPool
from rlfleet.mocker.cache import PrefixCache
from rlfleet.protocol import kv_events as kv
from rlfleet.protocol.nvext import PolicyBound
from rlfleet.runtime.discovery import FileDiscovery


@dataclass
class W:
    instance_id: int
    inflight: int = 0


def _tokens(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def test_block_keys_chain_full_blocks_and_salt() -> None:
    a = block_keys(_tokens(40), 16)
    assert len(a) == 2  # the partial third block has no key
    assert block_keys(_tokens(35), 16) == a
    assert block_keys(_tokens(32) + [1] * 16, 16)[:2] == a
    b = block_keys([7] + _tokens(39, 101), 16)
    assert b[0] != a[0] and b[1] != a[1]  # a different first block changes every key after
    assert Prefix(_tokens(40), "s").keys(16)[0] != a[0]


def _capture(cache: PrefixCache) -> list:
    seen: list = []
    cache._publish = seen.extend  # type: ignore[method-assign]
    return seen


def test_view_follows_mocker_events() -> None:
    cache = PrefixCache("m", block_size=4, blocks=6)
    events = _capture(cache)
    view = PrefixView(block_size=4, has_events=True)
    prompt = _tokens(18)
    assert cache.lookup(prompt) == 0
    for ev in events:
        view.apply(msgspec.msgpack.decode(msgspec.msgpack.encode(kv.EventBatch(0.0, [ev])),
                                          type=kv.EventBatch).events[0])
    assert view.overlap(Prefix(prompt).keys(4)) == 4
    assert view.overlap(Prefix(prompt[:10] + [1, 2, 3, 4]).keys(4)) == 2
    assert cache.lookup(prompt) == 16  # the mocker agrees
    # a second prompt evicts the oldest blocks (capacity 6): the view drops them too
    events.clear()
    cache.lookup(_tokens(16, 900))
    for ev in events:
        view.apply(ev)
    assert any(type(e) is kv.BlockRemoved for e in events)
    assert view.overlap(Prefix(prompt).keys(4)) == 0
    events.clear()
    cache.clear()
    view.apply(events[0])
    assert not view.cached and view.overlap(Prefix(_tokens(16, 900)).keys(4)) == 0


def _served(r: KvRouter, iid: int, p: Prefix, *completions: list[int]) -> None:
    r.finished(iid, p, r.routed(iid, p), completions)


def test_choose_prefers_the_prefix_holder_unless_overloaded() -> None:
    r = KvRouter(overload=1.5)
    a, b, c = W(1), W(2), W(3)
    p = Prefix(_tokens(64))
    _served(r, 2, p)
    assert r.choose([a, b, c], p) is b
    assert r.choose([a, b, c], Prefix(_tokens(64) + [9] * 30)) is b  # a continuation
    b.inflight = 3  # (3 + 1) > 1.5 x (1 + 1): overloaded
    assert r.choose([a, b, c], p) in (a, c)
    b.inflight = 1  # (1 + 1) <= 1.5 x (0.33 + 1): still fits
    assert r.choose([a, b, c], p) is b
    assert r.choose([a, c], p) in (a, c)  # b gated or gone: not a candidate


def test_choose_ties_go_to_the_least_loaded_then_round_robin() -> None:
    r = KvRouter()
    a, b = W(1, inflight=1), W(2)
    assert r.choose([a, b], None) is b
    assert r.choose([a, b], Prefix(_tokens(40))) is b
    a.inflight = 0
    assert {r.choose([a, b], None).instance_id for _ in range(4)} == {1, 2}


def test_completions_are_recorded_for_continuations() -> None:
    r = KvRouter()
    a, b = W(1), W(2)
    p = Prefix(_tokens(20))
    _served(r, 1, p, _tokens(30, 700))
    nxt = Prefix(_tokens(20) + _tokens(30, 700) + [5] * 10)
    assert r.views[1].overlap(nxt.keys(16)) == 3
    assert r.choose([a, b], nxt) is a


def test_record_expires_on_event_workers(monkeypatch) -> None:
    v = PrefixView(has_events=True)
    keys = Prefix(_tokens(32)).keys(16)
    v.note(keys)
    assert v.overlap(keys) == 2
    monkeypatch.setattr(kvr, "RECORD_TTL", -1.0)
    assert v.overlap(keys) == 0


def test_sync_clears_on_policy_change_and_forgets_workers() -> None:
    r = KvRouter()
    p = Prefix(_tokens(32))
    r.sync({1: {"weight_digest": "d1", "kv_block_size": 8}, 2: {"weight_digest": "d1"}})
    assert r.views[1].block_size == 8
    _served(r, 1, p)
    _served(r, 2, p)
    r.sync({1: {"weight_digest": "d1", "kv_block_size": 8}, 2: {"weight_digest": "d2"}})
    assert r.views[1].overlap(p.keys(8)) == 4
    assert r.views[2].overlap(p.keys(16)) == 0  # refreshed: its cache was flushed
    r.sync({2: {"weight_digest": "d2"}})
    assert 1 not in r.views


async def test_the_pool_in_mode_kv_follows_each_change_alone(tmp_path) -> None:
    """A discovery change touches the prefix view of the workers it names: a refreshed
    worker's cache is flushed, one that left is forgotten, the others keep theirs."""
    def entry(iid: int, digest: str) -> dict:
        return {"namespace": "ns", "component": "backend", "endpoint": "generate",
                "instance_id": iid, "model": "m", "transport": {"http": f"http://w{iid}"},
                "stream_plane": f"127.0.0.1:{iid}", "weight_digest": digest}
    async with FileDiscovery(tmp_path) as d:
        pool = WorkerPool(d, "ns", mode="kv")
        pool.update([entry(i, "d1") for i in (1, 2, 3)])
        kv_ = pool.kv
        assert kv_ is not None and set(kv_.views) == {1, 2, 3}
        p = Prefix(_tokens(32))
        for i in (1, 2, 3):
            _served(kv_, i, p)
        pool.apply({"ns/backend/generate/2": entry(2, "d2"), "ns/backend/generate/3": None})
        assert set(kv_.views) == {1, 2}
        assert kv_.views[1].overlap(p.keys(16)) == 2  # untouched
        assert kv_.views[2].overlap(p.keys(16)) == 0  # refreshed: flushed
        await pool.stop()


def test_load_outweighs_a_short_prefix_but_not_a_long_one() -> None:
    r = KvRouter(overload=100)  # the cost alone decides here
    a, b = W(1), W(2)
    shared, own = _tokens(32), _tokens(320, 5000)
    _served(r, 1, Prefix(shared + own))
    busy = Prefix(_tokens(200, 9000))
    r.routed(1, busy)  # 200 prompt tokens in flight on worker 1
    a.inflight = 1
    # a new task sharing only the first 32 tokens: not worth waiting behind 200 tokens
    assert r.choose([a, b], Prefix(shared + _tokens(100, 20000))) is b
    # a continuation holding 352 cached tokens stays
    assert r.choose([a, b], Prefix(shared + own + [1] * 20)) is a


def test_overload_threshold_must_exceed_one() -> None:
    with pytest.raises(ValueError, match="greater than 1"):
        KvRouter(overload=1.0)


def _entry(iid: int, **kw) -> dict:
    return {"instance_id": iid, "model": "m", "transport": {"http": f"http://h:{iid}"},
            "stream_plane": f"h:{iid}", "endpoint": "generate", "gated": False,
            "weight_step": 3, **kw}


def test_pool_in_kv_mode_routes_only_among_usable_and_bound() -> None:
    pool = WorkerPool(discovery=None, namespace="n", mode="kv")  # type: ignore[arg-type]
    pool.update([_entry(1), _entry(2)])
    p = Prefix(_tokens(48))
    _served(pool.kv, 1, p)  # type: ignore[arg-type]
    assert pool.pick("m", prefix=p).instance_id == 1
    assert pool.pick("m", exclude={1}, prefix=p).instance_id == 2
    pool.update([_entry(1, gated=True), _entry(2)])
    assert pool.pick("m", prefix=p).instance_id == 2
    pool.update([_entry(1, weight_step=1), _entry(2, weight_step=3)])
    # worker 1's step changed: its view was forgotten; and step 1 is outside max_lag 1
    assert pool.kv.views[1].overlap(p.keys(16)) == 0  # type: ignore[union-attr]
    _served(pool.kv, 1, p)  # type: ignore[arg-type]
    assert pool.pick("m", bound=PolicyBound(max_lag=1), prefix=p).instance_id == 2
    pool.update([_entry(2)])
    assert 1 not in pool.kv.views  # type: ignore[union-attr]
