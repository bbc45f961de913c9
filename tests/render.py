"""The frontend's renderings as JSON-ready dicts, and request-plane events written as plain
dicts, for tests that build responses without a frontend (a fake frontend, checks of
what a client makes of a response)."""

from __future__ import annotations

from typing import Any

import msgspec

from rlfleet.frontend.openai import render
from rlfleet.frontend.result import Result
from rlfleet.frontend.sglang.render import generate_response
from rlfleet.protocol.engine import Delta, Done, Event, Head, Step
from rlfleet.protocol.openai import ChatCompletionRequest, CompletionRequest
from rlfleet.protocol.sglang import SglangGenerateRequest


def event(ev: dict[str, Any]) -> Event:
    """A request-plane event written as the JSON the worker's HTTP plane sends (a Head has
    `prompt_token_ids`, a Step `choices`, a Done `done`), as the typed frame."""
    if "choices" in ev:
        return msgspec.convert(ev, Step)
    if "prompt_token_ids" in ev:
        return msgspec.convert(ev, Head)
    if "done" in ev:
        return msgspec.convert(ev, Done)
    raise ValueError(f"not a request-plane event: {sorted(ev)}")


def completion_response(req: CompletionRequest, res: Result | list[Result], model: str) -> dict:
    return msgspec.to_builtins(render.completion_body(req, res, model))


def completion_chunk(req: CompletionRequest, res: Result, model: str, d: Delta,
                     text_offset: int) -> dict:
    return msgspec.to_builtins(render.completion_chunk_body(req, res, model, d, text_offset)[0])


def final_chunk(req: CompletionRequest | ChatCompletionRequest, res: Result | list[Result],
                model: str, obj: str | None = None) -> dict | None:
    last = render.final_chunk_body(req, res, model, obj)
    return None if last is None else msgspec.to_builtins(last)


def chat_response(req: ChatCompletionRequest, res: Result, model: str) -> dict:
    return msgspec.to_builtins(render.chat_body(req, res, model))


def chat_chunk(req: ChatCompletionRequest, res: Result, model: str, d: Delta, first: bool
               ) -> dict:
    return msgspec.to_builtins(render.chat_chunk_body(req, res, model, d, first))


def sglang_body(req: SglangGenerateRequest, res: Result) -> dict:
    """SGLang's /generate answer for prompt 0 of `req`."""
    return msgspec.to_builtins(generate_response(req, res))
