"""Request bodies of the vLLM-flavoured /engine routes, parsed and checked in one place for
every engine (the vLLM worker and the mocker). A bad body raises `AdminRequestError`, which
the system server answers with the contract's 200 `{"status": "error", "message"}`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PAUSE_MODES = ("keep", "wait", "abort")

# a refresh coordinator's fleet epoch on every control call; a worker that has seen a newer
# one answers 409 with this `error` (rlfleet.worker.system_server.FleetFence)
EPOCH_HEADER = "X-Fleet-Epoch"
STALE_EPOCH = "Stale fleet epoch"


class AdminRequestError(ValueError):
    """The request body is not acceptable; the message says what to send instead."""


@dataclass(frozen=True)
class PauseRequest:
    mode: str
    clear_cache: bool


@dataclass(frozen=True)
class GroupRequest:
    master_address: str
    master_port: int
    world_size: int
    rank_offset: int
    backend: str
    timeout: float
    group_name: str | None


@dataclass(frozen=True)
class DistributedRequest:
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    version: str | None
    reset_prefix_cache: bool
    allow_unpaused: bool
    step: int | None = None  # the policy's fleet step (rlfleet)
    # fields this contract does not define, for an engine that reads its own (the mocker's
    # simulated `mock_seed`)
    extra: dict[str, Any] = field(default_factory=dict)


def pause_request(body: dict[str, Any]) -> PauseRequest:
    mode = body.get("mode", "keep")
    clear_cache = body.get("clear_cache", False)
    if mode not in PAUSE_MODES:
        raise AdminRequestError(f"Invalid mode {mode!r}; expected keep|wait|abort")
    if not isinstance(clear_cache, bool):
        raise AdminRequestError("clear_cache must be a boolean")
    return PauseRequest(mode, clear_cache)


def request_id(body: dict[str, Any]) -> str:
    rid = body.get("request_id")
    if not isinstance(rid, str) or not rid:
        raise AdminRequestError("request_id is required (the X-Request-Id or response id of "
                                "the request)")
    return rid


def weight_version(body: dict[str, Any]) -> str | None:
    """The optional `weight_version` of an update."""
    v = body.get("weight_version")
    if v is not None and not isinstance(v, str):
        raise AdminRequestError("weight_version must be a string")
    return v


def policy_step(body: dict[str, Any]) -> int | None:
    """The optional fleet `step` of the policy being installed (or relabelled): a
    non-negative integer that the refresh coordinator increases with every policy."""
    step = body.get("step")
    if step is not None and (type(step) is not int or step < 0):
        raise AdminRequestError(f"step must be a non-negative integer (the policy's fleet "
                                f"step), not {step!r}")
    return step


def declared_version(body: dict[str, Any]) -> str | None:
    """`set_weight_version`'s required `weight_version` (an explicit null counts)."""
    if "weight_version" not in body:
        raise AdminRequestError("weight_version is required (a string, or null)")
    v = body["weight_version"]
    if v is not None and not isinstance(v, str):
        raise AdminRequestError("weight_version must be a string or null")
    return v


def group_request(body: dict[str, Any], default_backend: str,
                  default_timeout: float) -> GroupRequest:
    addr, port = body.get("master_address"), body.get("master_port")
    world, rank = body.get("world_size"), body.get("rank_offset", 1)
    backend = body.get("backend") or default_backend
    timeout = body.get("timeout", default_timeout)
    if not isinstance(addr, str) or not isinstance(port, int) or not isinstance(world, int):
        raise AdminRequestError("master_address (string), master_port (int) and world_size "
                                "(int) are required")
    if not isinstance(rank, int) or not 0 < rank < world:
        raise AdminRequestError(f"rank_offset must be an integer in [1, world_size); got {rank!r}")
    if backend not in ("gloo", "nccl"):
        raise AdminRequestError(f"backend must be gloo or nccl, not {backend!r}")
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise AdminRequestError("timeout must be a positive number of seconds")
    return GroupRequest(addr, port, world, rank, backend, float(timeout), body.get("group_name"))


