"""Retention: which policy versions a run keeps, and the collection that releases and evicts
the rest of a catalog's versions (rlfleet.weights.catalog) and removes their bytes from
every location they were published to (a directory, S3).

Kept, per model, each with the first reason that applies (`RetentionPlan.kept`):

1. ``latest``: one of the last `retain` READY versions (by the time each became READY);
2. ``leased``: a live lease holds it (a worker staging it from the store: rlfleet.weights
   .staging takes one for as long as its transfer reads the store's bytes);
3. ``held``: a worker holds it applied (the catalog's holders: it serves it, and peers
   stage it from that worker); given the workers in use (`workers`: those the refresh
   journal saw lately, `journal_workers`), a holder among none of them is not counted (a
   worker killed without a clean stop never took its name off);
4. pinned by the caller (`pins`): from the refresh journal (`journal_pins`), the fleet's last
   verified policy, which a rollback reinstalls, what each worker was last seen holding, and
   the targets of transactions still unfinished;
5. ``publishing``: STAGING (its parts still being written) for less than `abandon_after`;
6. ``base``: a link of the delta chain of a version kept above, down to its full version
   (a delta is never left without the base it needs).

Everything else READY or STAGING is released (RELEASING: leases already held stay valid,
none is granted); a RELEASING version that no live lease holds is evicted (EVICTED) and its
bytes removed, index first. An EVICTED record stays as a tombstone, so that a request for
the version is refused by its name and state (a worker's stage_weights answers "version V
is EVICTED in the catalog"), for the newest `tombstones` of each model; older ones are
forgotten. Each step is recorded on the version in the catalog (`released_at`,
`release_reason`, `evicted_at`, `removed_at`): a collection cut short (the process died
after a version was marked EVICTED and before its bytes were gone) is finished by the next.

`collect` runs on publish (`Publisher(retention=...)`) and as `rlfleet weights gc`
(``--dry-run``: the plan, nothing changed)."""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.parse
from collections.abc import Collection, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from rlfleet.weights import artifacts as art
from rlfleet.weights.catalog import (
    MAX_CHAIN,
    Catalog,
    CatalogError,
    PayloadFormat,
    VersionState,
    WeightVersion,
)

log = logging.getLogger("rlfleet.weights.retention")

#: READY versions kept per model besides those in use (`--retain-versions`)
DEFAULT_RETAIN = 4
#: EVICTED records kept per model as tombstones (refused by name), the newest first
DEFAULT_TOMBSTONES = 256
#: seconds a version may stay STAGING (a publish under way) before it counts as abandoned
DEFAULT_ABANDON_AFTER = 3600.0


@dataclass(frozen=True)
class Retention:
    """What a collection keeps (module doc)."""

    retain: int = DEFAULT_RETAIN
    tombstones: int = DEFAULT_TOMBSTONES
    abandon_after: float = DEFAULT_ABANDON_AFTER

    def __post_init__(self) -> None:
        if self.retain < 1:
            raise ValueError(f"retain_versions must be at least 1 (the newest version is the "
                             f"next delta's base), not {self.retain}")
        if self.tombstones < 0:
            raise ValueError(f"tombstones must be 0 or more, not {self.tombstones}")


@dataclass
class RetentionPlan:
    """What one collection keeps and does, by version name."""

    kept: dict[str, str] = field(default_factory=dict)  # version -> why it is kept
    release: dict[str, str] = field(default_factory=dict)  # READY/STAGING -> RELEASING, why
    evict: list[str] = field(default_factory=list)  # RELEASING, no live lease: evicted
    waiting: dict[str, str] = field(default_factory=dict)  # RELEASING, a lease holds it
    unfinished: list[str] = field(default_factory=list)  # EVICTED, bytes not yet removed
    forget: list[str] = field(default_factory=list)  # tombstones past the bound
    broken: dict[str, str] = field(default_factory=dict)  # kept deltas missing a base

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _by_age(versions: Iterable[WeightVersion]) -> list[WeightVersion]:
    """Oldest first (by the time each became READY, else was created)."""
    return sorted(versions, key=lambda v: (v.ready_at or v.created_at, v.version))


