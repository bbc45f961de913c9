"""The fleet's committed policy, published where every frontend reads it: one record per
model in the discovery store (rlfleet.protocol.rl.CommittedPolicy), written by the refresh
coordinator when a transaction begins (committed: the policy the fleet serves; admitting:
the transaction's target) and when it commits (before a synchronous fleet reopens). A
frontend routes a model's requests only to workers serving one of the two, so a worker the
coordinator left out of a refresh is not routed on its old weights whatever its lease.

The store is the one the frontend's RL listener names (`discovery` in GET /v1/rl/workers),
or RefreshConfig.discovery. A record of a newer fleet epoch that the fleet's workers have
seen is never replaced (a coordinator that was taken over writes nothing over its
successor's); one of an epoch no worker has seen is an earlier fleet's (a new fleet with a
new journal counts epochs from the start again) and is replaced. Publishing never
fails a refresh: a store that cannot be written is reported (the frontends then route by
the last record they read)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

import msgspec

from rlfleet.protocol.identity import PolicyIdentity
from rlfleet.protocol.rl import CommittedPolicy
from rlfleet.runtime.discovery import DiscoveryError, open_discovery

log = logging.getLogger("rlfleet.refresh")

DEADLINE = 10.0  # seconds for one publication, every model included


async def publish(url: str | None, namespace: str | None, models: Iterable[str], *,
                  epoch: int, refresh_id: int, committed: PolicyIdentity | None,
                  admitting: PolicyIdentity | None, seen_epoch: int = 0,
                  on_event: Callable[[str], None]) -> bool:
    """Write the models' committed-policy records; whether every one was written (False
    also when there is nowhere to write: no store, namespace or model known).
    `seen_epoch`: the newest fleet epoch the fleet's workers report."""
    models = sorted(set(models))
    if not url or not namespace or not models:
        log.debug("no committed policy published: store %r, namespace %r, models %r",
                  url, namespace, models)
        return False
    records = [CommittedPolicy(model=m, epoch=epoch, refresh_id=refresh_id,
                               committed=committed or None, admitting=admitting or None,
                               written_at=time.time()) for m in models]
    try:
        async with asyncio.timeout(DEADLINE):
            async with open_discovery(url) as store:
                for rec in records:
                    await _put_unless_newer(store, namespace, rec, seen_epoch, on_event)
        return True
    except (DiscoveryError, TimeoutError, ValueError, msgspec.ValidationError) as e:
        on_event(f"[refresh {refresh_id}] could not publish the committed policy in {url}: "
                 f"{e!r} (frontends route by the last one they read)")
        return False


async def _put_unless_newer(store, namespace: str, rec: CommittedPolicy, seen_epoch: int,
                            on_event: Callable[[str], None]) -> None:
    name = CommittedPolicy.record_name(namespace, rec.model)
    raw = await store.get_record(name)
    if raw is not None:
        try:
            old = CommittedPolicy.from_record(raw)
        except msgspec.ValidationError:
            old = None  # not a record: replaced
        if old is not None and rec.epoch < old.epoch <= max(seen_epoch, rec.epoch):
            on_event(f"[refresh {rec.refresh_id}] the committed policy of {rec.model} is "
                     f"from a newer fleet epoch ({old.epoch} > {rec.epoch}): left as it is")
            return
        if old is not None and old.epoch > rec.epoch:
            on_event(f"[refresh {rec.refresh_id}] replacing the committed policy of "
                     f"{rec.model} from fleet epoch {old.epoch}, which no worker of this "
                     "fleet has seen (an earlier fleet's)")
    await store.put_record(name, rec.to_record())
