"""Recovery of a fleet whose refresh was begun and never finished (its coordinator crashed,
or is being taken over), from the journal: what the fleet last verified (`last_verified`,
the policy a rollback returns to and replacement workers are admitted on), which
transactions are unfinished (`unfinished`), which policy the recovering transaction reopens
the fleet on once every worker is fenced and paused (`choose`), and how the interrupted
transactions are closed in the journal (`close_interrupted`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlfleet.journal import JournalRecord, RefreshJournal
from rlfleet.protocol.identity import PolicyIdentity
from rlfleet.refresh.control import FleetWorker, RefreshHeld, WorkerControl, for_each
from rlfleet.refresh.policy import Policy
from rlfleet.refresh.transaction import RefreshResult, Transaction


@dataclass
class Verified:
    """What the journal says the fleet last served, verified."""

    policy: Policy | None = None
    workers: set[int] = field(default_factory=set)  # the workers verified on it
    # what each worker was last seen holding ({version, digest, step})
    holdings: dict[int, PolicyIdentity] = field(default_factory=dict)
    refresh_id: int | None = None  # the transaction that verified it


def last_verified(journal: RefreshJournal, fleet: str, model: str | None) -> Verified:
    """The fleet's last verified policy, from its journal (a new process, after a crash
    or a held refresh, or another coordinator's refresh since)."""
    holdings = journal.holdings(fleet, model)
    row = journal.last_served(fleet, model, workers=False)
    if row is None:
        return Verified(holdings=holdings)
    return Verified(Policy.from_journal(row, "served"),
                    set(row["verified_workers"] or []), holdings, row["id"])


async def unfinished(journal: RefreshJournal, fleet: str, model: str | None
                     ) -> list[dict[str, Any]]:
    """The fleet's transactions that were begun and never finished, oldest first."""
    return await asyncio.to_thread(journal.unfinished, fleet, model, 1 << 62)


def interrupted_target(row: JournalRecord) -> Policy:
    """The policy an unfinished transaction was moving the fleet to."""
    return Policy.from_journal(row, "target", "framework_step")


def describe(row: JournalRecord) -> str:
    return (f"refresh {row['id']} (epoch {row['fleet_epoch']}) to {row.target.version}, "
            f"interrupted after state {row['state']}")


async def choose(tx: Transaction, control: WorkerControl, target: Policy,
                 previous: Policy | None, interrupted: list[dict[str, Any]],
                 on_event: Callable[[str], None]) -> tuple[Policy, list[FleetWorker], str]:
    """A recovery's decision, with every worker fenced and paused: forward to the
    interrupted `target` when every worker holds it, else back to the last verified policy
    (forward by finishing the transfer when there is none); which workers still need it;
    and why, for the journal."""
    await tx.timed("inspect", for_each(tx.active(), lambda w: control.inspect(tx.ch, w),
                                       tx.ch.phase_deadline))
    ws = tx.active()
    was = describe(interrupted[-1])
    held = ", ".join(f"{w.instance_id} holds {w.holds.version if w.holds else None}" for w in ws)
    if ws and all(target.is_held(w.holds) for w in ws):
        chosen, how = target, "rolled forward: every worker holds it"
    elif previous is not None and previous.sendable:
        chosen, how = previous, f"rolled back to {previous.version} ({held})"
    elif target.sendable:
        chosen, how = target, f"rolled forward (no verified policy to return to; {held})"
    else:
        raise RefreshHeld(f"recovering {was}: the workers differ ({held}) and neither the "
                          "target nor a verified policy can be sent again")
    on_event(f"[refresh {tx.id}] recovering {was}: {how}")
    await tx.record(reason=f"recovering {was}: {how}")
    return chosen, [w for w in ws if not chosen.is_held(w.holds)], f"recovered {was}: {how}"


async def close_interrupted(journal: RefreshJournal, found: list[dict[str, Any]],
                            result: RefreshResult) -> None:
    """End the interrupted transactions in the journal, saying how the recovery went."""
    if result.decision == "fenced":  # another coordinator recovers them
        return
    what = (f"recovered by refresh {result.refresh_id} (epoch {result.epoch}): "
            f"{result.reason}" if result.ok else
            f"recovery {result.refresh_id} (epoch {result.epoch}) held the fleet: "
            f"{result.reason}")
    for rec in found:
        await asyncio.to_thread(
            journal.update, rec["id"], only_open=True, ended_at=time.time(),
            decision="recovered" if result.ok else "abandoned",
            reason=f"interrupted after state {rec['state']}; {what}")
