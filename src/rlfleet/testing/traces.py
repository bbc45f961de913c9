"""RL rollout workloads as replayable traces (tests and bench/rl_routing.py share them).

A `Trace` is a list of `TraceRequest`s, deterministic by seed, with token-ID prompts, written
as JSONL (a header line, then one request per line) so that any router can replay it:

- `grpo`: P prompts x n samples (GRPO groups): each prompt one of F long task preambles plus
  a question of its own; the n samples of a prompt are n requests with the same prompt, all
  arriving at once (a synchronous GRPO batch);
- `agent`: E multi-turn agent episodes x T turns: a system prompt all episodes share, a task
  of the episode's own, then every turn appends the model's output of the turn before and a
  tool result of L tokens, so that the context grows turn by turn; episodes arrive spread
  over `spread` seconds, each turn `think` seconds (the tool) after the one before ends;
- `mix`: both, with episodes and groups arriving over time.

A request names the request it continues (`after`): its prompt is that request's prompt, its
output as the engine returned it (token IDs), then `append`. A request without `after` has
its whole `prompt`. `session` is the episode (sent as X-Session-ID; its `last` turn ends the
session: POST /finish_session), `group` the GRPO group.

`replay` sends a trace through a `Client` (an OpenAI `/v1/completions` endpoint of rlfleet or
Dynamo, or SGLang's `/generate` behind sglang-router) at a fixed concurrency and returns
each request's `Outcome`; `summary` turns them into output tok/s, TTFT p50/p90 and the load
per worker. `sequential=True` sends one request at a time in trace order, ignoring arrival
times: the same trace then reaches a router as the same sequence of requests every time."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import msgspec

TOKENS = (1000, 4000)  # token IDs drawn from here: plain vocabulary entries of the test models


class TraceRequest(msgspec.Struct, omit_defaults=True):
    id: str
    max_tokens: int
    at: float = 0.0  # seconds after the replay starts before it may be sent
    prompt: list[int] | None = None  # the whole prompt (no `after`)
    after: str | None = None  # the request it continues (its prompt and output come first)
    append: list[int] = []  # tokens after `after`'s prompt and output (a tool result)
    think: float = 0.0  # seconds after `after` ends before it is sent
    session: str | None = None
    last: bool = False  # the last request of its session
    group: str | None = None


class Trace(msgspec.Struct):
    kind: str
    seed: int
    params: dict[str, Any]
    requests: list[TraceRequest]

    def dump(self, path: Path) -> Path:
        """Write the trace as JSONL: a header line (kind, seed, params), then the requests."""
        enc = msgspec.json.Encoder()
        with open(path, "wb") as f:
            f.write(enc.encode({"kind": self.kind, "seed": self.seed, "params": self.params}))
            for r in self.requests:
                f.write(b"\n" + enc.encode(r))
            f.write(b"\n")
        return path

    @classmethod
    def load(cls, path: Path) -> Trace:
        lines = [ln for ln in Path(path).read_bytes().splitlines() if ln.strip()]
        if not lines:
            raise ValueError(f"{path}: an empty trace (a header line is missing)")
        head = json.loads(lines[0])
        reqs = [msgspec.json.decode(ln, type=TraceRequest) for ln in lines[1:]]
        trace = cls(head["kind"], head["seed"], head["params"], reqs)
        trace.check()
        return trace

    def check(self) -> None:
        """ValueError unless every request continues one that comes before it (so that a
        replay can always send it) and has a prompt."""
        seen: set[str] = set()
        for r in self.requests:
            if r.id in seen:
                raise ValueError(f"request {r.id!r} appears twice")
            if (r.after is None) == (r.prompt is None):
                raise ValueError(f"request {r.id!r} needs exactly one of prompt, after")
            if r.after is not None and r.after not in seen:
                raise ValueError(f"request {r.id!r} continues {r.after!r}, not before it")
            seen.add(r.id)

    def prompt_tokens_known(self) -> int:
        """The prompt tokens the trace fixes (without the outputs a replay appends)."""
        return sum(len(r.prompt or ()) + len(r.append) for r in self.requests)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKENS) for _ in range(n)]


def grpo(seed: int = 0, prompts: int = 8, n: int = 8, families: int = 2,
         preamble: int = 1024, question: int = 256, max_tokens: int = 64,
         at: float = 0.0) -> Trace:
    rng = random.Random(seed)
    pre = [_tokens(rng, preamble) for _ in range(families)]
    reqs = []
    for p in range(prompts):
        prompt = pre[p % families] + _tokens(rng, question)
        reqs += [TraceRequest(f"g{p}-s{s}", max_tokens, at=at, prompt=prompt, group=f"g{p}")
                 for s in range(n)]
    return Trace("grpo", seed, dict(prompts=prompts, n=n, families=families,
                                    preamble=preamble, question=question,
                                    max_tokens=max_tokens), reqs)


def _episode(rng: random.Random, name: str, system: list[int], task: int, turns: int,
             tool: int, max_tokens: int, at: float, think: float) -> list[TraceRequest]:
    first = TraceRequest(f"{name}-t0", max_tokens, at=at, prompt=system + _tokens(rng, task),
                         session=name, last=turns == 1)
    out = [first]
    for t in range(1, turns):
        out.append(TraceRequest(f"{name}-t{t}", max_tokens, at=at, after=out[-1].id,
                                append=_tokens(rng, tool), think=think, session=name,
                                last=t == turns - 1))
    return out


def agent(seed: int = 0, episodes: int = 16, turns: int = 8, system: int = 1024,
          task: int = 256, tool: int = 256, max_tokens: int = 64, spread: float = 2.0,
          think: float = 0.2) -> Trace:
    rng = random.Random(seed)
    sys_ = _tokens(rng, system)
    reqs: list[TraceRequest] = []
    for e in range(episodes):
        at = round(spread * e / max(1, episodes), 3)
        reqs += _episode(rng, f"e{e}", sys_, task, turns, tool, max_tokens, at, think)
    return Trace("agent", seed, dict(episodes=episodes, turns=turns, system=system, task=task,
                                     tool=tool, max_tokens=max_tokens, spread=spread,
                                     think=think), reqs)


def mix(seed: int = 0, episodes: int = 8, turns: int = 6, groups: int = 6, n: int = 8,
        system: int = 1024, task: int = 256, tool: int = 256, preamble: int = 1024,
        question: int = 256, max_tokens: int = 64, duration: float = 20.0,
        think: float = 0.2) -> Trace:
    """Episodes and GRPO groups arriving at random over `duration` seconds (one shared
    system prompt for the episodes, one preamble for the groups)."""
    rng = random.Random(seed)
    sys_, pre = _tokens(rng, system), _tokens(rng, preamble)
    reqs: list[TraceRequest] = []
    for e in range(episodes):
        at = round(rng.uniform(0, duration), 3)
        reqs += _episode(rng, f"e{e}", sys_, task, turns, tool, max_tokens, at, think)
    for g in range(groups):
        at = round(rng.uniform(0, duration), 3)
        prompt = pre + _tokens(rng, question)
        reqs += [TraceRequest(f"g{g}-s{s}", max_tokens, at=at, prompt=prompt, group=f"g{g}")
                 for s in range(n)]
    return Trace("mix", seed, dict(episodes=episodes, turns=turns, groups=groups, n=n,
                                   system=system, task=task, tool=tool, preamble=preamble,
                                   question=question, max_tokens=max_tokens,
                                   duration=duration, think=think), reqs)


KINDS = {"grpo": grpo, "agent": agent, "mix": mix}


# ------------------------------------------------------------------ replay

@dataclass
class Outcome:
    id: str
    prompt_len: int
    start: float  # seconds after the replay began
    ttft: float
    latency: float
    output: list[int]
    worker: str | None = None  # the worker that served it, where the stack says
    cached: int | None = None  # prompt tokens its engine found cached, where it says


class Client(Protocol):
    async def send(self, http: httpx.AsyncClient, req: TraceRequest,
                   prompt: list[int]) -> tuple[list[int], float, str | None, int | None]:
        """Send one request (streamed): (output token IDs, TTFT, worker, cached tokens)."""

    async def finish(self, http: httpx.AsyncClient, session: str) -> None:
        """The session's last request ended."""


