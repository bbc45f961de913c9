"""The staged refresh path: every selected vLLM worker pulls the target version (from S3, a
directory, the trainer or a peer) while the fleet keeps serving; only once it is READY
everywhere does the lifecycle gate, pause, apply the staged buffers, verify, probe and
reopen, so the gated window holds the install and not the transfer.

A worker admitted later (`PolicyRefresh.admit_new_workers`) takes the version from a worker
that applied it (a peer), falling back to the version's own source."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import msgspec

from rlfleet.protocol import admin
from rlfleet.protocol.admin_vllm import (
    ApplyStagedRequest,
    DiskUpdateRequest,
    FanoutOrigin,
    HandleRequest,
    StagedListReply,
    StagedQuery,
    StagedSummary,
    StageRequest,
)
from rlfleet.protocol.identity import PolicyIdentity
from rlfleet.refresh.control import (
    LIFECYCLE_ROUTES,
    Channel,
    FleetWorker,
    RefreshHeld,
    VllmControl,
    applied,
    gather_all,
)
from rlfleet.refresh.policy import Policy
from rlfleet.weights.fanout import fanout_sources

STAGED_ROUTES = admin.route_names(admin.STAGED)


def source_from_uri(uri: str, endpoint_url: str | None = None) -> dict[str, Any]:
    """A stage source from what a user types: ``s3://bucket/prefix/VERSION``,
    ``file:///dir/VERSION`` or a directory path, ``http(s)://trainer:port`` (a trainer's
    publisher), ``peer:http://worker:port``."""
    if uri.startswith("s3://"):
        src: dict[str, Any] = {"kind": "s3", "uri": uri.rstrip("/")}
        if endpoint_url:
            src["endpoint_url"] = endpoint_url
        return src
    if uri.startswith("peer:"):
        return {"kind": "peer", "url": uri.removeprefix("peer:")}
    if uri.startswith(("http://", "https://")):
        return {"kind": "trainer", "url": uri}
    return {"kind": "disk", "path": uri.removeprefix("file://")}


def source_digest(source: dict[str, Any], version: str) -> str:
    """The content digest of the version a source holds (read and replayed here): for a
    caller that does not know it and has no catalog to ask."""
    from rlfleet.weights import artifacts as art
    from rlfleet.weights.digest import digest_tensors
    from rlfleet.weights.stage_transfer import open_source_storage, parse_source

    src = parse_source(source, version)
    storage = open_source_storage(src, 60.0)
    try:
        specs, data = art.read_version(storage, src.key)
    finally:
        storage.close()
    return digest_tensors(art.as_tensors(specs, data).items())


