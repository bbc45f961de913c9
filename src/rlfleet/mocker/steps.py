"""The mocker's engine iterations (`--engine-steps`, declared simulator): one batch at a time
per worker, as vLLM's scheduler runs them and as NVIDIA Dynamo 1.6.1's `dynamo.mocker`
simulates them, so that requests on one worker contend for its time.

Each iteration takes every running request that has its first token (one decode token each,
all its choices) and, first come first served, prompt tokens of requests still in prefill:
chunks of their uncached tokens up to `--max-num-batched-tokens` per iteration (decode
tokens count against it), at most `--max-batch` requests running. A request's prefix-cache
lookup happens when it is admitted, and the blocks an iteration will compute are cached
when it is planned (as vLLM caches blocks when it allocates them): of the n samples of one
prompt admitted together, one computes the prompt and the others find it. An iteration
lasts `--prefill-delay` x its prompt tokens + `--token-delay` when it decodes anything, and
every request it served gets one token (a request whose prefill it finished, its first).

A running request holds its prompt's blocks (the cache evicts others first) and, with
`--uncached-completions`, a block for every block-size tokens it generates, which no prompt
matches (as Dynamo's mocker keeps decode blocks); they age out once it ends. Iterations run
back to back on the event loop's clock: the time this process takes to hand out tokens does
not stretch the simulated time.

What it does not simulate: preemption (when every block is held the cache grows past its
capacity), and a decode step's cost growing with the batch. Nothing here says how a real
engine's time is spent."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Sequence

from rlfleet.mocker.cache import PrefixCache, Salt

DEFAULT_BATCHED_TOKENS = 8192  # vLLM's (and Dynamo's mocker's) max_num_batched_tokens


class Seq:
    """One request's place in the simulated batch."""

    __slots__ = ("prompt", "salt", "width", "wake", "todo", "cached", "admitted", "ready",
                 "hashes", "made", "held")

    def __init__(self, prompt: Sequence[int], salt: Salt, width: int,
                 wake: Callable[[], None]) -> None:
        self.prompt, self.salt, self.width = prompt, salt, width  # width: its choices (n)
        self.wake = wake  # called when an iteration computed a token for it
        self.todo = -1  # prompt tokens left to compute (-1: not admitted yet)
        self.cached = 0  # prompt tokens its admission found cached
        self.admitted = False
        self.ready = 0  # tokens computed for it and not yet taken (`take`)
        self.hashes: list[int] = []  # its prompt's blocks (held while it runs)
        self.made = 0  # tokens generated (per choice)
        self.held: list[int] = []  # the blocks its generated tokens take (with `occupy`)

    @property
    def decoding(self) -> bool:
        return self.admitted and self.todo == 0

    def give(self) -> None:
        self.ready += 1
        self.wake()

    def take(self) -> bool:
        """Take a computed token (False: none yet)."""
        if self.ready == 0:
            return False
        self.ready -= 1
        return True


class EngineSteps:
    """The iterations of one simulated engine (see the module doc)."""

    def __init__(self, cache: PrefixCache, prefill_delay: float, token_delay: float,
                 max_seqs: int | None, max_tokens: int = DEFAULT_BATCHED_TOKENS,
                 occupy: bool = False) -> None:
        if max_tokens < 1:
            raise ValueError("max-num-batched-tokens must be at least 1")
        self.cache, self.prefill_delay, self.token_delay = cache, prefill_delay, token_delay
        self.max_seqs, self.max_tokens = max_seqs, max_tokens
        self.occupy = occupy  # generated tokens take cache blocks (no prompt matches them)
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.held = False
        self._work = asyncio.Event()
        self._task: asyncio.Task | None = None

    def join(self, seq: Seq) -> None:
        """Queue a request for admission (its iterations start with the next one)."""
        self.waiting.append(seq)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        self._work.set()

    def hold(self, held: bool) -> None:
        """Stop running iterations (a keep-pause freezes the batch), or run them again."""
        self.held = held
        self._work.set()

    def leave(self, seq: Seq) -> None:
        """The request ended (or was aborted): it takes no more iterations, and holds no
        more blocks."""
        if seq.admitted:
            self.cache.unpin(seq.hashes + seq.held)
        with contextlib.suppress(ValueError):
            self.running.remove(seq)
        with contextlib.suppress(ValueError):
            self.waiting.remove(seq)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _plan(self) -> tuple[list[Seq], list[tuple[Seq, int]]]:
        """The next iteration: the requests that decode, and the prompt chunks it computes
        (admitting waiting requests, first come first served, while there is room)."""
        decoders = [s for s in self.running if s.decoding]
        budget = self.max_tokens - sum(s.width for s in decoders)
        chunks: list[tuple[Seq, int]] = []
        for s in self.running:
            if not s.decoding and budget > 0:
                budget -= self._chunk(s, budget, chunks)
        seqs = sum(s.width for s in self.running)
        while self.waiting and budget > 0:
            s = self.waiting[0]
            if self.max_seqs is not None and seqs + s.width > self.max_seqs and self.running:
                break
            self.waiting.popleft()
            s.hashes = self.cache.hashes(s.prompt, s.salt)
            self.cache.pin(s.hashes)
            s.cached = self.cache.match(s.prompt, s.salt, s.hashes)
            s.todo, s.admitted = len(s.prompt) - s.cached, True
            self.running.append(s)
            seqs += s.width
            budget -= self._chunk(s, budget, chunks)
        return decoders, chunks

    def _chunk(self, s: Seq, budget: int, chunks: list[tuple[Seq, int]]) -> int:
        """Schedule the next chunk of `s`'s prompt; its blocks are cached as they are
        allocated (as vLLM does): a request admitted into the same iteration finds them."""
        take = min(s.todo, budget)
        chunks.append((s, take))
        done = len(s.prompt) - s.todo + take
        self.cache.store(s.prompt[:done], s.salt, s.hashes[:done // self.cache.block_size])
        return take

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time()
        while True:
            while self.held or not (self.running or self.waiting):
                self._work.clear()
                await self._work.wait()
                end = loop.time()  # idle: the next iteration starts now
            decoders, chunks = self._plan()
            prefill = sum(take for _, take in chunks)
            # back to back: an iteration starts when the one before ended, however long this
            # process took to hand out its tokens (the simulated time does not drift)
            end = max(end, loop.time() - self.token_delay) + self.prefill_delay * prefill + \
                (self.token_delay if decoders else 0.0)
            await asyncio.sleep(max(0.0, end - loop.time()))  # 0: the requests run between
            for s, take in chunks:
                s.todo -= take
                if s.todo == 0 and s in self.running:
                    s.give()  # its first token
            for s in decoders:
                if s in self.running:
                    s.give()
                    self._generated(s)

    def _generated(self, s: Seq) -> None:
        """`s` made one more token per choice: a full block of them takes a cache place."""
        s.made += 1
        if self.occupy and s.made % self.cache.block_size == 0:
            s.held += [self.cache.occupy() for _ in range(s.width)]
