"""The vLLM-flavoured /engine routes of a worker: pause/resume, cache, weight updates from
disk or from a trainer's process group, versions and digests. Shapes: shared/spec/CONTRACT.md."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

from rlfleet.protocol import admin
from rlfleet.runtime.system_server import Route, failed, ok
from rlfleet.vllm.engine import VllmEngine
from rlfleet.weights.digest import checkpoint_signature, signature_mismatch

log = logging.getLogger("rlfleet.vllm.admin")

LOAD_TIMEOUT = float(os.environ.get("RLFLEET_LOAD_TIMEOUT", 600))
GROUP_TIMEOUT = float(os.environ.get("RLFLEET_GROUP_TIMEOUT", 60))


class VllmAdmin:
    """Route handlers over one VllmEngine. Weight version and digest live on the engine
    (`engine.version`, `engine.version_declared`, `engine.digest`)."""

    def __init__(self, engine: VllmEngine, allowed_roots: list[str] | None = None) -> None:
        self.engine = engine
        self.roots = [Path(r).resolve() for r in allowed_roots or []]
        self.group_open = False

    @property
    def llm(self):
        return self.engine.llm

    async def _rpc(self, method: str, timeout: float, *args: Any, **kwargs: Any) -> Any:
        out = await asyncio.wait_for(
            self.llm.collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs),
            timeout + 5)
        return out[0]

    def routes(self) -> list[Route]:
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

    # ---------------------------------------------------------------- lifecycle

    async def liveness_probe(self, body: dict) -> dict:
        try:
            await asyncio.wait_for(self.llm.check_health(), 10)
        except Exception as e:
            return failed(f"engine is not healthy: {e!r}", alive=False)
        return ok(alive=True)

    async def pause_generation(self, body: dict) -> dict:
        p = admin.pause_request(body)
        await self.llm.pause_generation(mode=p.mode, clear_cache=p.clear_cache)
        return ok(message="Engine paused", mode=p.mode, clear_cache=p.clear_cache)

    async def resume_generation(self, body: dict) -> dict:
        await self.llm.resume_generation()
        return ok(message="Engine resumed")

    async def flush_cache(self, body: dict) -> dict:
        if not await self.llm.reset_prefix_cache():
            return failed("the prefix cache was not reset because requests are running; "
                          "pause generation first")
        return ok(message="Cache flushed")

    async def abort_request(self, body: dict) -> dict:
        rid = admin.request_id(body)
        await self.engine.abort(rid)
        return ok(request_id=rid)

    # ---------------------------------------------------------------- versions

    def _version_fields(self) -> dict:
        e = self.engine
        return {"version": e.version, "version_declared": e.version_declared,
                "weight_digest": e.digest}

    async def get_weight_version(self, body: dict) -> dict:
        return ok(**self._version_fields())

    async def set_weight_version(self, body: dict) -> dict:
        v = admin.declared_version(body)
        await self.engine.set_version(v, declared=True)
        return ok(version=v)

    async def _applied(self, digest: str, version: Any) -> dict:
        """Bookkeeping after new weights are live: stale KV out, identity recorded."""
        if not await self.llm.reset_prefix_cache(reset_running_requests=True):
            return failed("weights were applied but the prefix cache could not be reset; "
                          "do not admit this worker", weight_digest=digest)
        await self.engine.set_version(version, declared=version is not None, digest=digest)
        return ok(version=version if version is not None else "unknown",
                  version_declared=version is not None, weight_digest=digest)

    # ---------------------------------------------------------------- from disk

    def _check_checkpoint(self, raw: Any) -> Path:
        path = admin.weights_path(raw, self.roots)
        try:
            why = signature_mismatch(self.engine.signature, checkpoint_signature(path))
        except ValueError as e:
            raise admin.AdminRequestError(str(e)) from e
        if why:
            raise admin.AdminRequestError(
                f"checkpoint {raw} does not fit the served model's architecture: {why}")
        return path

    async def update_weights_from_disk(self, body: dict) -> dict:
        version = admin.weight_version(body)
        if not await self.llm.is_paused():
            return failed("generation is not paused: call pause_generation first")
        path = self._check_checkpoint(body.get("model_path"))
        try:
            digest = await self._rpc("rlfleet_load_from_disk", LOAD_TIMEOUT, str(path))
        except Exception as e:
            return failed(f"loading {path} failed: {e!r}; {await self._restore()}")
        self.engine.weights_path = str(path)
        return await self._applied(digest, version)

    async def _restore(self) -> str:
        """After a failed load, put the previous weights back."""
        if self.engine.weights_path is None:
            return ("the previous weights came from a trainer broadcast and cannot be re-read: "
                    "replace this worker")
        try:
            digest = await self._rpc("rlfleet_load_from_disk", LOAD_TIMEOUT,
                                     self.engine.weights_path)
        except Exception as e:
            log.error("restoring %s failed: %r", self.engine.weights_path, e)
            return "restoring the previous weights also failed: replace this worker"
        if digest != self.engine.digest:
            return "the restored weights do not match the previous digest: replace this worker"
        await self.llm.reset_prefix_cache(reset_running_requests=True)
        return "the previous weights were restored"

    # ---------------------------------------------------------------- from a trainer

    async def init_weights_update_group(self, body: dict) -> dict:
        g = admin.group_request(body, "nccl" if self.engine.on_gpu else "gloo", GROUP_TIMEOUT)
        try:
            await self._rpc("rlfleet_init_group", g.timeout + 5, g.master_address, g.master_port,
                            g.rank_offset, g.world_size, g.backend, g.timeout)
        except Exception as e:
            return failed(f"weight update group initialisation failed (within {g.timeout}s): "
                          f"{e!r}")
        self.group_open = True
        self.group_timeout = g.timeout
        return ok(message="Weight update group initialized")

    async def update_weights_from_distributed(self, body: dict) -> dict:
        d = admin.distributed_request(body)
        version, names, dtypes, shapes = d.version, d.names, d.dtypes, d.shapes
        if not self.group_open:
            return failed("no weight update group: call init_weights_update_group first")
        if not d.allow_unpaused and not await self.llm.is_paused():
            return failed("generation is not paused: call pause_generation first "
                          "(or allow_unpaused with reset_prefix_cache: false)")
        sig = {n: ("", tuple(s)) for n, s in zip(names, shapes, strict=True)}
        why = signature_mismatch(self.engine.signature, sig)
        if why:
            return failed(f"the announced tensors do not fit the served model: {why}")
        t = self.group_timeout
        try:
            received = await self._rpc("rlfleet_receive", t * len(names) + 5, names, dtypes,
                                       shapes, t)
        except Exception as e:
            return failed(f"weight transfer failed: {e!r}; the previous weights are still serving")
        try:
            digest = await self._rpc("rlfleet_apply_staged", LOAD_TIMEOUT)
        except Exception as e:
            return failed(f"applying received weights failed: {e!r}; {await self._restore()}")
        log.info("received %d tensors (%d bytes) from the trainer", len(names), received)
        self.engine.weights_path = None
        if not d.reset_prefix_cache:
            await self.engine.set_version(version, declared=version is not None, digest=digest)
            return ok(version=version if version is not None else "unknown",
                      version_declared=version is not None, weight_digest=digest)
        return await self._applied(digest, version)

    async def destroy_weights_update_group(self, body: dict) -> dict:
        try:
            await self._rpc("rlfleet_destroy_group", 30)
        finally:
            self.group_open = False
        return ok(message="Weight update group destroyed")
