"""The checks a worker runs on a prompt before the engine sees it, as vLLM's server runs
them: a client's chat template refused unless trusted, a text too long for the context
refused before it is tokenised, tokenisation off the event loop, truncation, token IDs
inside the vocabulary, and `max_tokens` / `min_tokens` against the room the prompt leaves.
BadRequest says what to fix."""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import Executor
from typing import Protocol

import msgspec

from rlfleet.protocol.engine import GenerateRequest, TokenizeRequest
from rlfleet.worker.engine import BadRequest, Engine

_json = msgspec.json.Encoder()


class WorkerPlane(Protocol):
    """What the checks read of the plane that runs them (rlfleet.worker.stream_server's)."""

    engine: Engine
    tokenizer_thread: Executor
    trust_request_chat_template: bool


# No token is longer than this many UTF-8 bytes in any vocabulary we serve: a text longer
# than max_model_len times this cannot fit and is refused before it is tokenised.
MAX_BYTES_PER_TOKEN = 64


def _text_bytes(req: GenerateRequest | TokenizeRequest) -> int:
    if req.prompt is not None:
        return len(req.prompt.encode("utf-8", "surrogatepass"))
    return len(_json.encode(req.messages or []))


def check_template(req: GenerateRequest | TokenizeRequest, trust_request_template: bool) -> None:
    """A chat template sent by the client is code the worker would run (Jinja): refused
    unless the operator started the worker with --trust-request-chat-template."""
    kwargs = req.chat_template_kwargs or {}
    if "chat_template" in kwargs and not trust_request_template:
        raise BadRequest("chat_template_kwargs.chat_template: this worker does not render "
                         "chat templates sent by clients (the operator can allow it with "
                         "--trust-request-chat-template); drop it to use the model's template")


async def tokenize_off_loop(plane: WorkerPlane, req: GenerateRequest | TokenizeRequest,
                            max_model_len: int | None) -> list[int]:
    """Tokenise (and render the chat template) in the plane's tokeniser thread, never on
    the event loop; a text that cannot fit `max_model_len` is refused before that."""
    check_template(req, plane.trust_request_chat_template)
    if max_model_len is not None:
        size = _text_bytes(req)
        if size > max_model_len * MAX_BYTES_PER_TOKEN:
            raise BadRequest(f"the prompt is {size} bytes of text: more than the context length "
                             f"of {max_model_len} tokens can hold; shorten the prompt")
    return await asyncio.get_running_loop().run_in_executor(
        plane.tokenizer_thread, functools.partial(
            plane.engine.tokenize, req.prompt, req.messages, req.add_generation_prompt,
            req.chat_template_kwargs, add_special_tokens=getattr(req, "add_special_tokens", None)))


async def check_prompt(plane: WorkerPlane, req: GenerateRequest) -> list[int]:
    """Tokenise if needed (off the event loop), truncate as asked, and check the prompt and
    the sampling parameters against the model as vLLM's server does (a `max_tokens` beyond
    the room the prompt leaves is lowered to it; beyond the context length it is refused).
    BadRequest says what to fix."""
    engine = plane.engine
    info = engine.info
    s = req.sampling
    if req.prompt_token_ids is not None:
        ids = req.prompt_token_ids
        if not ids:
            raise BadRequest("prompt_token_ids is empty: send at least one token")
    else:
        ids = await tokenize_off_loop(plane, req, info.max_model_len)
    keep = req.truncate_prompt_tokens
    if keep is not None:
        if keep > info.max_model_len:
            raise BadRequest(f"truncate_prompt_tokens={keep} cannot be greater than max_model_len "
                             f"= {info.max_model_len}. Please request a smaller truncation size.")
        if keep < 0:
            keep = info.max_model_len - 1
        if keep < len(ids):
            side = req.truncation_side or engine.truncation_side
            ids = ids[len(ids) - keep:] if side == "left" else ids[:keep]
    if not ids:
        raise BadRequest("the prompt is empty (it tokenises to zero tokens, or was truncated "
                         "to none): send a non-empty prompt")
    vocab = info.vocab_size
    if min(ids) < 0 or max(ids) >= vocab:
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise BadRequest(f"prompt token ID {bad} is outside the vocabulary "
                         f"[0, {vocab}) of model {info.served_model_name!r}")
    for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
        bad = [t for t in getattr(s, name) or () if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"token_id(s) {bad[:8]} in {name} contain out-of-vocab token ids. "
                             f"Vocabulary size: {vocab}")
    room = info.max_model_len - len(ids)
    if room <= 0:
        raise BadRequest(f"the prompt has {len(ids)} tokens, but the context length of "
                         f"{info.served_model_name!r} is {info.max_model_len}: shorten the prompt")
    mt = s.max_tokens
    if mt is not None and mt > info.max_model_len:
        raise BadRequest(f"max_tokens={mt} cannot be greater than max_model_len="
                         f"{info.max_model_len}. Please request fewer output tokens.")
    if mt is not None and mt > room:
        s.max_tokens = mt = room  # as vLLM's server: at most what the context leaves
    if s.min_tokens > (mt or room):
        raise BadRequest(f"min_tokens must be less than or equal to max_tokens={mt or room}, "
                         f"got {s.min_tokens} (the prompt has {len(ids)} tokens of a context "
                         f"of {info.max_model_len})")
    return ids
