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

A journal keeps its size bounded (:class:`.base.JournalBounds`); a URL may set the bounds
in its query: ``?keep_full=256&keep_summaries=4096`` (both stores) and, for etcd,
``&keep_revisions=1000`` (the etcd history the journal keeps when it compacts it; ``0``:
it does not, and etcd's own ``--auto-compaction-*`` must).

It sits below rlfleet.refresh (which writes it) and the status page and `rlfleet journal`
(which read it), and imports neither the trainer side nor the frontend."""

from __future__ import annotations

import urllib.parse
from pathlib import Path

from rlfleet.journal.base import JournalBounds, JournalError, JournalMissing, RefreshJournal
from rlfleet.journal.etcd import KEEP_REVISIONS, EtcdJournal
from rlfleet.journal.record import POLICY_ROLES, JournalRecord
from rlfleet.journal.sqlite import SqliteJournal

__all__ = ["POLICY_ROLES", "EtcdJournal", "JournalBounds", "JournalError", "JournalMissing",
           "JournalRecord", "RefreshJournal", "SqliteJournal", "open_journal"]

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
        if not parts.hostname or parts.fragment:
            raise ValueError(f"bad journal URL {text!r}: expected etcd://host:port[/name]")
        bounds, keep_revisions = _bounds(text, parts.query, etcd=True)
        return EtcdJournal(parts.hostname, parts.port or ETCD_DEFAULT_PORT, parts.path,
                           bounds=bounds, keep_revisions=keep_revisions)
    if parts.scheme == "sqlite":
        bounds, _ = _bounds(text, parts.query, etcd=False)
        return SqliteJournal(urllib.parse.unquote(parts.netloc + parts.path), create=create,
                             bounds=bounds)
    if parts.scheme not in ("", "file"):
        raise ValueError(f"unsupported journal {text!r}: use a file path, sqlite:///path, "
                         ":memory: or etcd://host:port")
    path = urllib.parse.unquote(parts.path) if parts.scheme == "file" else text
    return SqliteJournal(path, create=create)


def _bounds(url: str, query: str, etcd: bool) -> tuple[JournalBounds, int | None]:
    """The bounds a journal URL's query sets (rlfleet.journal.base.JournalBounds), and for
    etcd the revisions kept when the journal compacts etcd's history (None: it does not)."""
    known = ("keep_full", "keep_summaries") + (("keep_revisions",) if etcd else ())
    try:
        given = {k: int(v) for k, v in urllib.parse.parse_qsl(query, strict_parsing=bool(query))}
    except ValueError:
        raise ValueError(f"bad journal URL {url!r}: its query takes integers: "
                         f"{', '.join(f'{k}=N' for k in known)}") from None
    if unknown := sorted(set(given) - set(known)):
        raise ValueError(f"bad journal URL {url!r}: unknown {', '.join(unknown)} (it takes "
                         f"{', '.join(known)})")
    defaults = JournalBounds()
    bounds = JournalBounds(given.get("keep_full", defaults.keep_full),
                           given.get("keep_summaries", defaults.keep_summaries))
    keep = given.get("keep_revisions", KEEP_REVISIONS)
    return bounds, keep or None
