"""Fleet: the one object a trainer holds.

    fleet = Fleet("http://127.0.0.1:8000", "tiny", rl_url="http://127.0.0.1:8001",
                  ledger="ledger.sqlite")
    outcomes = fleet.rollout([SampleRequest("s-1", "Hello", SamplingSpec(max_tokens=32))])
    result = fleet.refresh("checkpoints/step-1", "step-1")  # gate, apply, verify, reopen
    assert result.fleet_moved  # every selected worker moved; only step-1 is admitted now
    fleet.close()

It joins a `RolloutClient` (rollouts through the frontend, admission checks, the sample
ledger), a `PolicyRefresh` (the fleet's policy, through the RL listener and the workers'
system servers) and the `RolloutGate` between them, and runs them on an event loop of its
own in a background thread. So the plain methods (`generate`, `rollout`, `refresh`,
`tokenize`) can be called from any thread, several at once, and the `a`-prefixed ones
(`agenerate`, `arollout`, `arefresh`, `atokenize`) from any event loop.

After a refresh that reopens the fleet on its target (or rolls it back), the fleet admits
only samples of the policy it now serves (`expect` is called for you). A refresh that
holds the fleet leaves it gated: `rollout` then raises `FleetHeld` until a later refresh
reopens it. `RefreshResult.fleet_moved` says whether every selected worker moved.

With `mode="rolling"` (and `max_lag`, `min_serving`: see `PolicyRefresh`) the fleet keeps
serving while it moves, and admits by staleness instead: from the start of a refresh to
step N, samples ask for (and are checked against) `PolicyBound(min_step=N - max_lag,
max_lag=max_lag)`; samples whose tokens span two steps (an update under a keep-pause) need
`allow_mixed_versions=True`.

`stream_rollouts` runs the asynchronous loop (rlfleet.rl.stream): rollouts go on while the
trainer trains, and every sample handed over is within `max_staleness` steps of the
trainer's policy, token span by token span.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx

from rlfleet.protocol.nvext import PolicyBound
from rlfleet.refresh.config import RefreshConfig, RefreshMode, UpdatePath
from rlfleet.refresh.coordinator import PolicyRefresh
from rlfleet.refresh.probe import Probe
from rlfleet.refresh.transaction import RefreshResult
from rlfleet.rl.stream import RolloutStream, StreamConfig
from rlfleet.rollout.client import RolloutClient
from rlfleet.rollout.gate import RolloutGate
from rlfleet.rollout.ledger import SampleLedger
from rlfleet.rollout.partial import PartialRolloutPolicy
from rlfleet.rollout.retry import RetryPolicy
from rlfleet.rollout.sample import (
    AdmittedSample,
    Chat,
    RolloutOutcome,
    SampleRequest,
    SamplingSpec,
)

T = TypeVar("T")

#: how a Fleet refreshes unless told otherwise: every worker stages the checkpoint while it
#: serves (read once, straight into a shadow of the model), and the pause holds only the
#: swap; a worker that cannot stage it installs it from disk (rlfleet.refresh.staged)
DEFAULT_PATH = UpdatePath.VLLM_STAGED


class FleetHeld(RuntimeError):
    """The last policy refresh left the fleet gated (`result` says why); refresh again to
    reopen it."""

    def __init__(self, result: RefreshResult) -> None:
        super().__init__(f"the fleet is held by refresh {result.refresh_id} to "
                         f"{result.policy.version}: {result.reason}; run a refresh that "
                         f"reopens it before rolling out")
        self.result = result


class Fleet:
    """Rollouts and policy refreshes of one served model.

    url: the frontend; model: the served model name; rl_url: the frontend's RL listener
    (needed for `refresh`); ledger: a `SampleLedger`, a path for one, or None (in memory);
    journal: the refresh journal (a path, ":memory:" or etcd://...; default: the config's);
    retry, partial, route, stream: as for `RolloutClient`; concurrency: samples in flight
    per `rollout` call; rollout_timeout: seconds after which a `rollout` or `generate` call
    starts no attempt and stops waiting for a closed gate (None: no bound; each attempt
    still has the retry policy's timeout); expected_version / expected_digest: the policy
    the fleet serves at start, if known (a refresh sets them). How it refreshes: `refresh`
    (a `RefreshConfig`), with the other keyword arguments (RefreshConfig's fields:
    on_failure, pause_mode, min_workers, probe_tolerance, timeout, admin_token, path, mode,
    max_lag, ...; or PolicyRefresh's on_event, hooks) set in it; without `refresh`, `path`
    is `vllm-staged` unless given (`DEFAULT_PATH`: stage first, pause only for the swap) and
    the post-update probe runs once the fleet reopened (`probe_after_reopen`). A
    fleet that refreshes a LoRA adapter (`path="vllm-adapter", adapter=NAME`) whose model is
    NAME admits only that adapter's samples (a model that is not NAME: only the base
    model's)."""

    def __init__(self, url: str, model: str, *, rl_url: str | None = None,
                 ledger: SampleLedger | str | Path | None = None,
                 journal: str | Path | None = None, retry: RetryPolicy | None = None,
                 partial: PartialRolloutPolicy | None = None, route: str = "openai",
                 stream: bool = False, concurrency: int = 64,
                 rollout_timeout: float | None = 600.0,
                 expected_version: Any = None, expected_digest: Any = None,
                 allow_mixed_versions: bool = False,
                 transport: httpx.AsyncBaseTransport | None = None,
                 refresh: RefreshConfig | None = None, **refresh_options: Any) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        rl_url = rl_url or (refresh.rl_url if refresh else None)
        self.url, self.model, self.rl_url = url, model, rl_url
        self.concurrency, self.rollout_timeout = concurrency, rollout_timeout
        self._own_ledger = not isinstance(ledger, SampleLedger)
        self.ledger = ledger if isinstance(ledger, SampleLedger) else SampleLedger(ledger or ":memory:")
        self.rollout_gate = RolloutGate()
        adapter = refresh_options.get("adapter", refresh.adapter if refresh else None)
        self.client = RolloutClient(url, model, ledger=self.ledger, retry=retry, partial=partial,
                                    expected_version=expected_version,
                                    expected_digest=expected_digest,
                                    allow_mixed_versions=allow_mixed_versions,
                                    adapter=adapter == model if adapter else None, route=route,
                                    stream=stream, gate=self.rollout_gate, transport=transport)
        if refresh is None:  # stage first, pause only for the swap (RefreshConfig.path)
            refresh_options.setdefault("path", DEFAULT_PATH)
            refresh_options.setdefault("probe_after_reopen", True)
        self.coordinator = PolicyRefresh(
            rl_url, config=refresh, model=model, journal=journal,
            rollout_gate=self.rollout_gate, **refresh_options) if rl_url else None
        self.last_refresh: RefreshResult | None = None
        self.held: RefreshResult | None = None  # the refresh that left the fleet gated
        self._refreshing = 0
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rlfleet-fleet",
                                        daemon=True)
        self._thread.start()
        self._refresh_lock = self._run(self._new_lock())  # refreshes run one at a time

    @staticmethod
    async def _new_lock() -> asyncio.Lock:
        return asyncio.Lock()

    # ------------------------------------------------------------ plumbing

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the fleet's loop and wait for it (from any other thread)."""
        if self._closed:
            coro.close()
            raise RuntimeError("this Fleet is closed")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a blocking Fleet method was called on the Fleet's own event "
                               "loop: await its a-prefixed twin instead")
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result()
        except BaseException:
            fut.cancel()  # e.g. Ctrl-C while waiting: the rollout's requests are canceled
            raise

    async def _on_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro` on the fleet's loop from whatever loop the caller runs."""
        if self._closed:
            coro.close()
            raise RuntimeError("this Fleet is closed")
        if asyncio.get_running_loop() is self._loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def _deadline(self, options: dict[str, Any]) -> dict[str, Any]:
        if self.rollout_timeout is not None and "deadline" not in options:
            options = {**options, "deadline": time.monotonic() + self.rollout_timeout}
        return options

    def _check_open(self) -> None:
        """A fleet left gated by a held refresh serves nothing: say so at once."""
        if self.held is not None and not self.rollout_gate.is_open and not self._refreshing:
            raise FleetHeld(self.held)

    # ------------------------------------------------------------ rollouts

    async def _generate(self, sample_id: str, prompt: Any, sampling: SamplingSpec | None,
                        n: int, options: dict[str, Any]) -> AdmittedSample:
        self._check_open()
        return await self.client.generate(sample_id, prompt, sampling, n, **options)

    async def _rollout(self, samples: list[SampleRequest], concurrency: int,
                       options: dict[str, Any]) -> list[RolloutOutcome]:
        self._check_open()
        return await self.client.rollout(samples, concurrency=concurrency, **options)

    def generate(self, sample_id: str, prompt: Any, sampling: SamplingSpec | None = None,
                 n: int = 1, **options: Any) -> AdmittedSample:
        """One sample, admitted, or an exception (`RolloutClient.generate`). `prompt`: token
        IDs, text, chat messages, `Chat` or `NextTurn`."""
        return self._run(self._generate(sample_id, prompt, sampling, n, self._deadline(options)))

    async def agenerate(self, sample_id: str, prompt: Any, sampling: SamplingSpec | None = None,
                        n: int = 1, **options: Any) -> AdmittedSample:
        return await self._on_loop(self._generate(sample_id, prompt, sampling, n,
                                                  self._deadline(options)))

    def rollout(self, samples: Iterable[SampleRequest], concurrency: int | None = None,
                **options: Any) -> list[RolloutOutcome]:
        """Every sample, at most `concurrency` at a time; one outcome per sample in input
        order (admitted, or the reason it is not). `options` go to `generate`."""
        return self._run(self._rollout(list(samples), concurrency or self.concurrency,
                                       self._deadline(options)))

    async def arollout(self, samples: Iterable[SampleRequest], concurrency: int | None = None,
                       **options: Any) -> list[RolloutOutcome]:
        return await self._on_loop(self._rollout(list(samples), concurrency or self.concurrency,
                                                 self._deadline(options)))

    def tokenize(self, prompt: str | Chat | list[dict[str, Any]], **options: Any) -> list[int]:
        """The IDs a worker's tokenizer (and chat template) makes of `prompt`."""
        return self._run(self.client.tokenize(prompt, **options))

    async def atokenize(self, prompt: str | Chat | list[dict[str, Any]], **options: Any
                        ) -> list[int]:
        return await self._on_loop(self.client.tokenize(prompt, **options))

    def expect(self, version: Any = None, digest: Any = None) -> None:
        """Admit only samples of this policy from now on (a refresh does it for you)."""
        self.client.expect(version, digest)

    @property
    def expected(self) -> tuple[Any, Any]:
        """(version, digest) a sample must come from; (None, None): any."""
        expected = self.client.rules.expected
        return expected.version, expected.digest

    def stream_rollouts(self, requests: Iterable[SampleRequest], batch_size: int, *,
                        max_staleness: int = 1, start_step: int | None = None,
                        **config: Any) -> RolloutStream:
        """Start the asynchronous loop (rlfleet.rl.stream) on `requests` (an iterable of
        SampleRequest, usually endless): `batch_size` samples per `next_batch`, none with a
        token more than `max_staleness` steps behind the trainer's step (`start_step`:
        the step the fleet serves now, default the coordinator's); `config`: the other
        StreamConfig fields (max_ahead, on_stale, refresh_attempts, sync_fallback,
        request_deadline)."""
        if start_step is None:
            current = self.coordinator.current if self.coordinator else None
            start_step = current.step if current is not None and current.step is not None else 0
        stream = RolloutStream(self, requests, StreamConfig(batch_size, max_staleness, **config),
                               start_step)
        self._run(stream._start())
        return stream

    # ------------------------------------------------------------ policy refresh

    async def _refresh(self, checkpoint: str | Path | None, version: str, digest: str | None,
                       probe: Probe | None,
                       tensors: Callable[[], Sequence[tuple[str, Any]]] | None,
                       step: int | None) -> RefreshResult:
        if self.coordinator is None:
            raise RuntimeError("this Fleet has no rl_url (the frontend's RL listener): it "
                               "cannot refresh the fleet's policy")
        async with self._refresh_lock:
            rolling = self.coordinator.mode is RefreshMode.ROLLING
            if rolling:  # the bound moves before the first wave serves the new step
                step = self.coordinator.next_step(step)
                lag = self.coordinator.config.max_lag
                self.client.expect(None, None)
                self.client.bound(PolicyBound(min_step=max(0, step - lag), max_lag=lag))
            self._refreshing += 1
            try:
                result = await self.coordinator.refresh(checkpoint, version, digest=digest,
                                                        probe=probe, tensors=tensors, step=step)
            finally:
                self._refreshing -= 1
            self.last_refresh = result
            if rolling:
                self.held = result if result.decision == "fenced" else None
            elif result.decision in ("reopened", "rolled_back"):
                # the policy the fleet serves now, whichever it is, and nothing else
                self.client.expect(result.policy.version, result.policy.digest)
                self.held = None
            else:
                self.held = result
            return result

    def refresh(self, checkpoint: str | Path | None, version: str, *, digest: str | None = None,
                probe: Probe | None = None,
                tensors: Callable[[], Sequence[tuple[str, Any]]] | None = None,
                step: int | None = None) -> RefreshResult:
        """Move the fleet to the checkpoint (declared `version`; `digest` computed when not
        given; `probe`: the greedy tokens and logprobs every worker must reproduce, default
        a transformers forward pass of the checkpoint). New rollouts wait while it runs.
        The result's `fleet_moved` says whether every selected worker moved."""
        return self._run(self._refresh(checkpoint, version, digest, probe, tensors, step))

    async def arefresh(self, checkpoint: str | Path | None, version: str, *,
                       digest: str | None = None, probe: Probe | None = None,
                       tensors: Callable[[], Sequence[tuple[str, Any]]] | None = None,
                       step: int | None = None) -> RefreshResult:
        return await self._on_loop(self._refresh(checkpoint, version, digest, probe, tensors, step))

    # ------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Close the HTTP client (and the ledger, if the fleet opened it) and stop the loop."""
        if self._closed:
            return
        if threading.current_thread() is self._thread:
            raise RuntimeError("close the Fleet from outside its own event loop (await aclose)")
        try:
            asyncio.run_coroutine_threadsafe(self.client.aclose(), self._loop).result()
        finally:
            self._closed = True
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
            if self._own_ledger:
                self.ledger.close()
            if self.coordinator is not None:
                self.coordinator.close()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Fleet:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
