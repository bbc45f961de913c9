"""vLLM's own HTTPVLLMWeightSyncClient drives an rlfleet vLLM worker on the CPU build, started
with `--weight-transfer-config '{"backend": "modelexpress"}'`, through pause ->
init_weight_transfer_engine -> start_weight_update -> update_weights -> finish_weight_update
-> resume, only through its public methods (pause and resume over HTTP): ModelExpress's own
trainer-side publisher (two ranks over gloo) wrote the versions to a real S3 server
(SeaweedFS): mx-1, an XOR delta on the seed checkpoint the worker was started from (never
uploaded), and mx-2, a delta on mx-1. The worker stages each from object storage and applies
it through the checks of every rlfleet install; its digest is that of the published tensors.

vLLM's own server with the same backend (`VLLM_SERVER_DEV_MODE=1 vllm serve
--weight-transfer-config '{"backend": "modelexpress"}'`, ModelExpress on that process's path
only, its vLLM plugin not loaded: the plugin needs modules the test set-up does not
install) answers the steps out of order as the worker does. It cannot apply a version here:
ModelExpress's receiver asks a ModelExpress server where a version is, and there is none.
Intended differences, not compared as equal: its engine process wraps the worker's errors
(`Call to collective_rpc method failed: ...`, and a bad init_info is a 500 there, a 400
here, as vLLM answers a ValueError); it takes start_weight_update before any init (its
ModelExpress engine then ignores the update), the worker refuses it; a step out of the
update's order (update or finish before start, start twice) is refused by vLLM 0.32's engine
(500) and by the worker as vLLM's newer RL state machine refuses it, before it runs
(`vllm/entrypoints/serve/dev/rlhf/rl_state_machine.py`: 409 `{"detail"}`)."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
import requests

from rlfleet.testing.s3 import BUCKET
from rlfleet.weights.digest import checkpoint_digest
from tests.fleets import vllm_serve, weight_versions
from tests.modelexpress_publisher import (
    TRANSFER_BACKEND,
    publish_transfer_versions,
    transfer_init_info,
    transfer_worker_args,
)

pytestmark = pytest.mark.engine

MODEL = "tiny-mx-transfer"
PREFIX = f"s3://{BUCKET}/mx-transfer"
PROMPT = [151644, 8948, 198, 1, 2, 3]


@pytest.fixture(scope="module")
def published(tiny_model, tmp_path_factory, s3_server):
    """The seed (a copy of the tiny model, never uploaded) and ModelExpress's two deltas."""
    return publish_transfer_versions(tiny_model, tmp_path_factory.mktemp("mx-transfer"),
                                     prefix=PREFIX, model=MODEL, s3_server=s3_server)


@pytest.fixture(scope="module")
def fleet(start_module_fleet, published, s3_server):
    """One vLLM worker started from the seed, with the backend, behind a frontend."""
    return start_module_fleet([transfer_worker_args(published, MODEL)], name="mx-transfer",
                              kind="vllm", model=MODEL, worker_env=s3_server.env)


def greedy(fleet) -> list[int]:
    r = httpx.post(f"{fleet.url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0,
        "ignore_eos": True, "nvext": {"extra_fields": ["completion_token_ids"]}})
    assert r.status_code == 200, r.text
    return r.json()["nvext"]["completion_token_ids"]


def post(url: str, path: str, **kw) -> httpx.Response:
    return httpx.post(f"{url}{path}", timeout=300, **kw)


def test_vllms_client_moves_a_worker_to_modelexpress_versions(fleet, published, s3_server):
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    url = fleet.workers[0].ready["system_url"]
    assert weight_versions(fleet) == [(None, checkpoint_digest(published["seed_dir"]))]
    tokens = {None: greedy(fleet)}
    client = HTTPVLLMWeightSyncClient(url, timeout=300)
    client.init_weight_transfer_engine(transfer_init_info(published, s3_server, PREFIX))
    for version, label in (("mx-1", "policy-1"), ("mx-2", None)):  # None: the version's id
        assert post(url, "/pause", params={"mode": "keep"}).json() == {"status": "paused"}
        client.start_weight_update()
        client.update_weights({"version_id": version})
        client.finish_weight_update(label)
        assert post(url, "/resume").json() == {"status": "resumed"}
        served = label or version
        assert httpx.get(f"{url}/weight_info").json() == {"weight_version": served}
        assert weight_versions(fleet) == [(served, published["digests"][version])]
        probe = post(url, "/engine/liveness_probe").json()
        assert probe["status"] == "ok" and "self_check" not in probe, probe  # passed on resume
        tokens[version] = greedy(fleet)
    assert len({tuple(t) for t in tokens.values()}) == 3, tokens  # each version its own policy
    client.shutdown_weight_transfer_engine()


