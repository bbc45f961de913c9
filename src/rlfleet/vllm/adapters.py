"""LoRA adapters served beside the base model by one vLLM engine, each a policy of its own.

vLLM (CPU build included) adds and removes adapters on a running AsyncLLM between engine
steps (`add_lora` / `remove_lora`), without pausing generation. A new version of an adapter
is therefore loaded as a new vLLM adapter (a new integer id) while the old version serves;
from the moment it is loaded, requests that name the adapter run on it, requests already
running on the old version finish on it, and the old one is removed once none runs on it.
Nothing is paused: the base model and every other adapter serve throughout, and a load
that fails leaves the old version serving.

A version may also be loaded beside the serving one without serving the adapter's name
(`load_beside`): only requests that name its own vLLM name (`name@id`) run on it, so a
refresh probes it while the old version serves, and `activate` then switches the name to it
(or `discard` drops it).

Each adapter has its own admission flag (`set_open`), published in the worker's discovery
entry: while it is closed, frontends hold requests that name the adapter (as they hold a
gated worker's), and route the base model's and the other adapters' as before; the
worker's own request plane (a refresh's probe) still serves it."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlfleet.protocol.identity import PolicyIdentity
from rlfleet.weights.digest import checkpoint_digest, checkpoint_signature
from rlfleet.worker.engine import (
    AdapterState,
    BadRequest,
    UnknownAdapter,
    adapter_named,
    set_admission,
)

log = logging.getLogger("rlfleet.vllm.adapters")

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


@dataclass
class Served:
    """One loaded version of an adapter: its vLLM request and what runs on it."""

    policy: PolicyIdentity
    lora: Any  # vllm.lora.request.LoRARequest
    path: str
    rank: int
    running: int = 0
    retired: bool = False  # a newer version replaced it (or it was unloaded)


@dataclass
class Adapter:
    """A name and the version requests that name it run on, with its gate."""

    current: Served
    open: bool = True  # admitted by frontends (a refresh coordinator closes it)
    reason: str | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one load or unload at a time


def adapter_problem(path: Path, base: dict[str, tuple[str, tuple[int, ...]]],
                    max_rank: int) -> tuple[int, str | None]:
    """(rank, why `path` cannot serve on this base: None when it can). Checked from the
    adapter's files alone, before the engine sees them."""
    if not path.is_dir():
        return 0, f"lora_path {path} does not exist or is not a directory"
    cfg_file, weights = path / CONFIG, path / WEIGHTS
    if not cfg_file.is_file() or not weights.is_file():
        return 0, (f"lora_path {path} is not a LoRA adapter: it needs {CONFIG} and {WEIGHTS} "
                   "(as peft's save_pretrained writes them)")
    try:
        cfg = json.loads(cfg_file.read_text())
        sig = checkpoint_signature(path)
    except (OSError, ValueError) as e:
        return 0, f"lora_path {path} cannot be read: {e}"
    rank = int(cfg.get("r") or 0)
    if rank < 1:
        return 0, f"{CONFIG} in {path} gives no rank (r)"
    if rank > max_rank:
        return rank, (f"the adapter's rank {rank} exceeds this worker's --max-lora-rank "
                      f"{max_rank}: make it with rank <= {max_rank}, or start the worker with "
                      f"--max-lora-rank {rank}")
    return rank, _shape_problem(sig, base, rank)


