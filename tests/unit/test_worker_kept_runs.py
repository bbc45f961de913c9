"""The runs a worker keeps by request ID (rlfleet.worker.kept), over a scripted engine."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from rlfleet.protocol.engine import ATTACH_NOT_FOUND, Frame, GenerateRequest
from rlfleet.runtime.http import HttpError
from rlfleet.worker.kept import KeptRuns


class Opened:
    def __init__(self, head, events) -> None:
        self.head, self.events, self.closed, self.abandoned = head, events, False, False

    def left(self) -> None:
        self.abandoned = True

    async def aclose(self) -> None:
        self.closed = True


class Script:
    """An engine whose runs produce `steps` events, one per `release()`."""

    def __init__(self, steps: int = 3, refuse: bool = False, fail: bool = False) -> None:
        self.steps, self.refuse, self.fail = steps, refuse, fail
        self.opened: list[Opened] = []
        self.gate = asyncio.Event()

    async def open(self, req: GenerateRequest) -> Opened:
        if self.refuse:
            raise HttpError(400, "refused as given")
        o = Opened({"head": req.request_id}, None)
        self.opened.append(o)
        return o

    async def rest(self, opened: Opened):
        for i in range(self.steps):
            await self.gate.wait()
            self.gate.clear()
            yield Frame.STEP, {"choices": [{"index": 0, "token_ids": [i]}]}
        if self.fail:
            yield Frame.ERROR, {"message": "engine failed"}
            return
        yield Frame.DONE, {"done": True}

    def release(self) -> None:
        self.gate.set()


def req(rid: str = "r", retain: str = "fp", cancel_hash: str | None = None) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_token_ids=[1], retain=retain,
                           cancel_hash=cancel_hash)


async def collect(kept: KeptRuns, run) -> list:
    return [kind for kind, _ in [x async for x in kept.follow(run)]]


async def drive(script: Script, task: asyncio.Future) -> None:
    while not task.done():
        script.release()
        await asyncio.sleep(0.001)


async def test_a_second_request_with_the_id_follows_the_first_run_from_its_head():
    s = Script()
    kept = KeptRuns(s.open, s.rest)
    first = kept.start(req())
    a = asyncio.ensure_future(collect(kept, first))
    s.release()
    await asyncio.sleep(0.01)
    second = kept.start(req())  # mid-run: the same run
    assert second is first
    b = asyncio.ensure_future(collect(kept, second))
    await drive(s, asyncio.gather(a, b))
    want = [Frame.HEAD, Frame.STEP, Frame.STEP, Frame.STEP, Frame.DONE]
    assert await a == want and await b == want
    assert kept.start(req()) is first  # ended: still the same run (replayed)
    assert await collect(kept, first) == want
    assert len(s.opened) == 1 and kept.started == 1


async def test_another_body_under_the_id_is_refused():
    s = Script()
    kept = KeptRuns(s.open, s.rest)
    kept.start(req())
    with pytest.raises(HttpError) as e:
        kept.start(req(retain="other"))
    assert e.value.status == 409


async def test_a_refused_or_failed_run_starts_anew_on_a_retry():
    s = Script(refuse=True)
    kept = KeptRuns(s.open, s.rest)
    run = kept.start(req())
    with pytest.raises(HttpError) as e:
        await collect(kept, run)
    assert e.value.status == 400 and "r" not in kept.runs  # nothing kept
    s.refuse, s.fail = False, True
    run = kept.start(req())
    await drive(s, asyncio.ensure_future(collect(kept, run)))
    assert run.failed
    again = kept.start(req())
    assert again is not run and kept.started == 3


async def test_an_orphaned_run_is_aborted_after_its_grace_and_cancel_checks_the_owner():
    s = Script(steps=100)
    kept = KeptRuns(s.open, s.rest, orphan_grace=0.05)
    run = kept.start(req(cancel_hash="ab" * 32))
    assert run.may_cancel("ab" * 32) and not run.may_cancel("cd" * 32)
    kept.attach(run)
    await asyncio.sleep(0.01)
    kept.detach(run)
    await asyncio.sleep(0.2)
    assert run.done and run.failed and s.opened[0].abandoned and s.opened[0].closed


async def test_memory_bound_forgets_finished_runs_then_refuses():
    s = Script(steps=1)
    kept = KeptRuns(s.open, s.rest, max_bytes=1)
    run = kept.start(req("a"))
    await drive(s, asyncio.ensure_future(collect(kept, run)))
    s.steps = 2
    kept.start(req("b"))  # "a" ended: forgotten to make room
    assert "a" not in kept.runs
    s.release()
    await asyncio.sleep(0.01)  # "b" holds more than the bound while in flight
    with pytest.raises(HttpError) as e:
        kept.start(req("c"))
    assert e.value.status == 429
    await kept.close()


async def test_an_attach_only_request_follows_a_kept_run_and_never_starts_one():
    s = Script()
    kept = KeptRuns(s.open, s.rest)
    probe = msgspec.structs.replace(req(), attach_only=True)
    with pytest.raises(HttpError) as e:
        kept.start(probe)
    assert e.value.status == ATTACH_NOT_FOUND and "r" not in kept.runs
    assert kept.started == 0 and not s.opened  # nothing generated
    first = kept.start(req())
    assert kept.start(probe) is first  # the run kept under the ID
    with pytest.raises(HttpError) as e:  # kept for another request: the 409, as for any
        kept.start(msgspec.structs.replace(probe, retain="other"))
    assert e.value.status == 409
    await drive(s, asyncio.ensure_future(collect(kept, first)))
    assert kept.start(probe) is first and kept.started == 1  # ended whole: still followed
    with pytest.raises(ValueError, match="retain"):
        GenerateRequest(request_id="x", prompt_token_ids=[1], attach_only=True)


async def test_an_id_placed_elsewhere_after_asking_here_is_followed_there_not_generated():
    s = Script(steps=2)
    asked: list[tuple[str, GenerateRequest]] = []
    elsewhere = [(Frame.HEAD, {"head": "there"}), (Frame.DONE, {"done": True})]

    async def peer(address: str, r: GenerateRequest):
        asked.append((address, r))
        if address == "gone:1":
            return None

        async def relayed():
            for item in elsewhere:
                yield item
        return relayed()
    kept = KeptRuns(s.open, s.rest, peer=peer)
    probe = msgspec.structs.replace(req(), attach_only=True, placed_at="peer:1")
    with pytest.raises(HttpError):
        kept.start(probe)  # not here; placed at peer:1
    run = kept.start(req())  # a retry sent here: the run at peer:1, relayed
    assert await collect(kept, run) == [Frame.HEAD, Frame.DONE]
    assert run.relayed_from == "peer:1" and kept.relayed == 1
    assert asked == [("peer:1", req())] and not s.opened and kept.started == 0
    # a pointer for another body, or one used up, or a peer that keeps nothing: generated
    with pytest.raises(HttpError):
        kept.start(msgspec.structs.replace(probe, request_id="q", placed_at="gone:1"))
    run = kept.start(req("q"))
    await drive(s, asyncio.ensure_future(collect(kept, run)))
    assert run.relayed_from is None and kept.started == 1 and len(s.opened) == 1
    with pytest.raises(HttpError):
        kept.start(msgspec.structs.replace(probe, request_id="z"))
    run = kept.start(req("z", retain="another body"))
    await drive(s, asyncio.ensure_future(collect(kept, run)))
    assert kept.started == 2 and len(asked) == 2  # "z": no peer asked


async def test_an_attach_only_request_follows_a_pointer_too_and_finds_none_where_it_ends():
    s = Script()
    kept_there: set[str] = {"peer:1"}

    async def peer(address: str, r: GenerateRequest):
        if address not in kept_there:
            return None

        async def relayed():
            yield Frame.HEAD, {"head": "there"}
            yield Frame.DONE, {"done": True}
        return relayed()
    kept = KeptRuns(s.open, s.rest, peer=peer)
    probe = msgspec.structs.replace(req(), attach_only=True, placed_at="peer:1")
    with pytest.raises(HttpError):
        kept.start(probe)  # the first attempt's ask: none here, it goes to peer:1
    # a later ask (from a retry placed lower still) follows the run to peer:1
    run = kept.start(msgspec.structs.replace(probe, placed_at="peer:2"))
    assert await collect(kept, run) == [Frame.HEAD, Frame.DONE] and kept.started == 0
    # where the pointer leads to no run: "none", nothing generated, nothing kept
    with pytest.raises(HttpError):
        kept.start(msgspec.structs.replace(probe, request_id="q", placed_at="peer:3"))
    run = kept.start(msgspec.structs.replace(probe, request_id="q", placed_at=None))
    with pytest.raises(HttpError) as e:
        await collect(kept, run)
    assert e.value.status == ATTACH_NOT_FOUND and "q" not in kept.runs
    assert kept.started == 0 and not s.opened
