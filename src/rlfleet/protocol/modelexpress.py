"""ModelExpress's weight-transfer backend for vLLM (`--weight-transfer-config
'{"backend": "modelexpress"}'`; its code is in the `modelexpress` 0.7.0 wheel,
`modelexpress_rl/inference/engines/vllm/weight_transfer_engine.py`), as an rlfleet worker on
vLLM's CPU build serves it over rlfleet's weight plane (rlfleet.worker.modelexpress): the
bodies of /init_weight_transfer_engine (`init_info`) and /update_weights (`update_info`),
checked as ModelExpress checks them.

Where a version is: ModelExpress's receiver asks the ModelExpress server (`server_url`) for
the READY WeightVersion record, whose `object_storage.uri` names the version's index in S3
(ModelExpress's publisher checks that it lies under the `uri_prefix` it was configured
with); no environment variable or init field names the place. An rlfleet worker has no
ModelExpress server, so init_info carries the prefix (`object_storage_uri_prefix`, rlfleet's
one addition) and version V is read at `{object_storage_uri_prefix}/V/`
(`model.safetensors.index.json` and its shards): where the publisher writes V when the
server names its index `{uri_prefix}/V/model.safetensors.index.json`. How a ModelExpress
server names it is not in the wheel; a server that names versions otherwise does not fit."""

from __future__ import annotations

import math
from typing import Any, ClassVar

from rlfleet.protocol.admin import read_struct
from rlfleet.protocol.admin_base import AdminRequestError, Request

#: the backend's name in vLLM's weight-transfer registry (and --weight-transfer-config)
BACKEND = "modelexpress"
#: ModelExpress's ObjectStorageType values; its receiver reads S3 only
STORAGE_TYPES = ("S3", "AZURE", "GCS")
#: what an rlfleet worker needs in init_info (ModelExpress's four object-storage settings,
#: required together, and the prefix its server would know)
REQUIRED = ("object_storage_type", "initial_base_version_id", "seed_checkpoint_path",
            "refit_checkpoint_dir", "object_storage_uri_prefix")
#: counts and sizes that must be positive when given (ModelExpress's checks)
POSITIVE = ("refit_checkpoint_max_size_gb", "registration_ttl_seconds", "lease_ttl_seconds",
            "max_transfer_attempts", "max_replay_chain_length")


class ModelExpressInitInfo(Request, kw_only=True, frozen=True):
    """ModelExpress's `ModelExpressWeightTransferInitInfo` fields, and rlfleet's prefix.
    Used by an rlfleet worker: the prefix, the endpoint, the seed's version id and path.
    The others are checked as ModelExpress checks them and have no effect here (no server
    to register or lease with; versions are staged in the worker's staging area, not in
    `refit_checkpoint_dir`; the S3 region and credentials come from the worker's
    environment, as for every rlfleet S3 source)."""

    model_name: str | None = None
    initial_serving_version_id: str | None = None
    initial_base_version_id: str | None = None  # the seed's id: a delta on it names it as base
    seed_checkpoint_path: str | None = None  # the seed checkpoint on this worker (not uploaded)
    refit_checkpoint_dir: str | None = None  # ModelExpress's local cache of rebuilt versions
    refit_checkpoint_max_size_gb: int | None = 500
    server_url: str | None = None  # refused: an rlfleet worker has no ModelExpress server
    object_storage_type: str | None = None  # "S3"
    object_storage_endpoint_url: str | None = None  # http://host:port of the S3 service
    object_storage_region_name: str | None = None
    registration_ttl_seconds: int | None = None
    lease_ttl_seconds: int | None = None
    max_transfer_attempts: int = 3
    max_replay_chain_length: int = 64
    rpc_timeout_seconds: float = 30.0
    object_storage_uri_prefix: str | None = None  # rlfleet: s3://bucket/prefix, V under it

    def __post_init__(self) -> None:
        missing = [f for f in REQUIRED if not (getattr(self, f) or "").strip()]
        if missing:
            raise AdminRequestError(
                f"init_info: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                "required (an rlfleet worker reads ModelExpress versions from object storage: "
                f"it needs {', '.join(REQUIRED)})")
        if self.object_storage_type not in STORAGE_TYPES:
            raise AdminRequestError(f"unsupported object_storage_type="
                                    f"{self.object_storage_type!r} (one of {STORAGE_TYPES})")
        if self.object_storage_type != "S3":
            raise AdminRequestError("object_storage_type: only S3 object storage is currently "
                                    "supported")
        prefix = str(self.object_storage_uri_prefix)
        if not prefix.startswith("s3://") or not prefix[5:].strip("/"):
            raise AdminRequestError(f"object_storage_uri_prefix {prefix!r}: expected "
                                    "s3://bucket[/prefix], under which version V is V/")
        if self.server_url is not None:
            raise AdminRequestError("server_url: an rlfleet worker has no ModelExpress server "
                                    "to ask; it reads version V at object_storage_uri_prefix/V "
                                    "(leave server_url out)")
        if self.initial_serving_version_id is not None \
                and not self.initial_serving_version_id.strip():
            raise AdminRequestError("initial_serving_version_id must not be empty")
        for name in POSITIVE:
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise AdminRequestError(f"{name} must be positive")
        if not math.isfinite(self.rpc_timeout_seconds) or self.rpc_timeout_seconds <= 0:
            raise AdminRequestError("rpc_timeout_seconds must be finite and positive")

    def version_uri(self, version_id: str) -> str:
        """Where version `version_id` is: s3://bucket/prefix/VERSION."""
        return f"{str(self.object_storage_uri_prefix).rstrip('/')}/{version_id}"


class ModelExpressUpdateInfo(Request, kw_only=True, frozen=True):
    """ModelExpress's `ModelExpressWeightTransferUpdateInfo`: one immutable READY version."""

    version_id: str
    MESSAGES: ClassVar[dict[str, str]] = {"version_id": "version_id is required"}

    def __post_init__(self) -> None:
        if not self.version_id.strip():
            raise AdminRequestError("version_id is required")
        if "/" in self.version_id or self.version_id in (".", ".."):
            raise AdminRequestError(f"version_id {self.version_id!r}: a version is a directory "
                                    "under object_storage_uri_prefix (no '/')")


def read_init_info(raw: Any) -> ModelExpressInitInfo:
    """`init_info` checked (AdminRequestError names the field that does not fit)."""
    return read_struct(ModelExpressInitInfo, "init_info", raw)


def read_update_info(raw: Any) -> ModelExpressUpdateInfo:
    """`update_info`: an object, or vLLM's list of one per rank (they must name the same
    version: a worker stages one version for all its ranks)."""
    if not isinstance(raw, list):
        return read_struct(ModelExpressUpdateInfo, "update_info", raw)
    infos = [read_struct(ModelExpressUpdateInfo, "update_info", r) for r in raw]
    if not infos:
        raise AdminRequestError("update_info: an empty list names no version")
    if len({i.version_id for i in infos}) > 1:
        raise AdminRequestError("update_info: the ranks name different versions; a worker "
                                "stages one version for all its ranks")
    return infos[0]
