"""LoRA adapters in the simulated engine (a declared simulator: nothing here is vLLM's
behaviour): the engine side of the worker's adapter routes (rlfleet.worker.lora_admin over
`EngineControl`), so that a refresh coordinator's adapter path (rlfleet.refresh.adapter) drives
a mocker fleet as it drives vLLM workers.

An adapter is a directory in peft's format (adapter_config.json with its rank `r`, and
adapter_model.safetensors), as `rlfleet make-model --adapter` writes it; its identity is
its content digest, computed as the coordinator computes it (rlfleet.weights.digest). The
tokens of a request that names the adapter are drawn from a distribution seeded by the base
weights' seed and that digest: another version, other tokens, the same for every worker.

As in rlfleet.vllm.adapters: a new version of an adapter replaces the old one for requests
that arrive from then on while requests running on the old one finish on it, nothing is
paused, a load that does not fit leaves the old version serving, and each adapter has its
admission flag (frontends hold its requests while it is closed)."""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path

from rlfleet.mocker.cache import BlockSalt
from rlfleet.protocol.identity import PolicyIdentity
from rlfleet.weights.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from rlfleet.weights.digest import checkpoint_digest
from rlfleet.worker.engine import (
    AdapterState,
    BadRequest,
    adapter_named,
    set_admission,
)

# vLLM's defaults for its LoRA engine arguments
MAX_LORAS, MAX_LORA_RANK = 1, 16


def add_lora_args(p: argparse.ArgumentParser) -> None:
    """vLLM's LoRA flags, as the vLLM worker takes them (rlfleet.vllm.args)."""
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters beside the simulated base model (their tokens "
                        "are seeded by the adapter's content digest)")
    p.add_argument("--max-loras", type=int, default=MAX_LORAS,
                   help=f"adapters served at once (vLLM's default {MAX_LORAS})")
    p.add_argument("--max-lora-rank", type=int, default=MAX_LORA_RANK,
                   help=f"the largest adapter rank accepted (vLLM's default {MAX_LORA_RANK})")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="adapters to serve from the start (needs --enable-lora), as `vllm "
                        "serve` takes them: name=path, or JSON {\"name\", \"path\"}")


def parse_lora_modules(values: list[str] | None) -> list[tuple[str, str]]:
    """--lora-modules as (name, path) pairs; ValueError says which one is malformed."""
    out = []
    for v in values or []:
        if v.lstrip().startswith("{"):
            try:
                d = json.loads(v)
            except ValueError as e:
                raise ValueError(f"--lora-modules {v!r}: not JSON: {e}") from None
            name, path = (d.get("name"), d.get("path")) if isinstance(d, dict) else (None, None)
        else:
            name, _, path = v.partition("=")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"--lora-modules {v!r}: give name=path or "
                             '{"name": ..., "path": ...}')
        out.append((name, path))
    return out


def adapter_rank(path: Path, max_rank: int) -> int:
    """The rank of the peft adapter at `path`; BadRequest says why it cannot serve here."""
    if not path.is_dir():
        raise BadRequest(f"lora_path {path} does not exist or is not a directory")
    cfg_file = path / ADAPTER_CONFIG
    if not cfg_file.is_file() or not (path / ADAPTER_WEIGHTS).is_file():
        raise BadRequest(f"lora_path {path} is not a LoRA adapter: it needs {ADAPTER_CONFIG} "
                         f"and {ADAPTER_WEIGHTS} (as peft's save_pretrained writes them)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise BadRequest(f"lora_path {path} cannot be read: {e}") from None
    rank = cfg.get("r") if isinstance(cfg, dict) else None
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise BadRequest(f"{ADAPTER_CONFIG} in {path} gives no rank (r)")
    if rank > max_rank:
        raise BadRequest(f"the adapter's rank {rank} exceeds this worker's --max-lora-rank "
                         f"{max_rank}: make it with rank <= {max_rank}, or start the worker "
                         f"with --max-lora-rank {rank}")
    return rank


@dataclass(frozen=True)
class Version:
    """One loaded version of an adapter; `key` seeds its tokens (from its digest)."""

    policy: PolicyIdentity
    rank: int
    path: str
    serial: int  # which load of this engine it is (its prefix-cache salt)

    @property
    def key(self) -> str:
        return self.policy.digest or ""


@dataclass
class _Adapter:
    current: Version
    open: bool = True
    reason: str | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class MockAdapters:
    """The adapters one simulated engine serves, by name."""

    def __init__(self, max_loras: int, max_rank: int,
                 modules: list[tuple[str, str]] | None = None) -> None:
        """`modules`: (name, path) of the adapters to load at start (--lora-modules)."""
        if max_loras < 1 or max_rank < 1:
            raise ValueError("--max-loras and --max-lora-rank must be at least 1")
        self.max_loras, self.max_rank = max_loras, max_rank
        self.modules = modules or []
        self.by_name: dict[str, _Adapter] = {}
        self._serial = 0

    def states(self) -> list[AdapterState]:
        return [self._state(a) for a in self.by_name.values()]

    @staticmethod
    def _state(a: _Adapter) -> AdapterState:
        v = a.current
        return AdapterState(v.policy, v.rank, v.path, a.open, a.reason)

    def get(self, name: str) -> _Adapter:
        return adapter_named(self.by_name, name)

    async def load(self, name: str, path: Path, version: str | None, step: int | None,
                   digest: str | None = None) -> tuple[PolicyIdentity, str | None]:
        rank = adapter_rank(path, self.max_rank)
        found = await asyncio.to_thread(checkpoint_digest, path)
        if digest is not None and found != digest:
            raise BadRequest(f"the adapter at {path} has digest {found}, not {digest} as "
                             "expected: nothing was changed")
        old = self.by_name.get(name)
        async with (old.lock if old else asyncio.Lock()):
            old = self.by_name.get(name)
            if old is None and len(self.by_name) >= self.max_loras:
                raise BadRequest(f"this worker serves {self.max_loras} adapters already "
                                 f"(--max-loras): unload one first "
                                 f"({', '.join(sorted(self.by_name))})")
            self._serial += 1
            new = Version(PolicyIdentity(version=version, digest=found, step=step,
                                         adapter=name), rank, str(path), self._serial)
            if old is None:
                self.by_name[name] = _Adapter(new)
                return new.policy, None
            replaced, old.current = old.current.policy.version, new
            return new.policy, replaced

    async def unload(self, name: str) -> PolicyIdentity:
        a = self.get(name)
        async with a.lock:
            del self.by_name[name]
        return a.current.policy

    def set_open(self, name: str, open_: bool, reason: str | None) -> AdapterState:
        a = self.get(name)
        set_admission(a, open_, reason)
        return self._state(a)

    def bind(self, name: str) -> Version:
        """The version a new request naming `name` runs on, to its end."""
        return self.get(name).current


def lora_salt(salt: str | None, version: Version | None) -> BlockSalt:
    """What keys a request's prefix-cache blocks: its salt, and the adapter version it runs
    on (an adapter version's KV is its own; the events name the adapter as vLLM's do)."""
    if version is None:
        return BlockSalt(salt)
    return BlockSalt(salt, version.policy.adapter, version.serial)
