"""Shared fixtures: locally made test models and real fleets (vLLM workers, etcd)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from tests.ray_server import LOOPBACK_ENV

# Ray reads these when it is first imported (vLLM imports it too): set them before anything
# else, so that drivers find the test's Ray head on 127.0.0.1
os.environ.update(LOOPBACK_ENV)

from rlfleet.models import make_model  # noqa: E402
from rlfleet.runtime.launch import LocalFleet
from tests.etcd_server import run_etcd
from tests.s3_server import S3Server

# float32 so logprobs can be compared with transformers; eager for a quick start
VLLM_FLAGS = ("--dtype", "float32", "--max-model-len", "2048", "--enforce-eager")
MODEL_NAME = "tiny"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("models") / "tiny-seed1", size="tiny", seed=1)


@pytest.fixture(scope="session")
def tiny_model_b(tmp_path_factory) -> Path:
    """The same architecture and tokenizer as tiny_model, another policy."""
    return make_model(tmp_path_factory.mktemp("models") / "tiny-seed2", size="tiny", seed=2)


@pytest.fixture(scope="session")
def etcd_url():
    with run_etcd() as url:
        yield url


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 server (SeaweedFS) on 127.0.0.1; tests may kill() and start() it again."""
    with S3Server() as server:
        yield server


def wait_for_workers(url: str, model: str, count: int, timeout: float = 30.0) -> list[dict]:
    """Block until the frontend at `url` routes to `count` usable workers of `model`."""
    deadline = time.monotonic() + timeout
    while True:
        workers = [w for w in httpx.get(f"{url}/health", timeout=5).json()["workers"]
                   if w["model"] == model and w["usable"]]
        if len(workers) == count:
            return workers
        if time.monotonic() > deadline:
            raise TimeoutError(f"frontend sees {len(workers)} usable workers of {model}, "
                               f"expected {count}")
        time.sleep(0.2)


@pytest.fixture(scope="session")
def vllm_fleet(tmp_path_factory, tiny_model, etcd_url):
    """Frontend (with the RL listener) + 2 real vLLM workers serving `tiny`, over etcd."""
    with LocalFleet(tmp_path_factory.mktemp("fleet"), discovery=etcd_url, lease_ttl=3) as fleet:
        fleet.start_frontend(enable_rl=True)
        procs = [fleet.start_worker("--model", str(tiny_model), "--served-model-name", MODEL_NAME,
                                    "--enable-rl", "--system-port", "0",
                                    "--enable-fault-injection", *VLLM_FLAGS, wait=False)
                 for _ in range(2)]
        for p in procs:
            p.wait_ready(600)
        wait_for_workers(fleet.url, MODEL_NAME, 2)
        yield fleet


@pytest.fixture(scope="session")
def ray_head():
    """One local Ray head (127.0.0.1) for the whole session; drivers and `rlfleet` processes
    find it at the address yielded."""
    pytest.importorskip("ray", reason="ray is not installed (pip install ray)")
    from ray._private import ray_constants

    from tests.ray_server import run_ray_head

    if ray_constants.ENABLE_RAY_CLUSTER:  # a driver would look for the head elsewhere, forever
        pytest.fail("ray was imported before tests/conftest.py set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    with run_ray_head() as address:
        yield address
