"""ModelExpress-published versions applied by a real two-worker vLLM fleet: ModelExpress's
own trainer-side publisher (two ranks over gloo) writes a chain of two XOR deltas to a real
S3 server (SeaweedFS), the first on the seed checkpoint the workers were started from (never
uploaded; the stage request names it by its content digest alone), and the staged refresh
path moves the fleet to each version. The versions hold the real model's tensors, float32:
no float8, which vLLM cannot load into this model (its float32 layers hold no float8
weights); test_weights_modelexpress.py stages ModelExpress's float8 versions in-process."""

from __future__ import annotations

import asyncio
import shutil

import httpx
import pytest

from rlfleet.journal import SqliteJournal
from rlfleet.refresh.coordinator import PolicyRefresh
from rlfleet.testing.fleet import LocalFleet
from rlfleet.testing.s3 import BUCKET
from rlfleet.weights import artifacts as art
from rlfleet.weights.digest import checkpoint_digest, digest_tensors, iter_checkpoint_tensors
from tests.fleets import vllm_worker_args, weight_versions
from tests.modelexpress_publisher import SEED, perturbed, publish_with_modelexpress

pytestmark = pytest.mark.engine

MODEL = "tiny-mx"
PREFIX = f"s3://{BUCKET}/mx-vllm"
PROMPT = [151644, 8948, 198, 1, 2, 3]
N = 8
PLAN = (("mx-1", SEED), ("mx-2", "mx-1"))  # mx-1 on the seed, mx-2 on mx-1


@pytest.fixture(scope="module")
def published(tiny_model, tmp_path_factory, s3_server):
    """The seed directory (a copy of the tiny model, never uploaded) and ModelExpress's
    two deltas on the S3 server, written by two ranks."""
    if s3_server.proc is None:
        s3_server.start()
    root = tmp_path_factory.mktemp("mx-vllm")
    seed_dir = shutil.copytree(tiny_model, root / "seed")
    seed = dict(iter_checkpoint_tensors(seed_dir))
    assert art.TIED_OUTPUT not in seed  # the tied lm_head is stored once, as the embedding
    steps = {"mx-1": perturbed(seed, 21, "layers.0.")}
    steps["mx-2"] = perturbed(steps["mx-1"], 22, "layers.1.")
    publish_with_modelexpress(root / "ranks", seed_dir / "model.safetensors", steps, PLAN,
                              prefix=PREFIX, model=MODEL, s3_server=s3_server)
    return {"seed_dir": seed_dir, "seed_digest": checkpoint_digest(seed_dir),
            "digests": {v: digest_tensors(t.items()) for v, t in steps.items()}, "root": root}


@pytest.fixture(scope="module")
def fleet(start_module_fleet, published, s3_server) -> LocalFleet:
    """Two vLLM workers started from the seed directory, each with its own staging dir."""
    workers = [vllm_worker_args(published["seed_dir"], MODEL, "--weights-staging-dir",
                                str(published["root"] / f"staging-{i}")) for i in range(2)]
    return start_module_fleet(workers, name="mx-vllm-fleet", kind="vllm", model=MODEL,
                              lease_ttl=3, enable_rl=True, worker_env=s3_server.env)


def _greedy(fleet: LocalFleet) -> set[tuple[int, ...]]:
    """The greedy completions of PROMPT through the frontend (four requests, both workers)."""
    out = set()
    for _ in range(4):
        r = httpx.post(f"{fleet.url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": N, "temperature": 0.0,
            "ignore_eos": True, "nvext": {"extra_fields": ["completion_token_ids"]}})
        assert r.status_code == 200, r.text
        out.add(tuple(r.json()["nvext"]["completion_token_ids"]))
    return out


def test_a_vllm_fleet_applies_modelexpress_deltas_on_its_seed(fleet, published, s3_server,
                                                               tmp_path, monkeypatch):
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    assert {d for _, d in weight_versions(fleet)} == {published["seed_digest"]}
    [seed_tokens] = _greedy(fleet)
    coordinator = PolicyRefresh(fleet.rl_url, model=MODEL, path="vllm-staged",
                                journal=SqliteJournal(tmp_path / "journal.sqlite"), timeout=300)
    for step, (version, base) in enumerate(PLAN):
        digest = published["digests"][version]
        source = {"kind": "s3", "uri": f"{PREFIX}/{version}",
                  "endpoint_url": s3_server.endpoint_url}
        if base == SEED:  # the seed was never uploaded: named by its content digest alone
            source["base"] = {"digest": published["seed_digest"]}
        result = asyncio.run(coordinator.refresh(None, version, digest=digest, source=source,
                                                 step=step))
        assert result.ok and result.fleet_moved, result.reason
        for w in result.workers:
            [staged] = [c["body"] for c in w["calls"] if c["route"] == "staged"]
            assert staged["state"] == "READY" and staged["source"]["kind"] == "s3"
            assert staged["format"] == "xor-delta" and staged["digest"] == digest
        assert weight_versions(fleet) == [(version, digest)] * 2
        tokens = _greedy(fleet)  # the gate reopened: both workers serve, the same tokens
        assert len(tokens) == 1 and tokens != {seed_tokens}, version
