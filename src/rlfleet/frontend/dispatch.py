"""Send one request to a worker (retrying elsewhere only when nothing reached an engine)
and collect its events into per-choice results that the route renderers read."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from rlfleet.frontend.router import Worker, WorkerPool
from rlfleet.protocol.engine import GenerateRequest
from rlfleet.runtime import metrics
from rlfleet.runtime.request_plane import WorkerClient, WorkerError

MAX_ATTEMPTS = 3


@dataclass
class Choice:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    weight_versions: list[dict] | None = None

    def add(self, delta: dict) -> None:
        self.token_ids.extend(delta.get("token_ids", ()))
        self.text += delta.get("text", "")
        if delta.get("logprobs") is not None:
            self.logprobs = (self.logprobs or []) + delta["logprobs"]
        if delta.get("finish_reason") is not None:
            self.finish_reason = delta["finish_reason"]
            self.stop_reason = delta.get("stop_reason")
        if delta.get("weight_versions") is not None:
            self.weight_versions = delta["weight_versions"]


@dataclass
class Result:
    """Everything a request produced, filled as events arrive."""

    request_id: str
    n: int
    received: float = field(default_factory=time.time)
    first_token: float | None = None
    finished: float | None = None
    worker_id: int | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list | None = None
    prompt_text: str = ""  # with echo
    prompt_token_strs: list[str] | None = None  # with echo
    weight: dict[str, Any] = field(default_factory=dict)
    choices: list[Choice] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.choices = [Choice(i) for i in range(self.n)]

    def apply(self, ev: dict) -> list[dict]:
        """Fold one worker event in; return its choice deltas (for streaming)."""
        if "prompt_token_ids" in ev:
            self.prompt_token_ids = ev["prompt_token_ids"]
            self.worker_id = ev.get("_worker")
            self.weight = {k: v for k, v in ev.items() if k.startswith("weight_")}
            self.prompt_text = ev.get("prompt_text", "")
            self.prompt_token_strs = ev.get("prompt_token_strs")
        deltas = ev.get("choices") or []
        if deltas and self.first_token is None:
            self.first_token = time.time()
            metrics.FRONTEND_TTFT.observe(self.first_token - self.received)
        for d in deltas:
            self.choices[d["index"]].add(d)
            metrics.FRONTEND_GENERATED_TOKENS.inc(len(d.get("token_ids", ())))
        if ev.get("done"):
            self.prompt_logprobs = ev.get("prompt_logprobs")
            self.finished = time.time()
        return deltas

    def spans(self, choice: Choice) -> list[dict]:
        """The weight-version spans of a finished choice; from an engine that does not
        track versions per token, one span from the weights the worker reported."""
        return choice.weight_versions or [
            {"version": self.weight.get("weight_version"),
             "digest": self.weight.get("weight_digest"), "start": 0, "end": len(choice.token_ids)}]

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    def usage(self) -> dict[str, int]:
        p = len(self.prompt_token_ids)
        return {"prompt_tokens": p, "completion_tokens": self.completion_tokens,
                "total_tokens": p + self.completion_tokens}

    def timing(self) -> dict[str, float]:
        end = self.finished or time.time()
        out = {"request_received_ms": round(self.received * 1000, 3),
               "total_time_ms": round((end - self.received) * 1000, 3)}
        if self.first_token is not None:
            out["ttft_ms"] = round((self.first_token - self.received) * 1000, 3)
        return out


async def dispatch(pool: WorkerPool, client: WorkerClient, model: str, req: GenerateRequest,
                   on_pick: Callable[[Worker], None] | None = None) -> AsyncIterator[dict]:
    """Yield the events of `req` served by one worker of `model`. The first event carries
    `_worker` (the instance ID); `on_pick` hears of each worker tried. Raises NoWorker or
    WorkerError."""
    tried: set[int] = set()
    for attempt in range(MAX_ATTEMPTS):
        w = await pool.acquire(model, tried)
        tried.add(w.instance_id)
        if on_pick is not None:
            on_pick(w)
        w.inflight += 1
        started = False
        try:
            async for ev in client.generate(w.url, req):
                if not started:
                    ev["_worker"] = w.instance_id
                    started = True
                yield ev
            return
        except WorkerError as e:
            metrics.FRONTEND_WORKER_ERRORS.labels("unreachable" if e.retryable else
                                                  "broken" if e.broken else "refused").inc()
            if e.broken:
                pool.mark_down(w, str(e))
            if e.retryable and not started and attempt + 1 < MAX_ATTEMPTS:
                continue
            raise
        finally:
            w.inflight -= 1
