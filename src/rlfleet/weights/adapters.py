"""LoRA adapter versions as weight-plane artifacts: the same layout as a model version
(rlfleet.weights.artifacts: full, or an exact-base XOR delta against the version before),
with the adapter's `adapter_config.json` beside the index. An adapter version moves
megabytes, not the model; a delta moves only what changed since the version it names.

`publish_adapter` writes one from a peft adapter directory; `materialize_adapter` turns one
back into a plain adapter directory on a worker, a delta only on the exact version the
worker serves (`WrongBase` otherwise, nothing changed)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from rlfleet.weights.artifacts import (
    INDEX,
    Artifact,
    ArtifactError,
    FileStorage,
    WrongBase,
    as_tensors,
    check_bytes,
    decode_deltas,
    encode_delta,
    encode_full,
    open_storage,
    plan_version,
    spec_of,
    tensor_bytes,
    write_artifact,
)
from rlfleet.weights.catalog import Catalog
from rlfleet.weights.digest import checkpoint_digest
from rlfleet.weights.publish import register_written

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def is_artifact(path: Path) -> bool:
    """Whether `path` is an artifact version (an index), not a plain adapter directory."""
    return (Path(path) / INDEX).is_file()


def publish_adapter(adapter: Path, root: Path | str, version: str,
                    base: tuple[str, Path] | None = None,
                    endpoint_url: str | None = None, catalog: Catalog | str | Path | None = None,
                    model: str | None = None) -> Artifact:
    """Write the peft adapter directory `adapter` under `root/version`: full, or with `base`
    (its version label and adapter directory) as an XOR delta against it. `root`: a
    directory, or a weights location (``s3://bucket/prefix`` at `endpoint_url`, as the
    model's versions are published): a worker stages it from there (stage_lora_adapter).
    With `catalog`, the version is registered there READY once written, filed under `model`
    (default: the adapter directory's name), as a model's versions are: the workers that
    serve it staged are listed as its holders, where a peer source without a url finds
    them."""
    from safetensors.torch import load_file  # torch only here: imports stay light
    adapter = Path(adapter)
    tensors = load_file(str(adapter / ADAPTER_WEIGHTS))
    digest = checkpoint_digest(adapter)
    if base is None:
        art = encode_full(version, tensors, digest)
    else:
        base_tensors = load_file(str(Path(base[1]) / ADAPTER_WEIGHTS))
        art = encode_delta(version, base[0], tensors,
                           {n: tensor_bytes(t) for n, t in base_tensors.items()}, digest)
    storage = open_storage(root, endpoint_url)
    try:
        storage.write(f"{version}/{ADAPTER_CONFIG}", (adapter / ADAPTER_CONFIG).read_bytes())
        write_artifact(storage, art)  # the index last: a reader sees it whole or not at all
        location = f"{storage.uri}/{version}"
    finally:
        storage.close()
    if catalog is not None:
        register_written(catalog, model or adapter.name, art, location)
    return art


def materialize_adapter(path: Path, out: Path, served: tuple[str | None, Path] | None
                        ) -> Path:
    """The adapter version at `path` (an artifact) as a plain adapter directory `out`. A
    delta is applied on `served` (the label and directory of the version the worker serves)
    only if that is the base it names: WrongBase otherwise."""
    from safetensors.torch import load_file, save_file  # torch only here: imports stay light
    path, out = Path(path), Path(out)
    storage, key = FileStorage(path.parent), path.name
    meta = json.loads((path / INDEX).read_text()).get("metadata", {})
    if not (path / ADAPTER_CONFIG).is_file():
        raise ArtifactError(f"{path}: an adapter artifact needs {ADAPTER_CONFIG} beside its "
                            "index")
    if meta.get("delta_encoding") is not None:
        base_version = meta.get("base_version")
        if served is None or served[0] != base_version:
            raise WrongBase(f"{path} is a delta against adapter version {base_version!r}, but "
                            f"this worker serves {served[0] if served else 'none'!r}: send the "
                            "full version, or a delta against the version served")
        plan = plan_version(storage.read, key, storage.list_version, base_version=served[0])
        base = load_file(str(Path(served[1]) / ADAPTER_WEIGHTS))
        specs = {n: spec_of(n, t) for n, t in base.items()}
        data = {n: tensor_bytes(t).copy() for n, t in base.items()}
        missing = [e.name for e in plan.entries if e.name not in data]
        if missing:
            raise WrongBase(f"{path}: delta tensor {missing[0]} is not in the served version")
        decode_deltas((e.name, np.frombuffer(storage.read(f"{key}/{e.file}", e.start, e.end),
                                             dtype=np.uint8), data[e.name], data[e.name],
                       e.checksum) for e in plan.entries)
    else:
        plan = plan_version(storage.read, key, storage.list_version)
        specs, data = {}, {}
        for e in plan.entries:
            buf = np.frombuffer(storage.read(f"{key}/{e.file}", e.start, e.end), dtype=np.uint8)
            check_bytes(e.name, buf, e.checksum)
            specs[e.name], data[e.name] = e.spec, buf
    out.mkdir(parents=True, exist_ok=True)
    tensors = {n: t.clone() for n, t in as_tensors(specs, data).items()}
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    shutil.copy2(path / ADAPTER_CONFIG, out / ADAPTER_CONFIG)
    return out
