"""Discovery v1: the entry a worker publishes for each of its endpoints (`WorkerEntry`),
the committed policy a refresh coordinator publishes per model (`CommittedPolicy`), and
GET /v1/rl/workers, protocol version 1, which lists the `rl` ones (`RlWorker`)."""

from __future__ import annotations

import functools
from typing import Annotated, Any
from urllib.parse import urlsplit

import msgspec
from pydantic import BaseModel, Field, field_validator, model_validator

from rlfleet.protocol.identity import PolicyIdentity

PROTOCOL_VERSION = 1

#: the discovery component every worker registers under (`namespace/backend/<endpoint>/id`)
WORKER_COMPONENT = "backend"
GENERATE_ENDPOINT = "generate"  # what frontends route to
RL_ENDPOINT = "rl"  # what GET /v1/rl/workers lists (--enable-rl)


class WorkerEntry(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a worker publishes in discovery for one endpoint, republished whenever its
    state (admission, policy, fleet epoch) changes. Stored as `to_entry()`: optional fields
    are left out when absent, and the policy is spelled as its stamped fields
    (`weight_version`, `weight_digest`, `weight_step`: `PolicyIdentity.stamped`), in place."""

    namespace: str
    component: str  # WORKER_COMPONENT
    instance_id: int
    transport: dict[str, str]  # {"http": the request plane's URL}
    stream_plane: str  # host:port of the stream plane frontends use
    model: str  # the served model name
    model_path: str | None
    vocab_size: int | None
    max_model_len: int | None
    pid: int
    system_url: str | None = None  # the system server (admin routes), when it runs
    # where vLLM's native RL routes are served (the system server): Dynamo 1.7's name for it
    admin_base_url: str | None = None
    world_size: int  # the engine's ranks, TP x PP x DP (1 for the mocker)
    # the vLLM weight-transfer backend its engine was started with ("none": the mocker)
    weight_transfer_backend: str | None = None
    # admission (rlfleet.worker.admission): open to rollouts or not, and why
    gated: bool
    gate_reason: str | None = None
    weights_uncertain: str | None = None  # the worker's own hold
    controlled: bool = False  # a controller called set_admission on it
    fleet_policy: dict[str, Any] | None = None  # the policy it was last opened on
    policy: PolicyIdentity  # the policy it applied (stored as weight_<field>)
    # the LoRA adapters it serves beside its model, each its own policy: {adapter, version,
    # digest, step, rank, path, open} (rlfleet.worker.engine.AdapterState)
    adapters: list[dict[str, Any]] | None = None
    fleet_epoch: int  # the newest fleet epoch it has seen
    endpoint: str
    request_plane_url: str  # dyn://<namespace>.<component>.<endpoint>
    # its engine's KV-event publisher (rlfleet.protocol.kv_events), tcp://host:port to
    # connect to, and the engine's KV block size (in tokens)
    kv_events: str | None = None
    kv_block_size: int | None = None
    # the engine's --logprobs-mode and tokenizer (vLLM's model_config, which server-info
    # clients read: TRL checks logprobs_mode)
    logprobs_mode: str | None = None
    tokenizer: str | None = None

    def to_entry(self) -> dict[str, Any]:
        """The entry as discovery stores it."""
        out: dict[str, Any] = {}
        for name, value in msgspec.to_builtins(self).items():
            if name == "policy":
                out.update(self.policy.stamped())
            else:
                out[name] = value
        return out

    @classmethod
    def from_entry(cls, entry: dict[str, Any]) -> WorkerEntry:
        """An entry as discovery stores it (keys it does not know are ignored);
        msgspec.ValidationError says what is wrong with one that is not an entry."""
        return msgspec.convert({**entry, "policy": PolicyIdentity.from_stamped(entry)}, cls)


class CommittedPolicy(msgspec.Struct, kw_only=True, frozen=True):
    """The policy a fleet's refresh coordinator committed for one model, published in the
    discovery store as a record beside the entries (`record_name`), so that every frontend
    routes the model's requests only to workers that serve it (`serves`): a worker left out
    of a refresh serves the old policy whatever its lease says, and is not routed.

    The coordinator writes it when a transaction begins (the policy the fleet is committed
    to, and the one the transaction is `admitting`: a rolling refresh's reopened waves serve
    that one before it commits) and again when it commits (before a synchronous fleet
    reopens). A record of an older fleet `epoch` never replaces a newer one."""

    model: str
    epoch: int  # the fleet epoch of the transaction that wrote it (rlfleet.journal)
    refresh_id: int  # that transaction's journal record
    committed: PolicyIdentity | None = None  # None: not known (nothing is filtered)
    admitting: PolicyIdentity | None = None  # the target of the transaction under way
    written_at: float = 0.0  # time.time() of the write

    @staticmethod
    def record_name(namespace: str, model: str) -> str:
        """Its name among the store's records (`Discovery.put_record`)."""
        return f"{namespace}/committed-policy/{model}"

    @property
    def binding(self) -> bool:
        """Whether it names a policy a worker can be checked against (its digest)."""
        return self.committed is not None and self.committed.digest is not None

    def serves(self, policy: PolicyIdentity) -> bool:
        """Whether a worker serving `policy` serves the committed policy (or the one being
        admitted): the same weights, by content digest (a worker started from the
        committed checkpoint serves it before any coordinator gave it the step; a
        request's staleness bound still judges steps, rlfleet.frontend.router.within)."""
        return not self.binding or any(
            p is not None and p.digest is not None and p.digest == policy.digest
            for p in (self.committed, self.admitting))

    def describe(self) -> str:
        c = self.committed or PolicyIdentity()
        return (f"{c.version} ({c.digest}, step {c.step}), fleet epoch {self.epoch}"
                + (f", admitting {self.admitting.version} ({self.admitting.digest}, step "
                   f"{self.admitting.step})" if self.admitting else ""))

    def to_record(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> CommittedPolicy:
        """msgspec.ValidationError says what is wrong with one that is not a record."""
        return msgspec.convert(record, cls)


class RlWorker(BaseModel):
    namespace: str
    component: str
    endpoint: str
    instance_id: int = Field(ge=0, lt=2**64)
    transport: dict[str, str]
    request_plane_url: str
    routes: list[str] = Field(default_factory=list)
    system_url: str | None = None
    admin_base_url: str | None = None
    model: str | None = None
    world_size: int | None = Field(None, gt=0)
    weight_transfer_backend: str | None = Field(None, min_length=1)  # Dynamo 1.7's
    error: str | None = None
    # rlfleet extensions, from the worker's own entry: the policy it applied and the newest
    # fleet epoch it has seen (what a refresh coordinator starts from), its admission flag
    weight_version: str | None = None
    weight_digest: str | None = None
    weight_step: int | None = Field(None, ge=0)
    fleet_epoch: int | None = Field(None, ge=0)
    gated: bool | None = None
    adapters: list[dict[str, Any]] | None = None  # its LoRA adapters, each a policy

    @field_validator("transport")
    @classmethod
    def _one_transport(cls, v: dict[str, str]) -> dict[str, str]:
        if len(v) != 1:
            raise ValueError("transport names exactly one transport")
        return v

    @field_validator("admin_base_url")
    @classmethod
    def _admin(cls, v: str | None) -> str | None:
        if v is not None and not admin_url_ok(v):
            raise ValueError("admin_base_url must be http(s) without userinfo, query or fragment")
        return v

    @model_validator(mode="after")
    def _check(self) -> RlWorker:
        if self.admin_base_url is not None and self.world_size is None:
            raise ValueError("admin_base_url requires world_size")
        self.routes = sorted(set(self.routes))
        return self

    @classmethod
    def from_entry(cls, entry: dict[str, Any]) -> RlWorker:
        """The listing of one discovery entry; routes are filled in by the probe."""
        keys = set(cls.model_fields) - {"routes", "error"}
        return cls(**{k: v for k, v in entry.items() if k in keys and v is not None})

    def dump(self) -> dict[str, Any]:
        """Optional fields are omitted when absent, never null."""
        return self.model_dump(exclude_none=True)


@functools.lru_cache(maxsize=8192)  # each worker's, listed again and again
def admin_url_ok(url: str) -> bool:
    """RlWorker's rule for admin_base_url: http(s), without userinfo, query or fragment
    (ValueError: a URL urlsplit cannot split)."""
    u = urlsplit(url)
    return u.scheme in ("http", "https") and not (u.username or u.password or u.query
                                                  or u.fragment)


class RlWorkerStrict(msgspec.Struct):
    """RlWorker's fields and bounds in msgspec's strict types: on a listing of a thousand
    workers a fraction of pydantic's CPU (the RL listener lists with it, a refresh
    coordinator reads listings with it). What the types cannot say, `passes` checks; an
    entry either refuses (or a value RlWorker would coerce) is judged by RlWorker itself,
    whose error is the one reported. Used only while its fields are RlWorker's, in order
    (STRICT_MIRRORS)."""

    namespace: str
    component: str
    endpoint: str
    instance_id: Annotated[int, msgspec.Meta(ge=0)]
    transport: dict[str, str]
    request_plane_url: str
    routes: list[str] = []
    system_url: str | None = None
    admin_base_url: str | None = None
    model: str | None = None
    world_size: Annotated[int, msgspec.Meta(gt=0)] | None = None
    weight_transfer_backend: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    error: str | None = None
    weight_version: str | None = None
    weight_digest: str | None = None
    weight_step: Annotated[int, msgspec.Meta(ge=0)] | None = None
    fleet_epoch: Annotated[int, msgspec.Meta(ge=0)] | None = None
    gated: bool | None = None
    adapters: list[dict[str, Any]] | None = None

    def passes(self) -> bool:
        """RlWorker's checks beyond the types (False for an admin URL urlsplit refuses)."""
        admin = self.admin_base_url
        try:
            return self.instance_id < 2**64 and len(self.transport) == 1 and (
                admin is None or (self.world_size is not None and admin_url_ok(admin)))
        except ValueError:
            return False


STRICT_MIRRORS = RlWorkerStrict.__struct_fields__ == tuple(RlWorker.model_fields)


class SkippedEntry(BaseModel):
    """A discovery entry the listener could not list (unreadable, or failing the schema
    above); the rest of the listing is unaffected. An rlfleet extension to version 1."""

    where: str  # the file, etcd key or instance it came from
    error: str
    key: str | None = None  # namespace/component/endpoint/instance_id, when known


class RlWorkers(BaseModel):
    protocol_version: int
    namespace: str
    workers: list[RlWorker]
    skipped: list[SkippedEntry] = Field(default_factory=list)
    # an rlfleet extension: the discovery store's URL, where a refresh coordinator
    # publishes the committed policy (CommittedPolicy) that every frontend routes by
    discovery: str | None = None
