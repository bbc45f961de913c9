"""The vLLM-flavoured /engine routes of a worker, written once over the engine-control
interface (`rlfleet.worker.engine.EngineControl`) that the vLLM engine and the mocker both
implement: pause/resume, cache, weight updates from disk or from a trainer's process group,
versions and digests. Shapes: shared/spec/CONTRACT.md; bodies: rlfleet.protocol.admin.

rlfleet extensions: every install takes the policy's fleet `step` (optional) and replies
with it; `get_weight_version` also reports `step` and `fleet_epoch` (the newest epoch the
worker's system server has seen, `rlfleet.worker.system_server.FleetFence`)."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import uuid
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from msgspec import UNSET

from rlfleet.protocol import admin
from rlfleet.protocol.admin import (
    AbortReply,
    AbortRequest,
    ApplyStagedRequest,
    CollectiveRpcReply,
    CollectiveRpcRequest,
    DiskUpdateRequest,
    DistributedRequest,
    GroupRequest,
    HandleRequest,
    InstallReply,
    IsPausedReply,
    LivenessReply,
    MessageReply,
    NewVersionRequest,
    NoFields,
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
from rlfleet.protocol.engine import GenerateRequest, SamplingOptions
from rlfleet.protocol.identity import PolicyIdentity
from rlfleet.worker.admission import Admission
from rlfleet.worker.engine import EngineControl, WeightLoadError
from rlfleet.worker.lora_admin import LoraAdmin, adapter_policies
from rlfleet.worker.system_server import FleetFence, Route
from rlfleet.worker.weight_transfer import WeightTransfer

if TYPE_CHECKING:
    from rlfleet.weights.staging import StagingArea

log = logging.getLogger("rlfleet.admin")

GROUP_TIMEOUT = float(os.environ.get("RLFLEET_GROUP_TIMEOUT", 60))
SELF_CHECK_TIMEOUT = float(os.environ.get("RLFLEET_SELF_CHECK_TIMEOUT", 60))
NOT_PAUSED = "generation is not paused: call pause_generation first"
#: what a reload refused because generation runs answers (vLLM's native route: HTTP 409)
RELOAD_NOT_PAUSED = f"reload_weights: {NOT_PAUSED}"
PENDING = "new weights installed: their self-check runs when generation resumes"


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
        self.staging = staging  # versions pulled while serving (stage_weights, ...)
        self.admission = Admission(identity=self._policy)
        self.check_pending = False  # weights installed since the last self-check
        self.lora = LoraAdmin(engine, self.roots, lambda: engine.info.served_model_name,
                              staging=staging)
        # vLLM's weight-transfer steps (its native routes and Dynamo 1.7's update/* alike)
        self.transfer = WeightTransfer(self)

    def routes(self) -> list[Route]:
        staged = [] if self.staging is None else [
            Route(admin.STAGE_WEIGHTS, self.stage_weights),
            Route(admin.GET_STAGED_WEIGHTS, self.get_staged_weights),
            Route(admin.APPLY_STAGED_WEIGHTS, self.apply_staged_weights),
            Route(admin.RELEASE_STAGED_WEIGHTS, self.release_staged_weights),
        ]
        return staged + [
            Route(admin.LIVENESS_PROBE, self.liveness_probe),
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
            Route(admin.CONTROL_GET_WEIGHT_VERSION, self.weight_version),
            Route(admin.UPDATE_UPDATE_WEIGHT_VERSION, self.update_weight_version),
            Route(admin.COLLECTIVE_RPC, self.collective_rpc),
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
        await self.engine.pause(req.mode, clear_cache=req.clear_cache)
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

    async def is_paused(self, req: NoFields) -> IsPausedReply:
        return IsPausedReply(is_paused=await self.engine.is_paused())

    # ---------------------------------------------------------------- self-check

    async def self_check(self) -> str | None:
        """The worker's own check of the weights it serves, run after every install: the
        model can run on them, and a one-token greedy generation gives a token of the
        vocabulary with finite logprobs that are not all equal (NaN logits can come out as
        a flat distribution). Why not, or None. Needs generation running."""
        problem = await self.engine.weights_problem()
        if problem:
            return problem
        vocab = self.engine.info.vocab_size
        prompt = [t % vocab for t in (1, 2, 3)] if vocab else [1, 2, 3]
        req = GenerateRequest(request_id=f"self-check-{uuid.uuid4().hex[:12]}",
                              prompt_token_ids=prompt, stream=False,
                              sampling=SamplingOptions(max_tokens=1, temperature=0.0, logprobs=5,
                                                       ignore_eos=True))

        async def run() -> list[dict]:
            return [lp for ev in [e async for e in self.engine.generate(req, prompt)]
                    for c in ev.get("choices", []) for lp in c.get("logprobs") or []]
        try:
            lps = await asyncio.wait_for(run(), SELF_CHECK_TIMEOUT)
        except TimeoutError:
            return f"a one-token greedy generation did not finish within {SELF_CHECK_TIMEOUT:.0f}s"
        except Exception as e:
            return f"a one-token greedy generation failed: {e!r}"
        if len(lps) != 1:
            return f"a one-token greedy generation gave {len(lps)} tokens"
        tid, lp = lps[0].get("token_id"), lps[0].get("logprob")
        if not isinstance(lp, float) or not math.isfinite(lp):
            return (f"a one-token greedy generation gave logprob {lp} (token {tid}): the "
                    "weights produce non-finite values")
        if not isinstance(tid, int) or (vocab and not 0 <= tid < vocab):
            return f"a one-token greedy generation gave token {tid}, outside the vocabulary"
        top = [t[1] for t in lps[0].get("top") or []]
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
        h = await self.staging.stage(req.version, req.source, digest=req.digest,
                                     applied=(policy.version, policy.digest))
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
        path = admin.weights_path(raw, self.roots)
        try:
            why = self.engine.checkpoint_mismatch(path)
        except ValueError as e:
            raise admin.AdminRequestError(str(e)) from e
        if why:
            raise admin.AdminRequestError(
                f"checkpoint {raw} does not fit the served model's architecture: {why}")
        return path

    async def update_weights_from_disk(self, req: DiskUpdateRequest) -> InstallReply:
        if not await self.engine.is_paused():
            return InstallReply.failed(NOT_PAUSED)
        path = self.checkpoint_path(req.model_path)
        return await self._install(lambda: self.engine.load_path(path), req.weight_version,
                                   what=f"loading {path}", step=req.step)

    async def reload_weights(self, model_path: str) -> InstallReply:
        """vLLM's `collective_rpc("reload_weights")` (its native RL route): a load from disk
        through update_weights_from_disk's checks (paused, the path allowed and a fit, the
        digest recorded, the self-check, the hold). As in vLLM, the label stays."""
        applied = self.engine.applied()
        policy = applied.policy
        return await self.update_weights_from_disk(DiskUpdateRequest(
            model_path=model_path, weight_version=policy.version if applied.declared else None,
            step=policy.step))

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
        g = req.resolved(self.engine.group_backend, GROUP_TIMEOUT)
        try:
            await self.engine.join_group(g)
        except Exception as e:
            return MessageReply.failed(f"weight update group initialisation failed (within "
                                       f"{g.timeout}s): {e!r}")
        self.group = g
        return MessageReply(message="Weight update group initialized")

    async def update_weights_from_distributed(self, d: DistributedRequest) -> InstallReply:
        why = self.engine.announced_mismatch(d)
        if why:
            return InstallReply.failed(why)
        if self.group is None:
            return InstallReply.failed("no weight update group: call init_weights_update_group "
                                       "first")
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
                                   reset_cache=d.reset_prefix_cache)

    async def destroy_weights_update_group(self, req: NoFields) -> MessageReply:
        try:
            await self.engine.leave_group()
        finally:
            self.group = None
        return MessageReply(message="Weight update group destroyed")
