"""ModelExpress's own trainer-side publisher (`CanonicalDeltaPublicationMethod`) writing
versions to the test S3 server, the independent writer of the ModelExpress weight tests:
`ranks` processes (spawned, over a gloo group) each publish the tensors they own (rank r:
every tensor whose position in the seed is r modulo `ranks`), XOR deltas on a seed checkpoint
that is never uploaded (named `seed` in ModelExpress's plan) and full checkpoints."""

from __future__ import annotations

import multiprocessing
import shutil
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from rlfleet.weights import artifacts as art
from rlfleet.weights.digest import digest_tensors, iter_checkpoint_tensors
from tests.fleets import vllm_worker_args
from tests.modelexpress_reader import on_path

SEED = "seed"  # the seed's version id in a plan: a delta on it has base_version "seed"


def _rank_main(rank: int, ranks: int, root: str, seed_file: str, plan: list[tuple[str, str | None]],
               prefix: str, model: str, endpoint: str) -> None:
    """One trainer rank: publishes every version of `plan` (version, base; None: full)."""
    import torch.distributed as dist

    with on_path():
        from modelexpress_rl import refit_pb2
        from modelexpress_rl.s3 import S3Client
        from modelexpress_rl.train.methods.canonical_delta import (
            CanonicalDeltaPublicationMethod,
        )
        from modelexpress_rl.version import WeightVersionRef

    dist.init_process_group("gloo", store=dist.FileStore(str(Path(root) / "gloo"), ranks),
                            rank=rank, world_size=ranks)
    seed = safetensors.torch.load_file(seed_file)
    names = [n for i, n in enumerate(seed) if i % ranks == rank]
    fmt = refit_pb2.WeightPayloadFormat

    def version(uid: str) -> refit_pb2.WeightVersion:
        base = dict(plan)[uid]
        v = refit_pb2.WeightVersion(
            uid=uid, model_name=model, payload_format=fmt.Value(
                "WEIGHT_PAYLOAD_FORMAT_XOR_DELTA" if base else
                "WEIGHT_PAYLOAD_FORMAT_FULL_HF_CHECKPOINT"),
            object_storage=refit_pb2.ObjectStorageSource(
                uri=f"{prefix}/{uid}/{art.INDEX}", storage_type=refit_pb2.OBJECT_STORAGE_TYPE_S3))
        if base:
            v.base_version_id = base
        return v

    service = types.SimpleNamespace(GetWeightVersion=lambda req, timeout: (
        refit_pb2.GetWeightVersionResponse(version=version(req.uid))))
    method = CanonicalDeltaPublicationMethod(
        config=types.SimpleNamespace(uri_prefix=prefix, initial_base_version_id=SEED),
        model_name=model, service=lambda: service, rpc_timeout_seconds=5.0,
        process_group=dist.group.WORLD,
        read_seed_tensor=lambda n: seed[n].reshape(-1).view(torch.uint8).numpy(),
        s3=S3Client(endpoint_url=endpoint, region_name="us-east-1"))
    method.prepare_base(hf_tensor_iter=[[(n, seed[n]) for n in names]])
    for uid, _ in plan:
        tensors = safetensors.torch.load_file(str(Path(root) / f"{uid}.safetensors"))
        ref = WeightVersionRef(uid)
        staged = method.stage(version=ref, hf_tensor_iter=[[(n, tensors[n]) for n in names]])
        method.publish(version=ref, staged=staged)
    method.close()
    dist.destroy_process_group()


def perturbed(tensors: Mapping[str, torch.Tensor], seed: int, only: str,
              scale: float = 0.05) -> dict[str, torch.Tensor]:
    """`tensors` with Gaussian noise (`scale`, from `seed`) on those whose name holds `only`:
    a next policy a trainer could publish."""
    g = torch.Generator().manual_seed(seed)
    return {n: t + torch.randn(t.shape, generator=g) * scale if only in n else t
            for n, t in tensors.items()}


def publish_with_modelexpress(root: Path, seed_file: Path,
                              versions: Mapping[str, Mapping[str, torch.Tensor]],
                              plan: Sequence[tuple[str, str | None]], *, prefix: str, model: str,
                              s3_server, ranks: int = 2) -> None:
    """ModelExpress publishes `versions` to `prefix` on `s3_server` in `plan`'s order (each
    (version, base): base SEED or a version before it, None for a full checkpoint), as
    `ranks` trainer ranks; the seed's tensors are read from `seed_file`. `root`: a scratch
    directory (the versions' tensors for the ranks, their gloo store)."""
    root.mkdir(parents=True, exist_ok=True)
    for uid, _ in plan:
        safetensors.torch.save_file(dict(versions[uid]), str(root / f"{uid}.safetensors"))
    ctx = multiprocessing.get_context("spawn")
    with pytest.MonkeyPatch.context() as env:  # the ranks inherit the S3 credentials
        for k, v in s3_server.env.items():
            env.setenv(k, v)
        procs = [ctx.Process(target=_rank_main, args=(
            r, ranks, str(root), str(seed_file), list(plan), prefix, model,
            s3_server.endpoint_url)) for r in range(ranks)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(240)
    assert [p.exitcode for p in procs] == [0] * ranks, "a ModelExpress rank failed"


# ---------------------------------------------------------------- the backend's versions

#: what the weight-transfer tests publish: mx-1, a delta on the seed; mx-2, a delta on mx-1
TRANSFER_PLAN = (("mx-1", SEED), ("mx-2", "mx-1"))
#: the flag that makes a vLLM worker (or vLLM's server) run ModelExpress's backend
TRANSFER_BACKEND = ("--weight-transfer-config", '{"backend": "modelexpress"}')


def publish_transfer_versions(model_dir: Path, root: Path, *, prefix: str, model: str,
                              s3_server) -> dict[str, Any]:
    """The seed (a copy of `model_dir` under `root`, never uploaded) and ModelExpress's two
    deltas of TRANSFER_PLAN published under `prefix`: {"seed_dir", "root", "digests"} (the
    content digest of each version's tensors)."""
    if s3_server.proc is None:
        s3_server.start()
    seed_dir = shutil.copytree(model_dir, root / "seed")
    seed = dict(iter_checkpoint_tensors(seed_dir))
    steps = {"mx-1": perturbed(seed, 41, "layers.")}
    steps["mx-2"] = perturbed(steps["mx-1"], 42, "layers.1.")
    publish_with_modelexpress(root / "ranks", seed_dir / "model.safetensors", steps,
                              TRANSFER_PLAN, prefix=prefix, model=model, s3_server=s3_server)
    return {"seed_dir": seed_dir, "root": root,
            "digests": {v: digest_tensors(t.items()) for v, t in steps.items()}}


def transfer_init_info(published: Mapping[str, Any], s3_server, prefix: str) -> dict[str, Any]:
    """ModelExpress's object-storage init_info for the published versions, and the prefix an
    rlfleet worker needs (rlfleet.protocol.modelexpress)."""
    return {"object_storage_type": "S3", "initial_base_version_id": SEED,
            "seed_checkpoint_path": str(published["seed_dir"]),
            "refit_checkpoint_dir": str(published["root"] / "refit"),
            "object_storage_endpoint_url": s3_server.endpoint_url,
            "object_storage_uri_prefix": prefix}


def transfer_worker_args(published: Mapping[str, Any], model: str) -> tuple[str, ...]:
    """A vLLM worker started from the seed with the backend, staging under the root."""
    return vllm_worker_args(published["seed_dir"], model, *TRANSFER_BACKEND,
                            "--weights-staging-dir", str(published["root"] / "staging"))
