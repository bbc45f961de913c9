"""The vLLM-flavoured /engine routes of a worker, written once over the engine-control
interface (`rlfleet.worker.engine.EngineControl`) that the vLLM engine and the mocker both
implement: pause/resume, cache, weight updates from disk or from a trainer's process group,
versions and digests. Shapes: docs/contract.md; bodies: rlfleet.protocol.admin.

rlfleet extensions: every install takes the policy's fleet `step` (optional) and replies
with it; `get_weight_version` also reports `step` and `fleet_epoch` (the newest epoch the
worker's system server has seen, `rlfleet.worker.system_server.FleetFence`)."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from msgspec import UNSET

import rlfleet
from rlfleet.protocol import admin, admin_base, sglang_admin
from rlfleet.protocol.admin import CommitRequest
from rlfleet.protocol.admin_base import NoFields, SglangReply
from rlfleet.protocol.admin_vllm import (
    AbortReply,
    AbortRequest,
    ApplyStagedRequest,
    CollectiveRpcReply,
    CollectiveRpcRequest,
    CommitProbe,
    CommitReply,
    CommitStep,
    DiskUpdateRequest,
    DistributedRequest,
    GroupLeaveRequest,
    GroupRequest,
    HandleRequest,
    InstallReply,
    IsPausedReply,
    LivenessReply,
    MessageReply,
    NewVersionRequest,
    PauseReply,
    PauseRequest,
    SetVersionReply,
    SetVersionRequest,
    StagedListReply,
    StagedQuery,
    StageReply,
    StageRequest,
    VersionReply,
    WeightVersionReply,
)
from rlfleet.protocol.engine import GenerateRequest, SamplingOptions, Step, TokenLogprob
from rlfleet.protocol.identity import PolicyIdentity
from rlfleet.protocol.sglang_admin import (
    EndSessionRequest,
    NativeContinueRequest,
    ServerInfoReply,
    SessionRequest,
)
from rlfleet.protocol.vllm_rl import RELOAD_WEIGHTS
from rlfleet.runtime.paths import weights_path
from rlfleet.runtime.request_checks import check_request
from rlfleet.weights.stage_transfer import CannotStage
from rlfleet.worker.admission import Admission
from rlfleet.worker.engine import EngineControl, WeightLoadError
from rlfleet.worker.lora_admin import LoraAdmin, adapter_policies
from rlfleet.worker.system_server import FleetFence, Route, table_call
from rlfleet.worker.weight_transfer import WeightTransfer

if TYPE_CHECKING:
    from rlfleet.weights.staging import StagingArea
    from rlfleet.worker.stream_server import WorkerPlane

log = logging.getLogger("rlfleet.admin")

GROUP_TIMEOUT = float(os.environ.get("RLFLEET_GROUP_TIMEOUT", 60))
SELF_CHECK_TIMEOUT = float(os.environ.get("RLFLEET_SELF_CHECK_TIMEOUT", 60))
NOT_PAUSED = "generation is not paused: call pause_generation first"
#: what a reload refused because generation runs answers (vLLM's native route: HTTP 409)
RELOAD_NOT_PAUSED = f"reload_weights: {NOT_PAUSED}"
PENDING = "new weights installed: their self-check runs when generation resumes"


def _said(step: CommitStep) -> str:
    """What a commit's step answered, in a line."""
    body = step.body
    msg = body.get("message", body) if isinstance(body, dict) else body
    return f"HTTP {step.http_status}: {msg}" if step.http_status != 200 else str(msg)


