"""What a worker's engine must provide: the vLLM engine (rlfleet.vllm) and the
synthetic engine (rlfleet.mocker) both implement `Engine` (serving) and `EngineControl`
(the control plane), and the shared worker runtime (request plane, system server with
`rlfleet.worker.admin`, discovery) drives either one."""

from __future__ import annotations

import abc
import functools
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rlfleet.protocol.admin_vllm import DistributedRequest, GroupRequest
from rlfleet.protocol.engine import Done, GenerateRequest, Step
from rlfleet.protocol.identity import UNKNOWN, PolicyIdentity
from rlfleet.protocol.vllm_rl import NO_TRANSFER_BACKEND
from rlfleet.runtime.metrics import WorkerSeries


class BadRequest(ValueError):
    """The request cannot be served as given; the message says what to fix (HTTP 400)."""


class UnknownAdapter(BadRequest):
    """The request names a LoRA adapter this worker does not serve (HTTP 404)."""


def adapter_named(by_name: Mapping[str, Any], name: str) -> Any:
    """`by_name[name]`, or UnknownAdapter naming the adapters this worker has loaded."""
    a = by_name.get(name)
    if a is None:
        known = ", ".join(sorted(by_name)) or "none"
        raise UnknownAdapter(f"no LoRA adapter {name!r} is loaded on this worker "
                             f"(loaded: {known})")
    return a


def set_admission(adapter: Any, open_: bool, reason: str | None) -> None:
    """Open or close an adapter's requests (`adapter.open`, `adapter.reason`)."""
    adapter.open = open_
    adapter.reason = None if open_ else (reason or "closed by a refresh coordinator")


NO_ADAPTERS = ("this worker serves no LoRA adapters: start it with vLLM's --enable-lora "
               "(and --max-loras, --max-lora-rank)")


@dataclass(frozen=True)
class AdapterState:
    """A LoRA adapter as a worker serves it: its policy (`policy.adapter` is its name), its
    rank and directory, and whether requests that name it are admitted."""

    policy: PolicyIdentity
    rank: int
    path: str
    open: bool = True
    reason: str | None = None


class AdapterTable(Protocol):
    """An engine's LoRA adapters (rlfleet.vllm.adapters, rlfleet.mocker.adapters): the
    engine-control adapter methods are written once over it (EngineControl)."""

    max_loras: int
    max_rank: int

    def states(self) -> list[AdapterState]: ...

    async def load(self, name: str, path: Path, version: str | None, step: int | None,
                   digest: str | None = None) -> tuple[PolicyIdentity, str | None]: ...

    async def unload(self, name: str) -> PolicyIdentity: ...

    def set_open(self, name: str, open_: bool, reason: str | None) -> AdapterState: ...


@dataclass
class EngineInfo:
    served_model_name: str
    model_path: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()
    world_size: int = 1  # the engine's ranks: TP x PP x DP (what a trainer's group counts)
    # the vLLM weight-transfer backend it was started with (--weight-transfer-config, else
    # vLLM's default), as discovery names it (Dynamo 1.7's `weight_transfer_backend`)
    weight_transfer_backend: str = NO_TRANSFER_BACKEND
    # its KV-event publisher (rlfleet.protocol.kv_events): a tcp:// endpoint, and the
    # engine's block size
    kv_events: str | None = None
    kv_block_size: int | None = None
    # what its log-probabilities are (vLLM's --logprobs-mode) and the tokenizer it loaded,
    # as server-info routes report them (None: not a vLLM engine / the model's own)
    logprobs_mode: str | None = None
    tokenizer: str | None = None


