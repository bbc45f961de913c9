"""One URL, one fleet, on two real vLLM workers (CPU build, the `modelexpress` weight-transfer
backend): vLLM's own `HTTPVLLMWeightSyncClient`, pointed at the frontend as at ONE vLLM
server, drives the four-phase transfer (init_weight_transfer_engine, start_weight_update,
update_weights, finish_weight_update) and the whole fleet moves: every worker serves the
version's digest (ModelExpress's publisher wrote mx-1, a delta on the seed, and mx-2, a delta
on mx-1, to a real S3 server). Without a pause the transfer is a whole transaction of its own;
when one worker fails its update, the worker that moved is rolled back to the fleet's last
verified policy, the client gets vLLM's error naming them, and the journal shows it."""

from __future__ import annotations

import sys

import httpx
import pytest
import requests

from rlfleet.journal import SqliteJournal
from rlfleet.runtime.launch import spawn
from rlfleet.testing.s3 import BUCKET
from rlfleet.weights.digest import checkpoint_digest
from tests.fleets import (
    RL_PROBE_ENV,
    fault,
    listening_port,
    vllm_worker_args,
    weight_versions,
)
from tests.modelexpress_publisher import (
    TRANSFER_BACKEND,
    publish_transfer_versions,
    transfer_init_info,
)

pytestmark = pytest.mark.engine

MODEL = "tiny-one-url"
PREFIX = f"s3://{BUCKET}/one-url"
PROMPT = [151644, 8948, 198, 1, 2, 3]


@pytest.fixture(scope="module")
def published(tiny_model, tmp_path_factory, s3_server):
    return publish_transfer_versions(tiny_model, tmp_path_factory.mktemp("one-url-mx"),
                                     prefix=PREFIX, model=MODEL, s3_server=s3_server)


@pytest.fixture(scope="module")
def fleet(start_module_fleet, published, s3_server, tmp_path_factory):
    """Two vLLM workers started from the seed (each its own staging area), a frontend that
    forwards control calls to the fleet control service, and the service."""
    port = listening_port()
    args = [vllm_worker_args(published["seed_dir"], MODEL, *TRANSFER_BACKEND,
                             "--weights-staging-dir", str(published["root"] / f"staging-{i}"))
            for i in range(2)]
    f = start_module_fleet(args, name="one-url-vllm", kind="vllm", model=MODEL,
                           worker_env=s3_server.env, enable_rl=True, frontend_env=RL_PROBE_ENV,
                           frontend=("--fleet-control", f"http://127.0.0.1:{port}"))
    f.journal = tmp_path_factory.mktemp("one-url-journal") / "journal.sqlite"
    p = spawn("control", [sys.executable, "-m", "rlfleet.cli", "control", "--rl-url", f.rl_url,
                          "--model", MODEL, "--journal", str(f.journal), "--port", str(port)],
              f.workdir / "logs")
    f.procs.append(p)
    p.wait_ready(60)
    return f


def greedy(fleet) -> list[int]:
    r = httpx.post(f"{fleet.url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0,
        "ignore_eos": True, "nvext": {"extra_fields": ["completion_token_ids"]}})
    assert r.status_code == 200, r.text
    return r.json()["nvext"]["completion_token_ids"]


def post(url: str, path: str, **kw) -> httpx.Response:
    return httpx.post(f"{url}{path}", timeout=600, **kw)


