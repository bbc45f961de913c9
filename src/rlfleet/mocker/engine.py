"""A simulated engine for load and fault tests: no model, no tokenizer, no GPU.

`MockEngine` speaks the worker contract of `rlfleet.worker.engine` with the event
shapes of the vLLM adapter, but its tokens are pseudo-random: it is a simulator for
exercising the fleet (routing, streaming, aborts, pauses, weight switches, thousands of
concurrent requests) and never a stand-in for the real engine. Nothing it generates
means anything.

The "model": at every step a choice draws its token from a fixed Zipf-shaped
distribution over the vocabulary (plus EOS with probability `eos_prob`) whose ranking of
token IDs is a hash of (weight seed, request seed, choice index, position, previous
token). The request seed is the sampling seed if given, else a hash of the prompt IDs.
So output is deterministic, whatever the concurrency, and the reported logprobs are
the true log-probabilities of that distribution. Temperature, top-p/k, min-p and the
penalties are accepted and ignored.

Detokenisation: token `1000 + b` is byte `b` (ASCII as itself, the rest as `<0xNN>`),
the EOS token is `<|im_end|>`, every other token ID `t` reads `<t>`.

Every generated token is stamped with the policy that produced it (version, digest, fleet
step): a choice's final delta carries `weight_versions`, one span per run of tokens from one
policy, as the vLLM engine reports them (a keep-pause across a weight swap shows two).

The simulated weights are one number, the seed of the token distribution. As a checkpoint
they are a directory holding ``mock_weights.json`` = ``{"seed": <int>}`` (see
`write_mock_checkpoint`); as tensors, ``{"mock.seed": <one integer>}``; their digest is
``"mock:<seed>"``. Tensors may carry ballast beside the seed (``mock.ballast.*``, any shape
and dtype, ignored by the simulated model) so that the weight plane moves a model's bytes
(a long soak's versions, deltas and all); weights with ballast have the content digest of
all their tensors (rlfleet.weights.digest), as a real engine's do.

It has no vLLM weight-transfer engine: its discovery entries say `weight_transfer_backend:
"none"` (so a client that transfers over nccl refuses to bind it at discovery instead of
failing mid-refresh), and it refuses vLLM's weight-transfer steps, natively and on
/engine/update/*, saying how to load weights instead.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import functools
import hashlib
import itertools
import json
import math
import random
from array import array
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from rlfleet.mocker.adapters import (
    MAX_LORA_RANK,
    MAX_LORAS,
    MockAdapters,
    Version,
    adapter_rank,
    add_lora_args,
    lora_salt,
    parse_lora_modules,
)
from rlfleet.mocker.cache import PrefixCache, parse_events_config
from rlfleet.protocol.admin import DistributedRequest, GroupRequest
from rlfleet.protocol.engine import (
    Delta,
    Done,
    GenerateRequest,
    PromptLogprob,
    RoutedExperts,
    SamplingOptions,
    Step,
    TokenLogprob,
)
from rlfleet.protocol.identity import PolicyIdentity, WeightSpan
from rlfleet.runtime.flags import Flag, add_flags
from rlfleet.worker import engine as contract
from rlfleet.worker.engine import (
    BadRequest,
    Engine,
    EngineControl,
    WeightLoadError,
)

QWEN_EOS = 151645
ZIPF_S = 1.2  # how peaked the per-step distribution is: top-1 has p ~ 0.18
PAUSE_MODES = ("keep", "wait", "abort")
EOS_TEXT = "<|im_end|>"

#: the simulated engine's knobs, each a flag and a key of DEFAULTS
KNOBS: tuple[Flag, ...] = (
    Flag("--model-name", "mock-model", "served model name (--served-model-name wins when given)"),
    Flag("--vocab-size", 151936),
    Flag("--max-model-len", 4096),
    Flag("--seed", 0, "the simulated weights: another seed, other tokens"),
    Flag("--token-delay", 0.0, "seconds per generated token (per step, all n choices together)"),
    Flag("--token-delay-jitter", 0.0, "up to this many extra seconds per token, uniformly at random"),
    Flag("--ttft", 0.0, "seconds before the first token"),
    Flag("--max-batch", None,
         "requests generating at once; more wait in a FIFO queue (default: no limit)", type=int),
    Flag("--eos-token-id", None,
         f"default {QWEN_EOS}, or vocab-size - 1 when the vocabulary is smaller", type=int),
    Flag("--eos-prob", 0.01, "chance per token that a choice ends with EOS (mean length ~ 1/p)"),
    Flag("--block-size", 16, "tokens per block of the simulated prefix cache (mocker/cache.py)"),
    Flag("--kv-blocks", 8192, "blocks the simulated prefix cache holds (least recently used go)"),
    Flag("--prefill-delay", 0.0,
         "seconds per prompt token not in the simulated prefix cache, before the first token"),
    Flag("--routed-experts", None,
         "LxExK: simulate a MoE engine started with --enable-return-routed-experts: L layers of "
         "E experts, top-K per token (e.g. 2x8x2); the experts it reports are a hash of the "
         "token, its position and the layer"),
    Flag("--kv-events-config", None,
         "publish the simulated cache's KV events as vLLM does, e.g. "
         '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}\' '
         "(port 0: any free port)"),
)

DEFAULTS: dict[str, Any] = {
    **{knob.dest: knob.default for knob in KNOBS},
    "served_model_name": None, "enable_lora": False, "max_loras": MAX_LORAS,
    "max_lora_rank": MAX_LORA_RANK, "lora_modules": None,
}


def add_mock_args(p: argparse.ArgumentParser) -> None:
    add_flags(p, KNOBS)
    add_lora_args(p)


CHECKPOINT_FILE = "mock_weights.json"
SEED_TENSOR = "mock.seed"
BALLAST_PREFIX = "mock.ballast."  # tensors beside the seed, for their bytes only


def write_mock_checkpoint(directory: str | Path, seed: int) -> Path:
    """Make `directory` a mock checkpoint whose weights are `seed`; returns the directory."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / CHECKPOINT_FILE).write_text(json.dumps({"seed": seed}))
    return d


