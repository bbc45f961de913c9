"""sglang-router 0.3.2 (the router slime, Miles and AReaL put in front of their SGLang engines;
its own Rust binary, installed by scripts/setup.sh, started by tests/clients.py on a loopback
port) with an rlfleet frontend registered as its one worker: the fleet behind the router
looks like one SGLang server.

Topology: test -> router (127.0.0.1) -> frontend (`--fleet-control`) -> workers; the
frontend forwards SGLang's control routes to a fleet control service (`rlfleet control`),
so the router's `/flush_cache` fan-out resets every worker's cache. What the router asks
of the frontend is the router's own: at registration `/server_info` or `/get_server_info`
and `/model_info` or `/get_model_info` (the model it files the worker under), `/health`
while it runs, `/generate` as the client sent it.

Token IDs and logprobs through the router equal the fleet's own (`/v1/completions` on the
same frontend, greedy). A batch (`text` as a list) is not sent: sglang-router 0.3.2's own
request type takes one string and answers 422 before any worker sees the request. One fleet
per kind and module: two mocker workers (always), and the session's two vLLM workers (marker
`engine`) behind a frontend of this module's own."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.clients import (
    LOGPROB_TOL,
    fleet_answer,
    one_url,
    router_workers,
    sglang_router,
)
from tests.fleets import MODEL_NAME, RL_MOCK_MODEL, RL_PROBE_ENV, mock_args

PROMPTS = ["The capital of France is", "Once upon a time"]
SAMPLING = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


@dataclass
class Routed:
    kind: str
    frontend: str  # the frontend the router sends to
    router: str
    model: str


@pytest.fixture(scope="module")
def mock_fleet(tmp_path_factory, start_module_fleet):
    root = tmp_path_factory.mktemp("router-mock")
    return start_module_fleet([mock_args(root)] * 2, model=RL_MOCK_MODEL, enable_rl=True,
                              frontend_env=RL_PROBE_ENV)


@pytest.fixture(scope="module", params=["mocker", pytest.param("vllm", marks=pytest.mark.engine)])
def routed(request, tmp_path_factory) -> Iterator[Routed]:
    if request.param == "mocker":
        fleet, model = request.getfixturevalue("mock_fleet"), RL_MOCK_MODEL
    else:
        fleet, model = request.getfixturevalue("vllm_fleet"), MODEL_NAME
    logs = tmp_path_factory.mktemp(f"router-{request.param}")
    with one_url(fleet, model, logs) as one, sglang_router([one.url], logs) as router:
        yield Routed(request.param, one.url, router, model)


def generate(routed: Routed, **body) -> dict | list:
    r = httpx.post(f"{routed.router}/generate", timeout=120,
                   json={"sampling_params": SAMPLING, "return_logprob": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def assert_is_the_fleets(out: dict, routed: Routed, prompt: str | list[int]) -> None:
    """An SGLang /generate answer with the fleet's own tokens and logprobs for `prompt`."""
    ref = fleet_answer(routed.frontend, routed.model, prompt, SAMPLING["max_new_tokens"])
    meta = out["meta_info"]
    assert out["output_ids"] == ref.ids
    assert [t[1] for t in meta["output_token_logprobs"]] == ref.ids
    assert [t[0] for t in meta["output_token_logprobs"]] == pytest.approx(ref.logprobs,
                                                                          abs=LOGPROB_TOL)
    assert out["text"] == ref.text
    assert meta["finish_reason"] == {"type": "length", "length": SAMPLING["max_new_tokens"]}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(ref.prompt_ids),
                                                                  len(ref.ids))


def test_registration_files_the_frontend_under_its_model(routed: Routed) -> None:
    (worker,) = router_workers(routed.router, 1)
    assert worker["url"] == routed.frontend
    assert worker["model_id"] == routed.model
    assert worker["is_healthy"] is True
    models = httpx.get(f"{routed.router}/v1/models", timeout=30)
    assert models.status_code == 200, models.text
    assert routed.model in [m["id"] for m in models.json()["data"]]


def test_generate_by_text_and_by_ids_through_the_router(routed: Routed) -> None:
    router_workers(routed.router, 1)
    assert_is_the_fleets(generate(routed, text=PROMPTS[0]), routed, PROMPTS[0])
    ids = fleet_answer(routed.frontend, routed.model, PROMPTS[1], 1).prompt_ids
    assert_is_the_fleets(generate(routed, input_ids=ids), routed, ids)


def test_flush_cache_fanned_out_by_the_router_reaches_the_fleet(routed: Routed) -> None:
    router_workers(routed.router, 1)
    r = httpx.post(f"{routed.router}/flush_cache", timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert (out["status"], out["workers_flushed"], out["total_workers"]) == ("success", 1, 1), out