class EngineAdmin:
    """Route handlers over one engine. The weight identity (version, declared, digest) is
    the engine's; the admin owns whether a trainer's weight-update group is open, and
    whether the worker vouches for its weights (`admission`'s hold, which the worker's
    discovery entries publish): after every install the worker's own self-check must pass
    (`self_check`) before it takes rollouts again, and a load that failed without the
    previous weights coming back keeps it closed until a load succeeds."""

    def __init__(self, engine: EngineControl, allowed_roots: list[str] | None = None,
                 staging: StagingArea | None = None, fence: FleetFence | None = None) -> None:
        self.engine = engine
        self.fence = fence if fence is not None else FleetFence()  # give it to system_app
        self.roots = [Path(r).resolve() for r in allowed_roots or []]
        self.group: GroupRequest | None = None  # the trainer's group, once joined
        self.update_session = False  # SGLang's weight-update session is open
        self.staging = staging  # versions pulled while serving (stage_weights, ...)
        self.admission = Admission(identity=self._policy)
        self.check_pending = False  # weights installed since the last self-check
        self.lora = LoraAdmin(engine, self.roots, lambda: engine.info.served_model_name,
                              staging=staging)
        # vLLM's weight-transfer steps (its native routes and Dynamo 1.7's update/* alike)
        self.transfer = WeightTransfer(self)
        # the worker's request plane, where a commit runs its post-update probe (set by the
        # worker that serves these routes: `use_plane`)
        self.plane: WorkerPlane | None = None

    def use_plane(self, plane: WorkerPlane) -> None:
        """Run commit_policy's post-update probes on `plane` (this worker's request plane)."""
        self.plane = plane

    def routes(self) -> list[Route]:
        staged = [] if self.staging is None else [
            Route(admin.STAGE_WEIGHTS, self.stage_weights),
            Route(admin.GET_STAGED_WEIGHTS, self.get_staged_weights),
            Route(admin.APPLY_STAGED_WEIGHTS, self.apply_staged_weights),
            Route(admin.RELEASE_STAGED_WEIGHTS, self.release_staged_weights),
        ]
        return staged + [
            Route(admin.LIVENESS_PROBE, self.liveness_probe),
            Route(admin.COMMIT_POLICY, self.commit_policy),
            Route(admin.PAUSE_GENERATION, self.pause_generation),
            Route(admin.RESUME_GENERATION, self.resume_generation),
            Route(admin.FLUSH_CACHE, self.flush_cache),
            Route(admin.ABORT_REQUEST, self.abort_request),
            Route(admin.UPDATE_WEIGHTS_FROM_DISK, self.update_weights_from_disk),
            Route(admin.GET_WEIGHT_VERSION, self.get_weight_version),
            Route(admin.SET_WEIGHT_VERSION, self.set_weight_version),
            Route(admin.INIT_WEIGHTS_UPDATE_GROUP, self.init_weights_update_group),
            Route(admin.UPDATE_WEIGHTS_FROM_DISTRIBUTED, self.update_weights_from_distributed),
            Route(admin.DESTROY_WEIGHTS_UPDATE_GROUP, self.destroy_weights_update_group),
            # Dynamo 1.7's names (rlfleet.protocol.admin.DYNAMO_17)
            Route(admin.CONTROL_PAUSE_GENERATION, self.pause_generation),
            Route(admin.CONTROL_RESUME_GENERATION, self.resume_generation),
            Route(admin.CONTROL_IS_PAUSED, self.is_paused),
            Route(admin.IS_PAUSED, self.is_paused),  # the flat name (served, not listed)
            Route(admin.CONTROL_GET_WEIGHT_VERSION, self.weight_version),
            Route(admin.UPDATE_UPDATE_WEIGHT_VERSION, self.update_weight_version),
            Route(admin.COLLECTIVE_RPC, self.collective_rpc),
            # SGLang's names (slime through Dynamo's facade: rlfleet.protocol.sglang_admin)
            Route(admin.CONTINUE_GENERATION, self.continue_generation),
            Route(admin.SERVER_INFO, self.server_info),
            Route(admin.GET_SERVER_INFO, self.server_info),
            Route(admin.BEGIN_WEIGHT_UPDATE, self.begin_weight_update),
            Route(admin.END_WEIGHT_UPDATE, self.end_weight_update),
            *self.transfer.routes(),
            *self.lora.routes(),
        ]

    # ---------------------------------------------------------------- lifecycle

    def _policy(self) -> dict[str, Any]:
        policy = self.engine.applied().policy
        return {"version": policy.version, "digest": policy.digest}

    async def liveness_probe(self, req: NoFields) -> LivenessReply:
        """The engine answers and its model can run on the weights it holds (both checked
        each time, cheaply); a worker that holds itself closed says why. While the engine
        runs a long control call, the answer says so instead of waiting behind it."""
        busy = self.engine.busy()
        try:
            await self.engine.check_health()
        except Exception as e:
            await self.admission.hold(f"the engine is not healthy: {e!r}")
            return LivenessReply.failed(f"engine is not healthy: {e!r}", alive=False,
                                        weights_uncertain=self.admission.hold_reason)
        try:
            problem = None if busy else await self.engine.weights_problem()
        except Exception as e:  # e.g. no answer in time: said, not held against it
            return LivenessReply.failed(f"the engine did not answer a check of its weights: "
                                        f"{e!r}", alive=False)
        if problem:
            await self.admission.hold(f"weights uncertain: {problem}")
        said = LivenessReply(alive=True, busy=True if busy else UNSET,
                             self_check="pending" if self.check_pending else UNSET)
        why = self.admission.hold_reason
        if why and why != PENDING:  # a pending self-check is no fault: it runs on resume
            said.status, said.message = "error", f"this worker holds itself closed: {why}"
            said.alive, said.weights_uncertain = not problem, why
        return said

    async def pause_generation(self, req: PauseRequest) -> PauseReply:
        await self.engine.pause(req.engine_mode, clear_cache=req.clear_cache)
        return PauseReply(message="Engine paused", mode=req.mode, clear_cache=req.clear_cache)

    async def resume_generation(self, req: NoFields) -> MessageReply:
        await self.engine.resume()
        if self.check_pending:
            why = await self.vouch()
            if why:
                return MessageReply.failed(
                    f"generation resumed, but {why}; this worker holds itself closed to "
                    "rollouts until weights that pass are installed",
                    weights_uncertain=self.admission.hold_reason)
        return MessageReply(message="Engine resumed")

    async def continue_generation(self, req: NativeContinueRequest) -> MessageReply:
        """SGLang's continue_generation: the resume (its cache release is a GPU allocator's,
        nothing to do here)."""
        return await self.resume_generation(NoFields())

    async def server_info(self, req: NoFields) -> ServerInfoReply:
        """SGLang's get_server_info for this worker (its engine's ranks as tp_size)."""
        info, applied = self.engine.info, self.engine.applied()
        return ServerInfoReply(
            model_path=info.model_path, tokenizer_path=info.tokenizer or info.model_path,
            served_model_name=info.served_model_name, context_length=info.max_model_len,
            tp_size=info.world_size, version=rlfleet.__version__,
            weight_version=applied.policy.version if applied.declared else None)

    async def begin_weight_update(self, req: SessionRequest) -> SglangReply:
        """SGLang 0.5.23's weight-update session opens (its tensors are the engine's own
        here: nothing to restore); once at a time."""
        if req.selector == "draft":
            return SglangReply.failed(sglang_admin.NO_DRAFT)
        if self.update_session:
            return SglangReply.failed(sglang_admin.SESSION_OPEN)
        self.update_session = True
        return SglangReply(message="Success")

    async def end_weight_update(self, req: EndSessionRequest) -> SglangReply:
        if not self.update_session:
            return SglangReply.failed(sglang_admin.SESSION_CLOSED)
        self.update_session = False
        return SglangReply(message="Success")

    async def is_paused(self, req: NoFields) -> IsPausedReply:
        return IsPausedReply(is_paused=await self.engine.is_paused())

    async def commit_policy(self, req: CommitRequest) -> CommitReply:
        """Close, pause, install, reset the cache, verify and resume in one call, each step
        through this worker's own route (`CommitRequest`); stops at the first step that
        fails. The reply lists every step run and the identity the worker reports."""
        call = table_call()
        if call is None:
            return CommitReply.failed("commit_policy runs only through the system server")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + req.deadline_s
        steps: list[CommitStep] = []

        async def step(name: str, route: admin.AdminRoute, body: dict[str, Any]) -> Any:
            # perf_counter, not loop.time(): uvloop's clock ticks in whole milliseconds
            # and holds still within one pass of the loop, so a quick step read 0.0
            t0 = time.perf_counter()
            status, out = await call(route.name, body)
            steps.append(CommitStep(step=name, route=route.name, http_status=status, body=out,
                                    seconds=time.perf_counter() - t0))
            return out if status == 200 and isinstance(out, dict) and \
                out.get("status") == "ok" else None

        def stop(name: str, why: str) -> CommitReply:
            return CommitReply.failed(f"{name} failed: {why}", steps=steps, failed_step=name)

        plan: list[tuple[str, admin.AdminRoute, dict[str, Any]]] = []
        if req.close_reason is not None:
            plan.append(("gate", admin.SET_ADMISSION, {"open": False,
                                                         "reason": req.close_reason}))
        plan += [("pause", admin.PAUSE_GENERATION, {"mode": req.pause_mode,
                                                    "clear_cache": False}),
                 ("apply", admin.ROUTES[req.install], req.body)]
        if req.reset_cache:
            plan.append(("reset_cache", admin.FLUSH_CACHE, {}))
        for name, route, body in plan:
            if loop.time() > deadline:
                return stop(name, f"the commit's deadline ({req.deadline_s:g} s) passed "
                                  "before this step")
            if await step(name, route, body) is None and name != "gate":  # as a refresh judges
                return stop(name, _said(steps[-1]))
        if loop.time() > deadline:
            return stop("verify", f"the commit's deadline ({req.deadline_s:g} s) passed "
                                  "before this step")
        version, live = await asyncio.gather(step("verify", admin.GET_WEIGHT_VERSION, {}),
                                             step("verify", admin.LIVENESS_PROBE, {}))
        if version is None:
            return stop("verify", _said(next(s for s in steps[-2:]
                                             if s.route == admin.GET_WEIGHT_VERSION.name)))
        said = msgspec.convert(version, VersionReply)
        identity = {k: getattr(said, k) for k in ("version", "version_declared",
                                                  "weight_digest", "step", "dtype")}
        if (said.version, said.weight_digest) != (req.expect_version, req.expect_digest):
            return CommitReply.failed(
                f"verify failed: the worker reports {said.version!r} / {said.weight_digest}, "
                f"not {req.expect_version!r} / {req.expect_digest}", steps=steps,
                failed_step="verify", **identity)
        if live is None:
            probe = next(s for s in steps[-2:] if s.route == admin.LIVENESS_PROBE.name)
            return CommitReply.failed(f"verify failed: {_said(probe)}", steps=steps,
                                      failed_step="verify", **identity)
        # the probe goes in now, ahead of the resume: the engine runs it in the same steps as
        # the self-check the resume runs (one round of generation after the swap, not two)
        probe = None if req.probe is None or self.plane is None else asyncio.create_task(
            self._commit_probe(self.plane, req.probe,
                               max(deadline - loop.time(), 0.0) + req.deadline_s))
        try:
            if await step("resume", admin.RESUME_GENERATION, {}) is None:
                return CommitReply.failed(f"resume failed: {_said(steps[-1])}", steps=steps,
                                          failed_step="resume", **identity)
            if probe is not None:
                identity["probe"] = await probe
        finally:
            if probe is not None and not probe.done():
                probe.cancel()
                await asyncio.gather(probe, return_exceptions=True)
        return CommitReply(message=f"committed {req.expect_version}", steps=steps, **identity)

    @staticmethod
    async def _commit_probe(plane: WorkerPlane, body: dict[str, Any], timeout: float
                            ) -> CommitProbe:
        """Run a commit's post-update probe on this worker's request plane exactly as
        `POST /generate` runs it (the same checks, faults and engine path), within `timeout`
        seconds; what that route would have answered."""
        from rlfleet.protocol.engine import ErrorEvent, Frame
        from rlfleet.runtime.http import HttpError

        try:
            greq = check_request(msgspec.convert(body, GenerateRequest))
        except (msgspec.ValidationError, ValueError) as e:
            why = f"invalid probe request: {e}"
            return CommitProbe(http_status=400, message=why, body={"error": {"message": why}})

        async def run() -> list[dict[str, Any]]:
            opened = await plane.open(greq)
            try:
                events = [msgspec.to_builtins(opened.head)]
                async for kind, ev in plane.rest(opened):
                    if kind is Frame.ERROR:
                        events.append(msgspec.to_builtins(ErrorEvent(error=ev)))
                        break
                    events.append(msgspec.to_builtins(ev))
                return events
            finally:
                await opened.aclose()
        try:
            return CommitProbe(http_status=200, events=await asyncio.wait_for(run(), timeout))
        except HttpError as e:
            return CommitProbe(http_status=e.status, message=e.message, body=e.body)
        except TimeoutError:
            why = f"the probe did not finish within {timeout:g} s"
            return CommitProbe(http_status=504, message=why, body={"error": {"message": why}})

    # ---------------------------------------------------------------- self-check

    async def self_check(self) -> str | None:
        """The worker's own check of the weights it serves, run after every install: the
        model can run on them, and a one-token greedy generation gives a token of the
        vocabulary with finite logprobs that are not all equal (NaN logits can come out as
        a flat distribution). Why not, or None. Needs generation running."""
        problem = await self.engine.weights_problem()
        if problem:
            return problem
        # one prompt token: a prefill of one position costs what a decode step does (on the
        # CPU build a bf16 prefill of several positions is several times slower per token),
        # and it already shows weights that produce non-finite or flat logits
        prompt, vocab = [1], self.engine.info.vocab_size
        req = GenerateRequest(request_id=f"self-check-{uuid.uuid4().hex[:12]}",
                              prompt_token_ids=prompt, stream=False,
                              sampling=SamplingOptions(max_tokens=1, temperature=0.0, logprobs=5,
                                                       ignore_eos=True))

        async def run() -> list[TokenLogprob]:
            return [lp async for ev in self.engine.generate(req, prompt) if type(ev) is Step
                    for c in ev.choices for lp in c.logprobs or []]
        try:
            lps = await asyncio.wait_for(run(), SELF_CHECK_TIMEOUT)
        except TimeoutError:
            return f"a one-token greedy generation did not finish within {SELF_CHECK_TIMEOUT:.0f}s"
        except Exception as e:
            return f"a one-token greedy generation failed: {e!r}"
        if len(lps) != 1:
            return f"a one-token greedy generation gave {len(lps)} tokens"
        tid, lp = lps[0].token_id, lps[0].logprob
        if not isinstance(lp, float) or not math.isfinite(lp):
            return (f"a one-token greedy generation gave logprob {lp} (token {tid}): the "
                    "weights produce non-finite values")
        if not isinstance(tid, int) or (vocab and not 0 <= tid < vocab):
            return f"a one-token greedy generation gave token {tid}, outside the vocabulary"
        top = [t[1] for t in lps[0].top or []]
        if not all(isinstance(x, float) and math.isfinite(x) for x in top):
            return f"a one-token greedy generation gave non-finite top logprobs {top}"
        if len(top) > 1 and max(top) - min(top) < 1e-6:
            return (f"a one-token greedy generation gave a flat distribution (top logprobs "
                    f"{top[0]:.4f}): the weights produce non-finite values")
        return None

    async def vouch(self) -> str | None:
        """Run the self-check on what is installed now: lift the worker's hold when it
        passes, hold it closed (saying why) when it does not. Returns why it failed."""
        why = await self.self_check()
        self.check_pending = False
        if why:
            why = f"the self-check of the installed weights failed: {why}"
            await self.admission.hold(why)
            return why
        await self.admission.release()
        return None

    async def flush_cache(self, req: NoFields) -> MessageReply:
        if not await self.engine.reset_cache():
            return MessageReply.failed("the prefix cache was not reset because requests are "
                                       "running; pause generation first")
        return MessageReply(message="Cache flushed")

    async def abort_request(self, req: AbortRequest) -> AbortReply:
        await self.engine.abort(req.request_id)
        return AbortReply(request_id=req.request_id)

    # ---------------------------------------------------------------- versions

    async def get_weight_version(self, req: NoFields) -> VersionReply:
        applied = self.engine.applied()
        adapters = [p.to_dict() for p in adapter_policies(self.engine)]
        return VersionReply(**applied.policy.reply_fields(), version_declared=applied.declared,
                            weight_version=applied.policy.version if applied.declared else None,
                            fleet_epoch=self.fence.newest,
                            dtype=applied.dtype or UNSET,  # what the probe tolerance needs
                            adapters=adapters or UNSET)

    async def set_weight_version(self, req: SetVersionRequest) -> SetVersionReply:
        await self.engine.set_version(req.weight_version, declared=True, step=req.step)
        return SetVersionReply(version=req.weight_version,
                               step=self.engine.applied().policy.step)

    async def weight_version(self, req: NoFields) -> WeightVersionReply:
        """The version label alone, as Dynamo 1.7 answers (null until one is declared)."""
        applied = self.engine.applied()
        return WeightVersionReply(weight_version=applied.policy.version if applied.declared
                                  else None)

    async def update_weight_version(self, req: NewVersionRequest) -> WeightVersionReply:
        """Relabel the weights served (Dynamo 1.7's update/update_weight_version): the
        digest and the fleet step stay."""
        await self.engine.set_version(req.new_version, declared=True)
        return WeightVersionReply(weight_version=req.new_version)

    # ---------------------------------------------------------------- installing weights

    async def _install(self, load: Callable[[], Awaitable[str]], version: str | None, *,
                       what: str, step: int | None = None, reset_cache: bool = True,
                       staged: bool = False) -> InstallReply:
        """Run `load` (new weights live when it returns their digest), record the identity
        (with the policy's fleet `step`), drop KV computed under the old weights; the
        route's reply."""
        try:
            digest = await load()
        except WeightLoadError as e:
            if e.uncertain:
                await self.admission.hold(f"weights uncertain: {what} failed and the previous "
                                          f"weights could not be put back ({e})")
                return InstallReply.failed(f"{what} failed: {e}",
                                           weights_uncertain=self.admission.hold_reason)
            return InstallReply.failed(f"{what} failed: {e}")
        if self.staging is not None and not staged:  # the resident staged copy is stale now
            await self.staging.weights_replaced()
        await self.engine.set_version(version, declared=version is not None, digest=digest,
                                      step=step)
        # closed until the self-check passes: now, or when generation resumes
        self.check_pending = True
        await self.admission.hold(PENDING)
        if reset_cache and not await self.engine.reset_cache(running=True):
            await self.admission.hold("weights were applied but the prefix cache could not be "
                                      "reset")
            return InstallReply.failed("weights were applied but the prefix cache could not "
                                       "be reset; do not admit this worker",
                                       weight_digest=digest)
        if not await self.engine.is_paused():
            why = await self.vouch()
            if why:
                return InstallReply.failed(f"{what}: the weights were applied but {why}",
                                           weight_digest=digest, weights_uncertain=why)
        installed = PolicyIdentity(version="unknown" if version is None else version,
                                   digest=digest, step=step)
        return InstallReply(**installed.reply_fields(), version_declared=version is not None)

    async def install_tensors(self, tensors: Mapping[str, Any], version: str | None,
                              step: int | None = None) -> InstallReply:
        """Install tensors staged in host memory (only while paused); the reply has the shape
        of update_weights_from_disk's. For routes that apply staged weights."""
        if not await self.engine.is_paused():
            return InstallReply.failed(NOT_PAUSED)

        async def load() -> str:
            try:
                return await self.engine.apply_tensors(tensors)
            except ValueError as e:  # they do not fit: nothing was changed
                raise WeightLoadError(f"{e}; the previous weights are still serving") from e
        return await self._install(load, version, what="applying staged weights", step=step)

    # ---------------------------------------------------------------- staged weights

    async def stage_weights(self, req: StageRequest) -> StageReply:
        """Start pulling a version into host buffers while the engine serves; returns at once
        with the handle (STAGING). Bad sources and wrong bases are refused here when they can
        be seen without the transfer, else the handle ends FAILED with the reason."""
        policy = self.engine.applied().policy
        try:
            h = await self.staging.stage(req.version, req.source, digest=req.digest,
                                         applied=(policy.version, policy.digest),
                                         require_swap=req.require_swap)
        except CannotStage as e:
            return StageReply.failed(f"cannot stage {req.version} to swap it in: {e}; install "
                                     "it from disk instead (update_weights_from_disk)",
                                     cannot_stage=str(e), version=req.version)
        return StageReply(handle=h.handle, state=h.state.value, version=h.version)

    async def get_staged_weights(self, req: StagedQuery) -> StagedListReply:
        """Every handle (or the one named) with its state, progress and error."""
        if req.handle is not None:
            return StagedListReply(staged=[self.staging.get(req.handle).summary()])
        r = self.staging.resident
        return StagedListReply(staged=self.staging.summaries(),
                               resident={"version": r.version, "digest": r.digest} if r else None)

    async def apply_staged_weights(self, req: ApplyStagedRequest) -> InstallReply:
        """Install a READY handle (only while paused); the reply is update_weights_from_disk's
        (version, weight_digest). `weight_version` defaults to the staged version's name."""
        h, staged = self.staging.ready(req.handle)
        if not await self.engine.is_paused():
            return InstallReply.failed(NOT_PAUSED)
        version = h.version if req.weight_version is None else req.weight_version
        if req.keep_label:
            applied = self.engine.applied()
            version = applied.policy.version if applied.declared else None
        reply = await self._install(lambda: self.engine.load_staged(staged.dir, staged.digest),
                                    version, what=f"applying staged {h.version}", step=req.step,
                                    staged=True)
        if reply.status == "ok":
            await self.staging.applied(req.handle, reply.weight_digest)
        reply.handle, reply.staged_digest = req.handle, staged.digest
        return reply

    async def release_staged_weights(self, req: HandleRequest) -> StageReply:
        h = await self.staging.release(req.handle)
        return StageReply(handle=h.handle, state=h.state.value)

    # ---------------------------------------------------------------- from disk

    def checkpoint_path(self, raw: Any) -> Path:
        """`model_path` checked: allowed, a directory, and a fit for the served model."""
        path = weights_path(raw, self.roots)
        try:
            why = self.engine.checkpoint_mismatch(path)
        except ValueError as e:
            raise admin_base.AdminRequestError(str(e)) from e
        if why:
            raise admin_base.AdminRequestError(
                f"checkpoint {raw} does not fit the served model's architecture: {why}")
        return path

    async def update_weights_from_disk(self, req: DiskUpdateRequest) -> InstallReply:
        """A load of `model_path` by the engine method Dynamo's `engine_rpc` names (vLLM's
        reload_weights, prime-rl's update_weights_from_path: the same load here), checked,
        digested and self-checked as every install."""
        if not await self.engine.is_paused():
            return InstallReply.failed(NOT_PAUSED)
        path = self.checkpoint_path(req.model_path)
        return await self._install(lambda: self.engine.load_path(path), req.weight_version,
                                   what=f"loading {path}" if req.engine_rpc is None
                                   else f"{req.engine_rpc} of {path}", step=req.step)

    async def reload_weights(self, model_path: str, method: str = RELOAD_WEIGHTS
                             ) -> InstallReply:
        """vLLM's `collective_rpc("reload_weights")` (its native RL route), or prime-rl's
        `update_weights_from_path` (its server's /update_weights): a load from disk through
        update_weights_from_disk's checks (paused, the path allowed and a fit, the digest
        recorded, the self-check, the hold). As in vLLM and prime-rl, the label stays."""
        applied = self.engine.applied()
        policy = applied.policy
        return await self.update_weights_from_disk(DiskUpdateRequest(
            model_path=model_path, weight_version=policy.version if applied.declared else None,
            step=policy.step, engine_rpc=None if method == RELOAD_WEIGHTS else method))

    async def collective_rpc(self, req: CollectiveRpcRequest) -> CollectiveRpcReply:
        """collective_rpc (`reload_weights`, the only method its request takes), for vLLM's
        native route and Dynamo 1.7's /engine/collective_rpc alike: a reload of `weights_path`
        (default: the model the worker was started from), one None result per rank."""
        said = await self.reload_weights(req.weights_path or self.engine.info.model_path)
        if said.status != "ok":
            return CollectiveRpcReply.failed(f"reload_weights: {said.message}")
        return CollectiveRpcReply(results=[None] * self.engine.world_size(False))

    async def weights_transferred(self, version: str | None) -> str | None:
        """New weights came in through vLLM's own weight transfer (finish_weight_update):
        record the label (when given), and vouch for them as for any install (closed until
        the self-check passes, now or on resume). Why the self-check failed, or None."""
        if version is not None:
            await self.engine.set_version(version, declared=True)
        if self.staging is not None:
            await self.staging.weights_replaced()
        self.check_pending = True
        await self.admission.hold(PENDING)
        await self.engine.reset_cache(running=True)
        if await self.engine.is_paused():
            return None
        return await self.vouch()

    # ---------------------------------------------------------------- from a trainer

    async def init_weights_update_group(self, req: GroupRequest) -> MessageReply:
        if req.engine_rpc is not None:  # vLLM's init_weight_transfer_engine (Dynamo's field)
            return await self.transfer.answer("init", req.init_info)
        g = req.resolved(self.engine.group_backend, GROUP_TIMEOUT)
        if g.backend == "nccl" and self.engine.group_backend != "nccl":
            raise admin_base.UnsupportedRequest(
                "backend nccl: an NCCL weight-update group needs a GPU, and this worker's "
                f"engine joins {self.engine.group_backend} groups only; join with backend "
                f"{self.engine.group_backend!r}, or load a checkpoint with "
                "update_weights_from_disk")
        try:
            await self.engine.join_group(g)
        except Exception as e:
            return MessageReply.failed(f"weight update group initialisation failed (within "
                                       f"{g.timeout}s): {e!r}")
        self.group = g
        return MessageReply(message="Weight update group initialized")

    async def update_weights_from_distributed(self, d: DistributedRequest) -> InstallReply:
        if d.transfer_step is not None:  # a step of vLLM's weight transfer (Dynamo's engine_rpc)
            return await self.transfer_step(d)
        if d.engine_rpc is not None:  # Dynamo's engine method: a load from disk (not a group)
            if not await self.engine.is_paused():
                return InstallReply.failed(NOT_PAUSED)
            path = self.checkpoint_path(d.checkpoint or self.engine.info.model_path)
            return await self._install(lambda: self.engine.load_path(path), d.version,
                                       what=f"{d.engine_rpc} of {path}", step=d.step,
                                       reset_cache=d.reset_cache)
        why = self.engine.announced_mismatch(d)
        if why:
            return InstallReply.failed(why)
        if self.group is None:
            return InstallReply.failed("no weight update group: call init_weights_update_group "
                                       "first")
        if not _same_group(self.group, d.group_name):
            return InstallReply.failed(f"group_name {d.group_name!r} is not the group this "
                                       f"worker joined ({self.group.group_name!r})")
        if not d.allow_unpaused and not await self.engine.is_paused():
            return InstallReply.failed(f"{NOT_PAUSED} (or allow_unpaused with "
                                       "reset_prefix_cache: false)")
        try:
            received = await self.engine.receive(d, self.group.timeout)
        except Exception as e:
            return InstallReply.failed(f"weight transfer failed: {e!r}; the previous weights "
                                       "are still serving")
        log.info("received %d tensors (%d bytes) from the trainer", len(d.names), received)
        return await self._install(self.engine.apply_received, d.version,
                                   what="applying received weights", step=d.step,
                                   reset_cache=d.reset_cache)

    async def transfer_step(self, d: DistributedRequest) -> InstallReply:
        """vLLM's start, update or finish step named by Dynamo's `engine_rpc`, in this route's
        reply; after finish, the identity of the weights transferred."""
        step = d.transfer_step
        if step == "update" and d.allow_unpaused and not await self.engine.is_paused():
            raise admin_base.UnsupportedRequest(
                "allow_unpaused: an rlfleet worker applies transferred weights only while "
                "generation is paused (its rule for every install); pause first "
                "(pause_generation), then send update_weights again: the update stays open")
        said = await self.transfer.answer(step, d.update_info,
                                          weight_version=d.version if step == "finish" else None)
        if said.status != "ok" or step != "finish":
            return InstallReply(status=said.status, message=said.message,
                                weights_uncertain=said.weights_uncertain)
        applied = self.engine.applied()
        return InstallReply(**applied.policy.reply_fields(), version_declared=applied.declared,
                            message=said.message)

    async def destroy_weights_update_group(self, req: GroupLeaveRequest) -> MessageReply:
        if req.engine_rpc is not None:  # vLLM's shutdown_weight_transfer_engine
            return await self.transfer.answer("shutdown")
        if self.group is not None and not _same_group(self.group, req.group_name):
            return MessageReply.failed(f"group_name {req.group_name!r} is not the group this "
                                       f"worker joined ({self.group.group_name!r})")
        try:
            await self.engine.leave_group()
        finally:
            self.group = None
        return MessageReply(message="Weight update group destroyed")


def _same_group(joined: GroupRequest, name: str | None) -> bool:
    """Whether a call naming `name` (None: unnamed) means the group joined."""
    return name is None or joined.group_name is None or name == joined.group_name
