"""The fleet control service: the refresh coordinator as one long-lived process
(`rlfleet control`), so that a client written for ONE vLLM or SGLang server drives the
whole fleet through one URL, and each of its control calls is a fleet operation.

A single-server client pauses, updates and resumes "the server"; here every such call maps
onto the fleet lifecycle (`FleetControl`); the route tables (rlfleet.protocol.fleet_control)
say, as data, which dialect route maps onto which operation (`Op`), and `HANDLERS` binds
each to the code that reads it and answers in the dialect's shapes:

* pause (vLLM `/pause?mode=`, SGLang `/pause_generation {mode}`): a fleet transaction opens
  in the journal; every worker is closed to rollouts (the frontends hold new requests,
  bounded by their --gated-hold, as a paused vLLM server queues them) and paused in that
  mode (abort: requests in flight end with finish reason abort and their partial output;
  keep: they freeze and go on after the resume; wait: they finish first). A second pause
  answers as the first did and changes nothing.
* weight updates inside the transaction: from disk (SGLang `/update_weights_from_disk`,
  vLLM `/collective_rpc` reload_weights) or vLLM's four-phase transfer
  (`/init_weight_transfer_engine` with the fleet's world size and each worker its rank
  offset, `/start_weight_update`, `/update_weights`, `/finish_weight_update`). Every worker
  must end on one policy (the same digest); when one fails, the workers that moved are
  rolled back to the fleet's last verified policy (from the journal) and the client gets
  the dialect's error naming the workers and what was rolled back. An update sent while the
  fleet is not paused is a whole transaction of its own (pause, apply, resume).
* resume (vLLM `/resume`, SGLang `/continue_generation`): verify (every worker holds one
  policy, its liveness probe and self-check pass), resume, reopen on that policy; the
  transaction ends in the journal with the policy the fleet serves.
* LoRA loads (vLLM `/v1/load_lora_adapter`, SGLang `/load_lora_adapter`) with the fleet
  open: the adapter's refresh (rlfleet.refresh.adapter), journaled under the adapter's own
  fleet key; the base model and the other adapters serve on while the adapter's requests
  wait at its own gate; every worker moves to the version (verified by its digest, probed),
  or a failed load rolls every worker back to the adapter's previous version (a failed
  probe holds the adapter closed on every worker). Inside a client's pause: every worker
  loads it, or none does.
* per-worker fan-outs: `/reset_prefix_cache` and `/flush_cache`, `/get_world_size` (the
  fleet's sum), the weight version, LoRA adapters unloaded on every worker that has them.

The service is the single owner of fleet transactions: one journal (rlfleet.journal),
one operation at a time. A service that dies mid-transaction leaves the fleet gated, and
its restart (or `rlfleet recover`) recovers it from the journal (PolicyRefresh.recover).
Routes that change the fleet require the admin token when one is set; several clients
cannot send one, so the service binds to loopback unless told otherwise.

The HTTP layer is beside it: one route module per dialect (rlfleet.refresh.fleet_control.vllm,
.sglang, .areal, .smg, .skyrl) and the app (rlfleet.refresh.fleet_control.app). This module
stays whole because FleetControl is the single owner of a fleet transaction's state (its
session, lock, channel and journal), which every operation here reads and changes."""



import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from rlfleet.journal import RefreshJournal, open_journal
from rlfleet.protocol import admin, admin_vllm
from rlfleet.protocol.admin_base import NoFields
from rlfleet.protocol.admin_lora import LoraLoadRequest, LoraRequest
from rlfleet.protocol.admin_vllm import (
    AdmissionRequest,
    DiskUpdateRequest,
    TransferFinishRequest,
    TransferInitRequest,
    TransferUpdateRequest,
)
from rlfleet.protocol.identity import PolicyIdentity
from rlfleet.refresh import committed as committed_policy
from rlfleet.refresh import recovery
from rlfleet.refresh.config import OnFailure, RefreshConfig, RefreshMode, UpdatePath
from rlfleet.refresh.control import Channel, FleetWorker, RefreshHeld, VllmControl, for_each
from rlfleet.refresh.coordinator import PolicyRefresh
from rlfleet.refresh.policy import Policy
from rlfleet.refresh.staged import VllmStagedControl, stage_checkpoint
from rlfleet.runtime.admin_client import AdminConnections, CallResult

log = logging.getLogger("rlfleet.fleet_control")

#: what the journal records as the update path of a transaction this service drives
UPDATE_PATH = "fleet-control"
#: the journal's `kind` of such a transaction
KIND = "control"


