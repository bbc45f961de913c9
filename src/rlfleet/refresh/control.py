"""How the policy-refresh coordinator drives each flavour of worker: one `WorkerControl` per
flavour (vLLM from disk, vLLM from the trainer's process group, SGLang from disk). The
lifecycle in `rlfleet.refresh.coordinator` calls these steps and never asks which flavour it has.

Every call goes to the worker's system server through the typed admin client
(`rlfleet.runtime.admin_client`: a route of `rlfleet.protocol.admin`'s table and its request
Struct) with a deadline and the transaction's fleet epoch, and is recorded on the worker for
the journal. A worker that has seen a newer epoch refuses the call (409): the
coordinator has been taken over and stops (`FleetFenced`)."""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import msgspec
import pydantic

from rlfleet.protocol import admin
from rlfleet.protocol.admin import AdminRoute, CommitRequest
from rlfleet.protocol.admin_vllm import (
    AdmissionRequest,
    CommitReply,
    DiskUpdateRequest,
    InstallReply,
    PauseRequest,
)
from rlfleet.protocol.identity import PolicyIdentity
from rlfleet.protocol.rl import PROTOCOL_VERSION, STRICT_MIRRORS, RlWorkers, RlWorkerStrict
from rlfleet.protocol.sglang_admin import NativeContinueRequest, NativePauseRequest, SglangDiskRequest
from rlfleet.runtime.admin_client import AdminClient, CallResult, answered

if TYPE_CHECKING:
    from rlfleet.refresh.policy import Policy
    from rlfleet.refresh.probe import Answer
    from rlfleet.refresh.relay import RelayTree

log = logging.getLogger("rlfleet.refresh")