async def _sse(http: httpx.AsyncClient, url: str, body: dict, headers: dict[str, str]
               ) -> Iterable[tuple[float, dict]]:
    """The JSON events of one streamed request, each with when it came (perf_counter)."""
    out = []
    async with http.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                out.append((time.perf_counter(), json.loads(line[6:])))
    return out


@dataclass
class OpenAIClient:
    """`/v1/completions` with token-ID prompts, streamed, the worker from `nvext.worker_id`
    (rlfleet and Dynamo both answer it). `session_header`: the header that carries the
    session (X-Session-ID for rlfleet, X-Dynamo-Session-ID for Dynamo; None: not sent);
    `finish`: POST {url}/finish_session?session_id= after a session's last request."""

    url: str
    model: str
    session_header: str | None = None
    finish_sessions: bool = False

    async def send(self, http: httpx.AsyncClient, req: TraceRequest, prompt: list[int]
                   ) -> tuple[list[int], float, str | None, int | None]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": req.max_tokens,
                "ignore_eos": True, "stream": True, "temperature": 1.0,
                "stream_options": {"include_usage": True},
                "nvext": {"extra_fields": ["completion_token_ids", "worker_id"]}}
        headers = {self.session_header: req.session} \
            if self.session_header and req.session else {}
        t0 = time.perf_counter()
        ttft, out, worker, cached = None, [], None, None
        for at, ev in await _sse(http, f"{self.url}/v1/completions", body, headers):
            nv = ev.get("nvext") or {}
            ids = nv.get("completion_token_ids") or []
            if ids and ttft is None:
                ttft = at - t0
            out += ids
            wid = nv.get("worker_id")
            if isinstance(wid, dict):
                worker = str(wid.get("decode_worker_id"))
            details = (ev.get("usage") or {}).get("prompt_tokens_details") or {}
            if isinstance(details.get("cached_tokens"), int):
                cached = details["cached_tokens"]
        return out, ttft if ttft is not None else time.perf_counter() - t0, worker, cached

    async def finish(self, http: httpx.AsyncClient, session: str) -> None:
        if self.finish_sessions:
            r = await http.post(f"{self.url}/finish_session", params={"session_id": session})
            r.raise_for_status()