class FleetFailure(Exception):
    """A fleet operation failed: `message` names the workers and what was rolled back;
    `status` the HTTP status a dialect answers with."""

    def __init__(self, message: str, status: int = 500, workers: list[dict] | None = None,
                 rolled_back: list[int] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.workers = workers or []
        self.rolled_back = rolled_back or []


class BadRequest(FleetFailure):
    """The request itself does not fit (HTTP 400); the message says what to send."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 400)


@dataclass
class Session:
    """The fleet transaction open between a pause (or a transfer's start) and the resume:
    its journal record and epoch, the workers it holds and what it did to them."""

    id: int
    epoch: int
    ch: Channel
    workers: dict[int, FleetWorker]
    previous: Policy | None  # the fleet's last verified policy: what a rollback returns to
    mode: str
    by_client: bool  # opened by a pause (ends at the resume), else by the update itself
    transfer_open: bool = False
    target: PolicyIdentity | None = None  # what an update in it installed
    target_path: str | None = None
    rolled_back: str | None = None  # what the last failed update rolled back
    back_on_previous: bool = False  # ... and whether every worker is verified back on it
    joined: set[int] = field(default_factory=set)  # workers that joined while it was open
    watch: asyncio.Task | None = None  # takes joining workers in (`_watch_joins`)

    transfer_workers: set[int] = field(default_factory=set)  # those the open transfer started on
    steps: list[dict[str, Any]] = field(default_factory=list)  # timed phases, for the journal

    async def timed(self, name: str, coro: Awaitable[Any]) -> Any:
        """`coro`, timed as the phase `name` of the transaction (in the journal's steps)."""
        t0 = time.perf_counter()
        try:
            return await coro
        finally:
            self.steps.append({"name": name, "seconds": time.perf_counter() - t0})

    def active(self) -> list[FleetWorker]:
        return [w for w in self.workers.values() if w.active]

    def participants(self) -> list[FleetWorker]:
        """The workers an update in progress moves: those its transfer started on (a worker
        that joined since waits for the resume), else every active one."""
        if self.transfer_workers:
            return [w for w in self.active() if w.instance_id in self.transfer_workers]
        return self.active()


@dataclass
class Outcome:
    """What an update did: the policy the fleet holds now, and on how many workers."""

    policy: PolicyIdentity
    workers: list[int] = field(default_factory=list)


def _label(p: PolicyIdentity) -> str:
    """A policy as messages name it: its version (or that it has none) and digest."""
    return f"{p.version or 'unversioned weights'} ({p.digest})"


class FleetControl:
    """The operations (rlfleet.protocol.fleet_control.Op) over one fleet, one at a time,
    recorded in one journal."""

    def __init__(self, config: RefreshConfig, *, journal: RefreshJournal | None = None,
                 on_event: Callable[[str], None] | None = None) -> None:
        if config.path is not UpdatePath.VLLM_DISK:
            raise ValueError(f"the fleet control service drives the workers the RL listener "
                             f"lists (path vllm-disk; transfers through vLLM's four phases), "
                             f"not path {config.path.value}")
        self.config = config
        self.journal = journal or open_journal(config.journal)
        self.on_event = on_event or (lambda msg: log.info("%s", msg))
        # the coordinator, for what it owns: recovery of unfinished transactions
        self.refresh = PolicyRefresh(config=config, journal=self.journal, on_event=self.on_event)
        self.control = VllmControl(config.rl_url or "", config.model)
        self.http = httpx.AsyncClient()
        self.clients = AdminConnections()
        self.lock = asyncio.Lock()
        self.session: Session | None = None
        # what the last init_weight_transfer_engine said per worker: None accepted, else why
        # it refused (a start that no worker can run is then the client's to fix: a 4xx)
        self.transfer_engines: dict[int, str | None] = {}

    async def aclose(self) -> None:
        await self.http.aclose()
        await self.clients.aclose()
        self.refresh.close()

    # ------------------------------------------------------------------ plumbing

    def channel(self, epoch: int | None = None) -> Channel:
        cfg = self.config
        return Channel(self.http, cfg.timeout, cfg.admin_token, epoch, self.clients,
                       concurrency=cfg.concurrency, phase_timeout=cfg.phase_timeout)

    async def discover(self) -> dict[int, FleetWorker]:
        """The fleet's usable workers now (FleetFailure 503 when the RL listener cannot say
        or lists none)."""
        try:
            found = await self.control.discover(self.channel())
        except httpx.HTTPError as e:
            raise FleetFailure(f"the RL listener {self.control.rl_url} cannot be reached: "
                               f"{e!r}", 503) from e
        except RefreshHeld as e:
            raise FleetFailure(str(e), 503) from e
        workers = {i: w for i, w in found.items() if w.active}
        if not workers:
            raise FleetFailure(f"no usable worker{' of ' + self.config.model if self.config.model else ''} "
                               f"in {self.control.rl_url}/v1/rl/workers", 503)
        return workers

    def last_verified(self) -> Policy | None:
        return recovery.last_verified(self.journal, self.control.fleet, self.config.model).policy

    async def recover(self) -> str | None:
        """Recover the fleet's unfinished transactions (this service's, or a coordinator's
        that died): what happened, or None when there was nothing to recover."""
        async with self.lock:
            result = await self.refresh.recover()
        if result is None:
            return None
        return f"refresh {result.refresh_id}: {result.decision} ({result.reason})"

    async def _each(self, ws: list[FleetWorker], call: Callable[[FleetWorker], Awaitable[Any]]
                    ) -> list[Any]:
        return await for_each(ws, call, self.channel().phase_deadline)

    async def _publish(self, s: Session, committed: PolicyIdentity | None,
                       admitting: PolicyIdentity | None) -> None:
        c = self.control
        await committed_policy.publish(
            self.config.discovery or c.discovery_url, c.namespace,
            {self.config.model} if self.config.model else c.models, epoch=s.epoch,
            refresh_id=s.id, committed=committed, admitting=admitting,
            seen_epoch=c.seen_epoch, on_event=self.on_event)

    # ------------------------------------------------------------------ the transaction

    async def _open(self, mode: str, by_client: bool) -> Session:
        """Open a transaction: record it (at the fleet's next epoch), close every worker to
        rollouts, pause it in `mode`."""
        workers = await self.discover()
        ch0 = self.channel()
        await self._each(list(workers.values()), lambda w: self.control.inspect(ch0, w))
        holds = {w.holds for w in workers.values() if w.active}
        current = holds.pop() if len(holds) == 1 else None
        previous = self.last_verified()
        rid, epoch = await asyncio.to_thread(
            self.journal.open_transaction, fleet=self.control.fleet,
            floor_epoch=self.control.seen_epoch, kind=KIND, model=self.config.model,
            update_path=UPDATE_PATH, framework_step=current.step if current else None,
            target=current or (previous.identity if previous else None),
            previous=previous.identity if previous else current,
            target_path=previous.path if previous and previous.identity == current else None,
            intended_workers=sorted(workers))
        s = Session(rid, epoch, self.channel(epoch), workers, previous, mode, by_client)
        self.session = s
        s.watch = asyncio.create_task(self._watch_joins(s))
        self.on_event(f"[refresh {rid}] fleet paused ({mode}) by the control service, "
                      f"fleet epoch {epoch}")
        reason = "paused by the fleet control service"

        async def hold(w: FleetWorker) -> None:
            await self.control.close(s.ch, w, reason)
            await self.control.pause(s.ch, w, mode)
        await s.timed("pause", self._each(s.active(), hold))
        failed = [w for w in workers.values() if not w.active]
        await self._record(s, state="paused")
        if failed:
            raise FleetFailure(f"{len(failed)} of {len(workers)} worker(s) could not be "
                               f"paused: {self._named(failed)}; the others are paused and "
                               "closed to rollouts (resume to reopen them)", 502,
                               [w.summary() for w in failed])
        return s

    #: how often an open transaction looks for workers that joined the fleet
    JOIN_POLL = 1.0

    async def _watch_joins(self, s: Session) -> None:
        """While `s` is open, close and pause every worker that joins the fleet: a paused
        fleet serves nothing, whoever joins it."""
        while self.session is s:
            await asyncio.sleep(self.JOIN_POLL)
            try:
                await self._take_in_joined(s)
            except Exception as e:  # noqa: BLE001 - the next poll tries again; say why
                log.warning("looking for workers that joined: %r", e)

    async def _take_in_joined(self, s: Session) -> None:
        try:
            now = await self.control.discover(self.channel())
        except (httpx.HTTPError, RefreshHeld) as e:
            log.warning("could not list the fleet's workers: %s", e)
            return
        new = [w for iid, w in now.items() if iid not in s.workers and w.active]
        for w in new:
            s.workers[w.instance_id] = w
            s.joined.add(w.instance_id)
            self.on_event(f"[refresh {s.id}] worker {w.instance_id} joined while the fleet is "
                          f"held: closed and paused ({s.mode})")

        async def hold(w: FleetWorker) -> None:
            await self.control.close(s.ch, w, "joined while the fleet control service holds "
                                              "the fleet")
            await self.control.pause(s.ch, w, s.mode)
        await self._each(new, hold)

    @staticmethod
    def _stop_watch(s: Session) -> None:
        if s.watch is not None and s.watch is not asyncio.current_task():
            s.watch.cancel()
        s.watch = None

    async def _record(self, s: Session, **fields: Any) -> None:
        await asyncio.to_thread(self.journal.update, s.id, only_open=True, steps=s.steps,
                                workers={str(w.instance_id): w.summary()
                                         for w in s.workers.values()}, **fields)

    @staticmethod
    def _named(ws: list[FleetWorker]) -> str:
        return "; ".join(f"worker {w.instance_id} ({w.reason})" for w in ws)

    async def _close(self, s: Session) -> PolicyIdentity:
        """Verify every worker holds one policy and passes its liveness probe, resume and
        reopen them on it, end the transaction. A fleet whose workers differ stays paused
        (FleetFailure)."""
        await self._take_in_joined(s)
        ws = s.active()
        await s.timed("verify", self._each(ws, lambda w: self.control.inspect(s.ch, w)))
        # a worker that joined meanwhile reopens only on the policy the others hold
        holds = {w.holds for w in ws if w.active and w.instance_id not in s.joined}
        if not holds:
            holds = {w.holds for w in ws if w.active}
        if len(holds) == 1:
            fleet_policy = next(iter(holds))
            for w in ws:
                if w.instance_id in s.joined and w.holds != fleet_policy:
                    w.exclude(f"joined while the fleet was held, holding "
                              f"{_label(w.holds) if w.holds else 'an unknown policy'}, not "
                              f"the fleet's {_label(fleet_policy)}: it stays closed and paused "
                              "until a refresh admits it (`rlfleet refresh`)")
            ws = s.active()
        if len(holds) != 1:
            what = "; ".join(f"worker {w.instance_id} holds "
                             f"{w.holds.to_dict() if w.holds else None}" for w in ws)
            await self._record(s, reason=f"resume refused: the workers differ ({what})")
            raise FleetFailure(f"resume refused: the workers do not hold one policy ({what}); "
                               "the fleet stays paused: update it again, or run "
                               "`rlfleet recover`", 409)
        served = holds.pop()
        await self._record(s, state="verified")

        async def back(w: FleetWorker) -> None:
            await self.control.resume(s.ch, w)
            live = await s.ch.on(w, "probe", admin.LIVENESS_PROBE)
            if not live.ok:
                w.exclude(f"liveness probe failed: {live.message}")
                return
            res = await s.ch.on(w, "reopen", admin.SET_ADMISSION, AdmissionRequest(
                open=True, policy={"version": served.version, "digest": served.digest}))
            if not res.ok:
                w.exclude(f"reopen failed: {res.message}")
        await self._publish(s, served, None)  # before any worker reopens on it
        await s.timed("resume", self._each(ws, back))
        ok = [w for w in ws if w.active]
        out = [w for w in s.workers.values() if not w.active]
        for w in ok:
            w.status = "verified"
        rolled = s.rolled_back
        decision = "rolled_back" if rolled and s.target is None else "reopened"
        reason = (f"{len(ok)} worker(s) verified on {_label(served)}"
                  + (f"; {rolled}" if rolled else "")
                  + (f"; kept out: {self._named(out)}" if out else ""))
        path = s.target_path if s.target == served else (
            s.previous.path if s.previous and s.previous.identity == served else None)
        await asyncio.to_thread(
            self.journal.update, s.id, only_open=True, ended_at=time.time(),
            state="reopened" if decision == "reopened" else "rolled_back",
            decision=decision, reason=reason, served=served, served_path=path, steps=s.steps,
            verified_workers=sorted(w.instance_id for w in ok),
            workers={str(w.instance_id): w.summary() for w in s.workers.values()})
        self._stop_watch(s)
        self.session = None
        self.on_event(f"[refresh {s.id}] {decision}: {reason}")
        if not ok:
            raise FleetFailure(f"no worker could be reopened: {self._named(out)}", 502,
                               [w.summary() for w in out])
        return served

    def _step(self, s: Session) -> int:
        served = s.previous.step if s.previous is not None else None
        held = [w.holds.step for w in s.workers.values()
                if w.holds is not None and w.holds.step is not None]
        return max([served if served is not None else -1, *held]) + 1

    async def _judge(self, s: Session, failed: list[FleetWorker], what: str) -> Outcome:
        """After an update on every worker: one policy everywhere, or the workers that
        moved rolled back (FleetFailure names the workers and what was rolled back). An
        update every worker refused, none of them moved by it, is the client's to fix: a
        400 naming why, nothing rolled back (the fleet may reopen as it was)."""
        ws = s.participants()
        before = {w.instance_id: w.holds for w in ws}
        await self._each(ws, lambda w: self.control.inspect(s.ch, w))
        if failed and len(failed) == len(ws) and all(
                w.active and w.holds == before[w.instance_id] for w in ws):
            why = f"{what} was refused by every worker, nothing changed: {self._named(failed)}"
            s.target, s.rolled_back, s.back_on_previous = None, None, True
            await self._record(s, reason=why)
            raise FleetFailure(why, 400, [w.summary() for w in failed])
        holds = {w.holds for w in ws if w.active}
        if not failed and len(holds) == 1 and all(w.active for w in ws):
            policy = holds.pop()
            s.target, s.rolled_back, s.back_on_previous = policy, None, False
            await self._record(s, state="applied", target=policy, target_path=s.target_path)
            await self._publish(s, s.previous.identity if s.previous else None, policy)
            return Outcome(policy, sorted(w.instance_id for w in ws))
        bad = failed + [w for w in s.workers.values() if not w.active and w not in failed]
        why = self._named(bad) if bad else "the workers report different policies"
        s.target = None
        rolled, s.back_on_previous = await self._roll_back(s)
        s.rolled_back = f"{what} failed on {len(bad) or 'some'} worker(s): {why}; {rolled}"
        await self._record(s, reason=s.rolled_back)
        self.on_event(f"[refresh {s.id}] {s.rolled_back}")
        raise FleetFailure(s.rolled_back, 500, [w.summary() for w in s.workers.values()],
                           [w.instance_id for w in s.workers.values()])

    async def _roll_back(self, s: Session) -> tuple[str, bool]:
        """Every worker back on the fleet's last verified policy (those that hold it are
        left alone): what was done, for the client and the journal, and whether every
        worker holds that policy now."""
        prev = s.previous
        ws = list(s.workers.values())
        for w in ws:  # a worker that failed its update is still paused and reachable
            if w.status == "excluded":
                w.status, w.reason = "selected", None
        await self._each(ws, lambda w: self.control.inspect(s.ch, w))
        if prev is None or prev.path is None:
            held = ", ".join(f"{w.instance_id}: {w.holds.version if w.holds else None}"
                             for w in ws)
            await self._record(s, state="held")
            return ("nothing rolled back: the journal has no verified policy with a checkpoint "
                    f"to return to (workers hold {held}); the fleet stays paused and closed",
                    False)
        moved = [w for w in ws if w.active and (w.holds is None or w.holds.digest != prev.digest)]
        await self._record(s, state="rolling_back")
        req = DiskUpdateRequest(model_path=prev.path, weight_version=prev.version,
                                step=prev.step)

        async def back(w: FleetWorker) -> None:
            res = await s.ch.on(w, "rollback", admin.UPDATE_WEIGHTS_FROM_DISK, req)
            if not res.ok:
                w.exclude(f"rollback failed: {res.message}")
        await s.timed("rollback", self._each(moved, back))
        await self._each(s.active(), lambda w: self.control.inspect(s.ch, w))
        left = [w for w in ws if not w.active or w.holds is None
                or w.holds.digest != prev.digest]
        names = sorted(w.instance_id for w in moved)
        if left:
            await self._record(s, state="held")
            return (f"rollback to {_label(prev.identity)} failed on {self._named(left)}; the "
                    "fleet stays paused and closed", False)
        await self._record(s, state="rolled_back")
        return (f"rolled back worker(s) {names} to {_label(prev.identity)}; every worker "
                "serves it" if names else
                f"no worker had moved; every worker holds {_label(prev.identity)}", True)

    # ------------------------------------------------------------------ operations

    async def pause(self, mode: str) -> bool:
        """Op.PAUSE; whether this call paused the fleet (False: it already was)."""
        if mode not in admin_vllm.PAUSE_MODES:
            raise BadRequest(f"mode must be one of {', '.join(admin_vllm.PAUSE_MODES)}, not {mode!r}")
        async with self.lock:
            if self.session is not None:
                self.session.by_client = True
                return False
            await self._open(mode, by_client=True)
            return True

    async def resume(self) -> PolicyIdentity | None:
        """Op.RESUME: the policy the fleet reopened on (None: it was not paused)."""
        async with self.lock:
            s = self.session
            if s is None:
                return None
            if s.transfer_open:
                raise FleetFailure("a weight update is open: finish it (/finish_weight_update) "
                                   "before resuming", 409)
            return await self._close(s)

    def dropped(self, why: str) -> None:
        """Forget the open transaction: another coordinator fenced it (it owns the fleet
        now, and the journal record of this one is ended by its recovery)."""
        if self.session is not None:
            self.on_event(f"[refresh {self.session.id}] fenced: {why}")
            self._stop_watch(self.session)
        self.session = None

    def is_paused(self) -> bool:
        return self.session is not None

    async def reset_cache(self) -> list[int]:
        """Op.RESET_CACHE on every worker; the workers that did it (FleetFailure: some
        could not)."""
        async with self.lock:
            s = self.session
            ch = s.ch if s else self.channel()
            ws = s.active() if s else list((await self.discover()).values())

            async def flush(w: FleetWorker) -> None:
                res = await ch.on(w, "reset_cache", admin.FLUSH_CACHE)
                if not res.ok:
                    w.exclude(f"cache reset failed: {res.message}")
            await self._each(ws, flush)
            bad = [w for w in ws if not w.active]
            if s:  # the session's workers stay in it
                for w in bad:
                    w.status, w.reason = "selected", None
            if bad:
                raise FleetFailure(f"cache reset failed on {self._named(bad)}", 500,
                                   [w.summary() for w in bad])
            return [w.instance_id for w in ws]

    async def world_size(self, include_dp: bool = True) -> int:
        """Op.WORLD_SIZE: the sum of the workers' world sizes (their rank offsets follow)."""
        return sum((await self._world_sizes(include_dp)).values())

    async def _world_sizes(self, include_dp: bool = True) -> dict[int, int]:
        workers = self.session.workers if self.session else await self.discover()
        ws = sorted(workers.values(), key=lambda w: w.instance_id)
        sizes: dict[int, int] = {}

        async def ask(w: FleetWorker) -> None:
            try:
                r = await self.clients.get(w.system_url).get(
                    f"{w.system_url}/get_world_size", params={"include_dp": include_dp},
                    timeout=self.config.timeout)
                sizes[w.instance_id] = int(r.json()["world_size"]) if r.status_code == 200 else 1
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                sizes[w.instance_id] = 1  # a worker that does not say is one rank
        await self._each(ws, ask)
        return {w.instance_id: sizes.get(w.instance_id, 1) for w in ws}

    async def weight_version(self) -> PolicyIdentity | None:
        """Op.WEIGHT_VERSION: the policy every worker holds (None: they differ)."""
        workers = await self.discover()
        ch = self.channel()
        await self._each(list(workers.values()), lambda w: self.control.inspect(ch, w))
        holds = {w.holds for w in workers.values() if w.active}
        return holds.pop() if len(holds) == 1 else None

    async def _in_session(self, mode: str, run: Callable[[Session], Awaitable[Outcome]]
                          ) -> Outcome:
        """`run` in the open transaction, or in one of its own (opened in `mode`, closed
        after it: a whole refresh)."""
        s = self.session
        own = s is None
        if own:
            s = await self._open(mode, by_client=False)
        try:
            out = await run(s)
        except FleetFailure:
            if own and s.back_on_previous:
                await self._close(s)  # back on the verified policy: reopen it
            raise
        if own:
            out.policy = await self._close(s)
        return out

    async def update_from_disk(self, model_path: str, version: str | None,
                               mode: str | None = None) -> Outcome:
        """Op.UPDATE_FROM_DISK: every worker reloads `model_path`; one policy everywhere,
        or rolled back."""
        if not isinstance(model_path, str) or not model_path:
            raise BadRequest("model_path is required: a checkpoint directory every worker "
                             "can read")

        staged: VllmStagedControl | None = None

        async def run(s: Session) -> Outcome:
            if s.transfer_open:
                raise FleetFailure("a weight transfer is open: finish it first", 409)
            await self._take_in_joined(s)  # a worker that joined moves with the others
            step = self._step(s)
            if staged is None:
                req = DiskUpdateRequest(model_path=model_path, weight_version=version, step=step)
                failed = await s.timed("apply", self._fan(
                    s, "apply", admin.UPDATE_WEIGHTS_FROM_DISK, req))
            else:  # each worker: its staged handle, or from disk
                failed = await s.timed("apply", self._install_each(s, staged, step, version))
            s.target_path = model_path
            return await self._judge(s, failed, f"update from {model_path}")
        async with self.lock:
            if self.session is None:  # stage first, while the fleet serves
                staged = await self._stage_first(model_path, version)
            try:
                return await self._in_session(mode or self.config.pause_mode.value, run)
            finally:
                if staged is not None:  # what no worker installed
                    await staged.release(self.channel())

    async def _stage_first(self, model_path: str, version: str | None) -> VllmStagedControl:
        """An update with the fleet open stages the checkpoint on every worker while it
        serves (rlfleet.refresh.staged.stage_checkpoint); the pause then holds only the swap.
        A staging failure answers before anything is paused (FleetFailure 500)."""
        try:
            return await stage_checkpoint(self.config.rl_url or "", self.config.model,
                                          self.channel(), model_path, version)
        except RefreshHeld as e:
            raise FleetFailure(f"update from {model_path}: {e}", 500) from e

    async def _install_each(self, s: Session, staged: VllmStagedControl, step: int,
                            version: str | None) -> list[FleetWorker]:
        """Each participant installs what `staged` holds for it; those that failed."""
        failed: list[FleetWorker] = []

        async def one(w: FleetWorker) -> None:
            route, req = staged.install(w, step, version)
            res = await s.ch.on(w, "apply", route, req)
            if not res.ok:
                w.reason = f"{route.name} failed: {res.message}"
                failed.append(w)
        await self._each(s.participants(), one)
        return failed

    async def transfer_init(self, init_info: dict[str, Any]) -> None:
        """Op.TRANSFER_INIT: every worker joins the trainer's group at its rank offset (the
        client's `rank_offset` plus the world sizes of the workers before it), or every
        worker takes the backend's settings as they are."""
        if not isinstance(init_info, dict):
            raise BadRequest("init_info must be a JSON object (the backend's settings)")
        async with self.lock:
            sizes = await self._world_sizes()
            workers = self.session.workers if self.session else await self.discover()
            ch = self.session.ch if self.session else self.channel()
            offset = init_info.get("rank_offset")
            per: dict[int, dict[str, Any]] = {}
            for iid in sorted(sizes):
                per[iid] = dict(init_info)
                if isinstance(offset, int):
                    per[iid]["rank_offset"] = offset
                    offset += sizes[iid]
            failed: list[FleetWorker] = []

            async def init(w: FleetWorker) -> None:
                res = await ch.on(w, "transfer_init", admin.UPDATE_INIT_WEIGHT_TRANSFER_ENGINE,
                                  TransferInitRequest(init_info=per[w.instance_id]))
                if not res.ok:
                    w.reason = f"init_weight_transfer_engine refused: {res.message}"
                    failed.append(w)
            await self._each(list(workers.values()), init)
            self.transfer_engines = {iid: None for iid in workers}
            self.transfer_engines.update({w.instance_id: w.reason for w in failed})
            if failed:
                raise FleetFailure(f"{len(failed)} of {len(workers)} worker(s) refused the "
                                   f"weight-transfer engine: {self._named(failed)}", 400,
                                   [w.summary() for w in failed])

    async def transfer_start(self) -> None:
        """Op.TRANSFER_START: opens the transaction unless a pause did. Refused up front (400)
        when every worker refused the weight-transfer engine; when no worker can start and
        none took an engine through this service, the transaction it opened for itself
        ends (nothing changed) and the client is told to initialise first (409)."""
        async with self.lock:
            refused = self._without_transfer_engine()
            if refused:
                raise FleetFailure(refused, 400)
            s = self.session or await self._open(self.config.pause_mode.value, by_client=False)
            if s.transfer_open:
                raise FleetFailure("start_weight_update called while a weight update is "
                                   "already active. Call finish_weight_update first.", 409)
            await self._take_in_joined(s)
            s.transfer_workers = {w.instance_id for w in s.active()}
            failed = await self._fan(s, "transfer_start", admin.UPDATE_START_WEIGHT_UPDATE,
                                     NoFields())
            if failed:
                await self._fan(s, "transfer_finish", admin.UPDATE_FINISH_WEIGHT_UPDATE,
                                TransferFinishRequest(), only=[w for w in s.participants()
                                                                if w not in failed])
                s.transfer_workers = set()
                none_started = len(failed) == len(s.participants()) and not any(
                    self.transfer_engines.get(w.instance_id, "") is None for w in failed)
                if none_started and not s.by_client:
                    for w in failed:  # a refused call, not a broken worker: it rejoins
                        w.status, w.reason = "selected", None
                    await self._close(s)
                raise FleetFailure(
                    f"start_weight_update failed on {self._named(failed)}; the update was "
                    "closed on the others" + (
                        ": no worker has a weight-transfer engine initialised by this "
                        "service; call /init_weight_transfer_engine first" if none_started
                        else ""), 409 if none_started else 500,
                    [w.summary() for w in failed])
            s.transfer_open = True
            await self._record(s, state="transfer_open")

    def _without_transfer_engine(self) -> str | None:
        """Why no worker can run a weight transfer, when the last init said so for all."""
        said = self.transfer_engines
        if not said or any(why is None for why in said.values()):
            return None
        named = "; ".join(f"worker {iid}: {why}" for iid, why in sorted(said.items()))
        return ("the fleet has no weight-transfer engine: every worker refused "
                f"init_weight_transfer_engine ({named}); load weights from disk instead "
                "(/collective_rpc reload_weights, /update_weights_from_disk)")

    async def transfer_update(self, update_info: Any) -> None:
        """Op.TRANSFER_UPDATE on every worker; a failure ends the update everywhere and
        rolls the fleet back."""
        if not isinstance(update_info, (dict, list)):
            raise BadRequest("update_info must be a JSON object (or a list of them)")
        async with self.lock:
            s = self._open_transfer("update_weights")
            failed = await s.timed("apply", self._fan(
                s, "transfer_update", admin.UPDATE_UPDATE_WEIGHTS,
                TransferUpdateRequest(update_info=update_info)))
            if failed:
                await self._end_transfer_failed(s, failed, "update_weights")

    async def transfer_finish(self, weight_version: str | None) -> Outcome:
        """Op.TRANSFER_FINISH: every worker closes the update under `weight_version`; one
        policy everywhere, or rolled back."""
        async with self.lock:
            s = self._open_transfer("finish_weight_update")
            failed = await self._fan(s, "transfer_finish", admin.UPDATE_FINISH_WEIGHT_UPDATE,
                                     TransferFinishRequest(weight_version=weight_version))
            s.transfer_open = False
            s.target_path = None
            try:
                out = await self._judge(s, failed, "finish_weight_update")
            except FleetFailure:
                s.transfer_workers = set()
                if not s.by_client and s.back_on_previous:
                    await self._close(s)
                raise
            s.transfer_workers = set()
            if not s.by_client:
                out.policy = await self._close(s)
            return out

    def _open_transfer(self, step: str) -> Session:
        s = self.session
        if s is None or not s.transfer_open:
            raise FleetFailure(f"{step}: no weight update is open: call start_weight_update "
                               "first", 409)
        return s

    async def _end_transfer_failed(self, s: Session, failed: list[FleetWorker],
                                   step: str) -> None:
        # the update ends on every worker, as a failed update ends it in vLLM (a worker
        # where it already ended refuses the finish: no harm)
        why = {w.instance_id: w.reason for w in failed}
        await self._fan(s, "transfer_finish", admin.UPDATE_FINISH_WEIGHT_UPDATE,
                        TransferFinishRequest())
        for w in failed:
            w.reason = why[w.instance_id]
        s.transfer_open = False
        try:
            await self._judge(s, failed, step)
        except FleetFailure:
            s.transfer_workers = set()
            if not s.by_client and s.back_on_previous:
                await self._close(s)
            raise

    async def _fan(self, s: Session, step: str, route: admin.AdminRoute, request: Any,
                   only: list[FleetWorker] | None = None) -> list[FleetWorker]:
        """`route` on every worker of the session (or `only`); those that failed."""
        failed: list[FleetWorker] = []

        async def one(w: FleetWorker) -> None:
            res: CallResult[Any] = await s.ch.on(w, step, route, request)
            if not res.ok:
                w.reason = f"{route.name} failed: {res.message}"
                failed.append(w)
        await self._each(s.participants() if only is None else only, one)
        return failed

    async def load_adapter(self, name: str, path: str) -> list[int]:
        """Op.LOAD_ADAPTER. With the fleet open: an adapter refresh (`_adapter_refresh`).
        Inside a client's pause (the fleet gated, its workers paused, so nothing could be
        probed; the resume verifies and reopens): every worker loads it, or none does (those
        that loaded it unload it again)."""
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise BadRequest("lora_name and lora_path are required (strings)")
        async with self.lock:
            if self.session is None:
                digest = await asyncio.to_thread(_adapter_digest, path)
                if digest is not None:
                    return await self._adapter_refresh(name, path, digest)
                self.on_event(f"LoRA adapter {name!r}: {path} cannot be read here, so its "
                              "digest is unknown and the load cannot be verified as a refresh: "
                              "every worker loads it, or none does")
            workers = await self._all_workers()
            ch = self.channel()
            results = await self._on_all(ch, workers, "load_adapter", admin.LOAD_LORA_ADAPTER,
                                         LoraLoadRequest(lora_name=name, lora_path=path))
            loaded = [w for w, res in results if res.ok]
            failed = [w for w, res in results if not res.ok]
            for w, res in results:
                if not res.ok:
                    w.reason = f"load failed: {res.message}"
            if failed:
                await self._on_all(ch, loaded, "unload_adapter", admin.UNLOAD_LORA_ADAPTER,
                                   LoraRequest(lora_name=name))
                undone = sorted(w.instance_id for w in loaded)
                raise FleetFailure(
                    f"loading LoRA adapter {name!r} failed on {self._named(failed)}; "
                    + (f"unloaded it again from worker(s) {undone}" if undone else
                       "no worker loaded it"), 400, [w.summary() for w in failed], undone)
            self.on_event(f"LoRA adapter {name!r} loaded from {path} on "
                          f"{len(workers)} worker(s)")
            return sorted(w.instance_id for w in workers)

    async def _adapter_refresh(self, name: str, path: str, digest: str) -> list[int]:
        """The adapter's refresh (rlfleet.refresh.adapter) to the version at `path`: the
        base model and the other adapters serve on; the adapter's requests wait at its own
        gate while every worker switches to the version, verified by its digest and probed;
        a failure leaves every worker on the adapter's previous version (or without it).
        Journaled in this service's journal under the adapter's own fleet key, with its own
        epochs and steps; an unfinished one is recovered by the adapter's next load."""
        workers = await self.discover()
        # every worker or none: a worker that fails rolls the others back (the coordinator
        # shares this service's journal, which the service closes)
        cfg = dataclasses.replace(self.config, path=UpdatePath.VLLM_ADAPTER, adapter=name,
                                  mode=RefreshMode.SYNC, on_failure=OnFailure.ROLLBACK,
                                  min_workers=len(workers))
        refresh = PolicyRefresh(config=cfg, journal=self.journal, on_event=self.on_event)
        res = await refresh.refresh(path, f"{name}-{digest.rsplit(':', 1)[-1][:12]}",
                                    digest=digest)
        if not res.fleet_moved:
            failed = [w for w in res.workers if w.get("status") != "verified"]
            named = "; ".join(f"worker {w['instance_id']}: {w.get('reason')}" for w in failed)
            rolled_back = res.decision == "rolled_back"
            raise FleetFailure(
                f"loading LoRA adapter {name!r} from {path} failed ({res.decision}): "
                f"{res.reason}" + (f"; {named}" if named else "") + (
                    "; every worker serves the adapter's previous version again" if rolled_back
                    else "; the adapter is closed on every worker (its requests wait) until a "
                    "load moves them all"), 500 if rolled_back else 400, failed,
                [w["instance_id"] for w in res.workers] if rolled_back else [])
        return sorted(w["instance_id"] for w in res.workers)

    async def _on_all(self, ch: Channel, ws: list[FleetWorker], step: str,
                      route: admin.AdminRoute, request: Any
                      ) -> list[tuple[FleetWorker, CallResult[Any]]]:
        """`route` on every worker of `ws`: each worker with its result."""
        out: list[tuple[FleetWorker, CallResult[Any]]] = []

        async def one(w: FleetWorker) -> None:
            out.append((w, await ch.on(w, step, route, request)))
        await self._each(ws, one)
        return out

    async def _all_workers(self) -> list[FleetWorker]:
        """The open transaction's workers, else the fleet's as listed now."""
        return list((self.session.workers if self.session else await self.discover()).values())

    async def unload_adapter(self, name: str) -> list[int]:
        """Op.UNLOAD_ADAPTER on every worker that has it; FleetFailure 404 when none has."""
        if not isinstance(name, str) or not name:
            raise BadRequest("lora_name is required (a string)")
        async with self.lock:
            results = await self._on_all(self.channel(), await self._all_workers(),
                                         "unload_adapter", admin.UNLOAD_LORA_ADAPTER,
                                         LoraRequest(lora_name=name))
            done = [w.instance_id for w, res in results if res.ok]
            why = [f"worker {w.instance_id}: {res.message}" for w, res in results if not res.ok]
            if not done:
                raise FleetFailure(f"The lora adapter '{name}' cannot be found: "
                                   + "; ".join(why), 404)
            return sorted(done)


def _adapter_digest(path: str) -> str | None:
    """The content digest of the adapter directory at `path`, or None where this process
    cannot read it (the workers may see paths the service does not)."""
    from rlfleet.weights.digest import checkpoint_digest  # torch: only when needed

    try:
        return checkpoint_digest(Path(path))
    except (OSError, ValueError):
        return None



async def fleet_now(ctl: FleetControl) -> tuple[Channel, list[FleetWorker]]:
    """The channel and workers of the open transaction, else of the fleet as listed now."""
    s = ctl.session
    if s is not None:
        return s.ch, s.active()
    return ctl.channel(), sorted((await ctl.discover()).values(), key=lambda w: w.instance_id)


async def on_each_native(ctl: FleetControl, path: str, body: dict[str, Any]
                          ) -> list[dict[str, Any]]:
    """POST `body` to vLLM's native `path` on every worker (its admin_base_url): their
    answers, in instance order; FleetFailure names the workers that refused or failed."""
    _, ws = await fleet_now(ctl)
    answers: dict[int, dict[str, Any]] = {}
    failed: list[dict[str, Any]] = []
    token = ctl.config.admin_token
    headers = {"Authorization": f"Bearer {token}"} if token else {}

    async def one(w: FleetWorker) -> None:
        try:
            r = await ctl.clients.get(w.system_url).post(
                f"{w.system_url}{path}", json=body, headers=headers,
                timeout=ctl.config.timeout)
            said = r.json()
        except (httpx.HTTPError, ValueError) as e:
            failed.append({"instance_id": w.instance_id, "error": repr(e)})
            return
        if r.status_code != 200 or not isinstance(said, dict):
            failed.append({"instance_id": w.instance_id, "status": r.status_code, "body": said})
        else:
            answers[w.instance_id] = said
    await ctl._each(ws, one)
    if failed:
        status = 409 if all(f.get("status") == 409 for f in failed) else 500
        raise FleetFailure(f"{path} failed on worker(s) "
                           f"{', '.join(str(f['instance_id']) for f in failed)}: {failed}",
                           status, failed)
    return [answers[w.instance_id] for w in ws]
