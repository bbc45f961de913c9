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

from rlfleet.rl.control import (
    _LIFECYCLE,
    Channel,
    FleetWorker,
    RefreshHeld,
    VllmControl,
    _message,
    gather_all,
    held,
)

if TYPE_CHECKING:
    from rlfleet.rl.policy import Policy

STAGED_ROUTES = frozenset({"stage_weights", "get_staged_weights", "apply_staged_weights",
                           "release_staged_weights"})


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
                 stage_timeout: float = 600.0, poll: float = 0.1) -> None:
        super().__init__(rl_url, model)
        self.path = "vllm-staged"
        self.required_routes = _LIFECYCLE | STAGED_ROUTES
        self.stage_timeout = stage_timeout
        self.poll = poll
        self.staged: dict[int, dict[str, Any]] = {}  # worker -> its last staging summary
        self.holders: dict[str, list[str]] = {}  # version -> system URLs that applied it

    def _sources(self, target: Policy, w: FleetWorker) -> list[dict[str, Any]]:
        peers = [{"kind": "peer", "url": u, "timeout": self.stage_timeout}
                 for u in self.holders.get(target.version, []) if u != w.system_url]
        own = [dict(target.source, timeout=self.stage_timeout)] if target.source else []
        return peers + own

    async def _stage(self, ch: Channel, w: FleetWorker, target: Policy) -> dict[str, Any]:
        """Stage `target` on `w` (each source in turn until one is READY); the summary."""
        summary: dict[str, Any] = {"state": "FAILED", "error": "no source for this version"}
        for source in self._sources(target, w):
            ok, data = await ch.call(w, "stage", "stage_weights", {
                "version": target.version, "source": source, "digest": target.digest})
            if not ok:
                summary = {"state": "FAILED", "source": source, "error": _message(data),
                           "unreachable": bool(data.get("unreachable"))}
                if data.get("unreachable"):
                    break
                continue
            summary = await self._wait(ch, w, data["handle"])
            if summary.get("state") == "READY":
                break
        self.staged[w.instance_id] = summary
        return summary

    async def _wait(self, ch: Channel, w: FleetWorker, handle: str) -> dict[str, Any]:
        deadline = time.monotonic() + self.stage_timeout + 30
        while True:
            ok, data = await ch.call(w, "stage", "get_staged_weights", {"handle": handle})
            w.calls.pop()  # polls are not journaled; the final summary is
            if ok and data.get("staged"):
                summary = data["staged"][0]
                if summary.get("state") != "STAGING":
                    return summary
            elif data.get("unreachable"):
                return {"handle": handle, "state": "FAILED", "unreachable": True,
                        "error": f"worker unreachable while staging: {data.get('message')}"}
            if time.monotonic() > deadline:
                await ch.call(w, "stage", "release_staged_weights", {"handle": handle})
                return {"handle": handle, "state": "FAILED",
                        "error": f"not READY within {self.stage_timeout:.0f}s"}
            await asyncio.sleep(self.poll)

    async def prepare(self, ch: Channel, target: Policy, skip: set[int]) -> None:
        """Stage `target` on every worker in discovery (but `skip`) while the gate is open
        and wait until each is READY or FAILED; failures are handled at transfer."""
        self.staged = {}
        found = await self.discover(ch)
        ws = [w for i, w in found.items() if w.active and i not in skip]
        results = await gather_all(self._stage(ch, w, target) for w in ws)
        if ws and not any(r.get("state") == "READY" for r in results):
            raise RefreshHeld(
                f"staging {target.version} failed on every worker, nothing was gated and the "
                "fleet keeps serving its policy: " + "; ".join(
                    f"{w.instance_id}: {r.get('error')}" for w, r in zip(ws, results, strict=True)))

    async def transfer(self, ch: Channel, ws: list[FleetWorker], target: Policy
                       ) -> list[FleetWorker]:
        """Apply each worker's READY handle; a worker without one (it joined, or its staging
        failed) stages now, inside the window."""
        failed: list[FleetWorker] = []

        async def one(w: FleetWorker) -> None:
            summary = self.staged.pop(w.instance_id, None)
            if summary is None or summary.get("state") != "READY" \
                    or summary.get("version") != target.version:
                summary = await self._stage(ch, w, target)
                self.staged.pop(w.instance_id, None)
            w.record("stage", "staged", 200, summary)
            if summary.get("state") != "READY":
                if summary.get("unreachable"):
                    w.exclude(f"unreachable while staging: {summary.get('error')}", "missing")
                else:
                    w.reason = f"staging failed: {summary.get('error')}"
                    failed.append(w)
                return
            ok, data = await ch.call(w, "apply", "apply_staged_weights", {
                "handle": summary["handle"], "weight_version": target.version,
                "step": target.step})
            if ok:
                w.holds = held(data)
                urls = self.holders.setdefault(target.version, [])
                if w.system_url not in urls:
                    urls.append(w.system_url)
            elif data.get("unreachable"):
                w.exclude(f"unreachable at transfer: {data.get('message')}", "missing")
            else:
                w.reason = f"transfer failed: {_message(data)}"
                failed.append(w)
        await gather_all(one(w) for w in ws)
        return failed

    async def reset_cache(self, ch: Channel, w: FleetWorker) -> None:
        """apply_staged_weights already reset the prefix cache (its reply says so)."""
