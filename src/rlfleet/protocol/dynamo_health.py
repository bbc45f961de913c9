"""Dynamo's frontend health and liveness bodies (its `lib/llm/src/http/service/health.rs`), as
rlfleet's frontend adds them to its own `/health` and answers `/live`: the discovery instances
it sees, one per worker and endpoint, and the endpoint URLs they serve. RL frameworks with a
Dynamo backend wait on them: NeMo RL's managed runtime counts the `backend` instances of its
namespace on the endpoints `generate` and `rl` (the two ID sets must be equal), verl-recipe's
Dynamo server counts the `generate` ones."""

from __future__ import annotations

from typing import Any

import msgspec


class Instance(msgspec.Struct, kw_only=True):
    """One registered endpoint of one worker (Dynamo's `Instance`)."""

    namespace: str
    component: str
    endpoint: str
    instance_id: int
    transport: dict[str, str]  # {"http": URL} for rlfleet's workers


class Live(msgspec.Struct, kw_only=True):
    status: str = "live"
    message: str = "Service is live"


#: `/health`'s `message` for each of rlfleet's statuses (Dynamo's status, where it has one)
HEALTH_MESSAGES = {"healthy": "Service is healthy",
                   "no_workers": "No worker serves a model yet"}


def endpoint_url(namespace: str, component: str, endpoint: str) -> str:
    """The endpoint's URL as Dynamo lists it under `endpoints`."""
    return f"dyn://{namespace}.{component}.{endpoint}"


def instance_of(entry: dict[str, Any]) -> Instance | None:
    """The instance a discovery entry registers, or None: an entry without those fields."""
    try:
        return msgspec.convert({k: entry.get(k) for k in Instance.__struct_fields__}, Instance)
    except msgspec.ValidationError:
        return None


def instances_of(entries: list[dict[str, Any]]) -> list[Instance]:
    """The entries' instances, in (namespace, component, endpoint, instance_id) order."""
    found = [i for i in map(instance_of, entries) if i is not None]
    return sorted(found, key=lambda i: (i.namespace, i.component, i.endpoint, i.instance_id))


def endpoints_of(instances: list[Instance]) -> list[str]:
    """The distinct endpoint URLs of `instances`, sorted."""
    return sorted({endpoint_url(i.namespace, i.component, i.endpoint) for i in instances})
