"""A Dynamo 1.7 client's weight sync on real vLLM workers of the CPU build, call by call as
prime-rl's Dynamo inference pool makes it (tests.dynamo17.DynamoWeightSync): GET the
listing and bind the workers of its model (strict types, the backend, the routes), then
control/pause_generation, control/is_paused, update/init_weight_transfer_engine (once),
update/start_weight_update, update/update_weights (per chunk), update/finish_weight_update,
control/get_weight_version, control/resume_generation on each worker's system_url.

- One worker started with `--weight-transfer-config '{"backend": "modelexpress"}'`, from a
  seed checkpoint: ModelExpress's own publisher wrote mx-1 (an XOR delta on the seed, which
  is never uploaded) and mx-2 (a delta on mx-1) to a real S3 server (SeaweedFS). The client
  moves the worker to each, and the worker serves the published tensors (their digest)
  under the label given to finish.
- The session fleet's workers, started without the flag: they list vLLM's default backend,
  nccl, so prime-rl's client binds them; its nccl init is refused with the contract's error
  saying the backend needs a GPU (natively: a 400 that says so), and they resume unharmed.

Intended difference from prime-rl's client: it binds only nccl workers; the first test's
client is configured for modelexpress and sends that backend's init_info and update_info,
through the same routes in the same order."""

from __future__ import annotations

import pytest

from rlfleet.testing.s3 import BUCKET
from tests.dynamo17 import DynamoClientError, DynamoWeightSync, listed, served_policy
from tests.fleets import MODEL_NAME, weight_versions
from tests.modelexpress_publisher import (
    publish_transfer_versions,
    transfer_init_info,
    transfer_worker_args,
)

pytestmark = pytest.mark.engine

MODEL = "tiny-dynamo17"
PREFIX = f"s3://{BUCKET}/dynamo17"
#: prime-rl's init_info for nccl: the trainer's rendezvous, this pool's first rank, the group
NCCL_INIT = {"master_address": "127.0.0.1", "master_port": 29531, "rank_offset": 1,
             "world_size": 3}


@pytest.fixture(scope="module")
def published(tiny_model, tmp_path_factory, s3_server):
    return publish_transfer_versions(tiny_model, tmp_path_factory.mktemp("dynamo17-mx"),
                                     prefix=PREFIX, model=MODEL, s3_server=s3_server)


@pytest.fixture(scope="module")
def mx_fleet(start_module_fleet, published, s3_server):
    """One vLLM worker started from the seed with the backend, behind a frontend with the
    RL listener."""
    return start_module_fleet([transfer_worker_args(published, MODEL)], name="dynamo17-mx",
                              kind="vllm", model=MODEL, enable_rl=True, worker_env=s3_server.env)


async def test_a_dynamo17_client_moves_a_worker_to_modelexpress_versions(mx_fleet, published,
                                                                         s3_server):
    [entry] = await listed(mx_fleet.rl_url)  # the strict 1.7 schema
    assert entry.weight_transfer_backend == "modelexpress" and entry.world_size == 1
    init_info = transfer_init_info(published, s3_server, PREFIX)
    async with DynamoWeightSync(mx_fleet.rl_url, MODEL, backend="modelexpress") as client:
        [worker] = await client.discover()
        assert worker.system_url == entry.system_url
        for version, label in (("mx-1", "1"), ("mx-2", "2")):
            await client.sync(label, [{"version_id": version}], init_info)
            assert weight_versions(mx_fleet) == [(label, published["digests"][version])]
            served = await served_policy(mx_fleet.url, MODEL)
            assert (served["weight_version"], served["weight_digest"]) == \
                (label, published["digests"][version])
        probe = (await client.call(worker, "liveness_probe", {}))
        assert "self_check" not in probe, probe  # passed when generation resumed
    [relisted] = await listed(mx_fleet.rl_url)
    extra = relisted.model_extra or {}
    assert (extra["weight_version"], extra["weight_digest"]) == ("2", published["digests"]["mx-2"])


