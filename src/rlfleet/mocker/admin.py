"""The mocker's /engine routes, in either flavour of the contract (docs/contract.md):

* ``vllm`` (default): the vLLM worker's own routes (`rlfleet.worker.admin.EngineAdmin`)
  over the simulated engine;
* ``sglang``: the SGLang-flavoured table: fixed ``control/*`` weight routes plus the native
  methods allow-listed in ``DYN_SGLANG_ENGINE_ROUTES``.

The mocker's "checkpoint" is a mock checkpoint directory (`rlfleet.mocker.engine`);
loading it makes the engine's weights that seed, digest ``"mock:<seed>"``.

SGLang ``control/update_weights_from_disk`` in the mocker, step by step:
  1. validate the request and the checkpoint (nothing changes on a bad request);
  2. ``abort_all_requests``: abort every request in the engine;
  3. if generation is not paused, pause it, letting running requests finish (SGLang's
     update lock waits for them);
  4. load the weights (``weight_version`` replaces the version when given, else the previous
     one stays, as in SGLang; rlfleet's ``step`` is the new policy's fleet step);
     ``flush_cache`` (default true) flushes the cache;
  5. resume, unless generation was paused before the call or ``keep_pause`` is true.
  ``num_paused_requests`` = requests held in the engine by the pause while the weights changed.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec

from rlfleet.mocker.engine import MockEngine
from rlfleet.protocol import admin
from rlfleet.protocol.admin import (
    AdminRequestError,
    AdminRoute,
    AnyBody,
    SglangDiskReply,
    SglangDiskRequest,
    SglangReply,
    SglangVersionReply,
    SglangVersionRequest,
)
from rlfleet.worker.admin import EngineAdmin
from rlfleet.worker.system_server import Handler, Route

SCHEMAS = ("vllm", "sglang")
# SGLang's pause_generation modes, as the simulated engine can honour them: retracted and
# in-place requests both continue on resume (keep), aborted ones end now.
SGLANG_PAUSE_MODES = {"abort": "abort", "retract": "keep", "in_place": "keep"}
ROUTE_TARGETS = ("engine", "tm")
_PATH_SEGMENT = re.compile(r"[A-Za-z0-9_.-]+")


@dataclasses.dataclass(frozen=True)
class EngineRoute:
    """One ``DYN_SGLANG_ENGINE_ROUTES`` descriptor: ``<path>[=<method>][:engine|tm]``."""

    path: str
    method: str
    target: str = "engine"


def parse_engine_routes(raw: str | None) -> list[EngineRoute]:
    """Parse the whitespace-separated descriptors; ValueError names the bad one."""
    out: list[EngineRoute] = []
    seen: set[str] = set()
    for d in (raw or "").split():
        spec, target = d, "engine"
        if ":" in d:
            spec, _, target = d.partition(":")
            if ":" in target:
                raise ValueError(f"engine route {d!r}: at most one ':' (the target)")
            if target not in ROUTE_TARGETS:
                raise ValueError(f"engine route {d!r}: unknown target {target!r}; "
                                 f"expected {' or '.join(ROUTE_TARGETS)}")
        path, eq, method = spec.partition("=")
        if not eq:
            method = path
        elif "=" in method:
            raise ValueError(f"engine route {d!r}: at most one '=' (path=method)")
        if not path or not method:
            raise ValueError(f"engine route {d!r}: give both the route path and method")
        if not all(_PATH_SEGMENT.fullmatch(s) for s in path.split("/")):
            raise ValueError(f"engine route {d!r}: bad route path {path!r} (segments of letters, "
                             "digits, '_', '.', '-' joined by '/', no leading or trailing '/')")
        if not method.isidentifier():
            raise ValueError(f"engine route {d!r}: method {method!r} is not a Python identifier")
        if method.startswith("_"):
            raise ValueError(f"engine route {d!r}: private methods cannot be exposed")
        if path in seen:
            raise ValueError(f"engine route path {path!r} is configured more than once")
        seen.add(path)
        out.append(EngineRoute(path, method, target))
    return out


def sglang_result(value: Any) -> dict[str, Any]:
    """Map a native method's return value to the response body, as SGLang-flavoured workers
    do: None -> {"status": "ok"}; (success, message[, num_paused_requests]) -> those keys;
    a dict as it is; anything else under "result"."""
    if value is None:
        return {"status": "ok"}
    if isinstance(value, tuple) and len(value) in (2, 3):
        out = {"success": bool(value[0]), "message": str(value[1])}
        if len(value) == 3:
            out["num_paused_requests"] = value[2]
        return out
    if isinstance(value, dict):
        return value
    return {"result": value}


class MockAdmin:
    """The mocker's route table in the `schema` flavour ("vllm" or "sglang"). `engine_routes`
    (sglang only) is the ``DYN_SGLANG_ENGINE_ROUTES`` value; a descriptor naming a method the
    mocker lacks raises ValueError, so the worker refuses to start."""

    def __init__(self, engine: MockEngine, allowed_roots: list[str] | None = None,
                 schema: str = "vllm", engine_routes: str | None = None,
                 staging=None, fence=None) -> None:
        if schema not in SCHEMAS:
            raise ValueError(f"admin schema must be one of {', '.join(SCHEMAS)}, not {schema!r}")
        self.engine = engine
        self.schema = schema
        # owns the checkpoint checks too; with `staging`, the staged-weights routes over the
        # simulated weights (one tensor holding the seed, rlfleet.mocker.engine)
        self.vllm = EngineAdmin(engine, allowed_roots, staging=staging, fence=fence)
        self.fence = self.vllm.fence  # the worker's fleet epoch, whichever the flavour
        self.native: list[tuple[EngineRoute, Callable[..., Awaitable[Any]]]] = []
        if schema == "sglang":
            methods = self._native_methods()
            fixed = {r.name for r in self._sglang_fixed()}
            for er in parse_engine_routes(engine_routes):
                if er.method not in methods:
                    raise ValueError(f"DYN_SGLANG_ENGINE_ROUTES: the mocker's {er.target} has no "
                                     f"method {er.method!r} (it has {', '.join(sorted(methods))})")
                if er.path in fixed or er.path == admin.FAULT_INJECTION.name:
                    raise ValueError(f"DYN_SGLANG_ENGINE_ROUTES: route path {er.path!r} is "
                                     "already taken")
                self.native.append((er, methods[er.method]))

    def routes(self) -> list[Route]:
        if self.schema == "vllm":
            return self.vllm.routes()
        routes = self._sglang_fixed()
        for er, fn in self.native:
            spec = admin.NATIVE_METHODS[er.method]
            routes.append(Route(spec.at(er.path), self._native_handler(fn, spec)))
        return routes

    # ---------------------------------------------------------------- sglang: fixed routes

    def _sglang_fixed(self) -> list[Route]:
        return [
            Route(admin.SGLANG_UPDATE_WEIGHTS_FROM_DISK, self.sgl_update_weights_from_disk),
            Route(admin.SGLANG_UPDATE_WEIGHTS_FROM_DISTRIBUTED, self._unsupported("distributed")),
            Route(admin.SGLANG_UPDATE_WEIGHTS_FROM_TENSOR, self._unsupported("tensor")),
            Route(admin.SGLANG_UPDATE_WEIGHTS_FROM_IPC, self._unsupported("IPC")),
            Route(admin.SGLANG_UPDATE_WEIGHT_VERSION, self.sgl_update_weight_version),
        ]

    @staticmethod
    def _unsupported(what: str) -> Handler:
        async def handler(req: AnyBody) -> SglangReply:
            return SglangReply.failed(
                f"weight updates from {what} are not supported by the mocker; use "
                f"{admin.SGLANG_UPDATE_WEIGHTS_FROM_DISK.name} with a mock checkpoint")
        return handler

    async def sgl_update_weights_from_disk(self, req: SglangDiskRequest) -> SglangDiskReply:
        """SGLang's disk update (see the module doc for the mocker's semantics)."""
        version, step = req.weight_version, req.step
        path: Path = self.vllm.checkpoint_path(req.model_path)  # refused: the route's failure
        engine = self.engine
        was_paused = await engine.is_paused()
        if req.abort_all_requests:
            await engine.abort_all()
        if not was_paused:
            await engine.pause("wait")
        held = engine.num_running()
        try:
            digest = await engine.load_path(path)
            applied = engine.applied()  # without weight_version the previous one stays (SGLang)
            await engine.set_version(version if version is not None else applied.policy.version,
                                     declared=version is not None or applied.declared,
                                     digest=digest, step=step)
            if req.flush_cache:
                await engine.reset_cache()
        finally:
            if not was_paused and not req.keep_pause:
                await engine.resume()
        message = "Succeeded to update model weights."
        if version is not None:
            message += f" Weight version updated to {version}."
        return SglangDiskReply(success=True, message=message, num_paused_requests=held)

    async def sgl_update_weight_version(self, req: SglangVersionRequest) -> SglangVersionReply:
        """Version metadata only. The version may come as `weight_version` or, as SGLang
        names it, `new_version`; `abort_all_requests` (default false) aborts requests first."""
        if req.abort_all_requests:
            await self.engine.abort_all()
        await self.engine.set_version(req.version)
        return SglangVersionReply(success=True, message=f"Weight version updated to "
                                  f"{req.version}", new_version=req.version)

    # ---------------------------------------------------------------- sglang: native methods

    def _native_methods(self) -> dict[str, Callable[..., Awaitable[Any]]]:
        """The engine / tokenizer-manager methods the mocker can expose; either target
        reaches the same simulated engine."""
        methods = {admin.NATIVE_PAUSE_GENERATION: self.sgl_pause_generation,
                   admin.NATIVE_CONTINUE_GENERATION: self.sgl_continue_generation,
                   admin.NATIVE_FLUSH_CACHE: self.sgl_flush_cache,
                   admin.NATIVE_GET_WEIGHT_VERSION: self.sgl_get_weight_version}
        return {route.name: fn for route, fn in methods.items()}

    @staticmethod
    def _native_handler(fn: Callable[..., Awaitable[Any]], spec: AdminRoute) -> Handler:
        """The request's fields are the method's keyword arguments (the system server
        refuses an unknown or mistyped one, and a bad value, with HTTP 400 naming it)."""
        async def handler(req: msgspec.Struct) -> Any:
            return msgspec.convert(sglang_result(await fn(**msgspec.structs.asdict(req))),
                                   spec.reply)
        return handler

    async def sgl_pause_generation(self, mode: str = "abort") -> None:
        if mode not in SGLANG_PAUSE_MODES:
            raise AdminRequestError(f"mode: invalid mode {mode!r}; expected "
                                    f"{'|'.join(SGLANG_PAUSE_MODES)}")
        await self.engine.pause(SGLANG_PAUSE_MODES[mode])

    async def sgl_continue_generation(self, torch_empty_cache: bool = True) -> None:
        await self.engine.resume()

    async def sgl_flush_cache(self, timeout_s: float | None = None) -> tuple[bool, str]:
        if await self.engine.reset_cache():
            return True, "Cache flushed."
        return False, "Cache not flushed because there are pending requests."

    async def sgl_get_weight_version(self) -> dict:
        return {"weight_version": self.engine.applied().policy.version}
