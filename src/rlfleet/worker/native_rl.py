"""vLLM 0.32's native RL routes on every rlfleet worker (rlfleet.protocol.vllm_rl), at the
root of its system server (its `admin_base_url`), with vLLM's semantics, bodies, replies and
status codes, over the same engine-control interface as the /engine routes
(rlfleet.worker.admin.EngineAdmin).

What rlfleet adds, as on every admin route: the admin token on the routes that change the
worker, the fleet-epoch fence (`X-Fleet-Epoch`), one control call at a time (the system
server's lock), and two safety rules:

* while an rlfleet refresh holds the worker (a coordinator paused it, or closed it to
  rollouts, with an `X-Fleet-Epoch` call and has not resumed or reopened it), a native call
  that changes the worker is refused with HTTP 409, so it cannot corrupt the refresh;
* `collective_rpc` runs `reload_weights` only, and through update_weights_from_disk's
  checks (paused, an allowed path that fits the model, the digest, the self-check, the hold).

`/abort_requests` takes a request's ID as vLLM's server names it in its engine (which is not
always as rlfleet's frontend does: `vllm_request_aliases`) as well as rlfleet's own.

Beside them, vLLM's dev-mode `/reset_prefix_cache`, `/sleep`, `/wake_up` and `/is_sleeping`
(answered as vLLM's CPU build answers them: sleep pauses and marks the engine asleep, the
memory stays; rlfleet.protocol.vllm_rl.SLEEP), and prime-rl's own server routes where they do
not collide with vLLM's: `/update_weights` with `weight_dir` (and no `update_info`) reloads
that checkpoint through update_weights_from_disk's checks, `/liveness`, `/load_lora_adapter`
(with LoRA), and `/init_broadcaster`, refused by name (prime-rl's NCCL receiver); with LoRA
too, SkyRL's `/skyrl/v1/load_lora_adapter` (vLLM's load in place, its body refused by name
where it does not fit).

vLLM's weight-transfer steps (init/start/update/finish/shutdown; rlfleet.worker.weight_transfer,
which Dynamo 1.7's /engine/update/* routes share) go through to vLLM on a GPU build. On
vLLM's CPU build, a worker started with `--weight-transfer-config '{"backend":
"modelexpress"}'` runs them itself over rlfleet's weight plane (rlfleet.worker.modelexpress:
ModelExpress versions staged from object storage); any other backend, and an engine that has
none (the mocker), is refused with HTTP 400."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Annotated, Any

import msgspec
from fastapi import APIRouter, Body, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from rlfleet.protocol import admin, admin_lora, admin_vllm, dynamo_lora, skyrl, vllm_rl
from rlfleet.protocol.admin import AdminRoute
from rlfleet.protocol.admin_base import AdminRequestError, NoFields
from rlfleet.protocol.admin_vllm import SetVersionRequest
from rlfleet.protocol.vllm_rl import NativeRoute, PauseMode
from rlfleet.runtime import weight_checker
from rlfleet.runtime.http import shared_routes
from rlfleet.worker import dynamo_lora as dynamo_lora_ids
from rlfleet.worker.admin import NOT_PAUSED, RELOAD_NOT_PAUSED, EngineAdmin
from rlfleet.worker.modelexpress import TransferError
from rlfleet.worker.system_server import Guard
from rlfleet.worker.weight_transfer import TransferUnavailable

log = logging.getLogger("rlfleet.native_rl")

#: seconds prime-rl's /liveness waits for the engine to answer (then HTTP 503)
LIVENESS_TIMEOUT = float(os.environ.get("RLFLEET_LIVENESS_TIMEOUT", 10))

Run = Callable[[], Awaitable[Response]]


#: the /engine routes that pause and resume the engine, by name: 1.6's flat names and 1.7's
_PAUSES = admin.route_names((admin.PAUSE_GENERATION, admin.CONTROL_PAUSE_GENERATION))
_RESUMES = admin.route_names((admin.RESUME_GENERATION, admin.CONTROL_RESUME_GENERATION))


@dataclass
class RefreshHold:
    """Whether an rlfleet refresh coordinator holds this worker: the fleet epoch of the call
    that paused it and of the one that closed it to rollouts (None: not held that way)."""

    paused_by: int | None = None
    closed_by: int | None = None

    def observe(self, spec: AdminRoute, req: Any, reply: Any, epoch: int | None) -> None:
        """Follow a fenced /engine call that ran (`reply`: what it answered)."""
        if epoch is None:
            return
        ok = getattr(reply, "status", "ok") == "ok"
        if spec.name in _PAUSES and ok:
            self.paused_by = epoch
        elif spec.name in _RESUMES:  # resumed, even when the check failed
            self.paused_by = None
        elif spec.name == admin.SET_ADMISSION.name:
            if not req.open:
                self.closed_by = epoch
            elif ok and getattr(reply, "open", False):
                self.closed_by = None

    def reason(self) -> str | None:
        held = [f"paused it (fleet epoch {self.paused_by})" if self.paused_by is not None else "",
                f"closed it to rollouts (fleet epoch {self.closed_by})"
                if self.closed_by is not None else ""]
        held = [h for h in held if h]
        if not held:
            return None
        return (f"an rlfleet policy refresh holds this worker: it {' and '.join(held)} and has "
                "not released it; vLLM's native RL calls that change the worker are refused "
                "until it resumes and reopens it")

    def epoch(self) -> int | None:
        return max((e for e in (self.paused_by, self.closed_by) if e is not None), default=None)


def vllm_error(message: str, status: int, param: str | None = None,
               err_type: str | None = None) -> JSONResponse:
    """The error body vLLM's server answers a refused request with (its ErrorResponse;
    `param`: where in the request, for a body or query that does not fit; `err_type`:
    default the status's phrase)."""
    return JSONResponse({"error": {"message": message,
                                   "type": err_type or HTTPStatus(status).phrase,
                                   "param": param, "code": status}}, status_code=status)