def _shape_problem(sig: dict[str, tuple[str, tuple[int, ...]]],
                   base: dict[str, tuple[str, tuple[int, ...]]], rank: int) -> str | None:
    """Why the adapter's A and B matrices do not fit the base model's layers."""
    pairs = 0
    other = sorted(n for n in sig if "lora_embedding" in n or ".lm_head." in n)
    if other:  # the output layer's LoRA is not served (rlfleet.vllm.extension)
        return (f"the adapter adapts the embeddings or the output layer ({other[0]}): rlfleet "
                "serves adapters of the transformer layers' projections only")
    for name, (_, shape) in sorted(sig.items()):
        part = "lora_A" if ".lora_A." in name else "lora_B" if ".lora_B." in name else None
        if part is None:
            continue
        module = name.removeprefix(_PEFT_PREFIX).split(f".{part}.")[0]
        layer = base.get(f"{module}.weight")
        if layer is None:
            return (f"the adapter was made for another base model: it adapts {module}, "
                    "which this worker's base model does not have")
        out_dim, in_dim = layer[1][0], layer[1][-1]
        want = (rank, in_dim) if part == "lora_A" else (out_dim, rank)
        if tuple(shape) != want:
            return (f"the adapter does not fit this worker's base model: {name} has shape "
                    f"{list(shape)}, {module} here needs {list(want)} (rank {rank}); an "
                    "adapter made for another base model, or a wrong rank in its config")
        pairs += 1
    if not pairs:
        return "the adapter holds no lora_A / lora_B tensors"
    return None