class VllmStagedControl(VllmControl):
    """vLLM-flavoured workers that stage the target while they serve (stage_weights), then
    install it in the gated window (apply_staged_weights): stage first, pause only for the
    swap.

    A target with a checkpoint directory (`Policy.path`) is staged only where the engine
    prepares it while serving (`require_swap`): a worker that cannot (no room for a shadow of
    the model, an engine that does not prepare versions, no staging routes) installs it from
    disk in its commit instead, and its calls in the journal say so (a `fallback` record on
    the `stage` step, with why). Any other staging failure (a wrong digest or base, a source
    that cannot be read, bad tensors) refuses the refresh before the gate: the handles
    staged elsewhere are released and the fleet keeps serving its policy, open, nothing
    paused."""

    stages = True
    #: the routes a worker must serve to stage (a LoRA adapter's control checks its own)
    stage_routes: frozenset[str] = STAGED_ROUTES

    def __init__(self, rl_url: str, model: str | None = None, *,
                 stage_timeout: float = 600.0, poll: float = 0.1, fanout: int = 0) -> None:
        """`fanout`: 0, every worker pulls from the version's source; k >= 1, a pipelined
        chain (1) or k-ary tree over the workers in discovery (rlfleet.weights.fanout)."""
        super().__init__(rl_url, model)
        self.fanout = fanout
        self.planned: dict[int, dict[str, Any]] = {}  # worker -> its fan-out source
        self.path = "vllm-staged"
        # a worker without the staging routes installs a checkpoint from disk (`fallback`)
        self.required_routes = LIFECYCLE_ROUTES
        self.stage_timeout = stage_timeout
        self.poll = poll
        self.staged: dict[int, StagedSummary] = {}  # worker -> its last staging summary
        self.fallback: dict[int, str] = {}  # worker -> why it installs from disk
        self.staging: list[FleetWorker] = []  # the workers the last `prepare` staged on
        self.staging_path: str | None = None  # ... and the checkpoint it staged
        self.holders: dict[str, list[str]] = {}  # version -> system URLs that applied it

    #: versions whose holders a coordinator remembers (the newest ones)
    HELD_VERSIONS = 8

    async def discover(self, ch: Channel) -> dict[int, FleetWorker]:
        """The fleet's workers now; the holders remembered are pruned to them (a replaced
        worker's URL is not offered as a peer: it would be tried until the stage deadline)
        and to the newest HELD_VERSIONS versions (issue 43: a long run's memory)."""
        found = await super().discover(ch)
        live = {w.system_url for w in found.values()}
        kept = list(self.holders.items())[-self.HELD_VERSIONS:]
        self.holders = {v: [u for u in urls if u in live] for v, urls in kept}
        return found

    def _sources(self, target: Policy, w: FleetWorker) -> list[dict[str, Any]]:
        peers = [{"kind": "peer", "url": u, "timeout": self.stage_timeout}
                 for u in self.holders.get(target.version, []) if u != w.system_url]
        own = [dict(target.source, timeout=self.stage_timeout)] if target.source else []
        planned = [self.planned[w.instance_id]] if w.instance_id in self.planned else []
        return planned + peers + own

    def _plan_fanout(self, ws: list[FleetWorker], target: Policy) -> None:
        """Each worker's fan-out source, over the workers in discovery order (by instance):
        the first from the version's source, the others from those before them."""
        self.planned = {}
        src = target.source or {}
        if not self.fanout or len(ws) < 2 or src.get("kind") not in ("s3", "disk", "trainer"):
            return
        uri = {"s3": lambda: src["uri"], "disk": lambda: f"file://{src['path']}",
               "trainer": lambda: f"{src['url'].rstrip('/')}/{target.version}"}[src["kind"]]()
        origin = FanoutOrigin(uri=uri, endpoint_url=src.get("endpoint_url"))
        ordered = sorted(ws, key=lambda w: w.instance_id)
        sources = fanout_sources([w.system_url for w in ordered], target.version, origin,
                                 degree=self.fanout, timeout=self.stage_timeout)
        self.planned = {w.instance_id: s for w, s in zip(ordered, sources, strict=True)}

    def _why_not_staged(self, w: FleetWorker, target: Policy) -> str | None:
        """Why `w` installs `target` from disk without staging it (None: it stages it)."""
        if STAGED_ROUTES <= w.routes:
            return None
        if target.path is None or admin.UPDATE_WEIGHTS_FROM_DISK.name not in w.routes:
            return None  # no way around staging: it fails there, saying what is missing
        return f"it serves no staging routes ({', '.join(sorted(STAGED_ROUTES - w.routes))})"

    async def _stage(self, ch: Channel, w: FleetWorker, target: Policy) -> StagedSummary:
        """Stage `target` on `w` (each source in turn until one is READY); the summary. One
        that cannot stage it as asked (`cannot_stage`) stops there: it installs from disk."""
        summary = StagedSummary(state="FAILED", error="no source for this version")
        if not self.stage_routes <= w.routes:
            summary.error = (f"worker {w.instance_id} serves no staging routes and "
                             f"{target.version} has no checkpoint directory to install instead")
        else:
            for source in self._sources(target, w):
                summary = await self._stage_from(ch, w, target, source)
                if summary.state == "READY" or summary.unreachable or summary.cannot_stage:
                    break
        self.staged[w.instance_id] = summary
        return summary

    async def _stage_from(self, ch: Channel, w: FleetWorker, target: Policy,
                          source: dict[str, Any]) -> StagedSummary:
        res = await ch.on(w, "stage", *self._stage_call(ch, target, source))
        if res.ok:
            return await self._wait(ch, w, res.reply.handle)
        cannot = getattr(res.reply, "cannot_stage", None)
        return StagedSummary(state="FAILED", source=source, error=str(res.message),
                             unreachable=res.unreachable,
                             cannot_stage=cannot if isinstance(cannot, str) else None)

    #: what a handle that is never READY is released with (None: its own deadline ends it)
    release_route: admin.AdminRoute | None = admin.RELEASE_STAGED_WEIGHTS

    def _stage_call(self, ch: Channel, target: Policy, source: dict[str, Any]
                    ) -> tuple[admin.AdminRoute, Any]:
        """The call that starts staging `target` from `source` on a worker: where the
        target has a checkpoint directory, staged only to be swapped in (else from disk)."""
        return admin.STAGE_WEIGHTS, StageRequest(version=target.version, source=source,
                                                 digest=target.digest,
                                                 require_swap=target.path is not None)

    def _query_call(self, ch: Channel, handle: str) -> tuple[admin.AdminRoute, Any]:
        """The call that reads a staging handle's summary."""
        return admin.GET_STAGED_WEIGHTS, StagedQuery(handle=handle)

    async def _wait(self, ch: Channel, w: FleetWorker, handle: str) -> StagedSummary:
        deadline = time.monotonic() + self.stage_timeout + 30
        while True:
            res = await ch.on(w, "stage", *self._query_call(ch, handle))
            w.calls.pop()  # polls are not journaled; the final summary is
            listed: StagedListReply | None = res.reply
            if res.ok and listed.staged:
                summary = listed.staged[0]
                if summary.state != "STAGING":
                    return summary
            elif res.unreachable:
                return StagedSummary(handle=handle, state="FAILED", unreachable=True,
                                     error=f"worker unreachable while staging: {res.message}")
            if time.monotonic() > deadline:
                if self.release_route is not None:
                    await ch.on(w, "stage", self.release_route, HandleRequest(handle=handle))
                return StagedSummary(handle=handle, state="FAILED",
                                     error=f"not READY within {self.stage_timeout:.0f}s")
            await asyncio.sleep(self.poll)

    async def prepare(self, ch: Channel, target: Policy, skip: set[int]) -> None:
        """Stage `target` on every worker in discovery (but `skip`) while the gate is open
        and wait until each is READY, FAILED, or installs from disk (`fallback`). A staging
        failure refuses the refresh (RefreshHeld) with nothing gated: the handles that were
        READY are released."""
        self.staged, self.fallback = {}, {}
        self.staging_path = target.path
        found = await self.discover(ch)
        ws = [w for i, w in found.items() if w.active and i not in skip]
        for w in ws:
            why = self._why_not_staged(w, target)
            if why is not None:
                self.fallback[w.instance_id] = why
        self.staging = staging = [w for w in ws if w.instance_id not in self.fallback]
        self._plan_fanout(staging, target)
        try:
            results = await gather_all(self._stage(ch, w, target) for w in staging)
        finally:
            self.planned = {}  # a worker staged later pulls from a holder or the source
        failed = []
        for w, r in zip(staging, results, strict=True):
            if r.state == "READY":
                continue
            if r.cannot_stage and target.path is not None:
                self.fallback[w.instance_id] = r.cannot_stage
            elif not r.unreachable:
                failed.append(f"{w.instance_id}: {r.error}")
        if failed:
            await self.release(ch)
            raise RefreshHeld(
                f"staging {target.version} failed on {len(failed)} of {len(staging)} "
                "worker(s), nothing was gated and the fleet keeps serving its policy: "
                + "; ".join(failed))

    async def release(self, ch: Channel) -> None:
        """Release every READY handle `prepare` staged (a refresh that does not go on)."""
        async def one(w: FleetWorker) -> None:
            summary = self.staged.pop(w.instance_id, None)
            if summary is not None and summary.state == "READY" and summary.handle:
                await ch.on(w, "stage", admin.RELEASE_STAGED_WEIGHTS,
                            HandleRequest(handle=summary.handle))
        await gather_all(one(w) for w in self.staging)

    def staged_digest(self) -> str | None:
        """The content digest every worker staged (RefreshHeld when they differ; None when
        none staged): a target whose digest the caller did not give takes it."""
        digests = {s.digest for s in self.staged.values() if s.state == "READY"}
        if len(digests) > 1:
            raise RefreshHeld(f"the workers staged different bytes (digests {sorted(digests)}): "
                              "nothing was gated; is the checkpoint being written?")
        return digests.pop() if digests else None

    def _record(self, w: FleetWorker, target: Policy) -> StagedSummary | None:
        """Journal how `w` takes `target`: its staging summary, or its fallback to disk;
        the READY summary (None: it installs from disk, or stages now)."""
        why = self.fallback.get(w.instance_id)
        if why is not None:
            w.record("stage", "fallback", None, {"install": admin.UPDATE_WEIGHTS_FROM_DISK.name,
                                                 "why": why})
            return None
        summary = self.staged.get(w.instance_id)
        if summary is not None:
            w.record("stage", "staged", 200, msgspec.to_builtins(summary))
        if summary is None or summary.state != "READY" or summary.version != target.version:
            return None
        return summary

    async def transfer(self, ch: Channel, ws: list[FleetWorker], target: Policy
                       ) -> list[FleetWorker]:
        """Apply each worker's READY handle; a worker that falls back installs from disk; one
        without a handle (it joined, or a retry, or its staging was not heard) stages now,
        inside the window, and installs from disk where it cannot stage to swap."""
        failed: list[FleetWorker] = []

        async def one(w: FleetWorker) -> None:
            summary = self._record(w, target)
            self.staged.pop(w.instance_id, None)
            if summary is None and w.instance_id not in self.fallback:
                summary = await self._stage(ch, w, target)
                self.staged.pop(w.instance_id, None)
                if summary.cannot_stage and target.path is not None:
                    self.fallback[w.instance_id] = summary.cannot_stage
                    self._record(w, target)
                else:
                    w.record("stage", "staged", 200, msgspec.to_builtins(summary))
            if w.instance_id in self.fallback:
                applied(w, await ch.on(w, "apply", *self._from_disk(target)), failed)
                return
            if summary.state != "READY":
                if summary.unreachable:
                    w.exclude(f"unreachable while staging: {summary.error}", "missing")
                else:
                    w.reason = f"staging failed: {summary.error}"
                    failed.append(w)
                return
            res = await ch.on(w, "apply", admin.APPLY_STAGED_WEIGHTS, ApplyStagedRequest(
                handle=summary.handle, weight_version=target.version, step=target.step))
            applied(w, res, failed)
            if res.ok:
                self._holds(w, target)
        await gather_all(one(w) for w in ws)  # staging has its own deadline (stage_timeout)
        return failed

    @staticmethod
    def _from_disk(target: Policy) -> tuple[admin.AdminRoute, DiskUpdateRequest]:
        return admin.UPDATE_WEIGHTS_FROM_DISK, DiskUpdateRequest(
            model_path=target.path, weight_version=target.version, step=target.step)

    def _holds(self, w: FleetWorker, target: Policy) -> None:
        """`w` applied `target` from its staged copy: a peer for workers admitted later."""
        urls = self.holders.setdefault(target.version, [])
        if w.system_url not in urls:
            urls.append(w.system_url)

    def commit_install(self, w: FleetWorker, target: Policy
                       ) -> tuple[admin.AdminRoute, Any, bool] | None:
        """The READY handle staged for `target` (apply_staged_weights resets the cache
        itself), or the checkpoint from disk for a worker that falls back; None for a worker
        without either: it stages inside the window, step by step."""
        if w.instance_id in self.fallback and target.path is not None:
            return (*self._from_disk(target), True)
        summary = self.staged.get(w.instance_id)
        if summary is None or summary.state != "READY" or summary.version != target.version:
            return None
        return (admin.APPLY_STAGED_WEIGHTS, ApplyStagedRequest(
            handle=summary.handle, weight_version=target.version, step=target.step), False)

    async def commit(self, ch: Channel, w: FleetWorker, target: Policy, close_reason: str,
                     pause_mode: str, probe: Any = None) -> tuple[bool, str | None]:
        staged = self._record(w, target) is not None  # as `transfer` journals it
        out = await super().commit(ch, w, target, close_reason, pause_mode, probe)
        self.staged.pop(w.instance_id, None)
        if staged and not out[0] and w.holds is not None and w.holds.digest == target.digest:
            self._holds(w, target)
        return out

    def install(self, w: FleetWorker, step: int | None, version: str | None
                ) -> tuple[admin.AdminRoute, Any]:
        """How `w` installs the checkpoint `stage_checkpoint` staged, journaled on it: its
        READY handle (labelled `version`, or keeping its label when None), else from disk."""
        summary = self.staged.pop(w.instance_id, None)
        why = self.fallback.get(w.instance_id)
        path = self.staging_path
        if summary is not None and summary.state == "READY":
            w.record("stage", "staged", 200, msgspec.to_builtins(summary))
            return admin.APPLY_STAGED_WEIGHTS, ApplyStagedRequest(
                handle=summary.handle, weight_version=version, step=step,
                keep_label=version is None)
        w.record("stage", "fallback", None, {"install": admin.UPDATE_WEIGHTS_FROM_DISK.name,
                                             "why": why or "it was not staged"})
        return admin.UPDATE_WEIGHTS_FROM_DISK, DiskUpdateRequest(
            model_path=path, weight_version=version, step=step)

    async def reset_cache(self, ch: Channel, w: FleetWorker) -> None:
        """apply_staged_weights already reset the prefix cache (its reply says so); a worker
        that installed from disk resets it."""
        if w.instance_id in self.fallback:
            await super().reset_cache(ch, w)


async def stage_checkpoint(rl_url: str, model: str | None, ch: Channel, path: str,
                           version: str | None) -> VllmStagedControl:
    """Stage the checkpoint at `path` on every worker the RL listener lists (of `model`)
    while the fleet serves, each read once into its engine's shadow: for an update that
    installs it next (rlfleet.refresh.fleet_control). A worker that cannot stage it falls
    back to disk (`fallback`); a staging failure raises RefreshHeld with nothing gated and
    the staged handles released. `install(w)` then says how each worker takes it."""
    control = VllmStagedControl(rl_url, model)
    name = version or f"update-{uuid.uuid4().hex[:12]}"
    await control.prepare(ch, Policy(PolicyIdentity(version=name), path=path,
                                     source={"kind": "disk", "path": path}), set())
    return control
