"""The post-update probe of a policy refresh: generation straight on each worker's request
plane, after the weights changed and before the worker is reopened.

Two kinds:
- expected (`Probe`): the trainer, which has the model in memory, says which greedy tokens
  and logprobs the target policy gives for a prompt (`probe_from_model`); every worker must
  reproduce them. `reference_probe` computes the same from a checkpoint directory with
  transformers, and only runs when asked (it loads the whole model).
- agreement (no `Probe`): every worker reads the same text prompt, tokenised by each
  worker with the model's own tokenizer, and says which token it puts first at every
  position (prompt logprobs, rank 1) and which it generates after it (greedy); they must
  all agree on the prompt tokens, those tokens, and their logprobs. One prefill and one
  decode step per worker.

Logprob tolerances follow the dtype each worker reports serving in (float32 exact to ~1e-6
against transformers; 16-bit formats round every activation), and can be set instead."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from rlfleet.protocol.engine import GenerateRequest, SamplingOptions
from rlfleet.runtime.request_plane import WorkerError

#: the agreement probe's prompt, tokenised by the workers themselves: a few tokens (each
#: position's first choice and logprob compared across workers, then one generated token).
#: Short because on the CPU build a bf16 prefill costs per position what a decode step does,
#: and the requests in flight on a worker wait that long (bench/refresh.py's serving gap)
PROBE_TEXT = "The quick brown fox"
#: max |logprob difference| accepted, by the dtype a worker serves in. float32: vLLM on CPU
#: matches transformers within 1.4e-6; bfloat16: 2.8e-3 measured on the tiny test model and
#: up to 5e-2 on the 0.6B geometry (bench/refresh.py); float16 has 3 more mantissa bits.
DTYPE_TOLERANCE = {"float32": 1e-3, "float16": 2e-2, "bfloat16": 5e-2}
#: when a worker does not report its dtype (SGLang, the mocker)
DEFAULT_TOLERANCE = 1e-3


def tolerance(dtype: str | None, override: float | None = None) -> float:
    """The logprob tolerance for a worker serving in `dtype` (`override` wins)."""
    if override is not None:
        return override
    return DTYPE_TOLERANCE.get((dtype or "").removeprefix("torch."), DEFAULT_TOLERANCE)


@dataclass
class Probe:
    """The post-update generation every worker must reproduce: greedy `token_ids` from
    `prompt`, with `logprobs` the trainer expects for the target policy."""

    prompt: list[int]
    token_ids: list[int]
    logprobs: list[float]


def probe_from_model(model: Any, prompt: Sequence[int], n: int) -> Probe:
    """The expected probe from a causal LM in memory (the trainer's: anything called as
    `model(input_ids).logits`, e.g. a transformers model): `n` greedy tokens after `prompt`
    and their logprobs."""
    import torch

    seq, lps = list(prompt), []
    device = next(model.parameters()).device
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq], device=device)).logits[0, -1].float()
            lsm = torch.log_softmax(logits, -1)
            t = int(torch.argmax(lsm))
            seq.append(t)
            lps.append(float(lsm[t]))
    return Probe(list(prompt), seq[len(prompt):], lps)


def reference_probe(checkpoint: str | Path, prompt: Sequence[int] | None, n: int) -> Probe:
    """The expected probe of a checkpoint directory by a plain float32 transformers forward
    pass (loads the whole model: for small models and tests). Without `prompt`, the
    checkpoint's tokenizer makes one from PROBE_TEXT."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if prompt is None:
        prompt = AutoTokenizer.from_pretrained(str(checkpoint)).encode(PROBE_TEXT)
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    return probe_from_model(model, prompt, n)


# ---------------------------------------------------------------------- asking a worker


def probe_request(request_id: str, probe: Probe | None, probe_text: str) -> GenerateRequest:
    """The request-plane request of one worker's probe. An expected probe is
    teacher-forced: the worker prefills prompt + expected[:-1] (prompt logprobs: each
    expected token, its rank and logprob) and generates the last token greedily, so every
    expected token is checked in one decode step. Without one, the worker's own first
    choice at every position of `probe_text`, then one token."""
    if probe is not None:
        return GenerateRequest(request_id=request_id,
                               prompt_token_ids=probe.prompt + probe.token_ids[:-1],
                               stream=False, sampling=SamplingOptions(
                                   temperature=0.0, max_tokens=1, logprobs=0,
                                   prompt_logprobs=0, ignore_eos=True))
    return GenerateRequest(request_id=request_id, prompt=probe_text, stream=False,
                           sampling=SamplingOptions(temperature=0.0, max_tokens=1, logprobs=0,
                                                    prompt_logprobs=1, ignore_eos=True))


