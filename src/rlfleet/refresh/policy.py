"""A policy a refresh moves a fleet to (or back to): which policy it is
(`rlfleet.protocol.identity.PolicyIdentity`: version, digest, fleet step) and where its
weights are (a checkpoint directory, tensors in memory, or a source workers stage from),
with the probe every worker must reproduce after installing it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from rlfleet.journal.record import JournalRecord
from rlfleet.protocol.identity import PolicyIdentity
from rlfleet.refresh.probe import Probe


@dataclass(frozen=True)
class Policy:
    """One policy: its identity, and where its weights are."""

    identity: PolicyIdentity
    path: str | None = None  # a checkpoint directory the workers can read
    tensors: Callable[[], Sequence[tuple[str, Any]]] | None = None  # the distributed path
    source: dict[str, Any] | None = None  # where workers stage it from (the staged path)
    probe: Probe | None = None  # what every worker must generate on it (None: agreement)

    @property
    def version(self) -> str | None:
        return self.identity.version

    @property
    def digest(self) -> str | None:
        return self.identity.digest

    @property
    def step(self) -> int | None:
        return self.identity.step

    def at_step(self, step: int) -> Policy:
        """This policy, given its fleet step."""
        identity = msgspec.structs.replace(self.identity, step=step)
        return dataclasses.replace(self, identity=identity)

    def with_digest(self, digest: str) -> Policy:
        """This policy, its content digest known."""
        identity = msgspec.structs.replace(self.identity, digest=digest)
        return dataclasses.replace(self, identity=identity)

    def is_held(self, holds: PolicyIdentity | None) -> bool:
        """Whether a worker that last reported holding `holds` holds this policy (its step
        too, when this policy has one)."""
        return holds is not None and (holds.version, holds.digest) == (
            self.version, self.digest) and (self.step is None or holds.step == self.step)

    @property
    def sendable(self) -> bool:
        """Whether its weights can be sent again (not only remembered)."""
        return self.path is not None or self.tensors is not None or self.source is not None

    @classmethod
    def from_journal(cls, row: JournalRecord, role: str, step_column: str | None = None
                     ) -> Policy:
        """The policy a journal record names in `role` (target, previous, served) with its
        `<role>_path` and `<role>_source`; a record that kept no step for it (written before
        the journal kept `target_step`) takes the one in `step_column`."""
        identity = row.policy(role)
        if identity.step is None and step_column is not None:
            identity = msgspec.structs.replace(identity, step=row.get(step_column))
        return cls(identity, path=row[f"{role}_path"], source=row.get(f"{role}_source"))