class Engine(abc.ABC):
    info: EngineInfo
    #: which end of a prompt `truncate_prompt_tokens` cuts by default: the start, keeping
    #: the last tokens (vLLM loads every tokenizer with truncation_side="left")
    truncation_side: str = "left"

    @functools.cached_property
    def series(self) -> WorkerSeries:
        """This engine's worker metrics, labelled with the model it serves."""
        return WorkerSeries(self.info.served_model_name)

    @abc.abstractmethod
    def tokenize(
        self,
        prompt: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool | None = None,
    ) -> list[int]:
        """Token IDs of a text prompt or of chat messages rendered by the chat template.
        `add_special_tokens` None: yes for a text prompt, no for chat (its template adds
        them). Raises BadRequest for messages the template cannot render."""

    def detokenize(self, token_ids: list[int]) -> str:
        """Text of token IDs (used for echo)."""
        return "".join(self.token_strs(token_ids))

    def token_strs(self, token_ids: list[int]) -> list[str]:
        """The text of each token on its own (used for echo)."""
        return ["" for _ in token_ids]

    def token_pieces(self, token_ids: list[int]) -> list[str]:
        """Each token as the tokenizer's vocabulary spells it (vLLM's /tokenize
        `token_strs`: the tokenizer's convert_ids_to_tokens)."""
        return self.token_strs(token_ids)

    def decode_text(self, token_ids: list[int]) -> str:
        """The text of token IDs, as the tokenizer decodes them with special tokens kept
        (vLLM's /detokenize)."""
        return self.detokenize(token_ids)

    @abc.abstractmethod
    def generate(self, req: GenerateRequest, prompt_token_ids: list[int]
                 ) -> AsyncIterator[Step | Done]:
        """Yield the request-plane events after the Head (see rlfleet.protocol.engine), as
        the typed frames the worker sends: `Step`s, then one `Done`. Closing the iterator
        early aborts the request in the engine."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """End a running request now, with its partial output and finish reason `abort`."""

    def tracks(self, request_id: str) -> bool:
        """Whether a request of this ID is in the engine now (running, frozen by a pause, or
        held by one): `abort` would end it."""
        raise NotImplementedError

    def serving_policy(self) -> PolicyIdentity:
        """The policy currently applied (stamped on every response)."""
        return UNKNOWN

    def request_policy(self, req: GenerateRequest) -> PolicyIdentity:
        """The policy `req` runs on (once `generate` has started it): the base model's, or
        for a request naming an adapter, the adapter version it was admitted to."""
        return self.serving_policy()

    #: its LoRA adapters, when started with --enable-lora (None: it serves none)
    lora: AdapterTable | None = None

    def adapters(self) -> list[AdapterState]:
        """The LoRA adapters served beside the base model."""
        return self.lora.states() if self.lora is not None else []

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Warm up; called once before the worker registers in discovery."""

    async def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release the engine's resources."""

    def num_running(self) -> int:
        return 0


# ---------------------------------------------------------------------- control plane


@dataclass(frozen=True)
class PreparedVersion:
    """What an engine prepared of a staged version while it served (`prepare_staged`)."""

    how: str  # "swap": installing it swaps the prepared tensors in
    digest: str  # the content digest of what was prepared
    seconds: float  # how long the preparation took


class WeightLoadError(RuntimeError):
    """New weights could not be loaded; the message says what failed and whether the
    previous weights serve again. `uncertain`: they do not, and the model may hold part of
    each (or nothing): the worker must not serve until a load succeeds."""

    def __init__(self, message: str, uncertain: bool = False) -> None:
        super().__init__(message)
        self.uncertain = uncertain


@dataclass(frozen=True)
class AppliedWeights:
    """What an engine serves: the policy, whether a caller declared its version, and the
    dtype it computes in."""

    policy: PolicyIdentity
    declared: bool  # whether a caller declared `policy.version` (an explicit null counts)
    dtype: str | None = None  # the dtype the engine computes in ("bfloat16"), when known


