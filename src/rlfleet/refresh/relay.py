"""A relay tree for the coordinator of a large fleet: a phase's admin calls to more than
`threshold` workers go out as K relay calls (rlfleet.protocol.relay), each to a worker that
runs the call on its subtree and answers every worker's result, so the coordinator makes K
calls a phase, not N, and each worker's call is two hops from it.

How the calls meet: a phase starts every worker's call at once (rlfleet.refresh.control.for_each)
and each comes to `RelayTree.call` through `Channel.on` before any is sent. The first one
opens a batch (one route, one body, one deadline) and the batch is sent a couple of event
loop turns later, when the phase's other calls have joined it. A batch of `threshold`
workers or fewer is called directly, as without a tree.

The tree, as the weights' fan-out lays out its chain or tree (rlfleet.weights.fanout): the
relays are the first K workers of the phase, in the order discovery lists them, that serve
the relay route (K: `fanout`, default the square root of the phase's workers) and have not
failed as a relay in this transaction; the other workers are cut, in that order, into K
runs, one under each relay, which is the first of its own subtree.

A relay that cannot be reached, dies, answers anything but its reply, or does not answer
within the call's deadline plus `GRACE` is not used again in the transaction, and every
worker of its subtree is called directly by the coordinator (a call it had relayed already
runs again: the lifecycle's calls may). A relay that refuses the coordinator's epoch is its
409 for every worker of its subtree: the coordinator has been taken over (`FleetFenced`), as
when a worker refuses it. Each worker's result is recorded on it as a direct call's
(journaled with the transaction), with the relay it came through (`relay`: its instance ID)."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from rlfleet.protocol.admin import AdminRoute
from rlfleet.protocol.relay import MAX_CONCURRENCY, RELAY, RelayRequest, RelayTarget, relayable
from rlfleet.runtime.admin_client import CallResult, answered


class FleetWorker(Protocol):
    """What the tree reads of a worker (rlfleet.refresh.control.FleetWorker)."""

    instance_id: int
    system_url: str
    routes: frozenset[str]


class Channel(Protocol):
    """What the tree needs of the coordinator's channel (rlfleet.refresh.control.Channel): its
    admin calls, the slots that bound them, and their deadline."""

    concurrency: int
    timeout: float

    def slot(self) -> asyncio.Semaphore: ...

    async def call(self, system_url: str, route: AdminRoute, request: Any = None,
                   timeout: float | None = None) -> CallResult[Any]: ...

log = logging.getLogger("rlfleet.refresh")

#: seconds a coordinator waits for a relay beyond the per-call deadline it gave it
GRACE = 5.0
#: event-loop turns a batch stays open for the rest of its phase's calls to join it
OPEN_TURNS = 2
#: the relay tree's default threshold: phases over more workers than this are relayed
DEFAULT_THRESHOLD = 256


@dataclass
class _Waiting:
    worker: FleetWorker
    answer: asyncio.Future  # (CallResult, via) | None: call it directly


@dataclass
class _Batch:
    route: AdminRoute
    body: bytes  # the request, encoded once
    timeout: float
    calls: list[_Waiting] = field(default_factory=list)


@dataclass
class Hop:
    """One batch as it went: what the bench reports (`RelayTree.hops`)."""

    route: str
    workers: int
    relays: list[int]  # instance IDs of the relays used (none: called directly)
    failed: list[int]  # relays whose subtree was then called directly
    rounds: int  # sequential round trips on the critical path of this batch


class RelayTree:
    """A transaction's relay tree (one per Channel: what failed is remembered for it)."""

    def __init__(self, threshold: int = DEFAULT_THRESHOLD, fanout: int | None = None,
                 relay_concurrency: int = 64,
                 on_event: Callable[[str], None] | None = None) -> None:
        if type(threshold) is not int or threshold < 1:
            raise ValueError(f"the relay threshold must be a positive integer, not {threshold!r}")
        if fanout is not None and (type(fanout) is not int or fanout < 1):
            raise ValueError(f"the relay fan-out must be a positive integer, not {fanout!r}")
        self.threshold, self.fanout = threshold, fanout
        self.relay_concurrency = min(relay_concurrency, MAX_CONCURRENCY)
        self.on_event = on_event or (lambda msg: None)
        self.failed: set[int] = set()  # relays not used again
        self.hops: list[Hop] = []
        self._open: dict[tuple[str, bytes, float], _Batch] = {}
        self._sending: set[asyncio.Future] = set()

    async def call(self, ch: Channel, w: FleetWorker, route: AdminRoute, request: Any,
                   timeout: float | None) -> tuple[CallResult[Any], int | None]:
        """`route` on `w`, through a relay when its phase is relayed: the result and the
        relay's instance ID (None: called directly)."""
        if not relayable(route):
            return await _direct(ch, w, route, request, timeout), None
        body = msgspec.json.encode(request) if request is not None else b"{}"
        deadline = timeout or ch.timeout
        key = (route.name, body, deadline)
        batch = self._open.get(key)
        if batch is None:
            batch = self._open[key] = _Batch(route, body, deadline)
            asyncio.get_running_loop().call_soon(self._ripen, ch, key, batch, 1)
        waiting = _Waiting(w, asyncio.get_running_loop().create_future())
        batch.calls.append(waiting)
        answer = await waiting.answer
        if answer is None:
            return await _direct(ch, w, route, request, timeout), None
        return answer

    def _ripen(self, ch: Channel, key: tuple[str, bytes, float], batch: _Batch,
               turn: int) -> None:
        if turn < OPEN_TURNS:
            asyncio.get_running_loop().call_soon(self._ripen, ch, key, batch, turn + 1)
            return
        if self._open.get(key) is batch:
            del self._open[key]
        task = asyncio.ensure_future(self._send(ch, batch))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    def layout(self, workers: list[FleetWorker]) -> list[tuple[FleetWorker, list[FleetWorker]]]:
        """The relays among `workers` (in their order) and each one's subtree (itself
        first); empty when no worker can relay."""
        k = self.fanout or math.isqrt(len(workers) - 1) + 1
        relays = [w for w in workers if RELAY.name in w.routes
                  and w.instance_id not in self.failed][:k]
        if not relays:
            return []
        chosen = {id(w) for w in relays}
        rest = [w for w in workers if id(w) not in chosen]
        size, extra = divmod(len(rest), len(relays))
        out, start = [], 0
        for i, r in enumerate(relays):
            end = start + size + (1 if i < extra else 0)
            out.append((r, [r, *rest[start:end]]))
            start = end
        return out

    async def _send(self, ch: Channel, batch: _Batch) -> None:
        """Send the batch; whatever goes wrong here, every call still waiting is made
        directly (none waits past its phase for an answer that will not come)."""
        try:
            await self._relay(ch, batch)
        except Exception as e:
            log.exception("relaying %s failed", batch.route.name)
            self.on_event(f"relaying {batch.route.name} failed ({e!r}): its calls are made "
                          "directly")
        finally:
            for c in batch.calls:
                _settle(c, None)

    async def _relay(self, ch: Channel, batch: _Batch) -> None:
        calls = [c for c in batch.calls if not c.answer.done()]
        tree = self.layout([c.worker for c in calls]) if len(calls) > self.threshold else []
        if not tree:
            for c in calls:
                _settle(c, None)
            self.hops.append(Hop(batch.route.name, len(calls), [], [],
                                 -(-len(calls) // ch.concurrency)))
            return
        by_worker = {id(c.worker): c for c in calls}
        hop = Hop(batch.route.name, len(calls), [r.instance_id for r, _ in tree], [],
                  -(-len(tree) // ch.concurrency) + -(-max(len(s) for _, s in tree)
                                                      // self.relay_concurrency))
        self.hops.append(hop)
        await asyncio.gather(*(self._through(ch, batch, relay, [by_worker[id(w)] for w in sub],
                                             hop)
                               for relay, sub in tree))

    async def _through(self, ch: Channel, batch: _Batch, relay: FleetWorker,
                       sub: list[_Waiting], hop: Hop) -> None:
        """One relay call for `sub`; on its failure, `sub` is called directly."""
        req = RelayRequest(route=batch.route.name, request=msgspec.Raw(batch.body),
                           targets=[RelayTarget(instance_id=c.worker.instance_id,
                                                system_url=c.worker.system_url) for c in sub],
                           timeout=batch.timeout,
                           concurrency=min(len(sub), self.relay_concurrency))
        async with ch.slot():
            res = await ch.call(relay.system_url, RELAY, req, batch.timeout + GRACE)
        if res.stale_epoch:  # the relay itself refuses this epoch: so does the fleet
            for c in sub:
                _settle(c, (CallResult(batch.route, res.http_status, res.body,
                                       error=None), relay.instance_id))
            return
        results = {r.instance_id: r for r in res.reply.results} if res.ok else {}
        if not res.ok:
            self.failed.add(relay.instance_id)
            hop.failed.append(relay.instance_id)
            self.on_event(f"relay {relay.instance_id} failed ({_why(res)}): its "
                          f"{len(sub)} worker(s) are called directly")
        for c in sub:
            r = results.get(c.worker.instance_id)
            if r is None:
                _settle(c, None)
            else:
                _settle(c, (_result(batch.route, r.http_status, r.body, r.error),
                            relay.instance_id))


def _settle(c: _Waiting, answer: tuple[CallResult[Any], int | None] | None) -> None:
    if not c.answer.done():
        c.answer.set_result(answer)


def _why(res: CallResult[Any]) -> str:
    if res.unreachable:
        return f"unreachable: {res.error}"
    return f"HTTP {res.http_status}: {str(res.message)[:200]}"


def _result(route: AdminRoute, status: int | None, body: Any, error: str | None
            ) -> CallResult[Any]:
    """A relayed call's result, as the admin client makes a direct call's."""
    if status is None:
        why = error or "no answer"
        return CallResult(route, None, {"error": why}, error=why)
    return answered(route, status, body)


async def _direct(ch: Channel, w: FleetWorker, route: AdminRoute, request: Any,
                  timeout: float | None) -> CallResult[Any]:
    async with ch.slot():
        return await ch.call(w.system_url, route, request, timeout)
