"""The mocker's /engine routes, in either flavour of the contract (shared/spec/CONTRACT.md):

* ``vllm`` (default): the route names, request validation, messages and response shapes of
  `rlfleet.vllm.admin.VllmAdmin`, over the simulated engine.
* ``sglang``: the SGLang-flavoured table: fixed ``control/*`` weight routes plus the native
  methods allow-listed in ``DYN_SGLANG_ENGINE_ROUTES``.

The mocker's "checkpoint" is a directory holding ``mock_weights.json`` = ``{"seed": <int>}``
(see `write_mock_checkpoint`); loading it makes the engine's weights that seed, and the
weight digest is the one `MockEngine.weight_identity()` reports (``"mock:<seed>"``).

SGLang ``control/update_weights_from_disk`` in the mocker, step by step:
  1. validate the request and the checkpoint (nothing changes on a bad request);
  2. ``abort_all_requests``: abort every request in the engine;
  3. if generation is not paused, pause it, letting running requests finish (SGLang's
     update lock waits for them);
  4. load the weights (``weight_version`` replaces the version when given, else the previous
     one stays, as in SGLang); ``flush_cache`` (default true) flushes the cache;
  5. resume, unless generation was paused before the call or ``keep_pause`` is true.
  ``num_paused_requests`` = requests held in the engine by the pause while the weights changed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rlfleet.mocker.engine import MockEngine, MockWeights
from rlfleet.protocol import admin
from rlfleet.runtime.system_server import Handler, Route, failed, ok

log = logging.getLogger("rlfleet.mocker.admin")

CHECKPOINT_FILE = "mock_weights.json"
SCHEMAS = ("vllm", "sglang")
# SGLang's pause_generation modes, as the simulated engine can honour them: retracted and
# in-place requests both continue on resume (keep), aborted ones end now.
SGLANG_PAUSE_MODES = {"abort": "abort", "retract": "keep", "in_place": "keep"}
ROUTE_TARGETS = ("engine", "tm")
_PATH_SEGMENT = re.compile(r"[A-Za-z0-9_.-]+")


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
    """Route handlers over one MockEngine, in the `schema` flavour ("vllm" or "sglang").
    `engine_routes` (sglang only) is the ``DYN_SGLANG_ENGINE_ROUTES`` value; a descriptor
    naming a method the mocker lacks raises ValueError, so the worker refuses to start."""

    def __init__(self, engine: MockEngine, allowed_roots: list[str] | None = None,
                 schema: str = "vllm", engine_routes: str | None = None) -> None:
        if schema not in SCHEMAS:
            raise ValueError(f"admin schema must be one of {', '.join(SCHEMAS)}, not {schema!r}")
        self.engine = engine
        self.schema = schema
        self.roots = [Path(r).resolve() for r in allowed_roots or []]
        self.version_declared = False
        self.group: dict[str, Any] | None = None  # the recorded weight update group
        self.native: list[tuple[EngineRoute, Callable[..., Awaitable[Any]]]] = []
        if schema == "sglang":
            methods = self._native_methods()
            fixed = {r.name for r in self._sglang_fixed()}
            for er in parse_engine_routes(engine_routes):
                if er.method not in methods:
                    raise ValueError(f"DYN_SGLANG_ENGINE_ROUTES: the mocker's {er.target} has no "
                                     f"method {er.method!r} (it has {', '.join(sorted(methods))})")
                if er.path in fixed or er.path == "fault_injection":
                    raise ValueError(f"DYN_SGLANG_ENGINE_ROUTES: route path {er.path!r} is "
                                     "already taken")
                self.native.append((er, methods[er.method]))

    def routes(self) -> list[Route]:
        if self.schema == "sglang":
            routes = self._sglang_fixed()
            for er, fn in self.native:
                reads = er.method == "get_weight_version"  # like the vLLM table's reader
                routes.append(Route(er.path, self._native_handler(fn), mutating=not reads,
                                    serialized=not reads))
            return routes
        return [
            Route("liveness_probe", self.liveness_probe, mutating=False, serialized=False),
            Route("pause_generation", self.pause_generation),
            Route("resume_generation", self.resume_generation),
            Route("flush_cache", self.flush_cache),
            Route("abort_request", self.abort_request, serialized=False),
            Route("update_weights_from_disk", self.update_weights_from_disk),
            Route("get_weight_version", self.get_weight_version, mutating=False, serialized=False),
            Route("set_weight_version", self.set_weight_version),
            Route("init_weights_update_group", self.init_weights_update_group),
            Route("update_weights_from_distributed", self.update_weights_from_distributed),
            Route("destroy_weights_update_group", self.destroy_weights_update_group),
        ]

    # ---------------------------------------------------------------- shared

    def _check_checkpoint(self, raw: Any) -> int:
        """The seed of a loadable mock checkpoint (AdminRequestError says why not)."""
        path = admin.weights_path(raw, self.roots)
        try:
            return read_mock_checkpoint(path)
        except ValueError as e:
            raise admin.AdminRequestError(
                f"checkpoint {raw} does not fit the served model's architecture: {e}") from e

    async def _install(self, seed: int, version: str | None) -> str:
        """Make `seed` the live weights; returns the new weight digest."""
        if self.engine.is_paused():
            await self.engine.set_weights(seed, version)
        else:  # allow_unpaused: running requests continue on the new weights
            self.engine.weights = MockWeights(seed, version)
        return self.engine.weight_identity()["weight_digest"]

    def _set_version(self, version: str | None) -> None:
        """Version metadata only; the weights stay."""
        self.engine.weights = dataclasses.replace(self.engine.weights, version=version)

    # ---------------------------------------------------------------- vllm: lifecycle

    async def liveness_probe(self, body: dict) -> dict:
        return ok(alive=True)

    async def pause_generation(self, body: dict) -> dict:
        p = admin.pause_request(body)
        await self.engine.pause(p.mode, clear_cache=p.clear_cache)
        return ok(message="Engine paused", mode=p.mode, clear_cache=p.clear_cache)

    async def resume_generation(self, body: dict) -> dict:
        await self.engine.resume()
        return ok(message="Engine resumed")

    async def flush_cache(self, body: dict) -> dict:
        if not await self.engine.flush_cache():
            return failed("the prefix cache was not reset because requests are running; "
                          "pause generation first")
        return ok(message="Cache flushed")

    async def abort_request(self, body: dict) -> dict:
        rid = admin.request_id(body)
        await self.engine.abort(rid)
        return ok(request_id=rid)

    # ---------------------------------------------------------------- vllm: versions

    def _version_fields(self) -> dict:
        ident = self.engine.weight_identity()
        return {"version": ident["weight_version"], "version_declared": self.version_declared,
                "weight_digest": ident["weight_digest"]}

    async def get_weight_version(self, body: dict) -> dict:
        return ok(**self._version_fields())

    async def set_weight_version(self, body: dict) -> dict:
        v = admin.declared_version(body)
        self._set_version(v)
        self.version_declared = True
        return ok(version=v)

    async def _applied(self, seed: int, version: str | None, reset_cache: bool = True) -> dict:
        """Install new weights, drop stale cache, record the version; the success body."""
        digest = await self._install(seed, version)
        if reset_cache and not await self.engine.flush_cache():
            return failed("weights were applied but the prefix cache could not be reset; "
                          "do not admit this worker", weight_digest=digest)
        self.version_declared = version is not None
        return ok(version=version if version is not None else "unknown",
                  version_declared=version is not None, weight_digest=digest)

    # ---------------------------------------------------------------- vllm: weights

    async def update_weights_from_disk(self, body: dict) -> dict:
        version = admin.weight_version(body)
        if not self.engine.is_paused():
            return failed("generation is not paused: call pause_generation first")
        return await self._applied(self._check_checkpoint(body.get("model_path")), version)

    async def init_weights_update_group(self, body: dict) -> dict:
        """Validates like the vLLM worker; the mocker needs no real group, so it records one."""
        self.group = dataclasses.asdict(admin.group_request(body, "gloo", 60.0))
        log.info("recorded weight update group %s", self.group)
        return ok(message="Weight update group initialized")

    async def update_weights_from_distributed(self, body: dict) -> dict:
        """As the vLLM worker, except that the new weights are the body's `mock_seed`."""
        d = admin.distributed_request(body)
        seed = body.get("mock_seed")
        if not isinstance(seed, int) or isinstance(seed, bool):
            return failed("mock_seed is required by the mocker: an integer, the seed of the "
                          "simulated weights being sent")
        if self.group is None:
            return failed("no weight update group: call init_weights_update_group first")
        if not d.allow_unpaused and not self.engine.is_paused():
            return failed("generation is not paused: call pause_generation first "
                          "(or allow_unpaused with reset_prefix_cache: false)")
        log.info("received %d (simulated) tensors from the trainer", len(d.names))
        return await self._applied(seed, d.version, reset_cache=d.reset_prefix_cache)

    async def destroy_weights_update_group(self, body: dict) -> dict:
        self.group = None
        return ok(message="Weight update group destroyed")

    # ---------------------------------------------------------------- sglang: fixed routes

    def _sglang_fixed(self) -> list[Route]:
        return [
            Route("control/update_weights_from_disk", self.sgl_update_weights_from_disk),
            Route("control/update_weights_from_distributed", self._unsupported("distributed")),
            Route("control/update_weights_from_tensor", self._unsupported("tensor")),
            Route("control/update_weights_from_ipc", self._unsupported("IPC")),
            Route("control/update_weight_version", self.sgl_update_weight_version),
        ]

    @staticmethod
    def _unsupported(what: str) -> Handler:
        async def handler(body: dict) -> dict:
            return {"success": False,
                    "message": f"weight updates from {what} are not supported by the mocker; "
                               "use control/update_weights_from_disk with a mock checkpoint"}
        return handler

    async def sgl_update_weights_from_disk(self, body: dict) -> dict:
        """SGLang's disk update (see the module doc for the mocker's semantics)."""

        def fail(message: str) -> dict:
            return {"success": False, "message": message, "num_paused_requests": 0}

        flags = {k: body.get(k, k == "flush_cache")
                 for k in ("flush_cache", "keep_pause", "abort_all_requests")}
        try:
            version = admin.weight_version(body)
            bad = [k for k, v in flags.items() if not isinstance(v, bool)]
            if bad:
                raise admin.AdminRequestError(f"{bad[0]} must be a boolean")
            seed = self._check_checkpoint(body.get("model_path"))
        except admin.AdminRequestError as e:
            return fail(str(e))
        was_paused = self.engine.is_paused()
        if flags["abort_all_requests"]:
            await self.engine.abort_all()
        if not was_paused:
            await self.engine.pause("wait")
        held = self.engine.num_running()
        try:
            keep = version if version is not None else self.engine.weights.version
            await self.engine.set_weights(seed, keep)
            if flags["flush_cache"]:
                await self.engine.flush_cache()
        finally:
            if not was_paused and not flags["keep_pause"]:
                await self.engine.resume()
        message = "Succeeded to update model weights."
        if version is not None:
            message += f" Weight version updated to {version}."
        return {"success": True, "message": message, "num_paused_requests": held}

    async def sgl_update_weight_version(self, body: dict) -> dict:
        """Version metadata only. The version may come as `weight_version` or, as SGLang
        names it, `new_version`; `abort_all_requests` (default false) aborts requests first."""
        v = body.get("weight_version", body.get("new_version"))
        abort = body.get("abort_all_requests", False)
        if not isinstance(v, str) or not v:
            return {"success": False,
                    "message": "weight_version is required (a non-empty string)"}
        if not isinstance(abort, bool):
            return {"success": False, "message": "abort_all_requests must be a boolean"}
        if abort:
            await self.engine.abort_all()
        self._set_version(v)
        return {"success": True, "message": f"Weight version updated to {v}", "new_version": v}

    # ---------------------------------------------------------------- sglang: native methods

    def _native_methods(self) -> dict[str, Callable[..., Awaitable[Any]]]:
        """The engine / tokenizer-manager methods the mocker can expose; either target
        reaches the same simulated engine."""
        return {"pause_generation": self.sgl_pause_generation,
                "continue_generation": self.sgl_continue_generation,
                "flush_cache": self.sgl_flush_cache,
                "get_weight_version": self.sgl_get_weight_version}

    @staticmethod
    def _native_handler(fn: Callable[..., Awaitable[Any]]) -> Handler:
        """The body's fields are the method's keyword arguments (an unknown one raises:
        HTTP 500, as a real SGLang method would)."""
        async def handler(body: dict) -> dict:
            return sglang_result(await fn(**body))
        return handler

    async def sgl_pause_generation(self, mode: str = "abort") -> None:
        if mode not in SGLANG_PAUSE_MODES:
            raise ValueError(f"Invalid mode {mode!r}; expected {'|'.join(SGLANG_PAUSE_MODES)}")
        await self.engine.pause(SGLANG_PAUSE_MODES[mode])

    async def sgl_continue_generation(self, torch_empty_cache: bool = True) -> None:
        await self.engine.resume()

    async def sgl_flush_cache(self, timeout_s: float | None = None) -> tuple[bool, str]:
        if await self.engine.flush_cache():
            return True, "Cache flushed."
        return False, "Cache not flushed because there are pending requests."

    async def sgl_get_weight_version(self) -> dict:
        return {"weight_version": self.engine.weights.version}