def read_mock_checkpoint(directory: Path) -> int:
    """The seed of a mock checkpoint; ValueError says why `directory` is not one."""
    f = directory / CHECKPOINT_FILE
    if not f.is_file():
        raise ValueError(f"it has no {CHECKPOINT_FILE} (a mock checkpoint holds "
                         f'{CHECKPOINT_FILE} with {{"seed": <int>}})')
    try:
        data = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{CHECKPOINT_FILE} is not readable JSON: {e}") from e
    seed = data.get("seed") if isinstance(data, dict) else None
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f'{CHECKPOINT_FILE} must be an object {{"seed": <int>}}')
    return seed


@dataclass(frozen=True)
class MockWeights:
    """What the simulated weights are: the seed of the token distribution."""

    seed: int
    version: str | None = None
    step: int | None = None  # the policy's fleet step, when declared
    content: str | None = None  # with ballast: the content digest of every tensor

    @functools.cached_property
    def policy(self) -> PolicyIdentity:
        """The policy these weights are: the digest is a function of the seed (of every
        tensor, with ballast)."""
        return PolicyIdentity(version=self.version, digest=self.content or f"mock:{self.seed}",
                              step=self.step)


@dataclass(eq=False)
class _Run:
    """One request in the engine."""

    aborted: bool = False
    admitted: bool = False  # past the pause gate (new requests wait there while paused)
    has_slot: bool = False  # counted against --max-batch
    waiter: asyncio.Future | None = None  # set while the request sleeps or waits
    lora: Version | None = None  # the adapter version it runs on (None: the base model)

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


@dataclass(eq=False)
class _Choice:
    index: int
    prev: int  # the previous token: the last prompt token at first
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_text: int = 0
    spans: list[WeightSpan] = field(default_factory=list)  # the policy of each run of tokens
    stamped: PolicyIdentity | None = None  # the policy of the last span

    def stamp(self, policy: PolicyIdentity) -> None:
        """Record that the token just appended came from `policy`."""
        end = len(self.token_ids)
        if self.spans and (policy is self.stamped or policy == self.stamped):
            self.spans[-1] = msgspec.structs.replace(self.spans[-1], end=end)
        else:
            self.spans.append(WeightSpan.of(policy, end - 1, end))
            self.stamped = policy


def _hash(key: tuple) -> tuple[float, int]:
    """A uniform float in [0, 1) and a 64-bit integer, both a function of `key`."""
    d = hashlib.blake2b(repr(key).encode(), digest_size=16).digest()
    return (int.from_bytes(d[:8], "little") >> 11) / (1 << 53), int.from_bytes(d[8:], "little")


