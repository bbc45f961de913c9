"""What a worker's engine must provide: the vLLM engine (rlfleet.vllm) and the
synthetic engine (rlfleet.mocker) both implement `Engine`, and the shared worker
runtime (request plane, system server, discovery) drives either one."""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from rlfleet.protocol.engine import GenerateRequest


class BadRequest(ValueError):
    """The request cannot be served as given; the message says what to fix (HTTP 400)."""


@dataclass
class EngineInfo:
    served_model_name: str
    model_path: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()


class Engine(abc.ABC):
    info: EngineInfo

    @abc.abstractmethod
    def tokenize(
        self,
        prompt: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token IDs of a text prompt or of chat messages rendered by the chat template."""

    def detokenize(self, token_ids: list[int]) -> str:
        """Text of token IDs (used for echo)."""
        return "".join(self.token_strs(token_ids))

    def token_strs(self, token_ids: list[int]) -> list[str]:
        """The text of each token on its own (used for echo)."""
        return ["" for _ in token_ids]

    @abc.abstractmethod
    def generate(self, req: GenerateRequest, prompt_token_ids: list[int]) -> AsyncIterator[dict]:
        """Yield request-plane events after the first one (see rlfleet.protocol.engine):
        `{"choices": [...]}` events, then `{"done": true, "prompt_logprobs": ...}`.
        Closing the iterator early aborts the request in the engine."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """End a running request now, with its partial output and finish reason `abort`."""

    def weight_identity(self) -> dict[str, Any]:
        """The weight version and digest currently applied (stamped on every response)."""
        return {}

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Warm up; called once before the worker registers in discovery."""

    async def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release the engine's resources."""

    def num_running(self) -> int:
        return 0