class LoraAdapters:
    """The adapters one engine serves, by name (vLLM's own LoRA engine: `llm`)."""

    def __init__(self, llm: Any, base: dict[str, tuple[str, tuple[int, ...]]],
                 max_loras: int, max_rank: int) -> None:
        self.llm, self.base = llm, base
        self.max_loras, self.max_rank = max_loras, max_rank
        self.by_name: dict[str, Adapter] = {}
        self._next_id = 1
        self._removing: set[asyncio.Future] = set()  # retired versions being removed
        self.beside: dict[str, Served] = {}  # name -> a version loaded beside the serving one
        self._locks: dict[str, asyncio.Lock] = {}  # one load, switch or unload at a time

    def states(self) -> list[AdapterState]:
        return [AdapterState(a.current.policy, a.current.rank, a.current.path,
                             a.open, a.reason) for a in self.by_name.values()]

    def state(self, name: str) -> AdapterState:
        a = self._get(name)
        return AdapterState(a.current.policy, a.current.rank, a.current.path,
                            a.open, a.reason)

    def _get(self, name: str) -> Adapter:
        return adapter_named(self.by_name, name)

    # ------------------------------------------------------------ loading

    async def load(self, name: str, path: Path, version: str | None, step: int | None,
                   digest: str | None = None) -> tuple[PolicyIdentity, str | None]:
        """Load `path` as `name`'s new version; (its policy, the version it replaced)."""
        async with self._lock(name):
            served = await self._add(name, path, version, step, digest)
            return served.policy, self._switch(name, served)

    async def load_beside(self, name: str, path: Path, version: str | None,
                          step: int | None, digest: str | None = None
                          ) -> tuple[PolicyIdentity, str]:
        """Load `path` as a version of `name` beside the serving one (requests naming `name`
        stay on that); (its policy, its vLLM name: a request naming that runs on it)."""
        async with self._lock(name):
            served = await self._add(name, path, version, step, digest)
            older, self.beside[name] = self.beside.get(name), served
            if older is not None:
                self._retire(older)
            return served.policy, served.lora.lora_name

    async def activate(self, name: str, version: str) -> tuple[PolicyIdentity, str | None]:
        """`name` serves its version loaded beside from now on; (its policy, the version
        it replaced: retired, removed once the requests running on it finish)."""
        async with self._lock(name):
            served = self._beside(name, version)
            del self.beside[name]
            return served.policy, self._switch(name, served)

    async def discard(self, name: str, version: str) -> PolicyIdentity:
        async with self._lock(name):
            served = self._beside(name, version)
            del self.beside[name]
            self._retire(served)
            return served.policy

    def _beside(self, name: str, version: str) -> Served:
        served = self.beside.get(name)
        if served is None or served.policy.version != version:
            held = served.policy.version if served else None
            raise UnknownAdapter(f"adapter {name!r} has no version {version!r} loaded beside "
                                 f"the serving one (beside: {held or 'none'}): load it with "
                                 "activate: false first")
        return served

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    async def _add(self, name: str, path: Path, version: str | None, step: int | None,
                   digest: str | None) -> Served:
        """Check `path` and add it to vLLM as a version of `name` of its own (not yet
        serving `name`); BadRequest, nothing changed, when it does not fit."""
        from vllm.lora.request import LoRARequest

        rank, why = await asyncio.to_thread(adapter_problem, path, self.base, self.max_rank)
        if why:
            raise BadRequest(why)
        found = await asyncio.to_thread(checkpoint_digest, path)
        if digest is not None and found != digest:
            raise BadRequest(f"the adapter at {path} has digest {found}, not {digest} as "
                             "expected: nothing was changed")
        names = set(self.by_name) | set(self.beside)
        if name not in names and len(names) >= self.max_loras:
            raise BadRequest(f"this worker serves {self.max_loras} adapters already "
                             f"(--max-loras): unload one first ({', '.join(sorted(names))})")
        # a name of its own per version: vLLM's prefix cache keys KV by the adapter's
        # name and path, and a new version may come from the same path
        lora = LoRARequest(f"{name}@{self._next_id}", self._next_id, str(path))
        self._next_id += 1
        t0 = time.monotonic()
        try:
            ok = await self.llm.add_lora(lora)
        except Exception as e:  # vLLM's own checks of the adapter
            raise BadRequest(f"vLLM refused the adapter at {path}: {e}; nothing was "
                             "changed") from e
        if not ok:
            raise BadRequest(f"vLLM did not load the adapter at {path}; nothing changed")
        log.info("adapter %s: loaded %s (rank %d) as %s in %.3f s", name, version, rank,
                 lora.lora_name, time.monotonic() - t0)
        return Served(PolicyIdentity(version=version, digest=found, step=step, adapter=name),
                      lora, str(path), rank)

    def _switch(self, name: str, served: Served) -> str | None:
        """Requests naming `name` run on `served` from now on; the version it replaced."""
        old = self.by_name.get(name)
        if old is None:
            self.by_name[name] = Adapter(served, lock=self._lock(name))
            return None
        old.current, previous = served, old.current
        self._retire(previous)
        log.info("adapter %s serves %s, replacing %s", name, served.policy.version,
                 previous.policy.version)
        return previous.policy.version

    async def unload(self, name: str) -> PolicyIdentity:
        a = self._get(name)
        async with a.lock:
            del self.by_name[name]
            self._retire(a.current)
            beside = self.beside.pop(name, None)
            if beside is not None:
                self._retire(beside)
        return a.current.policy

    def _retire(self, served: Served) -> None:
        served.retired = True
        if served.running == 0:
            self._remove(served)

    def _remove(self, served: Served) -> None:
        task = asyncio.ensure_future(self.llm.remove_lora(served.lora.lora_int_id))
        self._removing.add(task)

        def done(t: asyncio.Future) -> None:
            self._removing.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.warning("removing adapter %s version %s: %r", served.policy.adapter,
                            served.policy.version, t.exception())
        task.add_done_callback(done)

    # ------------------------------------------------------------ serving

    def set_open(self, name: str, open_: bool, reason: str | None) -> AdapterState:
        set_admission(self._get(name), open_, reason)
        return self.state(name)

    def _named(self, name: str) -> Served:
        """The version a request naming `name` runs on: the adapter's serving version, or
        a version loaded beside it named by its own vLLM name (`name@id`)."""
        for served in self.beside.values():
            if served.lora.lora_name == name:
                return served
        return self._get(name).current

    def policy_of(self, name: str) -> PolicyIdentity:
        return self._named(name).policy

    def bind(self, name: str) -> Served:
        """The version a new request naming `name` runs on (to `release` when it ends)."""
        served = self._named(name)
        served.running += 1
        return served

    def release(self, served: Served) -> None:
        served.running -= 1
        if served.retired and served.running == 0:
            self._remove(served)