def test_vllms_client_moves_the_whole_fleet_through_one_url(fleet, published, s3_server):
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    seed = checkpoint_digest(published["seed_dir"])
    assert weight_versions(fleet) == [(None, seed)] * 2
    assert httpx.get(f"{fleet.url}/get_world_size").json() == {"world_size": 2}
    tokens = {None: greedy(fleet)}
    client = HTTPVLLMWeightSyncClient(fleet.url, timeout=600)
    client.init_weight_transfer_engine(transfer_init_info(published, s3_server, PREFIX))
    # mx-1 inside a client's pause (keep) ... resume
    assert post(fleet.url, "/pause", params={"mode": "keep"}).json() == {"status": "paused"}
    client.start_weight_update()
    client.update_weights({"version_id": "mx-1"})
    client.finish_weight_update("policy-1")
    assert httpx.get(f"{fleet.url}/is_paused").json() == {"is_paused": True}
    assert post(fleet.url, "/resume").json() == {"status": "resumed"}
    assert weight_versions(fleet) == [("policy-1", published["digests"]["mx-1"])] * 2
    tokens["mx-1"] = greedy(fleet)
    # mx-2 with no pause: the transfer is a whole transaction of its own
    client.start_weight_update()
    client.update_weights({"version_id": "mx-2"})
    client.finish_weight_update(None)
    assert httpx.get(f"{fleet.url}/is_paused").json() == {"is_paused": False}
    assert weight_versions(fleet) == [("mx-2", published["digests"]["mx-2"])] * 2
    tokens["mx-2"] = greedy(fleet)
    assert len({tuple(t) for t in tokens.values()}) == 3, tokens  # each version its own policy
    assert httpx.get(f"{fleet.url}/weight_info").json() == {"weight_version": "mx-2"}
    with SqliteJournal(fleet.journal) as j:
        last = j.recent(1)[0]
    assert last["decision"] == "reopened" and last.served.digest == published["digests"]["mx-2"]


def test_one_worker_failing_the_transfer_rolls_the_fleet_back(fleet, published, s3_server):
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    seed = checkpoint_digest(published["seed_dir"])
    # the fleet on the seed, from disk and verified: what a rollback returns to
    r = post(fleet.url, "/collective_rpc", json={
        "method": "reload_weights", "kwargs": {"weights_path": str(published["seed_dir"])}})
    assert r.status_code == 200, r.text
    assert {d for _, d in weight_versions(fleet)} == {seed}
    bad = fleet.workers[1]
    fault(bad, "update/update_weights")
    client = HTTPVLLMWeightSyncClient(fleet.url, timeout=600)
    client.init_weight_transfer_engine(transfer_init_info(published, s3_server, PREFIX))
    assert post(fleet.url, "/pause", params={"mode": "wait"}).json() == {"status": "paused"}
    client.start_weight_update()
    with pytest.raises(requests.HTTPError) as e:
        client.update_weights({"version_id": "mx-1"})
    body = e.value.response.json()
    assert e.value.response.status_code == 500
    assert f"worker {bad.ready['instance_id']}" in body["error"], body
    assert "rolled back" in body["error"], body
    assert post(fleet.url, "/resume").json() == {"status": "resumed"}
    assert {d for _, d in weight_versions(fleet)} == {seed}  # one policy, the previous one
    greedy(fleet)
    with SqliteJournal(fleet.journal) as j:
        last = j.recent(1)[0]
    assert last["decision"] == "rolled_back" and last.served.digest == seed, dict(last)


def test_trls_vllm_client_on_the_vllm_fleet(fleet):
    """TRL 1.16's VLLMClient through the one URL: the fleet's world size, the server info
    GRPOTrainer reads (logprobs_mode), the cache reset on every worker, and generation whose
    token IDs are the fleet's own greedy answer."""
    from trl.generation.vllm_client import VLLMClient

    client = VLLMClient(base_url=fleet.url, connection_timeout=30)
    assert client.get_world_size() == 2
    assert "logprobs_mode" in client.get_server_info()["model_config"]
    client.reset_prefix_cache()
    out = client.generate([PROMPT], max_tokens=8, temperature=0.0,
                          generation_kwargs={"ignore_eos": True})
    assert out["completion_ids"] == [greedy(fleet)]
    r = post(fleet.url, "/init_weight_transfer_engine", json={"init_info": {
        "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 3}})
    # TRL's NCCL init_info: every worker refuses it (its backend is modelexpress; the CPU
    # build has no NCCL)
    assert r.status_code == 400, r.text
    for p in fleet.workers:
        assert f"worker {p.ready['instance_id']}" in r.json()["error"], r.text