def test_refusals_leave_the_old_weights_serving(fleet, published, s3_server):
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    url = fleet.workers[0].ready["system_url"]
    client = HTTPVLLMWeightSyncClient(url, timeout=300)
    before = weight_versions(fleet)
    with pytest.raises(requests.HTTPError) as e:
        client.update_weights({"version_id": "mx-1"})  # no start: vLLM's RL state machine
    assert e.value.response.status_code == 409
    assert "preceding start_weight_update" in e.value.response.json()["detail"]
    client.init_weight_transfer_engine(transfer_init_info(published, s3_server, PREFIX))
    client.start_weight_update()
    with pytest.raises(requests.HTTPError) as e:  # not paused: rlfleet's rule, still open
        client.update_weights({"version_id": "mx-1"})
    assert e.value.response.status_code == 409
    post(url, "/pause", params={"mode": "keep"})
    with pytest.raises(requests.HTTPError) as e:
        client.update_weights({"version_id": "mx-404"})
    assert e.value.response.status_code == 500
    assert "'mx-404'" in e.value.response.json()["error"]["message"]
    with pytest.raises(requests.HTTPError):  # the failed update ended it, as in vLLM
        client.finish_weight_update()
    post(url, "/resume")
    assert weight_versions(fleet) == before
    greedy(fleet)
    client.shutdown_weight_transfer_engine()


@pytest.fixture
def vllm_mx_url(published, tmp_path):
    """vLLM's own server with the backend; ModelExpress on its path (not its plugin)."""
    reader = str(Path(sys.prefix) / "modelexpress-reader")
    env = {"VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": reader, "VLLM_PLUGINS": "none"}
    with vllm_serve(published["seed_dir"], tmp_path, *TRANSFER_BACKEND, env=env) as url:
        yield url


def test_steps_out_of_order_are_refused_as_vllm_refuses_them(fleet, vllm_mx_url, published,
                                                              s3_server):
    url = fleet.workers[0].ready["system_url"]
    ours = transfer_init_info(published, s3_server, PREFIX)
    theirs = {k: v for k, v in ours.items() if k != "object_storage_uri_prefix"}
    # init_info that does not fit (before anything else: vLLM's ModelExpress engine ignores
    # every init after a shutdown): (to vLLM, to rlfleet, named in both refusals)
    for ref_info, got_info, named in [
            ({"bogus": 1}, {**ours, "bogus": 1}, "bogus"),
            ({"object_storage_type": "S3"}, {"object_storage_type": "S3"},
             "initial_base_version_id"),
            ({**theirs, "object_storage_type": "NFS"}, {**ours, "object_storage_type": "NFS"},
             "object_storage_type='NFS'")]:
        ref = post(vllm_mx_url, "/init_weight_transfer_engine", json={"init_info": ref_info})
        got = post(url, "/init_weight_transfer_engine", json={"init_info": got_info})
        assert (ref.status_code, got.status_code) == (500, 400), (ref.text, got.text)
        for r in (ref, got):
            assert named in r.json()["error"]["message"], r.text
    post(url, "/init_weight_transfer_engine", json={"init_info": ours})
    # (path, body, whether both take it) in the same order on both; None: out of the
    # update's order (vLLM 0.32's engine: 500; the worker: the newer state machine's 409)
    calls = [("/update_weights", {"update_info": {"version_id": "mx-1"}}, None),
             ("/finish_weight_update", None, None),
             ("/start_weight_update", None, True),
             ("/start_weight_update", None, None),
             ("/shutdown_weight_transfer_engine", None, False),
             ("/finish_weight_update", None, True),
             ("/shutdown_weight_transfer_engine", None, True)]
    for path, body, ok in calls:
        ref, got = post(vllm_mx_url, path, json=body), post(url, path, json=body)
        where = f"{path}: vLLM {ref.status_code} {ref.text} / rlfleet {got.status_code} {got.text}"
        if ok is None:
            assert (ref.status_code, got.status_code) == (500, 409), where
            assert "start_weight_update" in got.json()["detail"], where
            continue
        assert got.status_code == ref.status_code == (200 if ok else 500), where
        if ok:
            assert got.json() == ref.json(), where
        else:
            assert got.json()["error"]["type"] == ref.json()["error"]["type"], where
            assert ref.json()["error"]["message"].endswith(got.json()["error"]["message"]), where
