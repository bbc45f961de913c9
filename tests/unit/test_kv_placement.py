"""The KV router's RL-aware placement (frontend/kv.py, sessions.py, rates.py): sessions stay
on their worker until it is overloaded, moving costs less, or they are finished, a GRPO group's samples stay
together, and the cost turns into seconds once the rates are measured."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from rlfleet.frontend import sessions as sess
from rlfleet.frontend.kv import KvRouter, Prefix, PrefixView
from rlfleet.frontend.rates import Rates
from rlfleet.frontend.sessions import SessionTable
from rlfleet.mocker.cache import BlockSalt, PrefixCache
from rlfleet.protocol import kv_events as kv


@dataclass(eq=False)
class W:
    instance_id: int
    inflight: int = 0


def _tokens(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def send(r: KvRouter, workers: list[W], p: Prefix | None, session: str | None = None) -> W:
    """Route one request and keep it in flight (as the frontend books it)."""
    w = r.choose(workers, p, session)
    r.routed(w.instance_id, p)
    w.inflight += 1
    return w


def _session_on_a(system: list[int], conversation: Prefix) -> tuple[KvRouter, W, W]:
    """Workers a and b both caching `system`, a the conversation of the session "ep" too
    (bound there)."""
    r = KvRouter()
    a, b = W(1), W(2)
    for w in (a, b):
        r.finished(w.instance_id, Prefix(system), r.routed(w.instance_id, Prefix(system)))
    r.finished(1, conversation, r.routed(1, conversation))
    r.sessions.bind("ep", 1)
    return r, a, b


def test_a_session_stays_on_its_worker_until_finished() -> None:
    r = KvRouter()
    a, b = W(1), W(2)
    first = send(r, [a, b], None, "ep-1")
    other = b if first is a else a
    assert other.inflight == 0  # the other worker is less loaded, and still the session stays
    assert all(r.choose([a, b], None, "ep-1") is first for _ in range(3))
    assert r.describe(first.instance_id)["sessions"] == 1
    assert r.finish_session("ep-1") and not r.finish_session("ep-1")
    assert r.describe(first.instance_id)["sessions"] == 0
    assert r.choose([a, b], None, "ep-1") is other  # placed by load again


def test_an_overloaded_worker_sheds_the_session() -> None:
    r = KvRouter(overload=1.5)
    a, b = W(1), W(2)
    assert send(r, [a, b], None, "ep") is a
    a.inflight = 3  # (3 + 1) > 1.5 x (1.5 + 1): overloaded
    assert r.choose([a, b], None, "ep") is b
    assert r.sessions.shed == 1 and r.sessions.get("ep") == 2  # it moved, and stays there
    a.inflight = 0
    assert r.choose([a, b], None, "ep") is b


def test_a_session_whose_worker_is_gone_or_flushed_is_placed_again() -> None:
    r = KvRouter()
    a, b = W(1), W(2)
    r.sync({1: {"weight_digest": "d"}, 2: {"weight_digest": "d"}})
    assert send(r, [a, b], None, "ep") is a
    assert r.choose([b], None, "ep") is b  # a gated or down: not a candidate
    assert r.sessions.get("ep") == 2
    r.sync({1: {"weight_digest": "d"}, 2: {"weight_digest": "d2"}})  # b refreshed
    assert r.sessions.get("ep") is None


def test_a_session_goes_where_its_prefix_is_and_stays() -> None:
    r = KvRouter()
    a, b = W(1), W(2)
    ctx = Prefix(_tokens(200))
    r.finished(2, ctx, r.routed(2, ctx))  # b holds the conversation so far
    turn = Prefix(ctx.tokens + [7] * 40)
    assert send(r, [a, b], turn, "ep") is b
    r.finished(2, turn, 0, [[8] * 32])  # the turn ended, b holds its output too
    b.inflight, a.inflight = 1, 0  # and runs another request: a is less loaded
    assert r.choose([a, b], Prefix(turn.tokens + [8] * 32 + [9] * 40), "ep") is b
    assert r.sessions.shed == 0


def test_a_session_leaves_a_worker_other_sessions_crowd_when_recomputing_costs_less() -> None:
    """Sessions bound to a worker are load that comes back every turn: an episode whose
    worker holds five more, their turns just queued there, moves to the worker holding two
    (where the shared system prompt is cached) and recomputes its task there; with the
    other sessions elsewhere it stays. (The mix trace of bench/rl_routing.py: episodes that
    started while GRPO groups ran on the other worker piled up on one.)"""
    system = _tokens(1024)
    conversation = Prefix(system + _tokens(256, 5000) + _tokens(320, 6000))
    turn = Prefix(conversation.tokens + _tokens(320, 7000))

    def fleet(crowded: bool) -> tuple[KvRouter, W, W]:
        r, a, b = _session_on_a(system, conversation)
        here, there = (a, b) if crowded else (b, a)
        for i in range(5):  # other episodes' turns, just sent
            send(r, [here], Prefix(system + _tokens(256, 10_000 * (i + 1))), f"other-{i}")
        for i in range(2):
            r.sessions.bind(f"idle-{i}", there.instance_id)
        return r, a, b

    r, a, b = fleet(crowded=True)
    assert r.choose([a, b], turn, "ep") is b
    assert r.sessions.shed == 1 and r.sessions.get("ep") == 2
    r, a, b = fleet(crowded=False)
    assert r.choose([a, b], turn, "ep") is a and r.sessions.shed == 0


def test_a_session_leaves_the_worker_cheapest_now_when_its_turns_to_come_cost_more() -> None:
    """Nothing runs anywhere and the session's worker holds its conversation, so this turn
    costs least there; but two more sessions are bound there, one elsewhere, and sessions
    have been lasting twenty turns: each of its turns to come would stall the two and wait
    for theirs, so it moves now. With nothing learnt (a session of one turn so far may send
    one more) recomputing its 2,000 tokens is not worth it, and it stays."""
    system = _tokens(1024)
    conversation = Prefix(system + _tokens(2000, 5000))
    turn = Prefix(conversation.tokens + _tokens(320, 7000))

    def fleet(learnt: bool) -> tuple[KvRouter, W, W]:
        r, a, b = _session_on_a(system, conversation)
        for i in range(4 if learnt else 0):  # finished sessions of 20 turns
            for _ in range(20):
                r.sessions.bind(f"done-{i}", 2)
            r.sessions.finish(f"done-{i}")
        for i, w in enumerate((1, 1, 2)):
            r.sessions.bind(f"idle-{i}", w)
        return r, a, b

    r, a, b = fleet(learnt=False)
    assert r.cost(a, turn) < r.cost(b, turn)  # this turn alone: its worker
    assert r.choose([a, b], turn, "ep") is a and r.sessions.shed == 0
    r, a, b = fleet(learnt=True)
    assert r.choose([a, b], turn, "ep") is b
    assert r.sessions.shed == 1 and r.sessions.get("ep") == 2


def test_a_new_session_weighs_the_sessions_bound_where_its_prefix_is() -> None:
    """A first turn whose system prompt only a holds, where another session is bound: with
    nothing learnt it goes where its prefix is; once sessions have been lasting twenty
    turns, the turns it would share with that session there cost more than computing the
    system prompt once on b. (The mix trace's second RL step: the first turns spread.)"""
    system = _tokens(1024)
    first = Prefix(system + _tokens(512, 5000))

    def fleet(learnt: bool) -> tuple[KvRouter, W, W]:
        r = KvRouter()
        a, b = W(1), W(2)
        r.finished(1, Prefix(system), r.routed(1, Prefix(system)))
        r.sessions.bind("other", 1)
        for i in range(4 if learnt else 0):  # finished sessions of 20 turns
            for _ in range(20):
                r.sessions.bind(f"done-{i}", 2)
            r.sessions.finish(f"done-{i}")
        return r, a, b

    r, a, b = fleet(learnt=False)
    assert r.choose([a, b], first, "new") is a
    r, a, b = fleet(learnt=True)
    assert r.choose([a, b], first, "new") is b and r.sessions.shed == 0


def test_a_group_stays_together_until_load_demands() -> None:
    """The samples of one prompt are not counted against their own worker's load: with
    the default threshold a group of 8 on an idle fleet stays on one worker."""
    r = KvRouter(overload=1.5)
    a, b = W(1), W(2)
    group = Prefix(_tokens(512))
    placed = {send(r, [a, b], Prefix(list(group.tokens))).instance_id for _ in range(8)}
    assert len(placed) == 1
    other = Prefix(_tokens(512, 7000))
    assert send(r, [a, b], other).instance_id not in placed  # the next group goes elsewhere
    # a worker with other work still counts it: a new prompt is not piled on a busy one
    a.inflight, b.inflight = 9, 0
    assert r.choose([a, b], Prefix(_tokens(64, 20000))) is b


def test_rates_turn_the_cost_into_seconds() -> None:
    rates = Rates()
    assert not rates.known and rates.prefill == 0.0 and rates.step() == (0.0, 0.0)
    for _ in range(8):
        rates.prefilled(1000, 2.0)  # 2 ms per prompt token
        rates.generated(100)
    for running, itl in ((1, 0.03), (4, 0.06), (8, 0.10), (2, 0.04)):
        rates.decoded(running, itl)
    assert rates.known and rates.prefill == pytest.approx(0.002)
    base, per = rates.step()
    assert per == pytest.approx(0.01, rel=0.2) and base == pytest.approx(0.02, abs=0.01)
    assert rates.output == pytest.approx(100)
    rates.prefilled(8, 100.0)  # too few tokens to say anything: ignored
    assert rates.prefill == pytest.approx(0.002)


def test_with_rates_the_stall_on_a_busy_worker_counts() -> None:
    """A miss on a worker running many requests stalls them all: with a known prefill rate
    a request that would miss everywhere goes to the worker with fewer requests running,
    even where it finds a little of its prompt."""
    r = KvRouter(overload=100)
    for _ in range(8):
        r.rates.prefilled(1000, 1.0)
    a, b = W(1, inflight=10), W(2, inflight=2)
    shared = _tokens(64)
    r.finished(1, Prefix(shared), r.routed(1, Prefix(shared)))
    p = Prefix(shared + _tokens(2000, 5000))
    assert r.cost(a, p) > r.cost(b, p)
    assert r.choose([a, b], p) is b


def test_session_table_ttl_and_limit(monkeypatch) -> None:
    t = SessionTable(ttl=10, limit=2)
    now = [100.0]
    monkeypatch.setattr(sess.time, "monotonic", lambda: now[0])
    t.bind("a", 1)
    t.bind("b", 2)
    t.bind("c", 1)  # over the limit: the least recently used ("a") goes
    assert t.get("a") is None and t.get("b") == 2 and t.count(1) == 1
    now[0] += 11
    assert t.get("b") is None  # idle past the TTL
    assert t.drop_worker(1) == 1 and len(t) == 0
    with pytest.raises(ValueError, match="positive"):
        SessionTable(ttl=0)


def test_a_sessions_turns_to_come_are_learnt_from_finished_sessions() -> None:
    t = SessionTable()
    t.bind("a", 1)
    assert t.turns_to_come("a") == 1  # nothing finished yet: as many as it has sent
    t.bind("a", 1)
    t.bind("a", 2)  # moving keeps its count
    assert t.turns_to_come("a") == 3
    assert t.finish("a")
    for s in ("b", "c"):
        for _ in range(5):
            t.bind(s, 1)
        t.finish(s)
    t.bind("d", 2)
    assert t.turns_to_come("d") == pytest.approx((3 * 0.97 ** 2 + 5 * 0.97 + 5)
                                                 / (0.97 ** 2 + 0.97 + 1) - 1)
    for _ in range(9):
        t.bind("d", 2)
    assert t.turns_to_come("d") == 1  # past the mean: at least its next


def test_an_adapters_blocks_are_matched_for_that_adapter_only() -> None:
    """vLLM keys every block of a LoRA request by the adapter's name (its events publish it
    in each block's extra keys, before the cache salt); so does the router's key, and so do
    the mocker's events."""
    tokens = _tokens(64)
    view = PrefixView(block_size=16, has_events=True)
    view.apply(kv.BlockStored(block_hashes=[11, 12, 13, 14], parent_block_hash=None,
                              token_ids=tokens, block_size=16, lora_name="math",
                              extra_keys=[["math", "s"], ["math"], ["math"], ["math"]]))
    assert view.overlap(Prefix(tokens, "s", "math").keys(16)) == 4
    assert view.overlap(Prefix(tokens, "s").keys(16)) == 0  # the base model's: not these
    assert view.overlap(Prefix(tokens, "s", "code").keys(16)) == 0
    cache = PrefixCache("m", block_size=16, blocks=64)
    seen: list = []
    cache._publish = seen.extend  # type: ignore[method-assign]
    cache.lookup(tokens, BlockSalt(None, "math", 1))
    mock_view = PrefixView(block_size=16, has_events=True)
    for ev in seen:
        mock_view.apply(ev)
    assert mock_view.overlap(Prefix(tokens, None, "math").keys(16)) == 4
    assert mock_view.overlap(Prefix(tokens).keys(16)) == 0
    assert cache.lookup(tokens, BlockSalt(None, "math", 2)) == 0  # a reloaded adapter's own


def test_a_running_requests_blocks_are_not_evicted() -> None:
    cache = PrefixCache("m", block_size=4, blocks=4)
    held = cache.hashes(_tokens(16))
    cache.pin(held)
    cache.store(_tokens(16), None, held)
    cache.store(_tokens(8, 900))  # over the capacity: the unpinned ones would go first
    assert all(h in cache.blocks for h in held)
    cache.unpin(held)
    extra = cache.occupy()  # a block of generated tokens, held until unpinned
    assert extra in cache.blocks and not all(h in cache.blocks for h in held)


def test_a_refresh_clears_every_view_and_its_sessions() -> None:
    """A policy refresh flushes every worker's prefix cache: each worker's view (its events'
    blocks and the router's own record) and the sessions bound to it are forgotten, whether
    the router learns it from discovery (a new policy) or from the engine (AllBlocksCleared)."""
    tokens = _tokens(64)
    for how in ("discovery", "events"):
        r = KvRouter()
        workers = [W(1), W(2), W(3)]
        r.sync({w.instance_id: {"weight_version": "v1"} for w in workers})
        for i, w in enumerate(workers):
            r.views[w.instance_id].has_events = True
            r.on_message(w.instance_id, (0).to_bytes(8, "big"), kv.encode_batch(
                kv.EventBatch(ts=0.0, events=[kv.BlockStored(
                    block_hashes=[1, 2, 3, 4], parent_block_hash=None, token_ids=tokens,
                    block_size=16)])))
            r.routed(w.instance_id, Prefix(_tokens(32, 5000 + 100 * i)))
            r.sessions.bind(f"ep-{i}", w.instance_id)
        assert all(r.views[w.instance_id].overlap(Prefix(tokens).keys(16)) == 4
                   for w in workers)
        if how == "discovery":
            r.sync({w.instance_id: {"weight_version": "v2"} for w in workers})
        else:
            for w in workers:
                r.on_message(w.instance_id, (1).to_bytes(8, "big"), kv.encode_batch(
                    kv.EventBatch(ts=1.0, events=[kv.AllBlocksCleared()])))
        for w in workers:
            d = r.describe(w.instance_id)
            assert (d["cached_blocks"], d["recorded_blocks"], d["sessions"]) == (0, 0, 0), how
        assert len(r.sessions) == 0