def _moe_geometry(raw: str | None) -> tuple[int, int, int] | None:
    """--routed-experts LxExK as (layers, experts, top-k); ValueError says what is wrong."""
    if raw is None:
        return None
    try:
        layers, experts, k = (int(x) for x in raw.lower().split("x"))
    except ValueError:
        raise ValueError(f"--routed-experts {raw!r}: give LAYERSxEXPERTSxTOPK, e.g. 2x8x2") from None
    if min(layers, experts, k) < 1 or k > experts or experts > 1 << 16:
        raise ValueError(f"--routed-experts {raw!r}: need layers, experts, top-k >= 1, "
                         f"top-k <= experts <= 65536")
    return layers, experts, k


@dataclass(frozen=True)
class _Distribution:
    """The token distribution's tables for `m` candidates: the same for every engine of one
    vocabulary, so computed once per process (`_distribution`)."""

    stride: int
    stride_inv: int
    cum: array  # cumulative probabilities by rank (EOS excluded)
    lp0: float
    lp_eos: float
    eos_pos: int


@functools.lru_cache(maxsize=8)
def _distribution(m: int, eos_prob: float) -> _Distribution:
    stride = int(m * 0.6180339887) | 1
    while math.gcd(stride, m) != 1:
        stride += 2
    zipf = [(r + 1) ** -ZIPF_S for r in range(m)]
    z = math.fsum(zipf)
    lp0, lp_eos = math.log1p(-eos_prob) - math.log(z), math.log(eos_prob)
    eos_pos = 0
    while eos_pos < m and lp0 - ZIPF_S * math.log(eos_pos + 1) > lp_eos:
        eos_pos += 1
    return _Distribution(stride, pow(stride, -1, m),
                         array("d", itertools.accumulate(w / z for w in zipf)), lp0, lp_eos,
                         eos_pos)


