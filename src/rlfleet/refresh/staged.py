"""The staged refresh path: every selected vLLM worker pulls the target version (from S3, a
directory, the trainer or a peer) while the fleet keeps serving; only once it is READY
everywhere does the lifecycle gate, pause, apply the staged buffers, verify, probe and
reopen, so the gated window holds the install and not the transfer.

A worker admitted later (`PolicyRefresh.admit_new_workers`) takes the version from a worker
that applied it (a peer), falling back to the version's own source."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import msgspec

from rlfleet.protocol import admin
from rlfleet.protocol.admin_vllm import (
    ApplyStagedRequest,
    FanoutOrigin,
    HandleRequest,
    StagedListReply,
    StagedQuery,
    StagedSummary,
    StageRequest,
)
from rlfleet.refresh.control import (
    LIFECYCLE_ROUTES,
    Channel,
    FleetWorker,
    RefreshHeld,
    VllmControl,
    applied,
    gather_all,
)
from rlfleet.weights.fanout import fanout_sources

if TYPE_CHECKING:
    from rlfleet.refresh.policy import Policy

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
    from rlfleet.weights.staging import open_source_storage, parse_source

    src = parse_source(source, version)
    storage = open_source_storage(src, 60.0)
    try:
        specs, data = art.read_version(storage, src.key)
    finally:
        storage.close()
    return digest_tensors(art.as_tensors(specs, data).items())


class VllmStagedControl(VllmControl):
    """vLLM-flavoured workers that stage the target while they serve (stage_weights), then
    install it in the gated window (apply_staged_weights)."""

    stages = True

    def __init__(self, rl_url: str, model: str | None = None, *,
                 stage_timeout: float = 600.0, poll: float = 0.1, fanout: int = 0) -> None:
        """`fanout`: 0, every worker pulls from the version's source; k >= 1, a pipelined
        chain (1) or k-ary tree over the workers in discovery (rlfleet.weights.fanout)."""
        super().__init__(rl_url, model)
        self.fanout = fanout
        self.planned: dict[int, dict[str, Any]] = {}  # worker -> its fan-out source
        self.path = "vllm-staged"
        self.required_routes = LIFECYCLE_ROUTES | STAGED_ROUTES
        self.stage_timeout = stage_timeout
        self.poll = poll
        self.staged: dict[int, StagedSummary] = {}  # worker -> its last staging summary
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

    async def _stage(self, ch: Channel, w: FleetWorker, target: Policy) -> StagedSummary:
        """Stage `target` on `w` (each source in turn until one is READY); the summary."""
        summary = StagedSummary(state="FAILED", error="no source for this version")
        for source in self._sources(target, w):
            res = await ch.on(w, "stage", *self._stage_call(ch, target, source))
            if not res.ok:
                summary = StagedSummary(state="FAILED", source=source, error=str(res.message),
                                        unreachable=res.unreachable)
                if res.unreachable:
                    break
                continue
            summary = await self._wait(ch, w, res.reply.handle)
            if summary.state == "READY":
                break
        self.staged[w.instance_id] = summary
        return summary

    #: what a handle that is never READY is released with (None: its own deadline ends it)
    release_route: admin.AdminRoute | None = admin.RELEASE_STAGED_WEIGHTS

    def _stage_call(self, ch: Channel, target: Policy, source: dict[str, Any]
                    ) -> tuple[admin.AdminRoute, Any]:
        """The call that starts staging `target` from `source` on a worker."""
        return admin.STAGE_WEIGHTS, StageRequest(version=target.version, source=source,
                                                 digest=target.digest)

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
        and wait until each is READY or FAILED; failures are handled at transfer."""
        self.staged = {}
        found = await self.discover(ch)
        ws = [w for i, w in found.items() if w.active and i not in skip]
        self._plan_fanout(ws, target)
        try:
            results = await gather_all(self._stage(ch, w, target) for w in ws)
        finally:
            self.planned = {}  # a worker staged later pulls from a holder or the source
        if ws and not any(r.state == "READY" for r in results):
            raise RefreshHeld(
                f"staging {target.version} failed on every worker, nothing was gated and the "
                "fleet keeps serving its policy: " + "; ".join(
                    f"{w.instance_id}: {r.error}" for w, r in zip(ws, results, strict=True)))

    async def transfer(self, ch: Channel, ws: list[FleetWorker], target: Policy
                       ) -> list[FleetWorker]:
        """Apply each worker's READY handle; a worker without one (it joined, or its staging
        failed) stages now, inside the window."""
        failed: list[FleetWorker] = []

        async def one(w: FleetWorker) -> None:
            summary = self.staged.pop(w.instance_id, None)
            if summary is None or summary.state != "READY" or summary.version != target.version:
                summary = await self._stage(ch, w, target)
                self.staged.pop(w.instance_id, None)
            w.record("stage", "staged", 200, msgspec.to_builtins(summary))
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
                urls = self.holders.setdefault(target.version, [])
                if w.system_url not in urls:
                    urls.append(w.system_url)
        await gather_all(one(w) for w in ws)  # staging has its own deadline (stage_timeout)
        return failed

    def commit_install(self, w: FleetWorker, target: Policy
                       ) -> tuple[admin.AdminRoute, Any, bool] | None:
        """The READY handle staged for `target` (apply_staged_weights resets the cache
        itself); None for a worker without one: it stages inside the window, step by step."""
        summary = self.staged.get(w.instance_id)
        if summary is None or summary.state != "READY" or summary.version != target.version:
            return None
        return (admin.APPLY_STAGED_WEIGHTS, ApplyStagedRequest(
            handle=summary.handle, weight_version=target.version, step=target.step), False)

    async def commit(self, ch: Channel, w: FleetWorker, target: Policy, close_reason: str,
                     pause_mode: str, probe: Any = None) -> tuple[bool, str | None]:
        summary = self.staged[w.instance_id]
        w.record("stage", "staged", 200, msgspec.to_builtins(summary))  # as `transfer` does
        out = await super().commit(ch, w, target, close_reason, pause_mode, probe)
        self.staged.pop(w.instance_id, None)
        if not out[0] and w.holds is not None and w.holds.digest == target.digest:
            urls = self.holders.setdefault(target.version, [])
            if w.system_url not in urls:
                urls.append(w.system_url)
        return out

    async def reset_cache(self, ch: Channel, w: FleetWorker) -> None:
        """apply_staged_weights already reset the prefix cache (its reply says so)."""
