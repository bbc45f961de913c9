"""One transaction's record as the journal keeps it: its columns (one table, which the SQLite
schema and the etcd records both follow) and the policies it names.

A record names three policies, by role: the `target` it set out to install, the `previous`
one the fleet served before, and the one it ended `served` on by verified workers (none when
it held the fleet). Each is a PolicyIdentity, kept in the columns `<role>_<field>` (one per
field of PolicyIdentity: `target_version`, `served_digest`, `served_step`, ...). This module
is the one place that spells them: writers give `served=PolicyIdentity(...)`
(`stored_columns`), readers get `record.served` (`JournalRecord.policy`), so a field added to
PolicyIdentity becomes a column here with no other edit (older SQLite journals get it on
open)."""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from typing import Any

import msgspec

from rlfleet.protocol.identity import UNKNOWN, PolicyIdentity

POLICY_ROLES = ("target", "previous", "served")


def _sql_type(annotation: Any) -> str:
    union = typing.get_origin(annotation) in (types.UnionType, typing.Union)
    kinds = set(typing.get_args(annotation)) if union else {annotation}
    kinds.discard(type(None))
    kinds.discard(msgspec.UnsetType)  # a field left out while unknown (the adapter)
    if kinds == {str}:
        return "TEXT"
    if kinds and kinds <= {int, bool}:
        return "INTEGER"
    if kinds == {float}:
        return "REAL"
    raise TypeError(f"a journal column holds str, int or float, not {annotation!r}: give "
                    "PolicyIdentity's new field one of those or a mapping in "
                    "rlfleet.journal.record")


#: PolicyIdentity's fields and the SQLite type of each one's column
IDENTITY_FIELDS = {f.name: _sql_type(f.type) for f in msgspec.structs.fields(PolicyIdentity)}


def policy_column(role: str, field: str) -> str:
    """The column that keeps `field` of the policy in `role`."""
    return f"{role}_{field}"


IDENTITY_COLUMNS = {policy_column(role, f): role for role in POLICY_ROLES
                    for f in IDENTITY_FIELDS}
#: the column whose value says that a transaction ended with verified workers on one policy
SERVED_MARK = policy_column("served", "digest")

#: every column and its SQLite type; a journal written before a column existed gets it when
#: it is opened (every column added since the first release may be null or has a default)
COLUMNS: dict[str, str] = {
    "id": "INTEGER PRIMARY KEY AUTOINCREMENT",
    "started_at": "REAL NOT NULL",
    "ended_at": "REAL",
    "framework_step": "INTEGER",
    "fleet": "TEXT",
    "model": "TEXT",
    "kind": "TEXT",  # refresh | admit | recovery
    "fleet_epoch": "INTEGER",
    "state": "TEXT",
    "recovery_of": "INTEGER",
    "update_path": "TEXT NOT NULL",
    "target_path": "TEXT",
    "target_source": "TEXT",
    "served_path": "TEXT",
    "served_source": "TEXT",
    **{column: IDENTITY_FIELDS[column.removeprefix(f"{role}_")]
       for column, role in IDENTITY_COLUMNS.items()},
    "verified_workers": "TEXT NOT NULL DEFAULT '[]'",
    "intended_workers": "TEXT NOT NULL DEFAULT '[]'",
    "decision": "TEXT",
    "reason": "TEXT",
    "steps": "TEXT NOT NULL DEFAULT '[]'",
    "workers": "TEXT NOT NULL DEFAULT '{}'",
    # 1: a summary (its workers' entries and steps dropped: rlfleet.journal.base.JournalBounds)
    "compacted": "INTEGER",
}
#: the columns that hold JSON (SQLite keeps their text)
JSON_COLUMNS = frozenset({"intended_workers", "verified_workers", "steps", "workers",
                          "target_source", "served_source"})
#: what a never-written collection column reads as (made afresh for each record)
_EMPTY = {"verified_workers": list, "intended_workers": list, "steps": list, "workers": dict}


class JournalRecord(dict[str, Any]):
    """One transaction: its columns by name (every column, null when never written; what
    `rlfleet journal --json` prints), and the policies it names as PolicyIdentity."""

    def policy(self, role: str) -> PolicyIdentity:
        """The policy in `role` (one of POLICY_ROLES); unknown fields are None."""
        return PolicyIdentity.from_dict({f: self.get(policy_column(role, f))
                                         for f in IDENTITY_FIELDS})

    @property
    def target(self) -> PolicyIdentity:
        """The policy the transaction set out to install."""
        return self.policy("target")

    @property
    def previous(self) -> PolicyIdentity:
        """The policy the fleet served when it began."""
        return self.policy("previous")

    @property
    def served(self) -> PolicyIdentity:
        """The policy it ended on, served by verified workers (unknown, i.e. false, when it
        held the fleet or has not ended)."""
        return self.policy("served")


def journal_record(stored: Mapping[str, Any]) -> JournalRecord:
    """A record from what a store kept (JSON columns decoded)."""
    out = JournalRecord(dict.fromkeys(COLUMNS))
    out.update({name: empty() for name, empty in _EMPTY.items()})
    out.update(stored)
    return out


def stored_columns(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The columns a write sets: a policy given by its role (`target=`, `previous=`,
    `served=`: a PolicyIdentity, or None for unknown) as its identity's columns; other
    names as they are. A policy's columns are set through its role only, and a name that
    is no column is refused (both stores keep the same records)."""
    out: dict[str, Any] = {}
    for name, value in fields.items():
        if name in POLICY_ROLES:
            identity = UNKNOWN if value is None else value
            out.update({policy_column(name, f): v for f, v in identity.to_dict().items()})
        elif name in IDENTITY_COLUMNS:
            raise ValueError(f"journal: give the {IDENTITY_COLUMNS[name]} policy as "
                             f"{IDENTITY_COLUMNS[name]}=PolicyIdentity(...), not {name}=")
        elif name not in COLUMNS:
            raise ValueError(f"journal: a record has no column {name!r}")
        else:
            out[name] = value
    return out