class MockEngine(Engine, EngineControl):
    """A deterministic token simulator behind the `Engine` contract (see the module doc).

    Build it from parsed flags or keywords: `MockEngine(args)`, `MockEngine(seed=1, ttft=0.5)`.
    """

    def __init__(self, args: argparse.Namespace | None = None, **overrides: Any) -> None:
        o = {**DEFAULTS, **(vars(args) if args is not None else {}), **overrides}
        vocab, eos = o["vocab_size"], o["eos_token_id"]
        eos = min(QWEN_EOS, vocab - 1) if eos is None else eos
        if vocab < 512:
            raise ValueError("vocab-size must be at least 512")
        if not 0 <= eos < vocab:
            raise ValueError(f"eos-token-id {eos} is outside the vocabulary [0, {vocab})")
        if not 0 < o["eos_prob"] < 1:
            raise ValueError("eos-prob must be between 0 and 1 (exclusive)")
        if min(o["token_delay"], o["token_delay_jitter"], o["ttft"]) < 0:
            raise ValueError("delays must not be negative")
        if o["max_batch"] is not None and o["max_batch"] < 1:
            raise ValueError("max-batch must be at least 1")
        if o["max_model_len"] < 2:
            raise ValueError("max-model-len must be at least 2")
        if o["prefill_delay"] < 0:
            raise ValueError("prefill-delay must not be negative")
        name = o["served_model_name"] or o["model_name"]
        self.cache = PrefixCache(name, o["block_size"], o["kv_blocks"],
                                 parse_events_config(o["kv_events_config"]))
        self.prefill_delay = o["prefill_delay"]
        self.moe = _moe_geometry(o["routed_experts"])
        self.info = contract.EngineInfo(served_model_name=name, model_path=f"mock://{name}",
                               vocab_size=vocab, max_model_len=o["max_model_len"],
                               eos_token_ids=(eos,), kv_events=self.cache.endpoint,
                               kv_block_size=o["block_size"])
        self.eos = eos
        self.weights = MockWeights(o["seed"])  # loads swap this; tokens depend on it
        self.version_declared = False
        self._received: int | None = None  # the seed "received" from a trainer's group
        self.token_delay, self.token_delay_jitter = o["token_delay"], o["token_delay_jitter"]
        self.ttft = o["ttft"]
        self.max_batch: int | None = o["max_batch"]
        self._byte_base = min(1000, vocab - 256)

        # The distribution: candidate rank r (0-based, EOS excluded) has probability
        # (1 - eos_prob) * (r+1)^-s / Z; the ranking of token IDs is a hashed permutation.
        self._m = m = vocab - 1  # token IDs other than EOS
        d = _distribution(m, o["eos_prob"])  # one copy per process (--replicas: N engines)
        self._stride, self._stride_inv, self._cum = d.stride, d.stride_inv, d.cum
        self._eos_prob, self._lp0, self._lp_eos = o["eos_prob"], d.lp0, d.lp_eos
        self._eos_pos = d.eos_pos  # how many candidates are more likely than EOS

        self._runs: dict[str, _Run] = {}
        self._mode: str | None = None  # the pause mode, None while generating
        self._active = 0  # admitted, unfinished requests
        self._idle = asyncio.Event()
        self._idle.set()
        self._in_batch = 0
        self._queue: deque[_Run] = deque()  # admitted requests waiting for a batch slot
        self.lora = self._lora_engine(o)  # with --enable-lora (rlfleet.mocker.adapters)
        self._bound: dict[str, Version] = {}  # request id -> the adapter version it runs on

    # ------------------------------------------------------------ the distribution

    def _lp(self, r: int) -> float:
        return self._lp0 - ZIPF_S * math.log(r + 1)

    def _candidate(self, base: int, r: int) -> int:
        x = (base + r * self._stride) % self._m
        return x + (x >= self.eos)

    def _rank_of(self, base: int, token: int) -> tuple[int, float]:
        """The token's 1-based rank and logprob in the distribution `base`."""
        if token == self.eos:
            return self._eos_pos + 1, self._lp_eos
        x = token - (token > self.eos)
        r = (x - base) * self._stride_inv % self._m
        return r + 1 + (r >= self._eos_pos), self._lp(r)

    def _top(self, base: int, k: int) -> list[tuple[int, float]]:
        """The k most likely tokens, best first."""
        out = []
        for j in range(k):
            if j == self._eos_pos:
                out.append((self.eos, self._lp_eos))
            else:
                r = j - (j > self._eos_pos)
                out.append((self._candidate(base, r), self._lp(r)))
        return out

    def _sample(self, key: tuple, eos_ok: bool, banned: frozenset[int]) -> tuple[int, int]:
        """(distribution, token) for one step. Refusals (EOS or a banned token before
        min_tokens) redraw, so the sequence is otherwise the same with or without them."""
        u, base = _hash(key)
        base %= self._m
        for attempt in range(64):
            if attempt:
                u = _hash((*key, attempt))[0]
            if u < self._eos_prob:
                if eos_ok:
                    return base, self.eos
                continue
            r = bisect.bisect_right(self._cum, (u - self._eos_prob) / (1 - self._eos_prob))
            token = self._candidate(base, min(r, self._m - 1))
            if token not in banned:
                return base, token
        return base, next(t for r in range(self._m)
                          if (t := self._candidate(base, r)) not in banned)

    def decode(self, token: int) -> str:
        if token == self.eos:
            return EOS_TEXT
        b = token - self._byte_base
        if 0 <= b < 128:
            return chr(b)
        return f"<0x{b:02X}>" if 0 <= b < 256 else f"<{token}>"

    def _logprob_entry(self, base: int, token: int, k: int) -> TokenLogprob:
        rank, lp = self._rank_of(base, token)
        return TokenLogprob(token_id=token, logprob=lp, rank=rank, decoded=self.decode(token),
                            top=[(t, tlp, self.decode(t)) for t, tlp in self._top(base, k)])

    def _weights_key(self, lora: Version | None) -> Any:
        """What seeds the distribution: the base weights' seed, and an adapter's digest."""
        return self.weights.seed if lora is None else (self.weights.seed, lora.key)

    def _prompt_logprobs(self, ids: list[int], k: int, lora: Version | None = None
                         ) -> list[dict[str, PromptLogprob] | None]:
        out: list[dict[str, PromptLogprob] | None] = [None]
        seed = self._weights_key(lora)
        for p in range(1, len(ids)):
            base = _hash((seed, "prompt", p, ids[p - 1]))[1] % self._m
            rank, lp = self._rank_of(base, ids[p])
            entry = {str(ids[p]): PromptLogprob(logprob=lp, rank=rank,
                                                decoded_token=self.decode(ids[p]))}
            for j, (t, tlp) in enumerate(self._top(base, k)):
                key = str(t)
                if key not in entry:
                    entry[key] = PromptLogprob(logprob=tlp, rank=j + 1,
                                               decoded_token=self.decode(t))
            out.append(entry)
        return out

    # ------------------------------------------------------------ tokenizer

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """A ChatML-like rendering."""
        parts = []
        for m in messages:
            role, content = (m.get("role"), m.get("content")) if isinstance(m, dict) else (None, None)
            if isinstance(content, list):  # OpenAI content parts: keep the text ones
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            if not isinstance(role, str) or not isinstance(content, str | None):
                raise BadRequest("each message needs a string `role` and a string `content`")
            parts.append(f"<|im_start|>{role}\n{content or ''}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)

    def token_pieces(self, token_ids: list[int]) -> list[str]:
        return [self.decode(t) for t in token_ids]

    def decode_text(self, token_ids: list[int]) -> str:
        """The inverse of `tokenize` for its byte tokens (UTF-8, undecodable bytes
        replaced); any other token as `decode` spells it."""
        out: list[str] = []
        run = bytearray()
        for t in token_ids:
            b = t - self._byte_base
            if 0 <= b < 256 and t != self.eos:
                run.append(b)
                continue
            if run:
                out.append(run.decode("utf-8", "replace"))
                run.clear()
            out.append(self.decode(t))
        if run:
            out.append(run.decode("utf-8", "replace"))
        return "".join(out)

    def tokenize(self, prompt: str | None = None, messages: list[dict[str, Any]] | None = None,
                 add_generation_prompt: bool = True,
                 chat_template_kwargs: dict[str, Any] | None = None,
                 add_special_tokens: bool | None = None) -> list[int]:
        text = self.render_chat(messages, add_generation_prompt) if messages is not None else prompt
        return [self._byte_base + b for b in (text or "").encode()]

    # ------------------------------------------------------------ generation

    def serving_policy(self) -> PolicyIdentity:
        return self.weights.policy

    def request_policy(self, req: GenerateRequest) -> PolicyIdentity:
        if req.adapter is None:
            return self.serving_policy()
        bound = self._bound.get(req.request_id)
        return bound.policy if bound is not None else self._lora().bind(req.adapter).policy

    # ------------------------------------------------------------ LoRA adapters

    @staticmethod
    def _lora_engine(o: dict[str, Any]) -> MockAdapters | None:
        modules = parse_lora_modules(o["lora_modules"])
        if not o["enable_lora"]:
            if modules:
                raise ValueError("--lora-modules: serving adapters needs --enable-lora")
            return None
        for name, path in modules:  # refused before the worker starts, by name
            try:
                adapter_rank(Path(path), o["max_lora_rank"])
            except BadRequest as e:
                raise ValueError(f"--lora-modules {name}={path}: {e}") from None
        return MockAdapters(o["max_loras"], o["max_lora_rank"], modules)

    async def start(self) -> None:
        if self.lora is not None:
            for name, path in self.lora.modules:  # --lora-modules
                try:
                    await self.load_adapter(name, Path(path).resolve(), None, None)
                except BadRequest as e:
                    raise ValueError(f"--lora-modules {name}={path}: {e}") from None

    def num_running(self) -> int:
        return len(self._runs)

    async def generate(self, req: GenerateRequest, prompt_token_ids: list[int]
                       ) -> AsyncIterator[Step | Done]:
        rid = req.request_id
        if rid in self._runs:
            raise BadRequest(f"request_id {rid!r} is already running on this worker")
        run = _Run(lora=self._lora().bind(req.adapter) if req.adapter is not None else None)
        self._runs[rid] = run
        if run.lora is not None:
            self._bound[rid] = run.lora
        series = self.series
        series.running.inc()
        series.prompt.inc(len(prompt_token_ids))
        try:
            await self._wait(run, lambda: self._mode is None)  # held while paused
            if not run.aborted:
                run.admitted = True
                self._active += 1
                self._idle.clear()
                await self._take_slot(run)
            async for event in self._decode(req, prompt_token_ids, run):
                yield event
        finally:
            if run.has_slot:
                self._release_slot()
            elif run in self._queue:
                self._queue.remove(run)
            if run.admitted:
                self._active -= 1
                if not self._active:
                    self._idle.set()
            del self._runs[rid]
            self._bound.pop(rid, None)
            series.running.dec()

    async def _decode(self, req: GenerateRequest, ids: list[int], run: _Run
                      ) -> AsyncIterator[Step | Done]:
        s = req.sampling
        if req.routed_experts_start is not None and req.routed_experts_start > len(ids):
            raise BadRequest(f"routed_experts_prompt_start must be between 0 and the prompt "
                             f"length {len(ids)}, got {req.routed_experts_start}")
        room = max(1, self.info.max_model_len - len(ids))
        seed = s.seed if s.seed is not None else _hash(tuple(ids))[1]
        hold = max(map(len, s.stop)) - 1 if s.stop and not s.include_stop_str_in_output else 0
        want_lp = s.logprobs is not None
        prompt_lps = (self._prompt_logprobs(ids, s.prompt_logprobs, run.lora)
                      if s.prompt_logprobs is not None else None)
        if s.structured_outputs is not None or s.response_format is not None:
            raise BadRequest("structured outputs are not simulated by the mocker")
        choices = [_Choice(c, prev=ids[-1]) for c in range(s.n)]
        live = choices
        first = True
        salt = lora_salt(req.cache_salt, run.lora)
        prefill = self.prefill_delay * (len(ids) - self.cache.lookup(ids, salt))
        early = req.echo and req.stream  # prompt logprobs go in the first event
        generated = self.series.generated
        while live:
            await self._nap(run, self.ttft + prefill if first else self._token_delay())
            first = False
            await self._wait(run, lambda: self._mode != "keep")  # frozen while paused (keep)
            if run.aborted:
                break
            for ch in live:
                self._advance(ch, s, seed, s.max_tokens or room, run.lora)
            generated.inc(len(live))
            if req.stream:
                ev = Step(choices=[self._out(req, ids, ch, hold, want_lp) for ch in live])
                if early:
                    ev.prompt_logprobs, prompt_lps, early = prompt_lps, None, False
                yield ev
            live = [ch for ch in live if ch.finish_reason is None]
        for ch in live:
            ch.finish_reason = "abort"
        for ch in choices:  # what a continuation of it finds cached
            self.cache.store(ids + ch.token_ids, salt)
        final = choices if not req.stream else live
        if final:
            yield Step(choices=[self._out(req, ids, ch, hold, want_lp) for ch in final])
        yield Done(prompt_logprobs=prompt_lps)

    def _advance(self, ch: _Choice, s: SamplingOptions, seed: int, max_tokens: int,
                 lora: Version | None = None) -> None:
        """Generate one token of a choice and see whether it ends the choice."""
        i = len(ch.token_ids)
        can_stop = i >= s.min_tokens  # before min_tokens, EOS and stop tokens are masked
        banned = frozenset() if can_stop else frozenset(s.stop_token_ids)
        base, t = self._sample((self._weights_key(lora), seed, ch.index, i, ch.prev),
                               eos_ok=can_stop and not s.ignore_eos, banned=banned)
        ch.token_ids.append(t)
        ch.stamp(self.weights.policy if lora is None else lora.policy)
        ch.prev = t
        if s.logprobs is not None:
            ch.logprobs.append(self._logprob_entry(base, t, s.logprobs))
        if t == self.eos and not s.ignore_eos:
            ch.finish_reason, ch.stop_reason = "stop", None
            if s.include_stop_str_in_output and not s.skip_special_tokens:
                ch.text += EOS_TEXT
        elif can_stop and t in s.stop_token_ids:
            ch.finish_reason, ch.stop_reason = "stop", t
            if s.include_stop_str_in_output:
                ch.text += self.decode(t)
        else:
            start = len(ch.text)
            ch.text += self.decode(t)
            if s.stop and i + 1 >= s.min_tokens:
                self._check_stop_strings(ch, s, start)
        if ch.finish_reason is None and len(ch.token_ids) >= max_tokens:
            ch.finish_reason = "length"

    @staticmethod
    def _check_stop_strings(ch: _Choice, s: SamplingOptions, start: int) -> None:
        for stop in s.stop:  # the first listed stop string that occurs wins, as in vLLM
            at = ch.text.find(stop, max(0, start - len(stop) + 1))
            if at >= 0:
                ch.text = ch.text[:at + len(stop) if s.include_stop_str_in_output else at]
                ch.finish_reason, ch.stop_reason = "stop", stop
                return

    def _out(self, req: GenerateRequest, ids: list[int], ch: _Choice, hold: int,
             want_lp: bool) -> Delta:
        """A choice's delta; its final one with the routed experts when asked for."""
        d = self._delta(ch, hold, want_lp)
        if ch.finish_reason is not None and req.routed_experts_start is not None \
                and self.moe is not None:
            d.routed_experts = self._experts(ids + ch.token_ids, len(ids),
                                             req.routed_experts_start)
        return d

    def _experts(self, seq: list[int], prompt_len: int, start: int) -> RoutedExperts:
        """Simulated routing of every forwarded position from `start` (-1: the last prompt
        position) to the one before the last token: top-k distinct experts per layer, a
        hash of (weights, position, token, layer)."""
        layers, experts, k = self.moe  # type: ignore[misc]
        first = prompt_len - 1 if start == -1 else start
        rows = []
        for pos in range(first, len(seq) - 1):
            row = []
            for layer in range(layers):
                h = _hash((self.weights.seed, pos, seq[pos], layer))[1]
                picks: list[int] = []
                while len(picks) < k:
                    e = h % experts
                    h = h // experts + 0x9E3779B97F4A7C15 * (len(picks) + 1)
                    if e not in picks:
                        picks.append(e)
                row.append(picks)
            rows.append(row)
        arr = np.array(rows, dtype=np.int64).reshape(len(rows), layers, k)
        return RoutedExperts.of(arr, first)

    @staticmethod
    def _delta(ch: _Choice, hold: int, want_lp: bool) -> Delta:
        """What the client has not seen of a choice. While it runs, the last `hold`
        characters stay back: they may be the start of a stop string."""
        end = len(ch.text) if ch.finish_reason else max(ch.sent_text, len(ch.text) - hold)
        delta = Delta(index=ch.index, token_ids=ch.token_ids[ch.sent_tokens:],
                      text=ch.text[ch.sent_text:end],
                      logprobs=ch.logprobs[ch.sent_tokens:] if want_lp else None,
                      finish_reason=ch.finish_reason, stop_reason=ch.stop_reason,
                      weight_versions=list(ch.spans) if ch.finish_reason else None)
        ch.sent_tokens, ch.sent_text = len(ch.token_ids), end
        return delta

    def _token_delay(self) -> float:
        jitter = self.token_delay_jitter
        return self.token_delay + (random.uniform(0, jitter) if jitter else 0.0)

    # ------------------------------------------------------------ waiting, slots, abort

    @staticmethod
    async def _doze(run: _Run, timeout: float | None = None) -> None:
        """Sleep until run.wake() is called (or `timeout` seconds pass)."""
        loop = asyncio.get_running_loop()
        run.waiter = loop.create_future()
        timer = loop.call_later(timeout, run.wake) if timeout is not None else None
        try:
            await run.waiter
        finally:
            run.waiter = None
            if timer is not None:
                timer.cancel()

    async def _wait(self, run: _Run, ready: Callable[[], bool]) -> None:
        """Until ready() holds or the request is aborted; whoever changes what
        ready() reads wakes the run."""
        while not (run.aborted or ready()):
            await self._doze(run)

    async def _nap(self, run: _Run, delay: float) -> None:
        """Sleep `delay` seconds, less if the request is aborted meanwhile."""
        if delay <= 0:
            await asyncio.sleep(0)  # let others run between steps
            return
        loop = asyncio.get_running_loop()
        end = loop.time() + delay
        while not run.aborted and (left := end - loop.time()) > 0:
            await self._doze(run, left)

    async def _take_slot(self, run: _Run) -> None:
        if self.max_batch is None or (self._in_batch < self.max_batch and not self._queue):
            self._in_batch += 1
            run.has_slot = True
            return
        self._queue.append(run)
        await self._wait(run, lambda: run.has_slot)

    def _release_slot(self) -> None:
        if self._queue:  # hand the slot on, first come first served
            nxt = self._queue.popleft()
            nxt.has_slot = True
            nxt.wake()
        else:
            self._in_batch -= 1

    def _wake_all(self) -> None:
        for run in self._runs.values():
            run.wake()

    async def abort(self, request_id: str) -> None:
        run = self._runs.get(request_id)
        if run is not None:
            run.aborted = True
            run.wake()

    def tracks(self, request_id: str) -> bool:
        return request_id in self._runs

    async def abort_all(self) -> int:
        """Abort every request in the engine (running, frozen by a pause, or held at the
        pause gate); returns how many."""
        rids = list(self._runs)
        for rid in rids:
            await self.abort(rid)
        return len(rids)

    async def shutdown(self) -> None:
        await self.abort_all()
        self.cache.close()

    # ------------------------------------------------------------ control (EngineControl)

    async def is_paused(self) -> bool:
        return self._mode is not None

    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> None:
        """Stop generating. New requests wait until resume() in every mode; running ones:
        keep - freeze at their current step and continue on resume, as if never paused;
        wait - run to the end (this returns when they have);
        abort - end now with finish_reason "abort" and their partial output."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, not {mode!r}")
        self._mode = mode
        if mode == "abort":
            for run in self._runs.values():
                run.aborted = run.aborted or run.admitted
        self._wake_all()  # e.g. runs frozen by an earlier "keep" re-check the mode
        if mode == "wait":
            while self._active:
                await self._idle.wait()
        if clear_cache:
            await self.reset_cache()

    async def resume(self) -> None:
        self._mode = None
        self._wake_all()

    async def reset_cache(self, running: bool = False) -> bool:
        self.cache.clear()
        return True

    async def set_weights(self, seed: int, version: str | None = None) -> None:
        """Switch the simulated weights (hence the token distribution); only while paused."""
        if self._mode is None:
            raise RuntimeError("pause generation first")
        self.weights = MockWeights(seed, version)

    def _swap(self, seed: int, content: str | None = None) -> str:
        """New weights now (running requests continue on them); the version label and step
        stay until `set_version` records the new ones."""
        self.weights = MockWeights(seed, self.weights.version, self.weights.step, content)
        return self.weights.policy.digest or ""

    def applied(self) -> contract.AppliedWeights:
        return contract.AppliedWeights(self.weights.policy, self.version_declared)

    async def set_version(self, version: str | None, declared: bool = True,
                          digest: str | None = None, step: int | None = None) -> None:
        # the digest is a function of the seed, already swapped by the load
        keep = digest is None and step is None  # a relabel keeps the step
        self.weights = MockWeights(self.weights.seed, version,
                                   self.weights.step if keep else step, self.weights.content)
        self.version_declared = declared

    def checkpoint_mismatch(self, path: Path) -> str | None:
        try:
            read_mock_checkpoint(path)
        except ValueError as e:
            return str(e)
        return None

    async def load_path(self, path: Path) -> str:
        return self._swap(read_mock_checkpoint(path))

    async def apply_tensors(self, tensors: Mapping[str, Any]) -> str:
        return self._apply(tensors, None)

    async def load_staged(self, path: Path, digest: str) -> str:
        from rlfleet.weights.digest import iter_checkpoint_tensors

        return self._apply(dict(iter_checkpoint_tensors(path)), digest)

    def _apply(self, tensors: Mapping[str, Any], digest: str | None) -> str:
        """Swap in the seed of `tensors`; with ballast, their content digest is the weights'
        (`digest` when the staging computed it already)."""
        t = tensors.get(SEED_TENSOR)
        other = [n for n in tensors if n != SEED_TENSOR and not n.startswith(BALLAST_PREFIX)]
        if other or t is None or t.numel() != 1 or t.dtype.is_floating_point:
            raise ValueError(f"the mocker's weights are one tensor {SEED_TENSOR!r} holding one "
                             f"integer (the seed), and ballast ({BALLAST_PREFIX}*); got "
                             f"{sorted(tensors)[:3]}")
        content = None
        if len(tensors) > 1:
            from rlfleet.weights.digest import digest_tensors

            content = digest or digest_tensors(tensors.items())
        return self._swap(int(t.reshape(-1)[0]), content)

    def announced_mismatch(self, d: DistributedRequest) -> str | None:
        if d.mock_seed is None:
            return ("mock_seed is required by the mocker: an integer, the seed of the "
                    "simulated weights being sent")
        return None

    async def join_group(self, g: GroupRequest) -> None:
        """Nothing to join: the mocker simulates the transfer (the seed is in the request)."""

    async def receive(self, d: DistributedRequest, timeout: float) -> int:
        self._received = d.mock_seed
        return 0

    async def apply_received(self) -> str:
        seed, self._received = self._received, None
        if seed is None:
            raise WeightLoadError("nothing received to apply; the previous weights are still "
                                  "serving")
        return self._swap(seed)

    async def leave_group(self) -> None:
        self._received = None
