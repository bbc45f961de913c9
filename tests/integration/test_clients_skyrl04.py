"""SkyRL 0.4.0's own clients (installed by scripts/setup.sh for Python 3.12 and loaded on this
interpreter by tests/clients.py: its wheel is pure Python) driving an rlfleet fleet:

- `RemoteInferenceClient` with `proxy_url` = the frontend and `server_urls` = each worker's
  `admin_base_url` (SkyRL's set-up with an external router): `generate` (vLLM's
  `/inference/v1/generate`, then `/detokenize`), `tokenize`, `render_chat_completion`
  (`/v1/chat/completions/render`), `pause(KEEP)` / `resume` with a request in flight, its LoRA
  load (`/skyrl/v1/load_lora_adapter`) and unload, and, with routed experts asked for,
  `/skyrl/v1/generate` (the packed side channel decoded by SkyRL's own reader);
- the one-server variant: `server_urls = [proxy_url]`, the one URL (tests.clients.one_url);
- `fetch_weights` (its checkpoint-delta backend: a delta in SkyRL's own format) refused by
  name on every server, with what to call instead;
- the trainer-side `SkyrlWeightSyncClient` (weight_sync/control_plane.py), as far as it runs
  without NCCL: its pause, cache reset and resume on every server; NCCL's init refused by
  name (vLLM's CPU build: no GPU; the mocker: no backend), and the update steps that follow
  it refused too.

Every token ID and logprob the client returns equals the fleet's own answer to the same
greedy prompt. Its sessions (`session_ids`: X-Session-ID) stay on one worker of a frontend in
router mode kv until its `finish_session` (`POST /finish_session?session_id=`) releases them.
Fleets: two mocker workers with LoRA and simulated routed
experts (always), the session's two vLLM workers (marker `engine`; LoRA on the clients' LoRA
worker)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import httpx
import numpy as np
import pytest

from rlfleet.models import make_adapter
from rlfleet.runtime.routed_experts import as_array, from_npy_b64
from tests import clients
from tests.clients import (
    LOGPROB_TOL,
    LORA_FLAGS,
    SKYRL_MESSAGES,
    SKYRL_PROMPT,
    SkyrlTarget,
    admin_urls,
    fleet_answer,
    one_url,
    skyrl_pause_keep,
)
from tests.fleets import MODEL_NAME, RL_MOCK_MODEL, RL_PROBE_ENV, mock_args, wait_for_workers

DEADLINE = 600.0  # SkyRL's session has no timeout of its own
EXPERTS = (2, 8, 2)  # the mocker's simulated MoE: layers, experts, top-k




@pytest.fixture(scope="module")
def skyrl04():
    return clients.skyrl04()


@pytest.fixture(scope="module")
def mock_fleet(tmp_path_factory, start_module_fleet):
    root = tmp_path_factory.mktemp("skyrl04-mock")
    adapter = make_adapter(root / "a1", rank=4, seed=1)
    layers, experts, topk = EXPERTS
    args = mock_args(root, *LORA_FLAGS, "--token-delay", "0.01", "--routed-experts",
                     f"{layers}x{experts}x{topk}")
    f = start_module_fleet([args] * 2, model=RL_MOCK_MODEL, enable_rl=True,
                           frontend_env=RL_PROBE_ENV)
    f.target = SkyrlTarget("mocker", f.url, f.rl_url, RL_MOCK_MODEL, 400, adapter)
    return f


@pytest.fixture(scope="module", params=["mocker", pytest.param("vllm", marks=pytest.mark.engine)])
def target(request) -> SkyrlTarget:
    if request.param == "mocker":
        return request.getfixturevalue("mock_fleet").target
    f = request.getfixturevalue("vllm_fleet")
    return SkyrlTarget("vllm", f.url, f.rl_url, MODEL_NAME, 1500, None)


def client_of(skyrl04, target: SkyrlTarget, servers: list[str] | None = None, **kw):
    return skyrl04.client.RemoteInferenceClient(
        proxy_url=target.url, server_urls=servers or admin_urls(target.rl_url),
        data_parallel_size=1, model_name=target.model, **kw)


def run(client, coro_of) -> Any:
    """`coro_of(client)` on a loop of its own (as a SkyRL worker runs it), then teardown."""
    async def go() -> Any:
        try:
            return await coro_of(client)
        finally:
            await client.teardown()
    return asyncio.run(asyncio.wait_for(go(), DEADLINE))


def greedy(max_tokens: int) -> dict[str, Any]:
    return {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "logprobs": 0}


def test_generate_and_tokenize_equal_the_fleets(skyrl04, target: SkyrlTarget) -> None:
    client = client_of(skyrl04, target)
    ref = fleet_answer(target.url, target.model, SKYRL_PROMPT, 12)
    assert run(client, lambda c: c.tokenize([SKYRL_PROMPT])) == [ref.prompt_ids]
    out = run(client, lambda c: c.generate({"prompt_token_ids": [ref.prompt_ids],
                                            "sampling_params": greedy(12)}))
    assert out["response_ids"] == [ref.ids] and out["stop_reasons"] == ["length"]
    assert out["response_logprobs"][0] == pytest.approx(ref.logprobs, abs=LOGPROB_TOL)
    assert out["responses"] == [ref.text]  # through /detokenize


def test_render_chat_completion_is_the_chats_prompt(skyrl04, target: SkyrlTarget) -> None:
    client = client_of(skyrl04, target)
    rendered = run(client, lambda c: c.render_chat_completion({"json": {"messages": SKYRL_MESSAGES}}))
    chat = httpx.post(f"{target.url}/v1/chat/completions", timeout=120, json={
        "model": target.model, "messages": SKYRL_MESSAGES, "max_tokens": 1,
        "nvext": {"extra_fields": ["prompt_token_ids"]}}).json()
    [one] = rendered if isinstance(rendered, list) else [rendered]
    assert one["token_ids"] == chat["nvext"]["prompt_token_ids"]
    assert one["model"] == target.model


def pause_keep_round_trip(skyrl04, target: SkyrlTarget, servers: list[str] | None = None) -> None:
    client = client_of(skyrl04, target, servers)
    prompt = fleet_answer(target.url, target.model, SKYRL_PROMPT, 1).prompt_ids
    r = run(client, lambda c: skyrl_pause_keep(
        c, skyrl04.client.PauseMode.KEEP, target.url,
        {"prompt_token_ids": [prompt], "sampling_params": greedy(target.long)}))
    assert all(v["status"] == 200 for v in r["paused"].values())
    assert all(v["body"]["is_paused"] is True for v in r["states"].values()), r["states"]
    assert r["frozen"], "the request finished while every server was paused (keep)"
    ref = fleet_answer(target.url, target.model, prompt, target.long)
    assert r["out"]["response_ids"] == [ref.ids]
    assert r["out"]["response_logprobs"][0] == pytest.approx(ref.logprobs, abs=LOGPROB_TOL)


def test_pause_keep_with_a_request_in_flight_then_resume(skyrl04, target: SkyrlTarget) -> None:
    pause_keep_round_trip(skyrl04, target)


@pytest.fixture
def lora_target(request, target: SkyrlTarget) -> SkyrlTarget:
    if target.adapter is not None:
        return target
    f = request.getfixturevalue("lora_vllm_fleet")
    return SkyrlTarget("vllm", f.url, f.rl_url, MODEL_NAME, 0, f.adapter)


def test_lora_load_generate_and_unload(skyrl04, lora_target: SkyrlTarget) -> None:
    target = lora_target
    client = client_of(skyrl04, target)
    loaded = run(client, lambda c: c.load_lora_adapter("skyrl04-lora", str(target.adapter)))
    assert all(v["status"] == 200 for v in loaded.values()), loaded
    try:
        prompt = fleet_answer(target.url, target.model, SKYRL_PROMPT, 1).prompt_ids
        ref = fleet_answer(target.url, "skyrl04-lora", prompt, 8)
        assert ref.ids != fleet_answer(target.url, target.model, prompt, 8).ids
        out = run(client, lambda c: c.generate({"prompt_token_ids": [prompt],
                                                "sampling_params": greedy(8)},
                                               model="skyrl04-lora"))
        assert out["response_ids"] == [ref.ids]
        assert out["response_logprobs"][0] == pytest.approx(ref.logprobs, abs=LOGPROB_TOL)
    finally:
        run(client, lambda c: c.unload_lora_adapter("skyrl04-lora"))
    with pytest.raises(aiohttp.ClientResponseError):
        run(client, lambda c: c.generate({"prompt_token_ids": [prompt],
                                          "sampling_params": greedy(4)}, model="skyrl04-lora"))


def test_routed_experts_through_skyrls_packed_route(skyrl04, mock_fleet) -> None:
    """`generate` with routed experts asked for posts /skyrl/v1/generate; SkyRL's reader
    decodes the packed array, equal to what vLLM's route answers for the same request."""
    target = mock_fleet.target
    client = client_of(skyrl04, target, enable_return_routed_experts=True)
    prompt = fleet_answer(target.url, target.model, SKYRL_PROMPT, 1).prompt_ids
    gen = client._get_generate_client()
    got = run(client, lambda c: gen.generate(
        prompt_token_ids=prompt, sampling_params=greedy(6), session_id=None,
        model=target.model, return_routed_experts=True, routed_experts_prompt_start=0))
    own = httpx.post(f"{target.url}/inference/v1/generate", timeout=120, json={
        "model": target.model, "token_ids": prompt,
        "sampling_params": {**greedy(6), "routed_experts_prompt_start": 0}}).json()
    choice = own["choices"][0]
    assert got.response_ids == choice["token_ids"]
    expected = as_array(from_npy_b64(choice["routed_experts"]))
    assert isinstance(got.routed_experts, np.ndarray) and got.routed_experts.dtype == np.uint8
    assert np.array_equal(got.routed_experts, expected)
    assert got.routed_experts.shape == (len(prompt) + 6 - 1, EXPERTS[0], EXPERTS[2])
    refused = httpx.post(f"{target.url}/skyrl/v1/generate", timeout=60, json={
        "model": target.model, "token_ids": prompt, "sampling_params": greedy(2),
        "return_sample_support": True})
    assert refused.status_code == 400 and "return_sample_support" in refused.text


