"""Weight sources against real servers: a real S3 server (SeaweedFS), the trainer's publisher
and a peer's HTTP server. ModelExpress's own S3 receiver reads what rlfleet publishes; every
source killed mid-transfer leaves the handle FAILED with a clear error within its deadline,
and a retry after the source returns completes."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from rlfleet.runtime.server import AppServer, bind_socket
from rlfleet.testing.s3 import BUCKET
from rlfleet.weights.digest import digest_tensors, iter_checkpoint_tensors
from rlfleet.weights.publish import Publisher, TrainerServer, weights_app
from rlfleet.weights.stage_transfer import StageState
from rlfleet.weights.staging import StagingArea
from tests.modelexpress_reader import on_path

RATE = 8e6  # bytes/s: the tiny model (39 MB) then takes ~5 s, long enough to kill a source
DEADLINE = 6.0


def _step(tensors, seed, only):
    g = torch.Generator().manual_seed(seed)
    return {n: t + torch.randn(t.shape, generator=g) * 1e-3 if only in n else t
            for n, t in tensors.items()}


@pytest.fixture(scope="module")
def policy(tiny_model):
    v1 = dict(iter_checkpoint_tensors(tiny_model))
    v2 = _step(v1, 2, "layers.0.")
    v3 = _step(v2, 3, "layers.1.")
    return {"v1": v1, "v2": v2, "v3": v3}


@pytest.fixture
def s3(s3_server, monkeypatch):
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    if s3_server.proc is None:  # a test before this one killed it
        s3_server.start()
    return s3_server


@pytest.fixture(scope="module")
def s3_versions(s3_server, policy, tmp_path_factory):
    """v1 full, v2 and v3 deltas on the S3 server, registered in a catalog."""
    import os

    old = {k: os.environ.get(k) for k in s3_server.env}
    os.environ.update(s3_server.env)
    try:
        catalog = f"sqlite://{tmp_path_factory.mktemp('catalog') / 'catalog.sqlite'}"
        pub = Publisher(f"s3://{BUCKET}/sources", catalog=catalog, model="tiny",
                        endpoint_url=s3_server.endpoint_url)
        out = {"catalog": catalog, "prefix": f"s3://{BUCKET}/sources"}
        for v, base in (("v1", None), ("v2", "v1"), ("v3", "v2")):
            out[v] = pub.publish(policy[v], v, base=base)
        pub.close()
        return out
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_modelexpress_s3_receiver_reads_what_rlfleet_published(s3, s3_versions, policy, tmp_path):
    """ModelExpress's own generator-side code downloads the full version and replays the two
    deltas from the S3 server, verifying every Adler-32: the result is rlfleet's v3."""
    with on_path():  # ModelExpress's modules, imported with its directory on sys.path
        from modelexpress_rl.inference.receiver import (
            ObjectStorageGeneratorConfig,
            _LocalCheckpoint,
            _S3Version,
            bootstrap_s3_checkpoint,
        )
        from modelexpress_rl.object_storage import ObjectStorageType
        from modelexpress_rl.s3 import S3Client
        from modelexpress_rl.train import WeightPayloadFormat as Fmt

    client = S3Client(endpoint_url=s3.endpoint_url, region_name="us-east-1")

    def ref(v: str, base: str | None) -> _S3Version:
        return _S3Version(v, base, Fmt.XOR_DELTA if base else Fmt.FULL_HF_CHECKPOINT,
                          f"{s3_versions['prefix']}/{v}/model.safetensors.index.json")

    cache = tmp_path / "mx-cache"
    seed = bootstrap_s3_checkpoint(model_name="tiny", version=ref("v1", None),
                                   refit_checkpoint_dir=cache, s3=client)
    assert digest_tensors(iter_checkpoint_tensors(seed)) == s3_versions["v1"]["digest"]
    local = _LocalCheckpoint(model_name="tiny", s3=client, config=ObjectStorageGeneratorConfig(
        storage_type=ObjectStorageType.S3, initial_base_version_id="v1",
        seed_checkpoint_path=seed, refit_checkpoint_dir=cache, endpoint_url=s3.endpoint_url,
        region_name="us-east-1"))
    local.initialize()
    prepared = local.prepare_chain((ref("v2", "v1"), ref("v3", "v2")))
    assert prepared.target_version == "v3"
    assert digest_tensors(iter_checkpoint_tensors(prepared.path)) == \
        digest_tensors(policy["v3"].items()) == s3_versions["v3"]["digest"]