def distributed_request(body: dict[str, Any]) -> DistributedRequest:
    version = weight_version(body)
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    reset = body.get("reset_prefix_cache", True)
    unpaused = body.get("allow_unpaused", False)
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
            and len(names) == len(dtypes) == len(shapes) and names):
        raise AdminRequestError("names, dtypes and shapes are required: equal-length, "
                                "non-empty lists")
    if not isinstance(reset, bool) or not isinstance(unpaused, bool):
        raise AdminRequestError("reset_prefix_cache and allow_unpaused must be booleans")
    if unpaused and reset:
        raise AdminRequestError("allow_unpaused cannot be combined with reset_prefix_cache; "
                                "send reset_prefix_cache: false, or pause first")
    extra = {k: v for k, v in body.items() if k not in _DISTRIBUTED_FIELDS}
    return DistributedRequest(names, dtypes, shapes, version, reset, unpaused,
                              policy_step(body), extra)


_DISTRIBUTED_FIELDS = frozenset({"names", "dtypes", "shapes", "weight_version",
                                 "reset_prefix_cache", "allow_unpaused", "step"})


def weights_path(raw: Any, roots: list[Path]) -> Path:
    """`model_path` resolved (symlinks too), inside the allowed roots when any are set, and
    an existing directory none of whose entries (what a loader may read) leads outside them
    either, through a symlink."""
    if not isinstance(raw, str) or not raw:
        raise AdminRequestError("model_path is required (a checkpoint directory on this "
                                "worker's disk)")
    if "\0" in raw:
        raise AdminRequestError("model_path contains a null byte: send a plain directory path")
    try:
        path = Path(raw).resolve()
        inside = not roots or _within(path, roots)
        if inside and not path.is_dir():
            raise AdminRequestError(f"model_path {raw} does not exist or is not a directory")
        escapes = _escaping_links(path, roots) if inside and roots else []
    except (OSError, RuntimeError) as e:  # too long, unreadable, a symlink loop
        raise AdminRequestError(f"model_path {raw} cannot be read: {e}") from e
    if not inside:
        raise AdminRequestError(f"model_path {raw} is outside the allowed weights roots "
                                f"({', '.join(map(str, roots))})")
    if escapes:
        raise AdminRequestError(f"model_path {raw} holds symlinks that lead outside the allowed "
                                f"weights roots: {', '.join(sorted(escapes)[:5])}; copy the "
                                "files in instead")
    return path


def _within(path: Path, roots: list[Path]) -> bool:
    return any(path == r or path.is_relative_to(r) for r in roots)


def _escaping_links(path: Path, roots: list[Path]) -> list[str]:
    """Symlinks anywhere under `path` whose targets are outside the roots (relative names)."""
    out = []
    for top, dirs, files in os.walk(path):
        for name in dirs + files:
            entry = Path(top) / name
            if entry.is_symlink() and not _within(entry.resolve(), roots):
                out.append(str(entry.relative_to(path)))
    return out


# ---------------------------------------------------------------- staged weights (issue 11)


@dataclass(frozen=True)
class StageRequest:
    version: str
    source: dict[str, Any]  # checked by rlfleet.weights.staging.parse_source
    digest: str | None  # the version's content digest, when the caller knows it


def stage_request(body: dict[str, Any]) -> StageRequest:
    """`stage_weights` `{"version", "source": {"kind": ...}, "digest"?}`."""
    version, source, digest = body.get("version"), body.get("source"), body.get("digest")
    if not isinstance(version, str) or not version:
        raise AdminRequestError('version is required (the name of the version to stage), with '
                                'source: {"kind": "disk"|"s3"|"trainer"|"peer", ...}')
    if not isinstance(source, dict):
        raise AdminRequestError('source is required: {"kind": "disk", "path": DIR} | {"kind": '
                                '"s3", "uri": "s3://bucket/prefix/VERSION"} | {"kind": "trainer", '
                                '"url": URL} | {"kind": "peer"[, "url": SYSTEM_URL]}')
    if digest is not None and not isinstance(digest, str):
        raise AdminRequestError("digest must be a string (blake3:<hex>)")
    return StageRequest(version, source, digest)


def staging_handle(body: dict[str, Any]) -> str:
    handle = body.get("handle")
    if not isinstance(handle, str) or not handle:
        raise AdminRequestError("handle is required (the one stage_weights returned; "
                                "get_staged_weights lists them)")
    return handle