def _keep_reasons(versions: list[WeightVersion], policy: Retention, pins: Mapping[str, str],
                  now: float, workers: Collection[str] | None) -> dict[str, str]:
    """Every version kept for its own sake (rules 1-5 of the module doc), and why."""
    kept: dict[str, str] = {}
    models: dict[str, list[WeightVersion]] = {}
    for v in versions:
        models.setdefault(v.model, []).append(v)
    for group in models.values():
        ready = [v for v in _by_age(group) if v.state is VersionState.READY]
        for v in ready[-policy.retain:]:
            kept.setdefault(v.version, f"one of the last {policy.retain} READY versions")
    for v in versions:
        if v.state is VersionState.EVICTED:
            continue
        if leases := v.live_leases(now):
            holders = ", ".join(sorted({lease.holder for lease in leases}))
            kept.setdefault(v.version, f"leased by {holders}")
        elif holders := [w for w in v.holders if workers is None or w in workers]:
            kept.setdefault(v.version, f"held applied by worker(s) {', '.join(sorted(holders))}")
        elif v.version in pins:
            kept.setdefault(v.version, pins[v.version])
        elif v.state is VersionState.STAGING and now - v.created_at < policy.abandon_after:
            kept.setdefault(v.version, "being published")
    return kept


def plan(versions: list[WeightVersion], policy: Retention = Retention(),
         pins: Mapping[str, str] | None = None, now: float | None = None,
         workers: Collection[str] | None = None) -> RetentionPlan:
    """What a collection over `versions` (a catalog's listing) keeps and does."""
    now = time.time() if now is None else now
    by_name = {v.version: v for v in versions}
    out = RetentionPlan(kept=_keep_reasons(versions, policy, pins or {}, now, workers))
    for name in list(out.kept):  # the chains of the kept deltas, down to a full version
        v, links = by_name[name], 0
        while v.format is PayloadFormat.XOR_DELTA and v.base_version and links < MAX_CHAIN:
            base = by_name.get(v.base_version)
            if base is None or base.state is VersionState.EVICTED:
                out.broken[name] = (f"its base {v.base_version} is "
                                    f"{'gone' if base is None else 'EVICTED'}")
                break
            out.kept.setdefault(base.version, f"a base of {name}")
            v, links = base, links + 1
    for v in _by_age(versions):
        if v.version in out.kept:
            continue
        if v.state in (VersionState.READY, VersionState.STAGING):
            out.release[v.version] = ("abandoned while publishing" if v.state is
                                      VersionState.STAGING else "not kept by retention")
        if v.state in (VersionState.READY, VersionState.STAGING, VersionState.RELEASING):
            if leases := v.live_leases(now):
                holders = ", ".join(sorted({lease.holder for lease in leases}))
                out.waiting[v.version] = f"leased by {holders}: evicted once they let go"
            else:
                out.evict.append(v.version)
        elif v.state is VersionState.EVICTED and v.removed_at is None:
            out.unfinished.append(v.version)
    for model in sorted({v.model for v in versions}):
        dead = [v for v in _by_age(versions) if v.model == model
                and v.state is VersionState.EVICTED and v.removed_at is not None]
        out.forget += [v.version for v in dead[:max(0, len(dead) - policy.tombstones)]]
    return out


class ByteRemover:
    """Removes a version's files from every location the catalog records for it; one
    storage client per location's root, made on first use."""

    def __init__(self, endpoint_url: str | None = None) -> None:
        self.endpoint_url = endpoint_url
        self._storages: dict[str, art.Storage] = {}

    def _storage(self, root: str) -> art.Storage:
        if root not in self._storages:
            self._storages[root] = art.open_storage(root, self.endpoint_url)
        return self._storages[root]

    def remove(self, v: WeightVersion) -> None:
        for location in v.locations:
            if urllib.parse.urlsplit(location).scheme in ("http", "https"):
                continue  # a trainer's or a peer's server: its files are its own
            root, name = art.split_version_uri(location)
            self._storage(root).delete_version(name)

    def close(self) -> None:
        for s in self._storages.values():
            s.close()
        self._storages.clear()