async def gather_all(coros) -> list[Any]:
    """Run `coros` at once; the first one that raises cancels the others (a fenced
    coordinator makes no further calls) and its exception is raised as it is."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def for_each(ws: Sequence[FleetWorker], fn: Callable[[FleetWorker], Awaitable[Any]],
                   deadline: float | None) -> list[Any]:
    """`fn(w)` for every worker, all started at once (the channel bounds how many calls are
    in flight: `Channel.concurrency`); the first exception cancels the others and is raised, as
    in `gather_all`. A worker whose `fn` is not done within `deadline` seconds is excluded as
    missing (named in the result, its result None) and the others go on: a phase takes at
    most `deadline`, however many workers it moves."""
    tasks = [asyncio.ensure_future(fn(w)) for w in ws]
    if not tasks:
        return []
    try:
        done, pending = await asyncio.wait(tasks, timeout=deadline,
                                           return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:
            if t in done and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    for t, w in zip(tasks, ws, strict=True):
        if t in pending:
            t.cancel()
            w.exclude(f"no answer within the phase deadline ({deadline:g} s)", "missing")
    await asyncio.gather(*pending, return_exceptions=True)
    return [None if t in pending else t.result() for t in tasks]


class RefreshHeld(Exception):
    """The refresh stops here; the fleet stays gated."""


class FleetFenced(Exception):
    """Another coordinator has taken the fleet over (a worker refused this transaction's
    epoch, or the journal shows it recovered): stop at once, touch nothing more."""


@dataclass
class SglangWorker:
    """An SGLang worker, whose URLs come from the deployment (SGLang workers are not in
    /v1/rl/workers)."""

    system_url: str
    request_url: str
    name: str = ""


@dataclass
class FleetWorker:
    instance_id: int
    system_url: str
    request_url: str | None
    model: str | None = None
    routes: frozenset[str] = frozenset()
    status: str = "selected"  # selected | excluded | missing | verified
    reason: str | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)
    holds: PolicyIdentity | None = None  # the last identity it reported
    dtype: str | None = None  # the dtype it serves in, when it says
    #: the post-update probe its commit ran for a policy: (policy, request, CommitProbe),
    #: taken by the probe phase instead of asking the worker again (rlfleet.refresh.waves)
    committed_probe: tuple[Any, Any, Any] | None = field(default=None, repr=False,
                                                         compare=False)

    def record(self, step: str, route: str, http_status: int | None, body: Any) -> None:
        self.calls.append({"step": step, "route": route, "http_status": http_status,
                           "body": body, "at": time.time()})

    def exclude(self, why: str, status: str = "excluded") -> None:
        if self.status in ("selected", "verified"):
            self.status, self.reason = status, why
            log.warning("worker %s %s: %s", self.instance_id, status, why)

    @property
    def active(self) -> bool:
        return self.status in ("selected", "verified")

    def summary(self) -> dict[str, Any]:
        return {"instance_id": self.instance_id, "system_url": self.system_url,
                "model": self.model, "status": self.status, "reason": self.reason,
                "holds": self.holds.to_dict() if self.holds else None, "dtype": self.dtype,
                "calls": self.calls}


DEFAULT_CONCURRENCY = 64  # admin calls in flight at once: 1,024 workers take 16 rounds


PHASE_OVER_CALL = 1.25  # the default phase deadline, in calls' deadlines
#: a commit_policy call's deadline, in calls' deadlines: the worker starts no step after one
#: call's deadline, and the step under way (an install at worst) may take another
COMMIT_OVER_CALL = 2.0


@dataclass
class Channel(AdminClient):
    """The coordinator's admin client (its token, deadline and the transaction's fleet
    epoch), calling one worker at a time and recording each call on it. At most `concurrency`
    calls (and probes: `slot`) are in flight at once, whatever the fleet's size; a phase
    over many workers ends within `phase_timeout` seconds (default: a little over `timeout`,
    so that one late worker is reported by its own call's failure, unreachable or timed out,
    rather than by the phase's)."""

    concurrency: int = DEFAULT_CONCURRENCY
    phase_timeout: float | None = None
    #: a phase's calls to many workers go through a few of them (rlfleet.refresh.relay)
    relay: RelayTree | None = None
    _slots: asyncio.Semaphore = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if type(self.concurrency) is not int or self.concurrency < 1:
            raise ValueError(f"concurrency must be a positive integer, not {self.concurrency!r}")
        self._slots = asyncio.Semaphore(self.concurrency)

    @property
    def phase_deadline(self) -> float:
        return self.phase_timeout or self.timeout * PHASE_OVER_CALL

    @property
    def commit_deadline(self) -> float:
        """How long the commit phase may take over the whole fleet (`phase_timeout`, else
        a little over one commit_policy call's deadline)."""
        return self.phase_timeout or self.timeout * COMMIT_OVER_CALL * PHASE_OVER_CALL

    def slot(self) -> asyncio.Semaphore:
        """Held around one call to a worker (`async with ch.slot():`)."""
        return self._slots

    async def send(self, w: FleetWorker, route: AdminRoute, request: Any = None,
                   timeout: float | None = None) -> tuple[CallResult[Any], int | None]:
        """`route` on `w` (unrecorded): directly, or through a relay when the phase is
        relayed (`relay`); the result and the relay's instance ID (None: directly)."""
        if self.relay is not None:
            return await self.relay.call(self, w, route, request, timeout)
        async with self._slots:
            return await self.call(w.system_url, route, request, timeout), None

    async def on(self, w: FleetWorker, step: str, route: AdminRoute, request: Any = None,
                 timeout: float | None = None) -> CallResult[Any]:
        """Call `route` on `w` for lifecycle `step`; a refusal of this epoch raises
        FleetFenced."""
        res, via = await self.send(w, route, request, timeout)
        record(w, step, res)
        if via is not None:
            w.calls[-1]["relay"] = via
        if res.stale_epoch:
            raise FleetFenced(f"worker {w.instance_id} refused {route.name}: {res.message}")
        return res


def record(w: FleetWorker, step: str, res: CallResult[Any]) -> None:
    """The call in the worker's journal record, as plain JSON."""
    w.record(step, res.route.name, res.http_status, res.body)


def lost(res: CallResult[Any]) -> str:
    """The status of a worker a failed call excludes: missing when it could not be
    reached."""
    return "missing" if res.unreachable else "excluded"


def address_toward(url: str) -> str:
    """This host's address on the route to `url`'s host (what a worker there can reach us
    at). Connecting a UDP socket sends nothing."""
    host = urlsplit(url).hostname or "127.0.0.1"
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return s.getsockname()[0]
    except OSError as e:
        raise RefreshHeld(f"cannot tell this host's address toward {host}: {e}; give "
                          "master_address (rlfleet refresh --master-address)") from e


TRANSFER_BACKENDS = ("gloo", "nccl")


def _tensors_of(policy: Policy) -> list[tuple[str, Any]]:
    """The tensors to broadcast: the trainer's, else read from the checkpoint."""
    if policy.tensors is not None:
        return list(policy.tensors())
    if policy.path is None:
        raise RefreshHeld(f"policy {policy.version} has neither tensors nor a checkpoint "
                          "path to send")
    from pathlib import Path

    from rlfleet.weights.digest import iter_checkpoint_tensors

    return list(iter_checkpoint_tensors(Path(policy.path)))


@dataclass
class Beside:
    """A target version loaded beside the serving one on a worker, before the gate (an
    adapter's: rlfleet.refresh.adapter)."""

    worker: FleetWorker
    version: str
    served_name: str  # the engine's name of that version (its probe names it)
    answer: Answer | None = None  # its probe answer, once probed


class WorkerControl(abc.ABC):
    """The lifecycle steps for one flavour of worker. Per-worker steps exclude the worker
    (with the reason) when they fail; `transfer` returns the workers whose transfer failed,
    for the coordinator's failure policy."""

    #: the name recorded in the journal
    path: str
    #: which fleet this is, for the journal (a later coordinator finds its history by it)
    fleet: str
    #: whether workers can join or leave between resolve and transfer (discovery)
    dynamic_membership: bool = False
    #: how the last transfer moved the weights, when there is more to say than the path
    transfer_detail: dict[str, Any] | None = None
    #: whether the target is staged on the workers before the fleet is gated (`prepare`)
    stages: bool = False
    #: from the last `discover`: the workers' discovery namespace and store, and the models
    #: they serve (where the committed policy is published: rlfleet.refresh.committed)
    namespace: str | None = None
    discovery_url: str | None = None
    models: frozenset[str] = frozenset()
    seen_epoch: int = 0  # the newest fleet epoch a listed worker reports
    #: the LoRA adapter the post-update probe names (None: the base model)
    probe_adapter: str | None = None

    @abc.abstractmethod
    async def discover(self, ch: Channel) -> dict[int, FleetWorker]:
        """The current workers, by instance ID; unusable ones already excluded."""

    async def newest_epoch(self, ch: Channel) -> int:
        """The newest fleet epoch the workers report (0 when they do not say): a
        transaction's epoch is taken above it."""
        return 0

    async def inspect(self, ch: Channel, w: FleetWorker) -> PolicyIdentity | None:
        """What the worker holds now (also kept in `w.holds`); None when this flavour
        cannot tell."""
        return None

    async def prepare(self, ch: Channel, target: Policy, skip: set[int]) -> None:  # noqa: B027
        """Before the gate closes: move `target` onto the workers (but `skip`) while they
        serve (rlfleet.refresh.staged); `transfer` then only installs it."""

    def staged_digest(self) -> str | None:
        """The content digest the workers computed as `prepare` staged the target (None:
        none staged it)."""
        return None

    async def release(self, ch: Channel) -> None:  # noqa: B027
        """Drop what `prepare` staged (a refresh that does not go on)."""

    def loaded_beside(self) -> dict[int, Beside]:
        """What `prepare` loaded beside the serving policy, by worker: the probe reaches it
        before the gate (rlfleet.refresh.waves.Waves.probe_beside); none by default."""
        return {}

    async def discard_beside(self, ch: Channel) -> None:  # noqa: B027
        """Drop what `prepare` loaded beside the serving policy (a failure before the
        gate)."""

    def early_answer(self, w: FleetWorker, target: Policy) -> Answer | None:
        """The probe answer `w` gave for `target` before the gate, when the transfer only
        switched it to the version it probed then (rlfleet.refresh.adapter); None: probe it."""
        return None

    async def close(self, ch: Channel, w: FleetWorker, reason: str) -> None:
        """Stop routing rollouts to the worker (its own admission flag in discovery)."""
        if admin.SET_ADMISSION.name in w.routes:
            await ch.on(w, "gate", admin.SET_ADMISSION, AdmissionRequest(open=False,
                                                                         reason=reason))

    async def open(self, ch: Channel, w: FleetWorker) -> None:
        if admin.SET_ADMISSION.name in w.routes:
            res = await ch.on(w, "reopen", admin.SET_ADMISSION, AdmissionRequest(open=True))
            if not res.ok:  # one gone since its commit is first found here: missing
                w.exclude(f"reopen failed: {res.message}", lost(res))

    @abc.abstractmethod
    async def pause(self, ch: Channel, w: FleetWorker, mode: str) -> None: ...

    @abc.abstractmethod
    async def transfer(self, ch: Channel, ws: list[FleetWorker], target: Policy
                       ) -> list[FleetWorker]:
        """Move `target` onto the workers and apply it; returns those whose transfer failed
        (a worker that is gone is excluded as missing instead)."""

    async def reset_cache(self, ch: Channel, w: FleetWorker) -> None:  # noqa: B027
        """Drop KV computed under the old weights (when the transfer did not)."""

    async def verify(self, ch: Channel, w: FleetWorker, target: Policy) -> str | None:
        """Check the worker serves `target`; a mismatch is returned (it keeps a synchronous
        fleet closed), other failures exclude the worker."""
        return None

    @abc.abstractmethod
    async def resume(self, ch: Channel, w: FleetWorker) -> None: ...

    # ------------------------------------------------------------ in one call per worker

    def commit_install(self, w: FleetWorker, target: Policy
                       ) -> tuple[AdminRoute, Any, bool] | None:
        """The install a commit_policy call runs on `w` for `target`: its route, its
        request, and whether the prefix cache is reset after it; None when this path moves
        `w` step by step (the default)."""
        return None

    def commits(self, w: FleetWorker, target: Policy) -> bool:
        """Whether `w` moves to `target` in one commit_policy call: it lists the route and
        this path can say what it installs."""
        return admin.COMMIT_POLICY.name in w.routes and \
            self.commit_install(w, target) is not None

    async def commit(self, ch: Channel, w: FleetWorker, target: Policy, close_reason: str,
                     pause_mode: str, probe: Any = None) -> tuple[bool, str | None]:
        """Close, pause, install, reset, verify and resume `w` in one commit_policy call
        under the worker's own deadline (one call's), then judge each step it ran exactly as
        the step's own call is judged, recorded on the worker under the step's name. Returns
        (whether the transfer failed, for the failure policy; a version mismatch, as
        `verify` returns it); a worker that fails another step is excluded. `probe`: the
        post-update probe's request (a GenerateRequest) for the worker to run after the
        resume; what it answered is kept on `w.committed_probe` for the probe phase."""
        install = self.commit_install(w, target)
        assert install is not None, "commit() on a worker that does not commit"
        route, request, reset = install
        req = CommitRequest(install=route.name, body=msgspec.to_builtins(request),
                            expect_version=target.version or "", expect_digest=target.digest or "",
                            close_reason=close_reason, pause_mode=pause_mode,
                            reset_cache=reset, deadline_s=ch.timeout,
                            probe=None if probe is None else msgspec.to_builtins(probe))
        w.committed_probe = None
        res, relay = await ch.send(w, admin.COMMIT_POLICY, req, ch.timeout * COMMIT_OVER_CALL)
        reply = res.reply
        if not isinstance(reply, CommitReply) or not reply.steps:
            record(w, "commit", res)
            if relay is not None:
                w.calls[-1]["relay"] = relay
            if res.stale_epoch:
                raise FleetFenced(f"worker {w.instance_id} refused {admin.COMMIT_POLICY.name}: "
                                  f"{res.message}")
            w.exclude(("unreachable during its commit (close to resume): " if res.unreachable
                       else "commit failed: ") + str(res.message), lost(res))
            return False, None
        steps: dict[str, list[CallResult[Any]]] = {}
        for s in reply.steps:
            r = answered(admin.ROUTES[s.route], s.http_status, s.body)
            record(w, s.step, r)
            w.calls[-1] |= {"via": admin.COMMIT_POLICY.name, "seconds": round(s.seconds, 6),
                            **({"relay": relay} if relay is not None else {})}
            if r.stale_epoch:
                raise FleetFenced(f"worker {w.instance_id} refused {s.route}: {r.message}")
            steps.setdefault(s.step, []).append(r)
        if "pause" in steps:
            judge_pause(w, steps["pause"][0])
        failed: list[FleetWorker] = []
        if "apply" in steps:
            applied(w, steps["apply"][0], failed)
        if "reset_cache" in steps:
            judge_reset(w, steps["reset_cache"][0])
        mismatch = None
        if "verify" in steps and w.active:
            by = {r.route.name: r for r in steps["verify"]}
            mismatch = judge_verify(w, target, by[admin.GET_WEIGHT_VERSION.name],
                                    by[admin.LIVENESS_PROBE.name])
        if "resume" in steps:
            judge_resume(w, steps["resume"][0])
        if probe is not None and reply.probe is not msgspec.UNSET:
            w.committed_probe = (target, probe, reply.probe)
        return bool(failed), mismatch

    async def _transfer_each(self, ch: Channel, ws: list[FleetWorker], route: AdminRoute,
                             request: Any) -> list[FleetWorker]:
        """One update call per worker (`ch.concurrency` at once)."""
        failed: list[FleetWorker] = []

        async def one(w: FleetWorker) -> None:
            applied(w, await ch.on(w, "apply", route, request), failed)
        await for_each(ws, one, ch.phase_deadline)
        return failed


def applied(w: FleetWorker, res: CallResult[Any], failed: list[FleetWorker]) -> None:
    """Judge an install call: the worker holds what it reports, is missing, or failed."""
    if res.ok:
        if isinstance(res.reply, InstallReply) and res.reply.weight_digest:
            w.holds = res.reply.policy()
    elif res.unreachable:
        w.exclude(f"unreachable at transfer: {res.message}", "missing")
    else:
        w.reason = f"transfer failed: {res.message}"
        failed.append(w)


def judge_pause(w: FleetWorker, res: CallResult[Any]) -> None:
    if not res.ok:
        w.exclude(f"pause failed: {res.message}", lost(res))


def judge_reset(w: FleetWorker, res: CallResult[Any]) -> None:
    if not res.ok:
        w.exclude(f"cache reset failed: {res.message}")


def judge_verify(w: FleetWorker, target: Policy, v: CallResult[Any], live: CallResult[Any]
                 ) -> str | None:
    """The worker serves `target` (get_weight_version `v`) and is alive (`live`); a mismatch
    is returned (it keeps a synchronous fleet closed), other failures exclude the worker."""
    if not v.ok:
        w.exclude(f"version check failed: {v.message}")
        return None
    reply = v.reply
    w.holds, w.dtype = reply.policy(), reply.dtype or None
    if reply.version != target.version or reply.weight_digest != target.digest:
        w.exclude("version or digest differs from the target")
        return f"{w.instance_id} reports {reply.version!r} / {reply.weight_digest}"
    if not live.ok:
        w.exclude(f"liveness probe failed: {live.message}")
    return None


def judge_resume(w: FleetWorker, res: CallResult[Any]) -> None:
    if not res.ok:
        w.exclude(f"resume failed: {res.message}")


LIFECYCLE_ROUTES = admin.route_names(admin.VLLM_LIFECYCLE)


class _Skipped(msgspec.Struct):
    where: str
    error: str
    key: str | None = None


class _Listing(msgspec.Struct):
    """rlfleet.protocol.rl.RlWorkers, read by msgspec (see RlWorkerStrict)."""

    protocol_version: int
    namespace: str
    workers: list[RlWorkerStrict]
    skipped: list[_Skipped] = []
    discovery: str | None = None


_LISTING = msgspec.json.Decoder(_Listing)


def _listed(body: bytes) -> _Listing | None:
    """The listing when msgspec reads it and every worker passes RlWorker's own checks
    (routes then sorted and unique, as RlWorker keeps them); None: read it with RlWorkers."""
    if not STRICT_MIRRORS:
        return None
    try:
        listing = _LISTING.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    for w in listing.workers:
        if not w.passes():
            return None
        w.routes = sorted(set(w.routes))
    return listing


def _listing(body: bytes) -> RlWorkers | _Listing:
    """The RL listener's reply, checked against its schema (rlfleet.protocol.rl)."""
    listing: RlWorkers | _Listing | None = _listed(body)
    try:
        if listing is None:
            listing = RlWorkers.model_validate_json(body)
    except pydantic.ValidationError as e:
        version = _protocol_version(body)
        if version is not None and version != PROTOCOL_VERSION:
            raise RefreshHeld(f"unsupported discovery protocol_version {version!r} (this "
                              f"coordinator speaks {PROTOCOL_VERSION})") from None
        raise RefreshHeld(f"discovery listing does not follow the RL listener's schema: "
                          f"{e}") from None
    if listing.protocol_version != PROTOCOL_VERSION:
        raise RefreshHeld(f"unsupported discovery protocol_version "
                          f"{listing.protocol_version!r} (this coordinator speaks "
                          f"{PROTOCOL_VERSION})")
    return listing


def _protocol_version(body: bytes) -> Any:
    try:
        return json.loads(body)["protocol_version"]
    except (ValueError, TypeError, KeyError):
        return None


class VllmControl(WorkerControl):
    """vLLM-flavoured workers listed by the frontend's RL listener (`GET /v1/rl/workers`);
    weights from a directory they can read (`update_weights_from_disk`) or broadcast by the
    coordinator over a process group (`update_weights_from_distributed`)."""

    dynamic_membership = True

    def __init__(self, rl_url: str, model: str | None = None, *, distributed: bool = False,
                 backend: str = "gloo", master_address: str | None = None,
                 master_port: int | None = None) -> None:
        """The distributed path's group: `backend` gloo (CPU tensors) or nccl (needs CUDA
        here: the coordinator is rank 0), rendezvous at `master_address`:`master_port`
        (default: this host's address toward the workers, a free port)."""
        if backend not in TRANSFER_BACKENDS:
            raise ValueError(f"transfer backend must be gloo or nccl, not {backend!r}")
        if distributed and backend == "nccl":
            import torch

            if not torch.cuda.is_available():
                raise ValueError("transfer backend nccl needs a CUDA device on the coordinator "
                                 "(rank 0 of the weight-update group); use gloo")
        self.rl_url = self.fleet = rl_url.rstrip("/")
        self.model = model
        self.distributed = distributed
        self.backend, self.master_address, self.master_port = backend, master_address, master_port
        self.path = "vllm-distributed" if distributed else "vllm-disk"
        self.required_routes = LIFECYCLE_ROUTES | admin.route_names(
            admin.VLLM_GROUP if distributed else (admin.UPDATE_WEIGHTS_FROM_DISK,))

    async def discover(self, ch: Channel) -> dict[int, FleetWorker]:
        r = await ch.http.get(f"{self.rl_url}/v1/rl/workers", timeout=ch.timeout)
        if r.status_code != 200:
            raise RefreshHeld(f"discovery failed: HTTP {r.status_code} {r.text[:300]}")
        listing = _listing(r.content)
        out = {}
        self.namespace, self.discovery_url = listing.namespace, listing.discovery
        self.models = frozenset(e.model for e in listing.workers
                                if e.model is not None and self.model in (None, e.model))
        self.seen_epoch = max((e.fleet_epoch or 0 for e in listing.workers), default=0)
        for e in listing.workers:
            if self.model is not None and e.model != self.model:
                continue
            w = FleetWorker(e.instance_id, e.system_url or "", e.transport.get("http"), e.model,
                            frozenset(e.routes))
            need = self.required_routes - w.routes
            if e.error:
                w.exclude(f"discovery probe failed: {e.error}")
            elif not w.system_url:
                w.exclude("no system_url")
            elif need:
                w.exclude(f"missing routes for {self.path}: {sorted(need)}")
            out[w.instance_id] = w
        return out

    async def newest_epoch(self, ch: Channel) -> int:
        await self.discover(ch)
        return self.seen_epoch

    async def inspect(self, ch: Channel, w: FleetWorker) -> PolicyIdentity | None:
        res = await ch.on(w, "inspect", admin.GET_WEIGHT_VERSION)
        if not res.ok:
            w.exclude(f"version check failed: {res.message}", lost(res))
            return None
        w.holds, w.dtype = res.reply.policy(), res.reply.dtype or None
        return w.holds

    async def pause(self, ch: Channel, w: FleetWorker, mode: str) -> None:
        judge_pause(w, await ch.on(w, "pause", admin.PAUSE_GENERATION,
                                   PauseRequest(mode=mode, clear_cache=False)))

    def commit_install(self, w: FleetWorker, target: Policy
                       ) -> tuple[AdminRoute, Any, bool] | None:
        if self.distributed or target.path is None:
            return None  # the coordinator broadcasts: the lifecycle's own steps
        return (admin.UPDATE_WEIGHTS_FROM_DISK,
                DiskUpdateRequest(model_path=target.path, weight_version=target.version,
                                  step=target.step), True)

    async def transfer(self, ch: Channel, ws: list[FleetWorker], target: Policy
                       ) -> list[FleetWorker]:
        if not self.distributed:
            return await self._transfer_each(ch, ws, admin.UPDATE_WEIGHTS_FROM_DISK,
                                             DiskUpdateRequest(model_path=target.path,
                                                               weight_version=target.version,
                                                               step=target.step))
        return await self._broadcast(ch, ws, target)

    async def _broadcast(self, ch: Channel, ws: list[FleetWorker], target: Policy
                         ) -> list[FleetWorker]:
        """The distributed path: the coordinator is rank 0 and broadcasts the tensors."""
        from rlfleet.weights.broadcast import TransferError, free_port, push_weights

        tensors = await asyncio.to_thread(_tensors_of, target)
        host = self.master_address or address_toward(ws[0].system_url)
        port = self.master_port or free_port(host)
        self.transfer_detail = {"backend": self.backend, "master_address": host,
                                "master_port": port}
        try:
            results = await push_weights([w.system_url for w in ws], tensors, target.version,
                                         host=host, port=port, backend=self.backend,
                                         timeout=ch.timeout, client=ch, step=target.step)
        except TransferError as e:
            for i, w in enumerate(ws):
                w.reason = f"transfer failed: {e}"
                if i < len(e.results):
                    record(w, "apply", e.results[i])
                else:  # the broadcast failed: no answer to record
                    w.record("apply", admin.UPDATE_WEIGHTS_FROM_DISTRIBUTED.name, None, {})
            self._raise_if_fenced(ws, e.results)
            return list(ws)
        failed: list[FleetWorker] = []
        for w, r in zip(ws, results, strict=True):
            record(w, "apply", r)
            if r.ok:
                w.holds = r.reply.policy()
            else:
                w.reason = f"transfer failed: {r.message}"
                failed.append(w)
        self._raise_if_fenced(ws, results)
        return failed

    @staticmethod
    def _raise_if_fenced(ws: list[FleetWorker], results: list[CallResult[Any]]) -> None:
        for w, r in zip(ws, results, strict=False):
            if r.stale_epoch:
                raise FleetFenced(f"worker {w.instance_id} refused the weight transfer: "
                                  f"{r.message}")

    async def reset_cache(self, ch: Channel, w: FleetWorker) -> None:
        judge_reset(w, await ch.on(w, "reset_cache", admin.FLUSH_CACHE))

    async def verify(self, ch: Channel, w: FleetWorker, target: Policy) -> str | None:
        v, live = await gather_all((ch.on(w, "verify", admin.GET_WEIGHT_VERSION),
                                    ch.on(w, "verify", admin.LIVENESS_PROBE)))
        return judge_verify(w, target, v, live)

    async def resume(self, ch: Channel, w: FleetWorker) -> None:
        judge_resume(w, await ch.on(w, "resume", admin.RESUME_GENERATION))


class SglangControl(WorkerControl):
    """SGLang-flavoured workers named by the deployment: native pause/continue methods and
    `control/update_weights_from_disk` (which flushes the cache itself). SGLang has no
    version route: the post-update probe checks the digest the worker stamps."""

    path = "sglang-disk"

    def __init__(self, workers: Sequence[SglangWorker]) -> None:
        if not workers:
            raise ValueError("the SGLang path needs sglang_workers (system and request URLs)")
        self.workers = list(workers)
        self.fleet = " ".join(sorted(w.system_url.rstrip("/") for w in self.workers))

    async def discover(self, ch: Channel) -> dict[int, FleetWorker]:
        return {i: FleetWorker(i, w.system_url.rstrip("/"), w.request_url.rstrip("/"),
                               model=w.name or None)
                for i, w in enumerate(self.workers)}

    async def close(self, ch: Channel, w: FleetWorker, reason: str) -> None:
        # the routes of an SGLang worker are not listed anywhere: try, a failure is no harm
        await ch.on(w, "gate", admin.SET_ADMISSION, AdmissionRequest(open=False, reason=reason))

    async def open(self, ch: Channel, w: FleetWorker) -> None:
        await ch.on(w, "reopen", admin.SET_ADMISSION, AdmissionRequest(open=True))

    async def pause(self, ch: Channel, w: FleetWorker, mode: str) -> None:
        res = await ch.on(w, "pause", admin.NATIVE_PAUSE_GENERATION, NativePauseRequest())
        if not res.ok:
            w.exclude(f"pause failed: {res.message}", lost(res))

    async def transfer(self, ch: Channel, ws: list[FleetWorker], target: Policy
                       ) -> list[FleetWorker]:
        return await self._transfer_each(ch, ws, admin.SGLANG_UPDATE_WEIGHTS_FROM_DISK,
                                         SglangDiskRequest(model_path=target.path,
                                                           weight_version=target.version,
                                                           step=target.step, flush_cache=True,
                                                           keep_pause=True))

    async def resume(self, ch: Channel, w: FleetWorker) -> None:
        res = await ch.on(w, "resume", admin.NATIVE_CONTINUE_GENERATION,
                          NativeContinueRequest(torch_empty_cache=False))
        if not res.ok:
            w.exclude(f"resume failed: {res.message}")