def _dynamo(**fields: Any) -> JSONResponse:
    """A reply in Dynamo's LoraResponse shape (HTTP 200, errors included, as Dynamo)."""
    return JSONResponse(dynamo_lora.LoraResponse(**fields).body())


def route_error(message: str, status: int) -> JSONResponse:
    """The error body vLLM's RL routes answer with themselves: `{"error": "..."}`."""
    return JSONResponse({"error": message}, status_code=status)


async def _validation_error(request: Request, exc: Exception) -> Response:
    """A body or query that does not fit a native route: HTTP 400 in vLLM's shape."""
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    locs = [".".join(str(p) for p in e.get("loc", ())) for e in errors]
    lines = [f"  {loc}: {e.get('msg')}" for loc, e in zip(locs, errors, strict=True)]
    label = "error" if len(errors) == 1 else "errors"
    return vllm_error(f"{len(errors)} validation {label}:\n" + "\n".join(lines), 400,
                      param=locs[0] if locs else None)


def vllm_request_aliases(rid: str) -> list[str]:
    """What rlfleet's frontend calls the request vLLM's OpenAI server gives the engine ID
    `rid`, most exact first, `rid` itself first of all. vLLM names a chat request
    `chatcmpl-<base>` and prompt i of a completions request `cmpl-<base>-<i>`, `<base>` being
    the X-Request-Id (or the body's `request_id`, else random); its response `id` is
    `chatcmpl-<base>` / `cmpl-<base>`. rlfleet's frontend names a request by its response
    `id`: the X-Request-Id (or the body's `request_id`) as given, else `chatcmpl-<random>` /
    `cmpl-<random>`; prompt i of a batch `<id>-<i>`, a single prompt `<id>`."""
    out = [rid]
    for prefix in ("cmpl-", "chatcmpl-"):
        if not rid.startswith(prefix):
            continue
        base = rid.removeprefix(prefix)
        if prefix == "cmpl-" and rid.endswith("-0"):  # prompt 0, alone in its request
            out.append(rid.removesuffix("-0"))
        out.append(base)  # the X-Request-Id: a chat request, a prompt of a batch
        if prefix == "cmpl-" and base.endswith("-0"):
            out.append(base.removesuffix("-0"))
    return out


def skyrl_load_request(body: dict[str, Any]) -> admin_lora.LoraLoadRequest:
    """SkyRL's /skyrl/v1/load_lora_adapter body as vLLM's load in place; AdminRequestError
    (HTTP 400) names a field it does not take, or the one missing or empty."""
    path = vllm_rl.SKYRL_LOAD_LORA_ADAPTER.path
    extra = sorted(k for k in body if k not in vllm_rl.SKYRL_LOAD_FIELDS)
    if extra:
        raise AdminRequestError(f"{path} takes lora_name and lora_path only, not "
                                f"{', '.join(extra)}")
    for field in vllm_rl.SKYRL_LOAD_FIELDS:
        if not body.get(field):
            raise AdminRequestError(f"{path} needs both lora_name and lora_path: {field} is "
                                    "missing or empty")
    return admin.read_request(admin.LOAD_LORA_ADAPTER, {**body, "load_inplace": True})


def of(request: Request) -> NativeRL:
    """The worker a shared route (NativeRL.router) answers for: the one its app mounts."""
    return request.app.state.native_rl