async def test_nemo_rls_dynamo_refit_moves_a_worker_through_engine_rpc(mx_fleet, published,
                                                                      s3_server):
    """NeMo RL's Dynamo refit (nemo_rl/models/generation/dynamo/, DynamoRefitChannel): vLLM's
    weight-transfer methods named by `engine_rpc` on init_weights_update_group and
    update_weights_from_distributed, with allow_unpaused and without the cache reset. An
    rlfleet worker applies weights only while paused: unpaused, the update is refused by
    name (HTTP 400) and stays open; paused, the same calls move the worker."""
    [entry] = await listed(mx_fleet.rl_url)
    async with DynamoWeightSync(mx_fleet.rl_url, MODEL, backend="modelexpress") as client:
        [worker] = await client.discover()
        await client.call(worker, "init_weights_update_group", {
            "engine_rpc": "init_weight_transfer_engine",
            "init_info": transfer_init_info(published, s3_server, PREFIX)})
        common = {"allow_unpaused": True, "reset_prefix_cache": False}
        steps = [("start_weight_update", {"is_checkpoint_format": True}),
                 ("update_weights", {"update_info": {"version_id": "mx-1"}}),
                 ("finish_weight_update", {"weight_version": "nemo-1"})]
        said = await client.call(worker, "update_weights_from_distributed",
                                 {"engine_rpc": steps[0][0], **common, **steps[0][1]})
        unpaused = await client.http.post(
            f"{entry.system_url}/engine/update_weights_from_distributed",
            json={"engine_rpc": steps[1][0], **common, **steps[1][1]})
        assert unpaused.status_code == 400 and "allow_unpaused" in unpaused.text
        await client.call(worker, "pause_generation", {"mode": "wait"})
        for rpc, kw in steps[1:]:
            said = await client.call(worker, "update_weights_from_distributed",
                                     {"engine_rpc": rpc, **common, **kw})
            assert said["status"] == "ok", (rpc, said)
        assert said["version"] == "nemo-1" and said["weight_digest"] == \
            published["digests"]["mx-1"]
        await client.call(worker, "resume_generation", {})  # the self-check passes
        # NeMo RL's cache flush
        await client.call(worker, "pause_generation", {"mode": "wait", "clear_cache": True})
        await client.call(worker, "resume_generation", {})
        refused = await client.http.post(
            f"{entry.system_url}/engine/update_weights_from_distributed",
            json={"engine_rpc": "update_weights_from_ipc", **common})
        assert refused.status_code == 400 and "'update_weights_from_ipc'" in refused.text
    assert weight_versions(mx_fleet) == [("nemo-1", published["digests"]["mx-1"])]
    served = await served_policy(mx_fleet.url, MODEL)
    assert (served["weight_version"], served["weight_digest"]) == \
        ("nemo-1", published["digests"]["mx-1"])


async def test_an_nccl_init_on_the_cpu_build_is_refused_for_want_of_a_gpu(vllm_fleet):
    entries = [w for w in await listed(vllm_fleet.rl_url) if w.model == MODEL_NAME]
    assert entries and {w.weight_transfer_backend for w in entries} == {"nccl"}  # vLLM's default
    before = weight_versions(vllm_fleet)
    async with DynamoWeightSync(vllm_fleet.rl_url, MODEL_NAME) as client:
        workers = await client.discover()  # prime-rl's client binds them
        try:
            with pytest.raises(DynamoClientError, match="need a GPU") as refused:
                await client.sync("3", [{"names": ["w"], "dtype_names": ["float32"],
                                         "shapes": [[1]]}], NCCL_INIT)
            assert "update/init_weight_transfer_engine" in str(refused.value)
            assert "modelexpress" in str(refused.value)  # what the CPU build can run instead
        finally:
            await client.each("control/resume_generation", {})
        for w in workers:
            native = await client.http.post(f"{w.system_url}/init_weight_transfer_engine",
                                            json={"init_info": NCCL_INIT})
            assert native.status_code == 400 and "need a GPU" in native.json()["error"]
            assert (await client.call(w, "control/is_paused", {}))["is_paused"] is False
    assert weight_versions(vllm_fleet) == before
