"""The refresh journal: one record per fleet transaction (a policy refresh, the admission of
new workers, the recovery of an interrupted one) with everything needed to tell later what
happened and why, and the fleet's epoch counter.

It is the source of truth a coordinator starts from: the fleet's last verified policy
(`last_served`), what each worker was last seen holding (`holdings`), and the transactions
a coordinator began but never finished (`unfinished`: it crashed, or was paused and taken
over). Each transaction takes the fleet's next epoch with a compare-and-set in the same
write that records it (`open_transaction`), so two coordinators on one store never share an
epoch, and workers refuse the older one (rlfleet.worker.system_server.FleetFence).

One interface (:mod:`.base`: `RefreshJournal`), records and the policies they name
(:mod:`.record`), and a store per module, chosen by `open_journal`: a SQLite file
(:mod:`.sqlite`, the default; `:memory:` for a coordinator that keeps nothing) or etcd
(:mod:`.etcd`, ``etcd://host:port[/name]``) for coordinators on several hosts.

It sits below rlfleet.refresh (which writes it) and the status page and `rlfleet journal`
(which read it), and imports neither the trainer side nor the frontend."""

from __future__ import annotations

import urllib.parse
from pathlib import Path

from rlfleet.journal.base import JournalError, JournalMissing, RefreshJournal
from rlfleet.journal.etcd import EtcdJournal
from rlfleet.journal.record import POLICY_ROLES, JournalRecord
from rlfleet.journal.sqlite import SqliteJournal

__all__ = ["POLICY_ROLES", "EtcdJournal", "JournalError", "JournalMissing", "JournalRecord",
           "RefreshJournal", "SqliteJournal", "open_journal"]

ETCD_DEFAULT_PORT = 2379


def open_journal(where: RefreshJournal | str | Path, *, create: bool = True) -> RefreshJournal:
    """A journal from what a user gives: one already open, ``etcd://host:port[/name]``,
    ``sqlite:///path``, a file path, or ``:memory:``. `create=False` (a reader: `rlfleet
    journal`, the status page): a SQLite file that does not exist raises JournalMissing
    instead of being made (an etcd journal with no records is just empty)."""
    if isinstance(where, RefreshJournal):
        return where
    text = str(where)
    parts = urllib.parse.urlsplit(text)
    if parts.scheme == "etcd":
        if not parts.hostname or parts.query or parts.fragment:
            raise ValueError(f"bad journal URL {text!r}: expected etcd://host:port[/name]")
        return EtcdJournal(parts.hostname, parts.port or ETCD_DEFAULT_PORT, parts.path)
    if parts.scheme == "sqlite":
        return SqliteJournal(urllib.parse.unquote(parts.netloc + parts.path), create=create)
    if parts.scheme not in ("", "file"):
        raise ValueError(f"unsupported journal {text!r}: use a file path, sqlite:///path, "
                         ":memory: or etcd://host:port")
    path = urllib.parse.unquote(parts.path) if parts.scheme == "file" else text
    return SqliteJournal(path, create=create)