class NativeRL:
    """vLLM's native RL routes over one worker's EngineAdmin (mounted by its system server:
    `system_app(..., mounted=NativeRL(admin))`)."""

    def __init__(self, engine_admin: EngineAdmin) -> None:
        self.admin = engine_admin
        self.engine = engine_admin.engine
        self.hold = RefreshHold()
        self.guard: Guard | None = None
        # the memory pools vLLM's executor would hold asleep (/sleep at level >= 1): on the
        # CPU build a mark only, the weights and KV cache stay resident (vllm_rl.SLEEP)
        self.asleep: set[str] = set()

    def observe(self, spec: AdminRoute, req: Any, reply: Any, epoch: int | None) -> None:
        self.hold.observe(spec, req, reply, epoch)

    def mount(self, app: FastAPI, guard: Guard) -> None:
        self.guard = guard
        app.state.native_rl = self
        app.add_exception_handler(RequestValidationError, _validation_error)
        app.router.routes.extend(shared_routes(NativeRL.build,
                                               self.engine.adapter_limits() is not None))

    async def call(self, request: Request, route: NativeRoute, run: Run) -> Response:
        """`run` under the system server's rules and the refresh hold."""
        async def checked() -> Response:
            why = self.hold.reason() if route.mutating else None
            if why:
                log.warning("refused %s: %s", route.path, why)
                return JSONResponse({"error": vllm_rl.REFRESH_HOLDS, "message": why,
                                     "fleet_epoch": self.hold.epoch()}, status_code=409)
            try:
                return await run()
            except AdminRequestError as e:
                return vllm_error(str(e), 400)
            except Exception as e:
                log.exception("%s failed", route.path)
                return route_error(f"{route.path.lstrip('/')} failed: {e!r}", 500)
        assert self.guard is not None, "mount() first"
        serialized = route.mutating and route is not vllm_rl.ABORT_REQUESTS
        return await self.guard(request, route.path, checked, mutating=route.mutating,
                                serialized=serialized)

    @staticmethod
    def build(r: APIRouter, lora: bool) -> None:
        """The routes on `r`, each finding its worker's NativeRL in its app (`of`): made once
        per process (rlfleet.runtime.http.shared_routes)."""
        if lora:  # --enable-lora
            NativeRL._add_lora_routes(r)
            NativeRL._add_dynamo_lora_routes(r)
        NativeRL._add_generation_routes(r)
        NativeRL._add_transfer_routes(r)
        NativeRL._add_weight_routes(r)
        NativeRL._add_sleep_routes(r)
        NativeRL._add_prime_rl_routes(r)

    # ---------------------------------------------------------------- generation

    @staticmethod
    def _add_generation_routes(r: APIRouter) -> None:
        @r.post(vllm_rl.PAUSE.path)
        async def pause(raw_request: Request, mode: Annotated[PauseMode, Query()] = "abort",
                        clear_cache: Annotated[bool, Query()] = True) -> Response:
            self = of(raw_request)
            async def run() -> Response:
                await self.engine.pause(mode, clear_cache=clear_cache and mode != "keep")
                return JSONResponse({"status": "paused"})
            return await self.call(raw_request, vllm_rl.PAUSE, run)

        @r.post(vllm_rl.RESUME.path)
        async def resume(raw_request: Request) -> Response:
            self = of(raw_request)
            async def run() -> Response:
                said = await self.admin.resume_generation(NoFields())
                if said.status != "ok":  # resumed; the worker holds itself closed, and says so
                    log.warning("%s", said.message)
                return JSONResponse({"status": "resumed"})
            return await self.call(raw_request, vllm_rl.RESUME, run)

        @r.get(vllm_rl.IS_PAUSED.path)
        async def is_paused(raw_request: Request) -> Response:
            self = of(raw_request)
            async def run() -> Response:
                return JSONResponse({"is_paused": await self.engine.is_paused()})
            return await self.call(raw_request, vllm_rl.IS_PAUSED, run)

        @r.post(vllm_rl.ABORT_REQUESTS.path)
        async def abort_requests(raw_request: Request) -> Response:
            self = of(raw_request)
            async def run() -> Response:
                try:
                    body = await raw_request.json()
                except json.JSONDecodeError:
                    return vllm_error("Invalid JSON format", 400)
                if not isinstance(body, dict):
                    return vllm_error("Request body must be a JSON object", 400)
                ids = body.get("request_ids")
                if ids:
                    for rid in ids:
                        await self.engine.abort(self.engine_request_id(str(rid)))
                    n = len(ids)
                else:
                    n = await self.engine.abort_all()
                return JSONResponse({"status": "aborted", "aborted": n})
            return await self.call(raw_request, vllm_rl.ABORT_REQUESTS, run)

    def engine_request_id(self, rid: str) -> str:
        """The request `rid` names, as this worker's engine knows it: `rid` itself when the
        engine has it, else the request that vLLM's server would have called `rid`
        (vllm_request_aliases), else `rid` (aborting it ends nothing, as in vLLM)."""
        for name in vllm_request_aliases(rid):
            if self.engine.tracks(name):
                return name
        return rid

    # ---------------------------------------------------------------- vLLM's weight transfer

    async def transfer(self, step: str, payload: Any = None,
                       weight_version: str | None = None) -> Response:
        """One step (rlfleet.worker.weight_transfer, the same code as Dynamo 1.7's
        /engine/update/* routes) in vLLM's replies; a step out of the update's order is
        refused first, as vLLM's RL state machine refuses it (409 `{"detail"}`), on a worker
        that can run the steps at all."""
        steps = self.admin.transfer
        why = vllm_rl.out_of_order(step, steps.updating) if steps.available else None
        if why:
            return JSONResponse({"detail": why}, status_code=409)
        try:  # refusals as vLLM's exception handlers answer a worker's exceptions
            await self.admin.transfer.run(step, payload, weight_version)
        except TransferUnavailable as e:
            return route_error(str(e), 400)
        except AdminRequestError as e:  # a ValueError in vLLM
            return vllm_error(str(e), 400, err_type="BadRequestError")
        except TransferError as e:  # a RuntimeError in vLLM (500), or rlfleet's 409
            return vllm_error(str(e), e.status,
                              err_type="InternalServerError" if e.status == 500 else None)
        return JSONResponse({"message": vllm_rl.TRANSFER_MESSAGES[step]})

    @staticmethod
    def _add_transfer_routes(r: APIRouter) -> None:
        @r.post(vllm_rl.INIT_WEIGHT_TRANSFER_ENGINE.path)
        async def init_weight_transfer_engine(
                raw_request: Request,
                init_info: Annotated[dict[str, Any], Body(embed=True)]) -> Response:
            self = of(raw_request)
            return await self.call(raw_request, vllm_rl.INIT_WEIGHT_TRANSFER_ENGINE,
                                   lambda: self.transfer("init", init_info))

        @r.post(vllm_rl.SHUTDOWN_WEIGHT_TRANSFER_ENGINE.path)
        async def shutdown_weight_transfer_engine(raw_request: Request) -> Response:
            self = of(raw_request)
            return await self.call(raw_request, vllm_rl.SHUTDOWN_WEIGHT_TRANSFER_ENGINE,
                                   lambda: self.transfer("shutdown"))

        @r.post(vllm_rl.START_WEIGHT_UPDATE.path)
        async def start_weight_update(raw_request: Request) -> Response:
            self = of(raw_request)
            return await self.call(raw_request, vllm_rl.START_WEIGHT_UPDATE,
                                   lambda: self.transfer("start"))

        @r.post(vllm_rl.UPDATE_WEIGHTS.path)
        async def update_weights(
                raw_request: Request,
                update_info: Annotated[dict[str, Any] | list[dict[str, Any]] | None,
                                       Body(embed=True)] = None,
                weight_dir: Annotated[str | None, Body(embed=True)] = None) -> Response:
            """vLLM's step (`update_info`), or prime-rl's route of the same path (`weight_dir`
            without `update_info`: a reload from disk); told apart by the body."""
            self = of(raw_request)
            if update_info is None:
                body = await raw_request.json()
                if isinstance(body, dict) and "weight_dir" in body:
                    return await self.call(raw_request, vllm_rl.UPDATE_WEIGHTS,
                                           lambda: self.update_weights_from_path(weight_dir))
                raise RequestValidationError([{"type": "missing", "loc": ("body", "update_info"),
                                               "msg": "Field required", "input": None}])
            return await self.call(raw_request, vllm_rl.UPDATE_WEIGHTS,
                                   lambda: self.transfer("update", update_info))

        @r.post(vllm_rl.FINISH_WEIGHT_UPDATE.path)
        async def finish_weight_update(
                raw_request: Request,
                weight_version: Annotated[str | None, Body(embed=True)] = None) -> Response:
            self = of(raw_request)
            return await self.call(raw_request, vllm_rl.FINISH_WEIGHT_UPDATE,
                                   lambda: self.transfer("finish", weight_version=weight_version))

    # ---------------------------------------------------------------- versions and reloads

    def weight_version(self) -> str:
        """The label vLLM reports: the declared version, else vLLM's default."""
        applied = self.engine.applied()
        version = applied.policy.version
        return version if applied.declared and version is not None \
            else vllm_rl.DEFAULT_WEIGHT_VERSION

    @staticmethod
    def _add_weight_routes(r: APIRouter) -> None:
        @r.post(vllm_rl.UPDATE_WEIGHT_VERSION.path)
        async def update_weight_version(
                raw_request: Request, new_version: Annotated[str, Body(embed=True)]) -> Response:
            self = of(raw_request)
            async def run() -> Response:
                await self.admin.set_weight_version(SetVersionRequest(weight_version=new_version))
                return JSONResponse({"success": True, "new_version": new_version})
            return await self.call(raw_request, vllm_rl.UPDATE_WEIGHT_VERSION, run)

        @r.get(vllm_rl.WEIGHT_INFO.path)
        async def weight_info(raw_request: Request) -> Response:
            self = of(raw_request)
            async def run() -> Response:
                return JSONResponse({"weight_version": self.weight_version()})
            return await self.call(raw_request, vllm_rl.WEIGHT_INFO, run)

        NativeRL._refuse(r, vllm_rl.START_DRAFT_WEIGHT_UPDATE, vllm_rl.DRAFT_REFUSED)
        NativeRL._refuse(r, vllm_rl.SKYRL_FETCH_WEIGHTS, skyrl.FETCH_WEIGHTS_REFUSED)

        @r.post(vllm_rl.WEIGHT_CHECKER.path)
        async def weight_checker(raw_request: Request) -> Response:
            self = of(raw_request)
            return await self.call(raw_request, vllm_rl.WEIGHT_CHECKER,
                                   lambda: self.weight_checker(raw_request))

        @r.get(vllm_rl.GET_WORLD_SIZE.path)
        async def get_world_size(raw_request: Request,
                                 include_dp: bool = Query(True)) -> Response:  # noqa: B008
            self = of(raw_request)

            async def run() -> Response:
                return JSONResponse({"world_size": self.engine.world_size(include_dp)})
            return await self.call(raw_request, vllm_rl.GET_WORLD_SIZE, run)

        @r.post(vllm_rl.COLLECTIVE_RPC.path)
        async def collective_rpc(raw_request: Request) -> Response:
            self = of(raw_request)
            return await self.call(raw_request, vllm_rl.COLLECTIVE_RPC,
                                   lambda: self.collective_rpc(raw_request))

    def weight_checksums(self) -> dict[str, str]:
        """This worker's weight-checker report: one key per engine rank, the content digest
        of the weights it serves (rlfleet.runtime.weight_checker)."""
        digest = self.engine.applied().policy.digest or ""
        return {f"{weight_checker.rank_prefix(tp=rank)}{weight_checker.WEIGHTS_KEY}": digest
                for rank in range(self.engine.world_size(False))}

    async def weight_checker(self, raw_request: Request) -> Response:
        """vLLM's weight checker: `checksum` this worker's report, `compare` a baseline (and
        the caller's other reports) with it; `reset` is refused by name (random weights
        would serve rollouts: an rlfleet worker serves only weights it vouches for)."""
        try:
            body = await raw_request.json()
        except json.JSONDecodeError:
            return JSONResponse({"detail": "Invalid JSON"}, status_code=400)
        if not isinstance(body, dict):
            return JSONResponse({"detail": "Expected a JSON object"}, status_code=400)
        try:
            action, baseline, others = weight_checker.read_reports(body)
        except ValueError as e:
            return JSONResponse({"detail": str(e)}, status_code=400)
        if action == "reset":
            return JSONResponse({"detail": weight_checker.RESET_REFUSED}, status_code=400)
        mine = self.weight_checksums()
        if baseline is None:
            return JSONResponse({"checksums": mine})
        match, mismatches, ranks = weight_checker.compare([baseline, mine, *others])
        return JSONResponse({"match": match, "mismatches": mismatches, "ranks": ranks})

    # ---------------------------------------------------------------- cache and sleep

    @staticmethod
    def _add_sleep_routes(r: APIRouter) -> None:
        """vLLM's /reset_prefix_cache, /sleep, /wake_up and /is_sleeping, as its CPU build
        answers them (vllm_rl.SLEEP): sleep pauses generation (`mode`, the cache cleared at
        level >= 1 unless `keep`) and marks the executor asleep; the memory stays."""
        @r.post(vllm_rl.RESET_PREFIX_CACHE.path)
        async def reset_prefix_cache(
                raw_request: Request,
                reset_running_requests: Annotated[bool, Query()] = False,
                reset_external: Annotated[bool, Query()] = False) -> Response:
            self = of(raw_request)
            async def run() -> Response:
                # no connector-managed (external) cache on an rlfleet worker: nothing more
                ok = await self.engine.reset_cache(running=reset_running_requests)
                return JSONResponse({"success": bool(ok)})
            return await self.call(raw_request, vllm_rl.RESET_PREFIX_CACHE, run)

        @r.post(vllm_rl.SLEEP.path)
        async def sleep(raw_request: Request,
                        level: Annotated[int, Query(ge=0, le=2)] = 1,
                        mode: Annotated[PauseMode, Query()] = "abort") -> Response:
            self = of(raw_request)
            async def run() -> Response:
                await self.engine.pause(mode, clear_cache=level >= 1 and mode != "keep")
                if level >= 1:
                    if vllm_rl.SLEEP_TAGS <= self.asleep:
                        log.warning("/sleep: the executor is already sleeping")
                    else:
                        log.warning("/sleep (level %d): %s", level, vllm_rl.SLEEP_UNSUPPORTED)
                        self.asleep |= vllm_rl.SLEEP_TAGS
                return JSONResponse({"status": "sleeping", "level": level})
            return await self.call(raw_request, vllm_rl.SLEEP, run)

        @r.post(vllm_rl.WAKE_UP.path)
        async def wake_up(raw_request: Request) -> Response:
            self = of(raw_request)
            tags = raw_request.query_params.getlist("tags") or None

            async def run() -> Response:
                rest = None if tags is None else [t for t in tags if t != vllm_rl.SCHEDULING_TAG]
                if rest is None or rest:
                    self._wake(rest)
                awake = not self.asleep
                if awake:  # scheduling resumes once every pool is back, as in vLLM
                    said = await self.admin.resume_generation(NoFields())
                    if said.status != "ok":
                        log.warning("%s", said.message)
                return JSONResponse({"status": "awake" if awake else "sleeping", "tags": tags})
            return await self.call(raw_request, vllm_rl.WAKE_UP, run)

        @r.get(vllm_rl.IS_SLEEPING.path)
        async def is_sleeping(raw_request: Request) -> Response:
            self = of(raw_request)
            async def run() -> Response:  # a paused scheduler counts as asleep, as in vLLM
                sleeping = await self.engine.is_paused() or bool(self.asleep)
                return JSONResponse({"is_sleeping": sleeping})
            return await self.call(raw_request, vllm_rl.IS_SLEEPING, run)

    def _wake(self, tags: list[str] | None) -> None:
        """vLLM's executor wake_up: all pools (None) or the ones named, each of which must be
        asleep (else nothing changes, with a warning)."""
        if not self.asleep:
            log.warning("/wake_up: the executor is not sleeping")
            return
        unknown = [t for t in tags or [] if t not in self.asleep]
        if unknown:
            log.warning("/wake_up: tag %s is not in sleeping tags %s", unknown[0],
                        sorted(self.asleep))
            return
        log.warning("/wake_up: %s", vllm_rl.SLEEP_UNSUPPORTED)
        self.asleep -= set(tags) if tags else set(self.asleep)

    # ---------------------------------------------------------------- prime-rl's server

    async def update_weights_from_path(self, weight_dir: str | None) -> Response:
        """prime-rl's `POST /update_weights {"weight_dir"}`: its worker extension's
        update_weights_from_path, here a reload from disk through update_weights_from_disk's
        checks (the label stays, as in prime-rl); `{"status": "ok"}`."""
        method = vllm_rl.UPDATE_WEIGHTS_FROM_PATH
        if not weight_dir:
            return vllm_error(f"{method}: weight_dir is required (a checkpoint directory on "
                              "this worker's disk); without one prime-rl's server runs its NIXL "
                              "transfer, which an rlfleet worker does not", 400,
                              param="weight_dir")
        said = await self.admin.reload_weights(weight_dir, method=method)
        if said.status != "ok":
            return route_error(f"{method}: {said.message}",
                               409 if said.message == NOT_PAUSED else 500)
        return JSONResponse({"status": "ok"})

    @staticmethod
    def _add_prime_rl_routes(r: APIRouter) -> None:
        @r.get(vllm_rl.PRIME_RL_LIVENESS.path)
        async def liveness(raw_request: Request) -> Response:
            self = of(raw_request)
            async def run() -> Response:
                try:
                    await asyncio.wait_for(self.engine.check_health(), LIVENESS_TIMEOUT)
                except Exception as e:  # no answer in time, or a dead engine
                    log.warning("/liveness: the engine did not answer: %r", e)
                    return JSONResponse({"status": "engine_unresponsive"}, status_code=503)
                return JSONResponse({"status": "ok"})
            return await self.call(raw_request, vllm_rl.PRIME_RL_LIVENESS, run)

        NativeRL._refuse(r, vllm_rl.PRIME_RL_INIT_BROADCASTER,
                     "init_broadcaster starts prime-rl's NCCL broadcast receiver (its worker "
                     "extension), which an rlfleet worker does not run: move weights with "
                     "vLLM's weight-transfer routes (init_weight_transfer_engine, ...), or "
                     "reload a checkpoint with POST /update_weights {\"weight_dir\"}")

    @staticmethod
    def _refuse(r: APIRouter, route: NativeRoute, why: str) -> None:
        """Another server's route that asks for what this worker does not do: 400 `why`
        (what to call instead), under the routes' rules."""
        @r.post(route.path)
        async def refused(raw_request: Request) -> Response:
            self = of(raw_request)
            async def run() -> Response:
                return route_error(why, 400)
            return await self.call(raw_request, route, run)

    @staticmethod
    def _add_lora_routes(r: APIRouter) -> None:
        """vLLM's runtime LoRA routes, through the same handlers as /engine/*_lora_adapter
        (the adapter's version label is its name there: vLLM's body has none)."""
        NativeRL._lora_route(r, vllm_rl.LOAD_LORA_ADAPTER, admin.LOAD_LORA_ADAPTER,
                             lambda self: self.admin.lora.load_lora_adapter, 400, "added")
        # vLLM's unload body carries lora_int_id, which names nothing here: ignored
        NativeRL._lora_route(r, vllm_rl.UNLOAD_LORA_ADAPTER, admin.UNLOAD_LORA_ADAPTER,
                             lambda self: self.admin.lora.unload_lora_adapter, 404, "removed",
                             only_known=True)

        @r.post(vllm_rl.PRIME_RL_LOAD_LORA_ADAPTER.path)
        async def prime_rl_load_lora_adapter(raw_request: Request,
                                             body: Annotated[dict[str, Any], Body()]) -> Response:
            """prime-rl's wrapper of vLLM's load (its server's /load_lora_adapter): vLLM's
            body, always loaded in place (a new version replaces a loaded one, as every load
            here), `{"status": "ok"}`; a refusal in vLLM's error shape."""
            self = of(raw_request)
            async def run() -> Response:
                if body.get("is_3d_lora_weight"):
                    return vllm_error("is_3d_lora_weight: an rlfleet worker loads adapters as "
                                      "peft saves them (2-D LoRA weights) only", 400,
                                      param="is_3d_lora_weight")
                fields = ("lora_name", "lora_path", "load_inplace")
                req = admin.read_request(admin.LOAD_LORA_ADAPTER,
                                         {k: v for k, v in body.items() if k in fields})
                said = await self.admin.lora.load_lora_adapter(req)
                if said.status != "ok":
                    return vllm_error(str(said.message), 400)
                return JSONResponse({"status": "ok"})
            return await self.call(raw_request, vllm_rl.PRIME_RL_LOAD_LORA_ADAPTER, run)

        @r.post(vllm_rl.SKYRL_LOAD_LORA_ADAPTER.path)
        async def skyrl_load_lora_adapter(raw_request: Request,
                                          body: Annotated[dict[str, Any], Body()]) -> Response:
            """SkyRL's own load (its vLLM server's /skyrl/v1/load_lora_adapter): vLLM's load
            of `lora_path` under `lora_name`, in place (a new version replaces a loaded
            one); `{"status": "ok", "lora_name"}`, a refusal in vLLM's error shape."""
            self = of(raw_request)
            async def run() -> Response:
                req = skyrl_load_request(body)
                said = await self.admin.lora.load_lora_adapter(req)
                if said.status != "ok":
                    return vllm_error(str(said.message), 400)
                return JSONResponse({"status": "ok", "lora_name": req.lora_name})
            return await self.call(raw_request, vllm_rl.SKYRL_LOAD_LORA_ADAPTER, run)

    @staticmethod
    def _lora_route(r: APIRouter, native: Any, route: Any,
                    handler: Callable[[NativeRL], Callable[[Any], Awaitable[Any]]],
                    refused: int, done: str,
                    only_known: bool = False) -> None:
        """One of vLLM's LoRA routes: the body read as the admin route's request (with
        `only_known`, fields it has no place for are dropped first); a refusal is `refused`
        in vLLM's error shape."""
        fields = route.request.__struct_fields__

        @r.post(native.path)
        async def lora_adapter(raw_request: Request,
                               body: Annotated[dict[str, Any], Body()]) -> Response:
            self = of(raw_request)
            async def run() -> Response:
                req = admin.read_request(route, {k: v for k, v in body.items()
                                                 if k in fields} if only_known else body)
                said = await handler(self)(req)
                if said.status != "ok":
                    return vllm_error(str(said.message), refused)
                return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' {done} "
                                         "successfully.")
            return await self.call(raw_request, native, run)

    @staticmethod
    def _add_dynamo_lora_routes(r: APIRouter) -> None:
        """Dynamo's /v1/loras routes (rlfleet.protocol.dynamo_lora), through the same
        handlers as /engine/load_lora_adapter and /engine/unload_lora_adapter."""
        @r.post(dynamo_lora.LORAS.path)
        async def dynamo_load_lora(raw_request: Request) -> Response:
            self = of(raw_request)
            try:
                req = msgspec.json.decode(await raw_request.body(),
                                          type=dynamo_lora.LoadLoraRequest)
            except msgspec.ValidationError as e:
                return PlainTextResponse(f"the body must be {{\"lora_name\": str, \"source\": "
                                         f"{{\"uri\": str}}}}: {e}", status_code=422)
            except msgspec.DecodeError as e:
                return PlainTextResponse(f"the body is not JSON: {e}", status_code=400)
            return await self.call(raw_request, dynamo_lora.LORAS,
                                   lambda: self._dynamo_load(req))

        @r.get(dynamo_lora.LIST_LORAS.path)
        async def dynamo_list_loras(raw_request: Request) -> Response:
            self = of(raw_request)
            async def run() -> Response:
                names = [s.policy.adapter_name for s in self.engine.adapters()]
                ids = {n: dynamo_lora_ids.lora_name_to_id(n) for n in names if n}
                return JSONResponse(dynamo_lora.LoraResponse(
                    status="success", loras=ids, count=len(ids)).body())
            return await self.call(raw_request, dynamo_lora.LIST_LORAS, run)

        @r.delete(dynamo_lora.UNLOAD_LORA.path)
        async def dynamo_unload_lora(raw_request: Request, lora_name: str) -> Response:
            self = of(raw_request)
            async def run() -> Response:
                loaded = [s.policy.adapter_name for s in self.engine.adapters()]
                if lora_name not in loaded:
                    return _dynamo(status="error", message=f"LoRA adapter '{lora_name}' not "
                                   f"found. Available LoRAs: {loaded}")
                said = await self.admin.lora.unload_lora_adapter(
                    admin_lora.LoraRequest(lora_name=lora_name))
                if said.status != "ok":
                    return _dynamo(status="error", message=str(said.message),
                                   lora_name=lora_name)
                return _dynamo(status="success", lora_name=lora_name,
                               message=f"LoRA adapter '{lora_name}' unloaded successfully",
                               lora_id=dynamo_lora_ids.lora_name_to_id(lora_name))
            return await self.call(raw_request, dynamo_lora.UNLOAD_LORA, run)

    async def _dynamo_load(self, req: dynamo_lora.LoadLoraRequest) -> Response:
        """Dynamo's load: an adapter already loaded stays as it is unless hot swaps are
        enabled ($DYN_LORA_HOTSWAP_ENABLED), then its new version replaces it."""
        name, lora_id = req.lora_name, dynamo_lora_ids.lora_name_to_id(req.lora_name)
        loaded = any(s.policy.adapter_name == name for s in self.engine.adapters())
        swap = loaded and dynamo_lora_ids.hotswap_enabled(dict(os.environ))
        if loaded and not swap:
            return _dynamo(status="success", message=f"LoRA adapter '{name}' already loaded",
                           lora_name=name, lora_id=lora_id)
        try:
            path = dynamo_lora_ids.local_path(req.source.uri)
            said = await self.admin.lora.load_lora_adapter(
                admin_lora.LoraLoadRequest(lora_name=name, lora_path=path))
        except (ValueError, AdminRequestError) as e:
            return _dynamo(status="error", message=str(e), lora_name=name)
        if said.status != "ok":
            return _dynamo(status="error", message=f"Failed to add LoRA '{name}': "
                                                   f"{said.message}", lora_name=name)
        how = "hot-swapped" if swap else "loaded"
        return _dynamo(status="success", message=f"LoRA adapter '{name}' {how} successfully",
                       lora_name=name, lora_id=lora_id)

    async def collective_rpc(self, raw_request: Request) -> Response:
        """vLLM's collective_rpc for `reload_weights` (EngineAdmin.collective_rpc): fields
        vLLM does not read are ignored, as vLLM ignores them."""
        try:
            body = await raw_request.json()
        except json.JSONDecodeError as e:
            return vllm_error(f"JSON decode error: {e}", 400)
        if not isinstance(body, dict):
            return vllm_error("Request body must be a JSON object", 400)
        fields = admin_vllm.CollectiveRpcRequest.__struct_fields__
        req = admin.read_request(admin.COLLECTIVE_RPC, {k: v for k, v in body.items()
                                                        if k in fields})
        said = await self.admin.collective_rpc(req)
        if said.status != "ok":
            status = 409 if said.message == RELOAD_NOT_PAUSED else 500
            return route_error(str(said.message), status)
        return JSONResponse({"results": said.results})
