"""ModelExpress artifacts as ModelExpress writes them, through a real S3 server (SeaweedFS):
its own trainer-side publisher (`CanonicalDeltaPublicationMethod`, two ranks over gloo)
publishes XOR deltas on a never-uploaded seed checkpoint and a full checkpoint, with float8
tensors and a tied lm_head; rlfleet stages and applies them (in-process). The other way,
ModelExpress's own receiver replays rlfleet's float8 full and its deltas."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import safetensors.torch
import torch

from rlfleet.testing.s3 import BUCKET
from rlfleet.weights import artifacts as art
from rlfleet.weights.digest import digest_tensors, iter_checkpoint_tensors
from rlfleet.weights.publish import Publisher
from rlfleet.weights.stage_transfer import StageState
from rlfleet.weights.staging import StagingArea
from tests.modelexpress_publisher import SEED, publish_with_modelexpress
from tests.modelexpress_reader import on_path

MODEL = "tiny-fp8"
RANKS = 2
PREFIX = f"s3://{BUCKET}/mx"


def _policy(tiny_model: Path) -> dict[str, torch.Tensor]:
    """The tiny model with its MLP weights in float8 (e4m3 and e5m2) and an untouched
    lm_head tied to the embedding: a seed checkpoint stores it once."""
    out = {}
    for i, (name, t) in enumerate(iter_checkpoint_tensors(tiny_model)):
        if "mlp" in name and t.dim() == 2:
            t = t.float().to(torch.float8_e4m3fn if i % 2 else torch.float8_e5m2)
        out[name] = t.contiguous()
    out.pop(art.TIED_OUTPUT, None)
    return out


def _step(tensors: dict[str, torch.Tensor], seed: int, only: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: (t.float() + torch.randn(t.shape, generator=g) * 1e-2).to(t.dtype)
            if only in n else t for n, t in tensors.items()}


def _steps(seed: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """mx-1, mx-2: deltas on the seed, then on mx-1 (float8 tensors change in both);
    mx-3: a full checkpoint; mx-4: a delta on it that changes no tensor of rank 1."""
    v1 = _step(seed, 1, "layers.0.")
    v2 = _step(v1, 2, "layers.1.mlp")
    v3 = _step(v2, 3, "layers.")
    v4 = _step(v3, 4, "layers.0.mlp.down")
    return {"mx-1": v1, "mx-2": v2, "mx-3": v3, "mx-4": v4}


PLAN = (("mx-1", SEED), ("mx-2", "mx-1"), ("mx-3", None), ("mx-4", "mx-3"))


@pytest.fixture(scope="module")
def mx_published(s3_server, tiny_model, tmp_path_factory):
    """The seed checkpoint on local disk (never uploaded) and ModelExpress's four versions
    on the S3 server, written by two ranks."""
    root = tmp_path_factory.mktemp("mx")
    seed_dir = root / "seed"
    seed_dir.mkdir()
    seed = _policy(tiny_model)
    safetensors.torch.save_file(seed, str(seed_dir / "model.safetensors"))
    publish_with_modelexpress(root / "ranks", seed_dir / "model.safetensors", _steps(seed), PLAN,
                              prefix=PREFIX, model=MODEL, s3_server=s3_server, ranks=RANKS)
    return {"seed_dir": seed_dir, "seed": seed, "steps": _steps(seed)}


@pytest.fixture
def s3(s3_server, monkeypatch):
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    if s3_server.proc is None:
        s3_server.start()
    return s3_server


def _index(s3, version: str) -> dict:
    raw = s3.client().get_object(Bucket=BUCKET, Key=f"mx/{version}/{art.INDEX}")["Body"].read()
    return json.loads(raw)


async def _staged(area: StagingArea, version: str, source: dict, applied):
    h = await area.stage(version, source, applied=applied)
    await asyncio.wait_for(h.done.wait(), 120)
    return h


def test_modelexpress_layout_several_ranks(s3, mx_published):
    """What ModelExpress wrote: one delta shard per rank numbered from 0, full shards
    numbered from 1 across ranks, float8 tensors stored as they are."""
    d1 = _index(s3, "mx-1")
    assert d1["metadata"]["base_version"] == "seed" and d1["metadata"]["version"] == "mx-1"
    assert set(d1["weight_map"].values()) == {art.shard_name(i, RANKS) for i in range(RANKS)}
    full = _index(s3, "mx-3")
    shards = sorted(set(full["weight_map"].values()))
    assert shards == [art.shard_name(i, len(shards)) for i in range(1, len(shards) + 1)]
    assert len(shards) >= RANKS
    d4 = _index(s3, "mx-4")  # one rank changed a tensor: one shard, 00000-of-00001
    assert set(d4["weight_map"].values()) == {art.shard_name(0, 1)}


async def test_rlfleet_stages_and_applies_what_modelexpress_published(s3, mx_published,
                                                                      tmp_path):
    """A worker serving the seed (unversioned: only its content digest is known) stages
    mx-1 from S3 with the seed named by its local path and digest, applies it, then mx-2 on
    the resident copy, the full mx-3 and the delta mx-4: each digest is the policy's."""
    seed_digest = digest_tensors(mx_published["seed"].items())
    steps = mx_published["steps"]
    src = {"kind": "s3", "endpoint_url": s3.endpoint_url}
    area = StagingArea(tmp_path / "staging", allowed_roots=[str(mx_published["seed_dir"].parent)])
    try:
        applied = (None, seed_digest)
        for version, base in PLAN:
            source = {**src, "uri": f"{PREFIX}/{version}"}
            if base == SEED:
                source["base"] = {"path": str(mx_published["seed_dir"]), "digest": seed_digest}
            h = await _staged(area, version, source, applied)
            assert h.state is StageState.READY, h.error
            assert h.format == ("xor-delta" if base else "full")
            assert h.digest == digest_tensors(steps[version].items())
            specs = {s.name: s.dtype for s in area.ready(h.handle)[1].specs.values()}
            assert {"F8_E4M3", "F8_E5M2"} <= set(specs.values())
            await area.applied(h.handle, h.digest)
            applied = (version, h.digest)
        # a seed named by a digest it does not have is refused before a delta is applied
        wrong = {**src, "uri": f"{PREFIX}/mx-1",
                 "base": {"path": str(mx_published["seed_dir"]), "digest": "0" * 64}}
        h = await _staged(area, "mx-1", wrong, (None, seed_digest))
        assert h.state is StageState.FAILED and "content digest" in h.error
        # the index's own version must be the one asked for
        h = await _staged(area, "mx-2", {**src, "uri": f"{PREFIX}/mx-1",
                                         "base": {"path": str(mx_published["seed_dir"])}},
                          (None, seed_digest))
        assert h.state is StageState.FAILED and "'mx-1', not the 'mx-2'" in h.error
    finally:
        await area.close()