class EngineControl(abc.ABC):
    """What the admin routes (`rlfleet.worker.admin.EngineAdmin`) need from an engine.

    Loads never check the pause state (the admin does) and never reset the cache (the
    admin does, then records the identity with `set_version`). A load that fails leaves
    the previous weights serving, or raises `WeightLoadError` saying it could not."""

    #: backend of a trainer's weight-update group when the trainer names none
    group_backend: str = "gloo"

    # ---- generation

    async def check_health(self) -> None:  # noqa: B027 - optional: healthy by default
        """Raise when the engine cannot serve (its process is gone, its loop is dead)."""

    async def weights_problem(self) -> str | None:
        """Why the model cannot run on the weights it holds (None when it can), found
        without running it and cheaply: this answers every liveness probe."""
        return None

    def busy(self) -> str | None:
        """The long control call the engine runs now, if any ("init_group running for 3.1s"):
        a liveness probe answers from what it knows instead of queueing behind it."""
        return None

    @abc.abstractmethod
    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> None:
        """Stop generating; `mode` keep | wait | abort (protocol.admin_vllm.PAUSE_MODES)."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Generate again; requests frozen by a keep-pause continue."""

    @abc.abstractmethod
    async def is_paused(self) -> bool: ...

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """End a running request now (as `Engine.abort`)."""

    async def abort_all(self) -> int:
        """End every request in the engine now (as `abort`); returns how many."""
        raise NotImplementedError

    def world_size(self, include_dp: bool = True) -> int:
        """The engine's ranks: TP x PP, times DP with `include_dp` (1 for one process)."""
        return 1

    @abc.abstractmethod
    async def reset_cache(self, running: bool = False) -> bool:
        """Drop the prefix (KV) cache; with `running`, also the cache of requests still in
        the engine (they recompute). False when it could not be reset."""

    # ---- identity

    @abc.abstractmethod
    def applied(self) -> AppliedWeights: ...

    @abc.abstractmethod
    async def set_version(self, version: str | None, declared: bool = True,
                          digest: str | None = None, step: int | None = None) -> None:
        """Record the label of the weights served. After a load (`digest` given: what was
        loaded) `step` is the new policy's fleet step (None: unknown); without a digest
        (a relabel) the recorded step stays unless `step` is given."""

    # ---- loading

    @abc.abstractmethod
    def checkpoint_mismatch(self, path: Path) -> str | None:
        """Why the checkpoint directory at `path` cannot replace the served weights in
        place (None when it can). ValueError when `path` is not a readable checkpoint."""

    @abc.abstractmethod
    async def load_path(self, path: Path) -> str:
        """Load the checkpoint directory at `path`; returns the digest of what was loaded."""

    @abc.abstractmethod
    async def apply_tensors(self, tensors: Mapping[str, Any]) -> str:
        """Load staged tensors already in host memory (name -> tensor in checkpoint format,
        the model's complete set); returns the digest of what was loaded. ValueError
        (nothing changed) when they do not fit the served model."""

    async def staging_refusal(self) -> str | None:
        """Why this engine cannot prepare a version of its model while it serves, so that
        installing it is a swap (no room for a second copy of the weights now; an engine
        that does not prepare versions): None when it can. A refresh that stages a
        checkpoint only to shorten the pause asks first, and installs from disk otherwise."""
        return "this engine does not prepare a staged version while it serves"

    async def prepare_staged(self, path: Path, digest: str | None,
                             checksums: Mapping[str, str] | None = None
                             ) -> PreparedVersion | None:
        """Work done ahead of `load_staged(path, digest)` while the engine serves, so that the
        load inside the gated window is short; what was prepared (None: nothing, the load
        does all of it). `digest` None (only where `staging_refusal` says it can): the
        engine reads the files at `path` once, checks each tensor as it takes it (finite,
        its Adler-32 where `checksums` names one) and reports their digest; a bad tensor
        raises rlfleet.weights.artifacts.ArtifactError."""
        return None

    async def discard_staged(self, path: Path) -> None:
        """Forget what `prepare_staged` kept for the version at `path` (it was released)."""
        return None

    async def load_staged(self, path: Path, digest: str) -> str:
        """Load a staged version directory (rlfleet.weights.staging) whose content digest
        `digest` was computed over these very files when they were staged (they are
        read-only since); returns the digest of what was loaded. By default its tensors go
        through `apply_tensors`."""
        from rlfleet.weights.digest import iter_checkpoint_tensors

        return await self.apply_tensors(dict(iter_checkpoint_tensors(path)))

    # ---- LoRA adapters (each a policy of its own, served beside the base model)

    lora: AdapterTable | None = None  # (Engine's)

    def _lora(self) -> Any:
        if self.lora is None:
            raise UnknownAdapter(NO_ADAPTERS)
        return self.lora

    def _loadable(self, name: str) -> Any:
        """The adapter table, when `name` may be loaded as an adapter (BadRequest if not)."""
        if self.lora is None:
            raise BadRequest(NO_ADAPTERS)
        if name == self.info.served_model_name:  # type: ignore[attr-defined]
            raise BadRequest(f"lora_name {name!r} is the base model's name: give the adapter "
                             "a name of its own")
        return self.lora

    def adapter_limits(self) -> tuple[int, int] | None:
        """(max adapters, max rank) when the engine serves adapters, else None."""
        return (self.lora.max_loras, self.lora.max_rank) if self.lora is not None else None

    async def load_adapter(self, name: str, path: Path, version: str | None,
                           step: int | None, digest: str | None = None
                           ) -> tuple[PolicyIdentity, str | None]:
        """Load the adapter at `path` as `name` (a new version of it when loaded): requests
        that name it from now on run on it, the base model and other adapters serve on
        undisturbed. Returns (its policy, the version it replaced). BadRequest (nothing
        changed, the old version serving) when it does not fit."""
        return await self._loadable(name).load(name, path, version, step, digest)

    async def unload_adapter(self, name: str) -> PolicyIdentity:
        """Stop serving `name` (requests running on it finish); UnknownAdapter if absent."""
        return await self._lora().unload(name)

    #: whether the engine's adapter table loads a new adapter version beside the serving one
    #: (`load_beside`, `activate`, `discard`): a refresh probes it before its gate
    loads_adapters_beside: bool = False

    async def load_adapter_beside(self, name: str, path: Path, version: str | None,
                                  step: int | None, digest: str | None = None
                                  ) -> tuple[PolicyIdentity, str]:
        """Load `path` as a version of `name` beside the one serving it: requests naming
        `name` stay on the serving version; (its policy, the engine name a request gives to
        run on exactly this version). One such version per adapter (a newer one replaces
        it). BadRequest as load_adapter's."""
        table = self._loadable(name)
        if not self.loads_adapters_beside:
            raise BadRequest("this engine loads no adapter version beside the serving one")
        return await table.load_beside(name, path, version, step, digest)

    async def activate_adapter(self, name: str, version: str
                               ) -> tuple[PolicyIdentity, str | None]:
        """Switch `name` to its version loaded beside (labelled `version`): requests naming
        it from now on run on it; (its policy, the version it replaced)."""
        return await self._lora().activate(name, version)

    async def discard_adapter(self, name: str, version: str) -> PolicyIdentity:
        """Drop `name`'s version loaded beside (labelled `version`); the serving one serves
        on."""
        return await self._lora().discard(name, version)

    def set_adapter_open(self, name: str, open_: bool, reason: str | None) -> AdapterState:
        """Admit requests naming `name`, or hold them on the worker until it opens."""
        return self._lora().set_open(name, open_, reason)

    # ---- a trainer's weight-update group (update_weights_from_distributed)

    @abc.abstractmethod
    def announced_mismatch(self, d: DistributedRequest) -> str | None:
        """Why the tensors a trainer announces cannot be received (None when they can)."""

    @abc.abstractmethod
    async def join_group(self, g: GroupRequest) -> None:
        """Join the trainer's group (rank `g.rank_offset`); raises on failure or timeout."""

    @abc.abstractmethod
    async def receive(self, d: DistributedRequest, timeout: float) -> int:
        """Receive the announced tensors into staging (live weights untouched); returns
        the bytes received. Raises when the transfer fails."""

    @abc.abstractmethod
    async def apply_received(self) -> str:
        """Load what `receive` staged; returns the digest of what was loaded."""

    @abc.abstractmethod
    async def leave_group(self) -> None: ...

    # ---- vLLM's own weight transfer (its native RL routes, rlfleet.worker.native_rl)

    def own_transfer_backend(self) -> str | None:
        """The vLLM weight-transfer backend the worker runs itself, over rlfleet's weight
        plane, instead of the engine (rlfleet.worker.modelexpress); None: the engine's."""
        return None

    def weight_transfer_refusal(self) -> str | None:
        """Why this engine cannot run vLLM's weight-transfer steps (None when it can)."""
        return ("this engine has no vLLM weight-transfer engine: load weights with POST "
                "/collective_rpc {\"method\": \"reload_weights\"} or the /engine routes")

    async def transfer_weights(self, step: str, payload: Any = None) -> None:
        """Run one of vLLM's weight-transfer steps (rlfleet.protocol.vllm_rl.TRANSFER_STEPS:
        init with its init_info, start, update with its update_info, finish, shutdown)."""
        raise NotImplementedError(self.weight_transfer_refusal())