def test_sessions_are_kept_then_released_by_finish_session(skyrl04, mock_fleet) -> None:
    """`generate` with `session_ids` sends X-Session-ID: a frontend in router mode kv binds
    each session to a worker and keeps it there; SkyRL's `finish_session` releases it."""
    main = mock_fleet.frontend
    fe = mock_fleet.start_frontend("--router-mode", "kv")
    mock_fleet.frontend = main
    try:
        url = fe.ready["url"]
        wait_for_workers(url, RL_MOCK_MODEL, 2)

        def bound() -> dict[int, int]:
            h = httpx.get(f"{url}/health", timeout=10).json()
            return {w["instance_id"]: w["kv"]["sessions"] for w in h["workers"]}
        client = client_of(skyrl04, SkyrlTarget("mocker", url, mock_fleet.rl_url, RL_MOCK_MODEL,
                                           0, None))
        prompts = [list(range(1000, 1040)), list(range(2000, 2040))]  # nothing in common
        batch = {"prompt_token_ids": prompts, "session_ids": ["ep-a", "ep-b"],
                 "sampling_params": greedy(4)}
        run(client, lambda c: c.generate(batch))
        first = bound()
        assert sorted(first.values()) == [1, 1]  # one session each: spread, and bound
        for _ in range(3):  # the sessions' next turns keep their workers
            run(client, lambda c: c.generate(batch))
            assert bound() == first
        run(client, lambda c: c.finish_session("ep-a"))
        assert sum(bound().values()) == 1
        run(client, lambda c: c.finish_session("ep-b"))
        run(client, lambda c: c.finish_session("never-seen"))  # no error: nothing to release
        assert sum(bound().values()) == 0
    finally:
        fe.stop()
        mock_fleet.procs.remove(fe)


