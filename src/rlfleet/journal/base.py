"""What every journal store offers (`RefreshJournal`): what a coordinator, `rlfleet journal`
and the status page read and write. Writes go through one mapping (rlfleet.journal.record)
before a store sees them; a store implements the underscored methods.

A journal stays the same size however long the run (`JournalBounds`): after the newest
`keep_full` ended transactions, older ones are compacted to a summary (their decision,
policies, times and reason; their workers' entries and timed steps dropped), and after
`keep_summaries` more, folded into the fleet's history (a count per decision, the first
and last of them). Never compacted: a transaction still unfinished (recovery finds every
one), and never folded: the last verified one of each fleet and model selection (what a
rollback returns to). Compaction runs as each transaction opens. What each worker was last
seen holding comes from the transactions kept whole."""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass
from typing import Any, Self

from rlfleet.journal.record import JournalRecord, stored_columns
from rlfleet.protocol.identity import PolicyIdentity


class JournalError(RuntimeError):
    """The journal's store failed or refused an operation; the message says which."""


class JournalMissing(JournalError):
    """A reader asked for a journal that does not exist (yet): no coordinator wrote it."""


@dataclass(frozen=True)
class JournalBounds:
    """How much of its past a journal keeps (module doc)."""

    keep_full: int = 256  # the newest ended transactions, kept whole
    keep_summaries: int = 4096  # the ones before them, kept as summaries

    def __post_init__(self) -> None:
        if self.keep_full < 1 or self.keep_summaries < 0:
            raise ValueError(f"a journal keeps at least one transaction whole and 0 or more "
                             f"summaries, not {self}")


def fold(history: dict[str, Any] | None, rec: dict[str, Any]) -> dict[str, Any]:
    """A fleet and model selection's history with transaction `rec` folded in."""
    h = dict(history or {"transactions": 0, "decisions": {}, "first_id": rec["id"],
                         "first_at": rec.get("started_at")})
    h["transactions"] += 1
    decision = rec.get("decision") or "unfinished"
    h["decisions"] = {**h["decisions"], decision: h["decisions"].get(decision, 0) + 1}
    h["first_id"] = min(h["first_id"], rec["id"])
    h["last_id"] = max(h.get("last_id") or 0, rec["id"])
    h["last_at"] = max(h.get("last_at") or 0, rec.get("ended_at") or rec.get("started_at") or 0)
    return h


class RefreshJournal(abc.ABC):
    """The journal of one store; `path` names it in messages (as `open_journal` takes it)."""

    path: str
    bounds: JournalBounds = JournalBounds()

    # ---------------------------------------------------------------- writes

    def open_transaction(self, *, fleet: str | None, floor_epoch: int = 0,
                         **fields: Any) -> tuple[int, int]:
        """Take the fleet's next epoch (above `floor_epoch`, the newest its workers report)
        and record a transaction that holds it, in one atomic write; (id, epoch). `fields`:
        columns, and the policies by role (`target=`, `previous=`: PolicyIdentity)."""
        columns = {"started_at": time.time(), "state": "started", **stored_columns(fields),
                   "fleet": fleet}
        opened = self._open(fleet, floor_epoch, columns)
        self.compact()
        return opened

    def compact(self) -> dict[str, int]:
        """Compact and fold what the bounds no longer keep whole (module doc); how many
        records were compacted and folded. Runs as each transaction opens."""
        return self._compact(self.bounds)

    def begin(self, **fields: Any) -> int:
        """Record a transaction (it takes the next epoch of its `fleet`); its id."""
        return self.open_transaction(**{"fleet": None, **fields})[0]

    def update(self, refresh_id: int, *, only_open: bool = False, **fields: Any) -> bool:
        """Change a record (`fields` as for `open_transaction`; `served=` the policy it ended
        on); with `only_open`, only while it has not ended (a coordinator that was taken
        over must not rewrite what its successor recorded). Whether it changed."""
        return self._update(refresh_id, only_open, stored_columns(fields))

    # ---------------------------------------------------------------- reads

    def get(self, refresh_id: int) -> JournalRecord:
        found = self._find(refresh_id)
        if found is None:
            raise KeyError(f"no refresh {refresh_id} in {self.path}")
        return found

    @abc.abstractmethod
    def recent(self, limit: int = 20) -> list[JournalRecord]:
        """The newest records, newest first."""

    @abc.abstractmethod
    def last_served(self, fleet: str | None, model: str | None, *,
                    workers: bool = True) -> JournalRecord | None:
        """The latest transaction of this fleet (and model selection) that ended with
        verified workers serving one policy (`served`): what a rollback returns to.
        `workers=False`: without its workers' entries (`workers` reads empty), which in a
        refresh of many workers are most of a record (their calls and probe answers)."""

    def holdings(self, fleet: str | None, model: str | None) -> dict[int, PolicyIdentity]:
        """What each worker of this fleet was last seen holding, from the newest transaction
        that saw it."""
        return {iid: PolicyIdentity.from_dict(holds)
                for iid, holds in self._holdings(fleet, model).items()}

    @abc.abstractmethod
    def unfinished(self, fleet: str | None, model: str | None,
                   before_epoch: int) -> list[JournalRecord]:
        """Transactions of this fleet and model selection, from an epoch older than
        `before_epoch`, that never ended (oldest first)."""

    @abc.abstractmethod
    def fleet_epoch(self, fleet: str | None) -> int:
        """The newest epoch the fleet's transactions took (0: none yet)."""

    @abc.abstractmethod
    def history(self) -> list[dict[str, Any]]:
        """What was folded, per fleet and model selection: `fleet`, `model`, `transactions`,
        `decisions` (a count each), `first_id`, `last_id`, `first_at`, `last_at`."""

    @abc.abstractmethod
    def size(self) -> dict[str, int]:
        """What the journal holds: `records`, `full` (kept whole), `summaries`, `folded`
        (transactions in the history) and `bytes` (the store's, as near as it can say)."""

    def close(self) -> None:  # noqa: B027 - a store may hold nothing to release
        """Release the store."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- what a store does

    @abc.abstractmethod
    def _open(self, fleet: str | None, floor_epoch: int,
              columns: dict[str, Any]) -> tuple[int, int]:
        """Take the fleet's next epoch above `floor_epoch` and insert a record of `columns`
        with it as `fleet_epoch`, atomically; (id, epoch)."""

    @abc.abstractmethod
    def _update(self, refresh_id: int, only_open: bool, columns: dict[str, Any]) -> bool: ...

    @abc.abstractmethod
    def _find(self, refresh_id: int) -> JournalRecord | None: ...

    @abc.abstractmethod
    def _compact(self, bounds: JournalBounds) -> dict[str, int]: ...

    @abc.abstractmethod
    def _holdings(self, fleet: str | None, model: str | None) -> dict[int, dict[str, Any]]:
        """Per worker, the `holds` (PolicyIdentity.to_dict) of the newest record that has
        one for it."""


def holdings_of(records: list[JournalRecord]) -> dict[int, dict[str, Any]]:
    """Per worker, what the newest of `records` (newest first) saw it holding."""
    out: dict[int, dict[str, Any]] = {}
    for row in records:
        for iid, w in (row.get("workers") or {}).items():
            if w.get("holds") and int(iid) not in out:
                out[int(iid)] = w["holds"]
    return out