async def test_a_worker_started_from_modelexpress_seed_takes_it_by_digest_alone(
        s3, mx_published, tmp_path):
    """A worker started from ModelExpress's seed directory (nothing staged, the seed never
    uploaded) stages mx-1 from S3 with the seed named by its content digest alone."""
    seed_digest = digest_tensors(mx_published["seed"].items())
    area = StagingArea(tmp_path / "staging", startup_checkpoint=mx_published["seed_dir"])
    try:
        h = await _staged(area, "mx-1", {"kind": "s3", "endpoint_url": s3.endpoint_url,
                                         "uri": f"{PREFIX}/mx-1", "base": {"digest": seed_digest}},
                          (None, seed_digest))
        assert h.state is StageState.READY, h.error
        assert h.digest == digest_tensors(mx_published["steps"]["mx-1"].items())
    finally:
        await area.close()


def test_modelexpress_receiver_reads_rlfleets_float8_versions(s3, tiny_model, tmp_path):
    """rlfleet publishes a float8 full (the tied lm_head stored once) and two deltas on it
    to S3; ModelExpress's receiver downloads the full and replays both deltas, checking
    every Adler-32: the result is rlfleet's last version."""
    with on_path():
        from modelexpress_rl.inference.receiver import (
            ObjectStorageGeneratorConfig,
            _LocalCheckpoint,
            _S3Version,
            bootstrap_s3_checkpoint,
        )
        from modelexpress_rl.object_storage import ObjectStorageType
        from modelexpress_rl.s3 import S3Client
        from modelexpress_rl.train import WeightPayloadFormat as Fmt

    v1 = _policy(tiny_model)
    v1[art.TIED_OUTPUT] = v1[art.TIED_INPUT]  # tied: the same storage
    steps = _steps({n: t for n, t in v1.items() if n != art.TIED_OUTPUT})
    prefix = f"s3://{BUCKET}/rl-fp8"
    pub = Publisher(prefix, endpoint_url=s3.endpoint_url)
    published = {"r1": pub.publish(v1, "r1"), "r2": pub.publish(steps["mx-1"], "r2", base="r1"),
                 "r3": pub.publish(steps["mx-2"], "r3", base="r2")}
    pub.close()

    client = S3Client(endpoint_url=s3.endpoint_url, region_name="us-east-1")

    def ref(v: str, base: str | None) -> _S3Version:
        return _S3Version(v, base, Fmt.XOR_DELTA if base else Fmt.FULL_HF_CHECKPOINT,
                          f"{prefix}/{v}/{art.INDEX}")

    cache = tmp_path / "mx-cache"
    root = bootstrap_s3_checkpoint(model_name=MODEL, version=ref("r1", None),
                                   refit_checkpoint_dir=cache, s3=client)
    got = dict(iter_checkpoint_tensors(root))
    assert art.TIED_OUTPUT not in got and got["model.layers.0.mlp.down_proj.weight"].dtype in (
        torch.float8_e4m3fn, torch.float8_e5m2)
    assert digest_tensors(got.items()) == published["r1"]["digest"]
    local = _LocalCheckpoint(model_name=MODEL, s3=client, config=ObjectStorageGeneratorConfig(
        storage_type=ObjectStorageType.S3, initial_base_version_id="r1",
        seed_checkpoint_path=root, refit_checkpoint_dir=cache, endpoint_url=s3.endpoint_url,
        region_name="us-east-1"))
    local.initialize()
    prepared = local.prepare_chain((ref("r2", "r1"), ref("r3", "r2")))
    assert digest_tensors(iter_checkpoint_tensors(prepared.path)) == \
        digest_tensors(steps["mx-2"].items()) == published["r3"]["digest"]