@dataclass
class SglangClient:
    """SGLang's `/generate` with `input_ids`, streamed (sglang-router and rlfleet frontends
    answer it); its answers name no worker."""

    url: str

    async def send(self, http: httpx.AsyncClient, req: TraceRequest, prompt: list[int]
                   ) -> tuple[list[int], float, str | None, int | None]:
        body = {"input_ids": prompt, "stream": True, "sampling_params": {
            "max_new_tokens": req.max_tokens, "ignore_eos": True, "temperature": 1.0}}
        t0 = time.perf_counter()
        ttft, out, cached = None, [], None
        for at, ev in await _sse(http, f"{self.url}/generate", body, {}):
            ids = ev.get("output_ids") or []
            if ids and ttft is None:
                ttft = at - t0
            if ids:
                out = list(ids)  # SGLang streams cumulatively
            meta = ev.get("meta_info") or {}
            if isinstance(meta.get("cached_tokens"), int):
                cached = meta["cached_tokens"]
        return out, ttft if ttft is not None else time.perf_counter() - t0, None, cached

    async def finish(self, http: httpx.AsyncClient, session: str) -> None:
        return None


@dataclass
class _Replay:
    trace: Trace
    client: Client
    concurrency: int
    http: httpx.AsyncClient
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    prompts: dict[str, list[int]] = field(default_factory=dict)
    done: dict[str, asyncio.Event] = field(default_factory=dict)
    t0: float = 0.0

    async def one(self, req: TraceRequest, limit: asyncio.Semaphore, timed: bool) -> None:
        if timed:
            await asyncio.sleep(max(0.0, self.t0 + req.at - time.perf_counter()))
        if req.after is not None:
            await self.done[req.after].wait()
            if timed and req.think:
                await asyncio.sleep(req.think)
            prev = self.outcomes[req.after]
            prompt = self.prompts[req.after] + prev.output + req.append
        else:
            prompt = list(req.prompt or ())
        self.prompts[req.id] = prompt
        async with limit:
            start = time.perf_counter()
            out, ttft, worker, cached = await self.client.send(self.http, req, prompt)
            end = time.perf_counter()
        self.outcomes[req.id] = Outcome(req.id, len(prompt), start - self.t0, ttft,
                                        end - start, out, worker, cached)
        self.done[req.id].set()
        if req.last and req.session:
            await self.client.finish(self.http, req.session)


async def replay(trace: Trace, client: Client, concurrency: int = 64,
                 sequential: bool = False, timeout: float = 900.0) -> list[Outcome]:
    """Send every request of `trace` through `client` (see the module doc); the outcomes in
    trace order. A request that fails fails the replay (RuntimeError says which)."""
    trace.check()
    limits = httpx.Limits(max_connections=max(concurrency, 1) + 8,
                          max_keepalive_connections=max(concurrency, 1) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as http:
        rp = _Replay(trace, client, 1 if sequential else concurrency, http)
        rp.done = {r.id: asyncio.Event() for r in trace.requests}
        rp.t0 = time.perf_counter()
        limit = asyncio.Semaphore(rp.concurrency)
        if sequential:
            for r in trace.requests:
                await rp.one(r, limit, timed=False)
        else:
            await asyncio.gather(*(rp.one(r, limit, timed=True) for r in trace.requests))
    return [rp.outcomes[r.id] for r in trace.requests]


def percentile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))] if s else float("nan")


def summary(outcomes: Sequence[Outcome], busy: dict[str, float] | None = None) -> dict:
    """Output tok/s over the replay, TTFT p50/p90 (s), and the load: each worker's requests
    in flight on average (its requests' seconds ÷ the replay's), max ÷ mean over workers
    (`busy`: seconds of requests per worker, where the stack counts them itself)."""
    start = min(o.start for o in outcomes)
    span = max(o.start + o.latency for o in outcomes) - start
    tokens = sum(len(o.output) for o in outcomes)
    if busy is None:
        busy = {}
        for o in outcomes:
            if o.worker is not None:
                busy[o.worker] = busy.get(o.worker, 0.0) + o.latency
    loads = [b / span for b in busy.values()]
    ttfts = [o.ttft for o in outcomes]
    return {"requests": len(outcomes), "seconds": round(span, 3),
            "output_tokens": tokens, "tok_s": tokens / span,
            "ttft_p50": percentile(ttfts, 0.5), "ttft_p90": percentile(ttfts, 0.9),
            "ttft_mean": statistics.fmean(ttfts),
            "inflight_per_worker": [round(x, 3) for x in loads],
            "imbalance": max(loads) / statistics.fmean(loads) if loads and any(loads)
            else float("nan")}