async def collect(catalog: Catalog, policy: Retention = Retention(), *,
                  pins: Mapping[str, str] | None = None, dry_run: bool = False,
                  endpoint_url: str | None = None,
                  workers: Collection[str] | None = None) -> dict[str, Any]:
    """Plan over the catalog's versions and carry it out (`dry_run`: only plan); a report:
    the plan, and what was released, evicted, finished and forgotten, with the bytes the
    evicted versions held (their tensors' size, the catalog's `size`)."""
    t0 = time.monotonic()
    versions = await catalog.list()
    p = plan(versions, policy, pins, workers=workers)
    done: dict[str, list[str]] = {"released": [], "evicted": [], "finished": [],
                                  "forgotten": []}
    if not dry_run:
        remover = ByteRemover(endpoint_url)

        async def remove(v: WeightVersion) -> None:
            await asyncio.to_thread(remover.remove, v)
        try:
            for name, why in p.release.items():
                v = await catalog.delete(name, reason=f"retention: {why}", if_unused=True,
                                         workers=workers)
                if v.state is VersionState.RELEASING:
                    done["released"].append(name)
            refused = set(p.release) - set(done["released"])  # became used meanwhile
            for name in p.evict:
                if name not in refused and await catalog.evict(name, remove):
                    done["evicted"].append(name)
            for name in p.unfinished:
                await catalog.remove_evicted(name, remove)
                done["finished"].append(name)
            for name in p.forget:
                if await catalog.forget(name):
                    done["forgotten"].append(name)
        finally:
            remover.close()
    sizes = {v.version: v.size for v in versions}
    report = {"dry_run": dry_run, **p.to_json(), **done,
              "versions": len(versions), "seconds": round(time.monotonic() - t0, 4),
              "kept_bytes": sum(sizes[n] for n in p.kept)}
    for name, why in p.broken.items():
        log.warning("retention: kept version %s cannot be rebuilt: %s", name, why)
    return report


def journal_pins(journal: Any, recent: int = 64) -> dict[str, str]:
    """The versions the refresh journal says are in use, with why: for each fleet and model
    among its `recent` newest transactions, the last verified policy (what a rollback
    reinstalls), what each worker was last seen holding, and the target and previous policy
    of every transaction still unfinished."""
    pins: dict[str, str] = {}
    records = journal.recent(recent)
    for fleet, model in sorted({(r.get("fleet"), r.get("model")) for r in records},
                               key=lambda fm: (str(fm[0]), str(fm[1]))):
        row = journal.last_served(fleet, model, workers=False)
        if row is not None and row.served.version:
            pins.setdefault(row.served.version, f"the last verified policy of fleet {fleet} "
                                                "(a rollback reinstalls it)")
        for iid, holds in journal.holdings(fleet, model).items():
            if holds.version:
                pins.setdefault(holds.version, f"worker {iid} of fleet {fleet} was last seen "
                                               "holding it")
        for rec in journal.unfinished(fleet, model, 1 << 62):
            for role in ("target", "previous"):
                if rec.policy(role).version:
                    pins.setdefault(rec.policy(role).version,
                                    f"the {role} of unfinished refresh {rec['id']}")
    return pins


def journal_workers(journal: Any, recent: int = 64) -> frozenset[str]:
    """The workers the refresh journal saw lately (by instance ID, as the catalog names its
    holders): those in the holdings of every fleet and model among its `recent` newest
    transactions (the holdings come from the transactions it keeps whole)."""
    out: set[str] = set()
    for fleet, model in {(r.get("fleet"), r.get("model")) for r in journal.recent(recent)}:
        out.update(str(iid) for iid in journal.holdings(fleet, model))
    return frozenset(out)


async def collect_url(catalog_url: str, policy: Retention = Retention(), *,
                      pins: Mapping[str, str] | None = None, dry_run: bool = False,
                      endpoint_url: str | None = None,
                      workers: Collection[str] | None = None) -> dict[str, Any]:
    """`collect` over the catalog at `catalog_url`."""
    cat = Catalog(catalog_url)
    try:
        return await collect(cat, policy, pins=pins, dry_run=dry_run, endpoint_url=endpoint_url,
                             workers=workers)
    finally:
        await cat.close()


__all__ = ["DEFAULT_RETAIN", "ByteRemover", "CatalogError", "Retention", "RetentionPlan",
           "collect", "collect_url", "journal_pins", "journal_workers", "plan"]