def test_fetch_weights_is_refused_by_name_with_what_to_call(skyrl04, target: SkyrlTarget) -> None:
    client = client_of(skyrl04, target)
    with pytest.raises(aiohttp.ClientResponseError) as e:
        run(client, lambda c: c.fetch_weights(3, sync_dir="/tmp/skyrl-sync"))
    assert e.value.status == 400
    said = httpx.post(f"{client.server_urls[0]}/fetch_weights", json={"target_version": 3}).json()
    assert "stage_weights" in said["error"] and "SkyRL's own format" in said["error"]


def test_the_trainer_side_weight_sync_client_without_nccl(skyrl04, target: SkyrlTarget) -> None:
    cp = skyrl04.control_plane
    servers = admin_urls(target.rl_url)
    sync = cp.SkyrlWeightSyncClient(servers, 1, init_payload_fn=cp.nccl_init_payloads)
    before = fleet_answer(target.url, target.model, SKYRL_PROMPT, 6)
    try:
        sync.pause_generation()
        assert all(httpx.get(f"{u}/is_paused").json()["is_paused"] for u in servers)
        sync.reset_prefix_cache()
        with pytest.raises(Exception, match="need a GPU" if target.kind == "vllm"
                           else "no vLLM weight-transfer engine"):
            sync.init_weight_transfer_engine({"master_address": "127.0.0.1",
                                              "master_port": 29579, "rank_offset": 1,
                                              "world_size": 1 + len(servers)})
        with pytest.raises(Exception):  # noqa: B017 - refused: no engine was initialized
            sync.start_weight_update()
        with pytest.raises(Exception, match="stage_weights"):
            sync.fetch_weights(3)
    finally:
        sync.resume_generation()
        sync.close()
    assert not any(httpx.get(f"{u}/is_paused").json()["is_paused"] for u in servers)
    after = fleet_answer(target.url, target.model, SKYRL_PROMPT, 6)
    assert after.ids == before.ids


@pytest.fixture(scope="module")
def one(request, target: SkyrlTarget, tmp_path_factory) -> Iterator[SkyrlTarget]:
    fleet = request.getfixturevalue("mock_fleet" if target.kind == "mocker" else "vllm_fleet")
    with one_url(fleet, target.model, tmp_path_factory.mktemp(f"skyrl04-{target.kind}")) as u:
        yield SkyrlTarget(target.kind, u.url, u.rl_url, target.model, target.long, None)


def test_the_one_server_variant(skyrl04, one: SkyrlTarget) -> None:
    """server_urls = [proxy_url]: the control calls reach the whole fleet."""
    pause_keep_round_trip(skyrl04, one, [one.url])
    client = client_of(skyrl04, one, [one.url])
    assert run(client, lambda c: c.get_world_size())[0] == 2
    out = run(client, lambda c: c.reset_prefix_cache())
    assert out[one.url]["status"] == 200
    with pytest.raises(aiohttp.ClientResponseError) as e:
        run(client, lambda c: c.fetch_weights(3))
    assert e.value.status == 400