async def _until(pred, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def _kill_mid_transfer(area: StagingArea, source: dict, kill, revive, digest: str,
                             version: str = "v1") -> str:
    """Stage rate-limited, kill the source once bytes flow, check FAILED within the deadline;
    revive it, stage again, check READY. Returns the failure message."""
    h = await area.stage(version, {**source, "timeout": DEADLINE, "max_bytes_per_s": RATE},
                         applied=(None, None))
    await _until(lambda: h.bytes_done > 0)
    await asyncio.to_thread(kill)
    killed_at = time.monotonic()
    await asyncio.wait_for(h.done.wait(), DEADLINE + 15)
    assert h.state is StageState.FAILED, h.summary()
    assert 0 < h.bytes_done < h.bytes_total
    assert time.monotonic() - killed_at <= DEADLINE + 12  # the deadline (+ one read timeout)
    assert not list(area.root.glob(f"{version}.*"))  # nothing half-staged stays
    await asyncio.to_thread(revive)
    again = await area.stage(version, {**source, "timeout": 60}, applied=(None, None))
    await asyncio.wait_for(again.done.wait(), 90)
    assert again.state is StageState.READY, again.error
    assert again.digest == digest
    return h.error


async def test_stage_from_s3_full_then_delta(s3, s3_versions, tmp_path):
    area = StagingArea(tmp_path / "staging")
    try:
        src = {"kind": "s3", "uri": f"{s3_versions['prefix']}/v1", "endpoint_url": s3.endpoint_url}
        h = await area.stage("v1", src, applied=(None, None), digest=s3_versions["v1"]["digest"])
        await asyncio.wait_for(h.done.wait(), 60)
        assert h.state is StageState.READY, h.error
        await area.applied(h.handle)
        src["uri"] = f"{s3_versions['prefix']}/v2"
        h2 = await area.stage("v2", src, applied=("v1", h.digest))
        await asyncio.wait_for(h2.done.wait(), 60)
        assert h2.state is StageState.READY and h2.digest == s3_versions["v2"]["digest"]
        assert h2.summary()["bytes_total"] < s3_versions["v2"]["bytes_full"] / 10
        # AWS_ENDPOINT_URL (boto3's own variable) serves when the source names no endpoint
        import os

        os.environ["AWS_ENDPOINT_URL"] = s3.endpoint_url
        try:
            h3 = await area.stage("v3", {"kind": "s3", "uri": f"{s3_versions['prefix']}/v3",
                                         "chain": True}, applied=(None, None))
            await asyncio.wait_for(h3.done.wait(), 60)
        finally:
            del os.environ["AWS_ENDPOINT_URL"]
        assert h3.state is StageState.READY and h3.digest == s3_versions["v3"]["digest"]
    finally:
        await area.close()


async def test_killing_the_s3_server_mid_transfer(s3, s3_versions, tmp_path):
    area = StagingArea(tmp_path / "staging")
    try:
        src = {"kind": "s3", "uri": f"{s3_versions['prefix']}/v1", "endpoint_url": s3.endpoint_url}
        error = await _kill_mid_transfer(area, src, s3.kill, s3.start, s3_versions["v1"]["digest"])
        assert f"s3 source {s3_versions['prefix']}/v1: transfer deadline passed" in error
        assert "last error" in error
    finally:
        await area.close()


async def test_killing_the_trainer_publisher_mid_transfer(policy, tmp_path):
    directory = tmp_path / "trainer"
    server = TrainerServer(directory)
    port = server._server.port
    pub = Publisher(server.uri, model="tiny")
    res = pub.publish(policy["v1"], "v1")
    servers = [server]
    area = StagingArea(tmp_path / "staging")
    try:
        error = await _kill_mid_transfer(
            area, {"kind": "trainer", "url": server.url}, server.close,
            lambda: servers.append(TrainerServer(directory, port=port)), res["digest"])
        assert f"trainer source {server.url}/v1: transfer deadline passed" in error
        assert "ConnectError" in error
    finally:
        await area.close()
        for s in servers:
            s.close()


async def test_killing_a_peer_mid_transfer(policy, tmp_path):
    pub = Publisher(f"file://{tmp_path / 'store'}")
    res = pub.publish(policy["v1"], "v1")
    holder = StagingArea(tmp_path / "holder")
    h = await holder.stage("v1", {"kind": "disk", "path": str(tmp_path / "store" / "v1")},
                           applied=(None, None))
    await h.done.wait()
    await holder.applied(h.handle)
    servers = [AppServer(weights_app(holder.resident_dir), bind_socket("127.0.0.1", 0))]
    await servers[0].start()
    port, url = servers[0].port, servers[0].url

    async def revive() -> None:
        servers.append(AppServer(weights_app(holder.resident_dir), bind_socket("127.0.0.1", port)))
        await servers[-1].start()

    loop = asyncio.get_running_loop()
    area = StagingArea(tmp_path / "staging")
    try:
        error = await _kill_mid_transfer(
            area, {"kind": "peer", "url": url},
            lambda: asyncio.run_coroutine_threadsafe(servers[0].stop(), loop).result(30),
            lambda: asyncio.run_coroutine_threadsafe(revive(), loop).result(30), res["digest"])
        assert "no peer could serve it" in error and "transfer deadline passed" in error
    finally:
        await area.close()
        for s in servers:
            await s.stop()
        await holder.close()
