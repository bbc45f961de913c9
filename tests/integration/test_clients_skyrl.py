"""SkyRL 0.3.0's own HTTP client (`RemoteInferenceClient`, installed by scripts/setup.sh, loaded
by tests/clients.py) driving an rlfleet fleet, as a SkyRL trainer set up with an external
router does: `proxy_url` = the frontend (generate, tokenize, detokenize, completion, chat),
`server_urls` = each worker's `admin_base_url` from `GET /v1/rl/workers` (pause, resume,
reset_prefix_cache, world size, LoRA load and unload: SkyRL fans these out itself).

What each call sends is SkyRL's, unchanged: `generate` posts vLLM's token-in/token-out
`/inference/v1/generate` and then `/detokenize` per output; `pause` posts
`/pause?mode=keep&clear_cache=false` to every server; `load_lora_adapter` posts SkyRL's
`/skyrl/v1/load_lora_adapter {lora_name, lora_path}` (vLLM's load with `load_inplace`, as
SkyRL's own server wraps it) and `unload_lora_adapter` vLLM's `/v1/unload_lora_adapter`.

Every token ID and logprob the client returns equals the fleet's own answer to the same
greedy prompt (`/v1/completions`, `nvext.completion_token_ids`). One fleet per kind and
module: two mocker workers (always), and the session's two vLLM workers (marker `engine`;
the LoRA calls on one vLLM worker started with LoRA enabled, tests.clients.lora_vllm_fleet)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import httpx
import pytest

from rlfleet.models import make_adapter
from tests import clients
from tests.clients import (
    LOGPROB_TOL,
    LORA_FLAGS,
    SKYRL_MESSAGES,
    SKYRL_PROMPT,
    SkyrlTarget,
    admin_urls,
    fleet_answer,
    skyrl_pause_keep,
)
from tests.fleets import MODEL_NAME, RL_MOCK_MODEL, RL_PROBE_ENV, mock_args


@pytest.fixture(scope="module")
def mock_fleet(tmp_path_factory, start_module_fleet) -> SkyrlTarget:
    root = tmp_path_factory.mktemp("skyrl-mock")
    adapter = make_adapter(root / "a1", rank=4, seed=1)
    # 10 ms a token: a 400-token request is in flight for seconds
    args = mock_args(root, *LORA_FLAGS, "--token-delay", "0.01")
    f = start_module_fleet([args] * 2, model=RL_MOCK_MODEL, enable_rl=True,
                           frontend_env=RL_PROBE_ENV)
    return SkyrlTarget("mocker", f.url, f.rl_url, RL_MOCK_MODEL, 400, adapter)


@pytest.fixture(scope="module", params=["mocker", pytest.param("vllm", marks=pytest.mark.engine)])
def target(request) -> SkyrlTarget:
    if request.param == "mocker":
        return request.getfixturevalue("mock_fleet")
    f = request.getfixturevalue("vllm_fleet")
    return SkyrlTarget("vllm", f.url, f.rl_url, MODEL_NAME, 1500, None)


def make_client(target: SkyrlTarget):
    """A RemoteInferenceClient for `target` (no local tokenizer: SkyRL's HTTP paths)."""
    mod = clients.skyrl()
    client = mod.RemoteInferenceClient(proxy_url=target.url, server_urls=admin_urls(target.rl_url),
                                       data_parallel_size=1, model_name=target.model)
    client.mod = mod
    return client


@pytest.fixture
def skyrl(target: SkyrlTarget) -> Iterator:
    client = make_client(target)
    yield client
    asyncio.run(client.teardown())


@pytest.fixture
def lora_target(request, target: SkyrlTarget) -> SkyrlTarget:
    """`target` where its workers take adapters; for vLLM, a worker with LoRA enabled."""
    if target.adapter is not None:
        return target
    f = request.getfixturevalue("lora_vllm_fleet")
    return SkyrlTarget("vllm", f.url, f.rl_url, MODEL_NAME, 0, f.adapter)


@pytest.fixture
def lora_skyrl(lora_target: SkyrlTarget) -> Iterator:
    client = make_client(lora_target)
    yield client
    asyncio.run(client.teardown())


DEADLINE = 600.0  # SkyRL's session has no timeout of its own (ClientTimeout(total=None))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, DEADLINE))


async def _generate(client, prompts: list[list[int]], max_tokens: int, model: str | None = None):
    try:
        return await client.generate({"prompt_token_ids": prompts, "sampling_params": {
            "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "logprobs": 0}},
            model=model)
    finally:
        await client.teardown()


def generate(client, prompts: list[list[int]], max_tokens: int, model: str | None = None):
    return run(_generate(client, prompts, max_tokens, model))


async def _call(client, name: str, *args, **kw):
    try:
        return await getattr(client, name)(*args, **kw)
    finally:
        await client.teardown()


def call(client, name: str, *args, **kw):
    """One of the client's coroutine methods, on a loop of its own (as a SkyRL worker runs)."""
    return run(_call(client, name, *args, **kw))


def test_tokenize_and_detokenize_are_the_fleets(skyrl, target: SkyrlTarget) -> None:
    ref = fleet_answer(target.url, target.model, SKYRL_PROMPT, 4)
    assert call(skyrl, "tokenize", [SKYRL_PROMPT]) == [ref.prompt_ids]
    without = call(skyrl, "tokenize", [SKYRL_PROMPT], add_special_tokens=False)
    assert without[0] == ref.prompt_ids[len(ref.prompt_ids) - len(without[0]):]
    assert call(skyrl, "detokenize", [ref.ids]) == [ref.text]


def test_generate_token_ids_and_logprobs_equal_the_fleets(skyrl, target: SkyrlTarget) -> None:
    prompts = [fleet_answer(target.url, target.model, p, 1).prompt_ids
               for p in (SKYRL_PROMPT, "Once upon a time")]
    refs = [fleet_answer(target.url, target.model, p, 12) for p in prompts]
    out = generate(skyrl, prompts, 12)
    assert out["response_ids"] == [r.ids for r in refs]
    for got, ref in zip(out["response_logprobs"], refs, strict=True):
        assert got == pytest.approx(ref.logprobs, abs=LOGPROB_TOL)
    assert out["stop_reasons"] == ["length", "length"]
    assert out["responses"] == [r.text for r in refs]  # through /detokenize


def test_completion_and_chat(skyrl, target: SkyrlTarget) -> None:
    ref = fleet_answer(target.url, target.model, SKYRL_PROMPT, 8)
    body = {"prompt": SKYRL_PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "session_id": "s1"}
    got = call(skyrl, "completion", {"json": body})
    assert got["choices"][0]["text"] == ref.text
    assert got["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(ref.logprobs,
                                                                             abs=LOGPROB_TOL)
    chat = {"messages": SKYRL_MESSAGES, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "nvext": {"extra_fields": ["completion_token_ids"]}}
    got = call(skyrl, "chat_completion", {"json": dict(chat)})
    assert got["model"] == target.model
    # the fleet's own chat answer to the same messages
    own = call(skyrl, "_post", f"{target.url}/v1/chat/completions", {**chat, "model": target.model})
    assert got["nvext"]["completion_token_ids"] == own["nvext"]["completion_token_ids"]
    assert got["choices"][0]["message"]["content"] == own["choices"][0]["message"]["content"]
    assert ([t["logprob"] for t in got["choices"][0]["logprobs"]["content"]]
            == pytest.approx([t["logprob"] for t in own["choices"][0]["logprobs"]["content"]],
                             abs=LOGPROB_TOL))


def test_world_size_and_reset_prefix_cache(skyrl, target: SkyrlTarget) -> None:
    servers = skyrl.server_urls
    assert call(skyrl, "get_world_size") == (len(servers), 1)
    out = call(skyrl, "reset_prefix_cache")
    assert sorted(out) == servers and all(r["status"] == 200 for r in out.values())


async def _pause_keep_then_resume(client, target: SkyrlTarget, prompt: list[int]) -> dict:
    """A generate in flight; SkyRL's pause (keep) on every server; the request is frozen,
    the servers say they are paused; resume; the request finishes whole."""
    try:
        return await skyrl_pause_keep(client, client.mod.PauseMode.KEEP, target.url, {
            "prompt_token_ids": [prompt], "sampling_params": {
                "max_tokens": target.long, "temperature": 0.0, "ignore_eos": True,
                "logprobs": 0}})
    finally:
        await client.teardown()


def test_pause_keep_with_a_request_in_flight_then_resume(skyrl, target: SkyrlTarget) -> None:
    prompt = fleet_answer(target.url, target.model, SKYRL_PROMPT, 1).prompt_ids
    r = run(_pause_keep_then_resume(skyrl, target, prompt))
    servers = skyrl.server_urls
    assert sorted(r["paused"]) == servers and all(v["status"] == 200 for v in r["paused"].values())
    assert all(v["body"]["is_paused"] is True for v in r["states"].values()), r["states"]
    assert r["frozen"], "the request finished while every server was paused (keep)"
    assert sorted(r["resumed"]) == servers
    ref = fleet_answer(target.url, target.model, prompt, target.long)
    out = r["out"]
    assert out["stop_reasons"] == ["length"]
    assert out["response_ids"] == [ref.ids]
    assert out["response_logprobs"][0] == pytest.approx(ref.logprobs, abs=LOGPROB_TOL)
    after = call(skyrl, "_call_all_servers", "/is_paused", method="GET")
    assert all(v["body"]["is_paused"] is False for v in after.values())


def lora_round_trip(skyrl, target: SkyrlTarget, load) -> None:
    """`load()` puts the adapter on every server as `skyrl-lora`; then SkyRL generates with
    it (its tokens equal the fleet's own for that adapter), unloads it on every server, and
    a generate naming it is refused."""
    loaded = load()
    assert sorted(loaded) == skyrl.server_urls
    assert all(v["status"] == 200 for v in loaded.values()), loaded
    try:
        prompt = fleet_answer(target.url, target.model, SKYRL_PROMPT, 1).prompt_ids
        ref = fleet_answer(target.url, "skyrl-lora", prompt, 8)
        base = fleet_answer(target.url, target.model, prompt, 8)
        assert ref.ids != base.ids  # the adapter is another policy
        out = generate(skyrl, [prompt], 8, model="skyrl-lora")
        assert out["response_ids"] == [ref.ids]
        assert out["response_logprobs"][0] == pytest.approx(ref.logprobs, abs=LOGPROB_TOL)
    finally:
        unloaded = call(skyrl, "unload_lora_adapter", "skyrl-lora")
    assert sorted(unloaded) == skyrl.server_urls
    with pytest.raises(aiohttp.ClientResponseError) as e:
        generate(skyrl, [prompt], 4, model="skyrl-lora")
    assert e.value.status in (400, 404)


def test_lora_load_through_skyrls_route(lora_skyrl, lora_target: SkyrlTarget) -> None:
    """SkyRL 0.3.0's own load_lora_adapter: `/skyrl/v1/load_lora_adapter` on every server."""
    lora_round_trip(lora_skyrl, lora_target, lambda: call(
        lora_skyrl, "load_lora_adapter", "skyrl-lora", str(lora_target.adapter)))


def test_lora_load_through_vllms_route(lora_skyrl, lora_target: SkyrlTarget) -> None:
    """The load SkyRL goes back to once vLLM's fix is released (its TODO): vLLM's
    `/v1/load_lora_adapter` on every server, which answers plain text on success (why SkyRL
    reads it as text, not through `_call_server`)."""
    def load() -> dict:
        out = {}
        for url in lora_skyrl.server_urls:
            r = httpx.post(f"{url}/v1/load_lora_adapter", timeout=60, json={
                "lora_name": "skyrl-lora", "lora_path": str(lora_target.adapter),
                "load_inplace": True})
            out[url] = {"status": r.status_code, "body": r.text}
        return out

    lora_round_trip(lora_skyrl, lora_target, load)