async def ask(session: aiohttp.ClientSession, base_url: str, req: GenerateRequest,
              timeout: float, admin_token: str | None = None) -> list[dict[str, Any]]:
    """A probe request on a worker's HTTP request plane (`POST /generate`, newline-delimited
    JSON) through the coordinator's aiohttp session for that worker (rlfleet.runtime.
    admin_client.AdminConnections): every event as a plain dict, the last one `done`;
    WorkerError for a refusal, an unreachable worker, or a broken or unfinished stream."""
    headers = {"content-type": "application/json"}
    if admin_token:
        headers["authorization"] = f"Bearer {admin_token}"
    events: list[dict[str, Any]] = []
    try:
        async with session.post(f"{base_url}/generate", data=msgspec.json.encode(req),
                                headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                raw = await resp.read()
                try:
                    body = msgspec.json.decode(raw)
                    msg = body["error"]["message"]
                except (msgspec.DecodeError, KeyError, TypeError):
                    body, msg = None, raw.decode(errors="replace")[:500]
                raise WorkerError(msg, resp.status, body=body)
            async for line in resp.content:
                if not line.strip():
                    continue
                if _taken(msgspec.json.decode(line), events):
                    return events
    except aiohttp.ClientConnectionError as e:
        if not events and isinstance(e, aiohttp.ClientConnectorError):
            raise WorkerError(f"worker at {base_url} is unreachable: {e!r}", 503,
                              retryable=True) from e
        raise WorkerError(f"worker at {base_url} failed mid-request: {e!r}", 502,
                          broken=True) from e
    except (aiohttp.ClientError, TimeoutError) as e:
        raise WorkerError(f"worker at {base_url} failed mid-request: {e!r}", 502,
                          broken=True) from e
    raise WorkerError(f"worker at {base_url} closed the stream before the request finished",
                      502, broken=True)


def _taken(ev: dict[str, Any], events: list[dict[str, Any]]) -> bool:
    """One event of a probe's stream: WorkerError for an error event, else kept in `events`;
    True once it is the last (`done`)."""
    if "error" in ev:
        raise WorkerError(ev["error"].get("message", "worker error"), ev["error"].get("code", 502))
    events.append(ev)
    return bool(ev.get("done"))


def committed_events(out: Any, instance_id: int) -> list[dict[str, Any]]:
    """The events of a probe a worker ran inside its commit_policy call (`CommitProbe`),
    judged as `ask` judges a direct probe's stream: WorkerError for a refusal, an error
    event, or a stream that ended before `done`."""
    if out.http_status != 200:
        raise WorkerError(out.message or f"HTTP {out.http_status}", out.http_status,
                          body=out.body)
    events: list[dict[str, Any]] = []
    for ev in out.events:
        if _taken(ev, events):
            return events
    raise WorkerError(f"worker {instance_id} closed the stream before the request finished",
                      502, broken=True)


def read_answer(worker: int, req: GenerateRequest, events: list[dict[str, Any]],
                probe: Probe | None, digest: str | None, tol: float) -> Answer | str:
    """A worker's answer from the events of its probe request (`probe_request`), or why it
    has none (the stream ended early, or ran on weights other than `digest`)."""
    if not events or not events[-1].get("done"):
        return "post-update generation failed: the stream ended early"
    head = events[0]
    if head.get("weight_digest") != digest:
        return (f"post-update generation ran on digest {head.get('weight_digest')}, not the "
                f"target {digest}")
    tokens: list[tuple[int, int | None, float | None]] = []
    prompt_lps = events[-1].get("prompt_logprobs") or []
    if probe is not None:
        for t, e in zip(probe.token_ids[:-1], prompt_lps[len(probe.prompt):], strict=False):
            entry = (e or {}).get(str(t), {})
            tokens.append((t, entry.get("rank"), entry.get("logprob")))
    else:
        for e in prompt_lps[1:]:
            first = (-1, None, None)
            if e:
                for t, v in e.items():
                    if v.get("rank") == 1:
                        first = (int(t), 1, v.get("logprob"))
                        break
            tokens.append(first)
    tokens += [(lp["token_id"], lp.get("rank"), lp.get("logprob")) for ev in events
               for c in ev.get("choices", []) for lp in (c.get("logprobs") or [])]
    prompt = head.get("prompt_token_ids") or list(req.prompt_token_ids or [])
    return Answer(worker, prompt, tokens, tol)


# ---------------------------------------------------------------------- judging answers


@dataclass
class Answer:
    """What one worker generated for the probe."""

    worker: int
    prompt: list[int]  # the prompt token IDs the worker used
    # (token, rank, logprob) per checked position: the expected token (expected probe) or
    # the worker's own first choice (agreement probe)
    tokens: list[tuple[int, int | None, float | None]]
    tolerance: float


def check_expected(a: Answer, p: Probe) -> str | None:
    """Why worker `a` does not reproduce the expected probe (None when it does)."""
    got = [t for t, _, _ in a.tokens]
    for i, ((t, rank, lp), want) in enumerate(zip(a.tokens, p.token_ids, strict=False)):
        if t != want or rank != 1 or lp is None:
            return (f"post-update generation does not reproduce the target policy's greedy "
                    f"tokens: token {i} is {t} (rank {rank}), expected {want} (got {got}, "
                    f"expected {p.token_ids})")
    if len(a.tokens) != len(p.token_ids):
        return (f"post-update generation does not reproduce the target policy's greedy tokens "
                f"(got {got}, expected {p.token_ids})")
    worst, at = max(((abs(lp - ref), i) for i, ((_, _, lp), ref)
                     in enumerate(zip(a.tokens, p.logprobs, strict=True))), default=(0.0, 0))
    if worst > a.tolerance:
        return (f"post-update generation does not match the target policy: max logprob diff "
                f"{worst:.2e} > {a.tolerance:g} (token {at}: {p.token_ids[at]})")
    return None


def disagreement(answers: list[Answer]) -> str | None:
    """Whether workers that should serve the same policy generated the same thing; the
    reason names each worker that differs from the majority, and where."""
    if len(answers) < 2:
        return None
    groups: dict[tuple, list[Answer]] = {}
    for a in answers:
        groups.setdefault((tuple(a.prompt), tuple(t for t, _, _ in a.tokens)), []).append(a)
    # the reference: the largest group; on a tie, the one with the lowest worker ID
    ref_key = max(groups, key=lambda k: (len(groups[k]), -min(a.worker for a in groups[k])))
    ref = groups[ref_key][0]
    problems = []
    for a in sorted(answers, key=lambda a: a.worker):
        if a is ref or (a.tokens == ref.tokens and a.prompt == ref.prompt
                        and max(a.tolerance, ref.tolerance) >= 0):
            continue  # the same answer to the last logprob: nothing to tell
        if a.prompt != ref.prompt:
            problems.append(f"worker {a.worker} tokenised the probe prompt as {a.prompt[:8]}..., "
                            f"worker {ref.worker} as {ref.prompt[:8]}...")
            continue
        for i, (mine, theirs) in enumerate(zip(a.tokens, ref.tokens, strict=False)):
            if mine[0] != theirs[0]:
                problems.append(f"worker {a.worker} puts token {mine[0]} first at position {i} "
                                f"where worker {ref.worker} puts {theirs[0]}")
                break
            if mine[2] is not None and theirs[2] is not None and \
                    abs(mine[2] - theirs[2]) > max(a.tolerance, ref.tolerance):
                problems.append(f"worker {a.worker} gives token {mine[0]} at position {i} "
                                f"logprob {mine[2]:.6f}, worker {ref.worker} {theirs[2]:.6f} "
                                f"(> {max(a.tolerance, ref.tolerance):g} apart)")
                break
        else:
            if len(a.tokens) != len(ref.tokens):
                problems.append(f"worker {a.worker} answered for {len(a.tokens)} positions, "
                                f"worker {ref.worker} for {len(ref.tokens)}")
    if not problems:
        return None
    return "workers disagree on the post-update probe: " + "; ".join(problems)
