"""Which workers a frontend asks whether they own the run of a request's X-Request-Id before
it places the request elsewhere than on the ID's top-ranked worker
(rlfleet.frontend.router.WorkerPool.owners): none when it goes to the top-ranked one, the
workers ranked above it otherwise (not those marked down or tried), and in mode kv those
that hold the request's prefix."""

from __future__ import annotations

import time

from rlfleet.frontend.kv import Prefix
from rlfleet.frontend.router import ASK_RANKS, Worker, WorkerPool, rank

MODEL = "m"


def pool(n: int, mode: str = "round-robin") -> WorkerPool:
    p = WorkerPool(discovery=None, namespace="ns", mode=mode)  # type: ignore[arg-type]
    p.workers = {i: Worker(i, MODEL, f"http://w{i}", f"127.0.0.1:{9000 + i}", {})
                 for i in range(n)}
    return p


def test_none_asked_on_the_top_ranked_worker_the_ones_above_elsewhere():
    p = pool(6)
    order = rank("rid", list(p.workers.values()))
    assert p.owners(MODEL, "rid", order[0]) == []
    assert p.owners(MODEL, "rid", order[3]) == order[:3]
    # what the pool picks with the ID: the top-ranked usable worker
    order[0].entry = {"gated": True}
    assert p.pick(MODEL, key="rid") is order[1]
    assert p.owners(MODEL, "rid", order[1]) == [order[0]]
    # a worker marked down (unreachable, broken, stalled) or tried already is not asked
    order[0].down_until = time.monotonic() + 60
    assert p.owners(MODEL, "rid", order[2], exclude={order[1].instance_id}) == []
    # at most ASK_RANKS of them
    assert len(p.owners(MODEL, "rid", order[5])) == ASK_RANKS


def test_in_kv_mode_the_workers_holding_the_prefix_are_asked_too():
    p = pool(4, "kv")
    order = rank("rid", list(p.workers.values()))
    prefix = Prefix(list(range(48)))
    assert p.kv is not None
    # nobody holds the prefix: only the ranks
    assert p.owners(MODEL, "rid", order[0], prefix) == []
    holder = order[2]
    p.kv.routed(holder.instance_id, prefix)  # an earlier request with it went there
    # placed on the top-ranked worker, which does not hold it: the holder is asked
    assert p.owners(MODEL, "rid", order[0], prefix) == [holder]
    assert p.owners(MODEL, "rid", order[1], prefix) == [order[0], holder]
    # placed on the holder itself: only the ranks above it
    assert p.owners(MODEL, "rid", holder, prefix) == order[:2]
    # a request without a prefix is placed by its ID alone
    assert p.owners(MODEL, "rid", order[0]) == []
