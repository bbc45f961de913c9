"""Rollouts that never stop: the asynchronous RL loop (`Fleet.stream_rollouts`).

    stream = fleet.stream_rollouts(requests, batch_size=4, max_staleness=1, start_step=0)
    for step in range(1, steps + 1):
        batch = stream.next_batch()          # admitted samples, none beyond the bound
        trainer.step([s.sample for s in batch])
        stream.publish(save(step), f"step-{step}", step=step)  # rolling refresh, not awaited
    stream.close()

A producer keeps the fleet busy with the requests `requests` yields (an iterable of
`SampleRequest`, usually endless) while the trainer trains: it never holds more than
`max_ahead` samples (in flight plus admitted and not yet handed over) ahead of the trainer
(back-pressure). Each request asks the frontend for the policy steps the sample may come
from (`nvext.policy`: at or above the step the trainer will be at when it takes the sample,
minus `max_staleness`), and each admitted sample is checked again when it is handed over,
token span by token span (`Completion.weight_spans`, as the workers reported them): a
sample with a token from a step more than `max_staleness` below the trainer's is never
handed over; `on_stale` says whether it is dropped or generated again (under a new sample
ID: the ledger admits every sample ID once).

`publish` records the trainer's new step at once (staleness counts from it) and moves the
fleet to it with a refresh in the background (rolling, with `Fleet(mode="rolling")`: the
rest of the fleet keeps serving); it waits only for the previous refresh still running. A
refresh that fails, or whose coordinator dies mid-way, is run again (the next attempt
recovers the interrupted transaction from the journal first); one held because the fleet
is too small to roll (a wave would leave fewer than `min_serving` serving, say after a
worker died) runs synchronously instead, when `sync_fallback` allows it.

Interrupted generations (a worker paused or moved mid-generation, `on_stale` "abort" in
the request's bound) follow the Fleet's partial-rollout policy: `resume` continues on the
new policy, the earlier tokens kept with their spans (and counted at their own steps),
`discard` starts the sample over.

`stats` counts everything: samples handed, dropped, regenerated and failed, handed tokens
per staleness (trainer step minus the token's step, counted per span), the seconds the
trainer waited (for samples, for a previous refresh) and the seconds the fleet had
nothing in flight.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

from rlfleet.protocol.identity import UNKNOWN
from rlfleet.protocol.nvext import PolicyBound
from rlfleet.refresh.config import RefreshMode
from rlfleet.refresh.coordinator import PolicyRefresh
from rlfleet.refresh.probe import Probe
from rlfleet.refresh.transaction import RefreshResult
from rlfleet.rollout.client import RolloutClient
from rlfleet.rollout.ledger import AlreadyAdmitted
from rlfleet.rollout.sample import AdmittedSample, SampleFailed, SampleRequest

T = TypeVar("T")


class StreamHost(Protocol):
    """What a stream uses of the Fleet that builds it (rlfleet.rl.fleet.Fleet, which imports
    this module): its client, its coordinator and its event loop."""

    client: RolloutClient
    coordinator: PolicyRefresh | None
    _closed: bool

    def _run(self, coro: Coroutine[Any, Any, T]) -> T: ...

    async def _on_loop(self, coro: Coroutine[Any, Any, T]) -> T: ...

    async def arefresh(self, checkpoint: str | Path | None, version: str, *,
                       digest: str | None = None, probe: Probe | None = None,
                       tensors: Callable[[], Sequence[tuple[str, Any]]] | None = None,
                       step: int | None = None) -> RefreshResult: ...

log = logging.getLogger(__name__)


class OnStale(enum.StrEnum):
    DROP = "drop"  # count it and take the next sample
    REGENERATE = "regenerate"  # send its request again, under a new sample ID


@dataclass(frozen=True)
class StreamConfig:
    """`batch_size`: samples (requests) per `next_batch`; `max_staleness`: the most steps a
    handed token's policy may lag the trainer's; `max_ahead`: samples the producer holds
    ahead of the trainer (default max(1, max_staleness) × batch_size); `on_stale`: drop or
    regenerate a sample beyond the bound; `refresh_attempts`: tries per publish;
    `sync_fallback`: refresh synchronously when the fleet is too small to roll;
    `request_deadline`: seconds a request may take, all its attempts together."""

    batch_size: int
    max_staleness: int = 1
    max_ahead: int | None = None
    on_stale: OnStale = OnStale.REGENERATE
    refresh_attempts: int = 3
    sync_fallback: bool = True
    request_deadline: float = 600.0

    def __post_init__(self) -> None:
        if type(self.batch_size) is not int or self.batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, not {self.batch_size!r}")
        if type(self.max_staleness) is not int or self.max_staleness < 0:
            raise ValueError(f"max_staleness must be a non-negative integer (steps), not "
                             f"{self.max_staleness!r}")
        ahead = self.max_ahead if self.max_ahead is not None else \
            max(1, self.max_staleness) * self.batch_size
        if type(ahead) is not int or ahead < 1:
            raise ValueError(f"max_ahead must be an integer >= 1, not {self.max_ahead!r}")
        object.__setattr__(self, "max_ahead", ahead)
        try:
            object.__setattr__(self, "on_stale", OnStale(self.on_stale))
        except ValueError:
            raise ValueError(f"on_stale must be drop or regenerate, not {self.on_stale!r}") from None
        if type(self.refresh_attempts) is not int or self.refresh_attempts < 1:
            raise ValueError("refresh_attempts must be an integer >= 1")
        if not self.request_deadline > 0:
            raise ValueError("request_deadline must be positive (seconds)")


@dataclass(frozen=True)
class StreamedSample:
    """An admitted sample handed to the trainer. `steps`: the policy step of every span of
    every completion, in order; `staleness`: the trainer's step when it was handed minus
    the oldest of them; `request`: what was sent (a regenerated sample's ID has a `~rN`
    suffix); `origin`: the first sample ID of its request."""

    request: SampleRequest
    sample: AdmittedSample
    origin: str
    trainer_step: int
    steps: tuple[int, ...]
    staleness: int
    admitted_at: float
    handed_at: float


@dataclass
class StreamStats:
    """What the stream did; `tokens_by_staleness` counts handed tokens per staleness."""

    started: float = field(default_factory=time.monotonic)
    requested: int = 0
    admitted: int = 0
    handed: int = 0
    dropped_stale: int = 0
    regenerated: int = 0
    failed: int = 0
    batches: int = 0
    tokens_by_staleness: Counter = field(default_factory=Counter)
    trainer_wait_seconds: float = 0.0  # in next_batch
    refresh_wait_seconds: float = 0.0  # in publish, for the previous refresh
    fleet_idle_seconds: float = 0.0  # nothing in flight
    max_in_flight_ahead: int = 0  # the most samples held ahead at once (<= max_ahead)
    refreshes: list[dict[str, Any]] = field(default_factory=list)
    ended: float | None = None

    def elapsed(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    @property
    def max_staleness_seen(self) -> int | None:
        return max(self.tokens_by_staleness, default=None)

    @property
    def mean_staleness(self) -> float | None:
        n = sum(self.tokens_by_staleness.values())
        return sum(k * v for k, v in self.tokens_by_staleness.items()) / n if n else None

    def summary(self) -> dict[str, Any]:
        wall = self.elapsed()
        return {"seconds": wall, "requested": self.requested, "admitted": self.admitted,
                "handed": self.handed, "dropped_stale": self.dropped_stale,
                "regenerated": self.regenerated, "failed": self.failed,
                "batches": self.batches,
                "tokens_by_staleness": {str(k): v for k, v in
                                        sorted(self.tokens_by_staleness.items())},
                "mean_staleness": self.mean_staleness,
                "max_staleness_seen": self.max_staleness_seen,
                "trainer_idle_fraction": (self.trainer_wait_seconds + self.refresh_wait_seconds)
                / wall if wall else None,
                "fleet_idle_fraction": self.fleet_idle_seconds / wall if wall else None,
                "max_ahead_seen": self.max_in_flight_ahead,
                "refreshes": self.refreshes}


class StreamClosed(RuntimeError):
    """The stream was closed, or its producer stopped (the cause is chained)."""


def sample_steps(sample: AdmittedSample) -> list[tuple[int | None, int]]:
    """(policy step, tokens) of every span of every completion; a completion without spans
    counts as one span of the policy the worker reported."""
    out: list[tuple[int | None, int]] = []
    for c in sample.completions:
        spans = c.weight_spans
        if spans:
            out += [(s.step, s.end - s.start) for s in spans]
        else:
            out.append((sample.policy.step, len(c.token_ids)))
    return out


class RolloutStream:
    """See the module doc. Build it with `Fleet.stream_rollouts`; its blocking methods may be
    called from any thread but the Fleet's, the a-prefixed ones from any event loop."""

    def __init__(self, fleet: StreamHost, requests: Iterable[SampleRequest], config: StreamConfig,
                 start_step: int = 0) -> None:
        if fleet.coordinator is None:
            raise ValueError("the Fleet has no rl_url: a stream publishes every step")
        self.fleet, self.config = fleet, config
        self.step = start_step  # the trainer's policy step: staleness counts from it
        self.stats = StreamStats()
        self._source: Iterator[SampleRequest] = iter(requests)
        self._again: deque[tuple[SampleRequest, str, int]] = deque()  # to regenerate
        self._ready: deque[tuple[SampleRequest, str, int, AdmittedSample, float]] = deque()
        self._in_flight = 0
        self._taken = 0  # samples the trainer has taken (handed, and the ones being handed)
        self._published = 0  # publish calls so far: one per batch in the usual loop
        self._idle_since: float | None = time.monotonic()
        self._error: BaseException | None = None
        self._closed = False
        self._refresh: asyncio.Task | None = None
        self._sync_coordinator: PolicyRefresh | None = None
        self._tasks: set[asyncio.Task] = set()
        self._changed: asyncio.Condition | None = None
        self._producer: asyncio.Task | None = None

    # ------------------------------------------------------------ the producer

    async def _start(self) -> None:
        self._changed = asyncio.Condition()
        self._producer = asyncio.create_task(self._produce(), name="rlfleet-stream-producer")

    def _ahead(self) -> int:
        return self._in_flight + len(self._ready)

    def _floor(self) -> int:
        """The lowest step a sample sent now may come from: the step the trainer will be at
        when it takes it (one publish per batch), minus max_staleness."""
        position = self._taken + self._ahead()
        at = self.step + position // self.config.batch_size - self._published
        return max(0, max(at, self.step) - self.config.max_staleness)

    def _next_request(self) -> tuple[SampleRequest, str, int] | None:
        if self._again:
            return self._again.popleft()
        try:
            r = next(self._source)
        except StopIteration:
            return None
        return r, r.sample_id, 0

    async def _produce(self) -> None:
        cond = self._changed
        try:
            while True:
                async with cond:
                    await cond.wait_for(lambda: self._closed or self._error is not None
                                        or self._ahead() < self.config.max_ahead)
                    if self._closed or self._error is not None:
                        return
                    item = self._next_request()
                    if item is None:  # the source is exhausted: wait for regenerations
                        if not self._in_flight and not self._again:
                            return
                        await cond.wait()
                        continue
                    floor = self._floor()
                    self._in_flight += 1
                    self._busy()
                    self.stats.requested += 1
                    self.stats.max_in_flight_ahead = max(self.stats.max_in_flight_ahead,
                                                         self._ahead())
                task = asyncio.create_task(self._one(*item, floor))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except BaseException as e:
            self._error = e
            raise
        finally:
            async with cond:
                cond.notify_all()

    def _busy(self) -> None:
        if self._idle_since is not None:
            self.stats.fleet_idle_seconds += time.monotonic() - self._idle_since
            self._idle_since = None

    async def _one(self, req: SampleRequest, origin: str, generation: int, floor: int) -> None:
        """Generate one sample within [floor, ...] and queue it for the trainer."""
        s = self.config.max_staleness
        rules = replace(self.fleet.client.rules, expected=UNKNOWN, allow_mixed_versions=True,
                        policy=PolicyBound(min_step=floor, max_lag=s))
        got: AdmittedSample | None = None
        try:
            got = await self.fleet.client.generate(
                req.sample_id, req.prompt, req.sampling, req.n, rules=rules,
                deadline=time.monotonic() + self.config.request_deadline)
        except (SampleFailed, AlreadyAdmitted) as e:
            log.info("stream: sample %s not admitted: %s", req.sample_id, e)
        except Exception as e:  # a request that cannot be sent (ValueError, ...): say so
            self._error = e
        async with self._changed:
            self._in_flight -= 1
            if got is None:
                self.stats.failed += 1
                if self.config.on_stale is OnStale.REGENERATE and self._error is None:
                    self._regenerate(req, origin, generation)
            else:
                self.stats.admitted += 1
                self._ready.append((req, origin, generation, got, time.monotonic()))
            if not self._in_flight and self._idle_since is None:
                self._idle_since = time.monotonic()
            self._changed.notify_all()

    def _regenerate(self, req: SampleRequest, origin: str, generation: int) -> None:
        k = generation + 1
        self._again.append((replace(req, sample_id=f"{origin}~r{k}"), origin, k))
        self.stats.regenerated += 1

    # ------------------------------------------------------------ the trainer's side

    def _judge(self, req: SampleRequest, origin: str, generation: int, sample: AdmittedSample,
               admitted_at: float) -> StreamedSample | None:
        """The sample as handed at the trainer's step now, or None (dropped / regenerated)
        when a token's step is unknown or more than max_staleness below it."""
        spans = sample_steps(sample)
        steps = [st for st, _ in spans]
        if any(type(st) is not int for st in steps) or \
                self.step - min(steps) > self.config.max_staleness:
            self.stats.dropped_stale += 1
            if self.config.on_stale is OnStale.REGENERATE:
                self._regenerate(req, origin, generation)
            return None
        for st, n in spans:
            self.stats.tokens_by_staleness[self.step - st] += n
        return StreamedSample(req, sample, origin, self.step, tuple(steps),
                              self.step - min(steps), admitted_at, time.monotonic())

    async def _next_batch(self, timeout: float | None) -> list[StreamedSample]:
        t0 = time.monotonic()
        deadline = None if timeout is None else t0 + timeout
        batch: list[StreamedSample] = []
        taken: list[tuple] = []  # as they were queued: put back if the batch is not handed
        cond = self._changed
        try:
            async with cond:
                while len(batch) < self.config.batch_size:
                    self._check()
                    if not self._ready:
                        left = None if deadline is None else deadline - time.monotonic()
                        if left is not None and left <= 0:
                            raise TimeoutError(self._starved(len(batch)))
                        try:
                            await asyncio.wait_for(cond.wait(), left)
                        except TimeoutError:
                            raise TimeoutError(self._starved(len(batch))) from None
                        continue
                    item = self._ready.popleft()
                    got = self._judge(*item)
                    if got is not None:
                        batch.append(got)
                        taken.append(item)
                        self._taken += 1
                    cond.notify_all()  # room for the producer
        except BaseException:
            for b in batch:  # not handed: first in line for the next call
                for st, n in sample_steps(b.sample):
                    self.stats.tokens_by_staleness[b.trainer_step - st] -= n
            self.stats.tokens_by_staleness += Counter()  # drops the zero counts
            self._ready.extendleft(reversed(taken))
            self._taken -= len(batch)
            raise
        finally:
            self.stats.trainer_wait_seconds += time.monotonic() - t0
        self.stats.handed += len(batch)
        self.stats.batches += 1
        return batch

    def _check(self) -> None:
        if self._closed:
            raise StreamClosed("the stream is closed")
        if self._error is not None:
            raise StreamClosed(f"the stream's producer stopped: {self._error!r}") from self._error
        if self._producer is not None and self._producer.done() and not self._ready \
                and not self._in_flight:
            raise StreamClosed("the request source is exhausted and every sample is handed")

    def _starved(self, have: int) -> str:
        last = self.stats.refreshes[-1] if self.stats.refreshes else None
        return (f"no batch of {self.config.batch_size} within the timeout ({have} ready): "
                f"{self.stats.dropped_stale} sample(s) dropped as stale, {self.stats.failed} "
                f"failed, {self._in_flight} in flight; the trainer is at step {self.step}"
                + (f"; the last refresh: {last['decision']} ({last['reason']})" if last else ""))

    # ------------------------------------------------------------ publishing a step

    async def _publish(self, checkpoint: str | Path | None, version: str, step: int | None,
                       digest: str | None, probe: Probe | None,
                       tensors: Callable[[], Sequence[tuple[str, Any]]] | None) -> None:
        self._check()
        t0 = time.monotonic()
        if self._refresh is not None:
            await asyncio.wait([self._refresh])
        self.stats.refresh_wait_seconds += time.monotonic() - t0
        step = self.step + 1 if step is None else step
        if step <= self.step:
            raise ValueError(f"steps only increase: the trainer is at step {self.step}, not {step}")
        async with self._changed:
            self.step, self._published = step, self._published + 1
            self._changed.notify_all()
        self._refresh = asyncio.create_task(
            self._refresh_to(checkpoint, version, step, digest, probe, tensors))

    async def _refresh_to(self, checkpoint: str | Path | None, version: str, step: int,
                          digest: str | None, probe: Probe | None,
                          tensors: Callable[[], Sequence[tuple[str, Any]]] | None) -> None:
        """Move the fleet to `step`; again when an attempt fails or its coordinator dies."""
        for attempt in range(1, self.config.refresh_attempts + 1):
            t0 = time.monotonic()
            rec: dict[str, Any] = {"step": step, "version": version, "attempt": attempt,
                                   "started": t0 - self.stats.started}
            try:
                result = await self._one_refresh(checkpoint, version, step, digest, probe,
                                                 tensors, rec)
                rec.update(decision=result.decision, reason=result.reason,
                           moved=result.fleet_moved, refresh_id=result.refresh_id,
                           phase_seconds=result.step_seconds())
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # its coordinator died mid-refresh (or failed)
                if isinstance(e, KeyboardInterrupt | SystemExit):
                    raise
                rec.update(decision="error", reason=repr(e), moved=False)
                log.warning("stream: refresh to %s failed: %r", version, e)
            rec["seconds"] = time.monotonic() - t0
            self.stats.refreshes.append(rec)
            if rec["decision"] in ("reopened",) or self._closed:
                return
            await asyncio.sleep(min(2.0, 0.25 * 2 ** attempt))

    async def _one_refresh(self, checkpoint, version, step, digest, probe, tensors,
                           rec: dict[str, Any]) -> RefreshResult:
        coord = self.fleet.coordinator  # read each time: a new coordinator may have taken over
        if rec["attempt"] > 1:  # an interrupted attempt is recovered first
            recovered = await coord.recover()
            if recovered is not None:
                rec["recovered"] = f"{recovered.decision}: {recovered.reason}"
            c = coord.current
            if c is not None and (c.version, c.step) == (version, step):
                # the recovery rolled the interrupted refresh forward: the fleet is there
                return recovered or await coord.admit_new_workers()
        result = await self.fleet.arefresh(checkpoint, version, digest=digest, probe=probe,
                                           tensors=tensors, step=step)
        if result.decision == "held" and coord.mode is RefreshMode.ROLLING and \
                "min_serving" in result.reason and self.config.sync_fallback:
            rec["rolling_held"] = result.reason
            rec["mode"] = "sync"
            if self._sync_coordinator is None:  # on the Fleet's journal (the Fleet closes it)
                self._sync_coordinator = PolicyRefresh(
                    config=coord.config.replace(mode=RefreshMode.SYNC), journal=coord.journal,
                    rollout_gate=coord.rollout_gate, on_event=coord.on_event)
            result = await self._sync_coordinator.refresh(checkpoint, version, digest=digest,
                                                          probe=probe, tensors=tensors,
                                                          step=step)
        else:
            rec["mode"] = coord.mode.value
        return result

    async def _wait_refreshed(self, timeout: float | None) -> None:
        if self._refresh is not None:
            await asyncio.wait_for(asyncio.shield(self._refresh), timeout)

    # ------------------------------------------------------------ lifetime

    async def _aclose(self) -> None:
        if self._changed is None:
            return
        async with self._changed:
            self._closed = True
            self._changed.notify_all()
        tasks = [t for t in (self._producer, *self._tasks) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._refresh is not None:  # let a running refresh finish: never a half-moved fleet
            await asyncio.gather(self._refresh, return_exceptions=True)
        if self._idle_since is not None:
            self.stats.fleet_idle_seconds += time.monotonic() - self._idle_since
            self._idle_since = None
        self.stats.ended = time.monotonic()

    # ------------------------------------------------------------ the public methods

    def next_batch(self, timeout: float | None = None) -> list[StreamedSample]:
        """The next `batch_size` samples within the bound at the trainer's step (waiting for
        them; TimeoutError after `timeout` seconds, saying why none came)."""
        return self.fleet._run(self._next_batch(timeout))

    def publish(self, checkpoint: str | Path | None, version: str, *, step: int | None = None,
                digest: str | None = None, probe: Probe | None = None,
                tensors: Callable[[], Sequence[tuple[str, Any]]] | None = None) -> None:
        """The trainer is at `step` now (default: one more); move the fleet to the
        checkpoint in the background (see `Fleet.refresh` for the arguments). Waits only
        for the previous refresh, if it still runs."""
        self.fleet._run(self._publish(checkpoint, version, step, digest, probe, tensors))

    def wait_refreshed(self, timeout: float | None = None) -> None:
        """Until the last published step's refresh has ended (however it ended)."""
        self.fleet._run(self._wait_refreshed(timeout))

    def close(self) -> None:
        """Stop producing (requests in flight are canceled) and let a running refresh end."""
        if not self.fleet._closed:
            self.fleet._run(self._aclose())

    async def aclose(self) -> None:
        await self.fleet._on_loop(self._aclose())

    def __enter__(self) -> RolloutStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def numbered(make: Callable[[int], SampleRequest]) -> Iterator[SampleRequest]:
    """An endless request source: make(0), make(1), ..."""
    return map(make, itertools.count())
