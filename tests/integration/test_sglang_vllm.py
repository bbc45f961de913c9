"""SGLang's surface on a fleet of real vLLM workers (the tiny model): /generate answers carry
every meta_info field SGLang 0.5 returns for the same request, and their token IDs and
logprobs are the fleet's own (nvext.completion_token_ids and the logprobs of
/v1/completions on the same prompt, greedy); the server-info routes report the engine's
own settings."""

from __future__ import annotations

import httpx
import pytest

from tests.fleets import MODEL_NAME

pytestmark = pytest.mark.engine

# every meta_info field SGLang returns (managers/tokenizer_manager.py) for a finished
# request with return_logprob and top_logprobs_num
META = {"id", "finish_reason", "prompt_tokens", "weight_version", "total_retractions",
        "reasoning_tokens", "completion_tokens", "cached_tokens", "e2e_latency",
        "input_token_logprobs", "output_token_logprobs", "output_token_logprobs_length",
        "input_top_logprobs", "output_top_logprobs"}
PROMPTS = ["The capital of France is", "One, two, three,"]
N = 8


def post(fleet, path: str, body: dict) -> dict | list:
    r = httpx.post(f"{fleet.url}{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def fleet_truth(fleet, prompt: str) -> dict:
    """The fleet's own answer: IDs, logprobs (top 2) and prompt logprobs, greedy."""
    out = post(fleet, "/v1/completions", {
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": N, "temperature": 0,
        "ignore_eos": True, "logprobs": 2, "prompt_logprobs": 0,
        "return_tokens_as_token_ids": True,
        "nvext": {"extra_fields": ["completion_token_ids", "prompt_token_ids"]}})
    choice = out["choices"][0]
    return {"ids": out["nvext"]["completion_token_ids"],
            "prompt": out["nvext"]["prompt_token_ids"],
            "lps": choice["logprobs"]["token_logprobs"],
            "top": [{int(k.removeprefix("token_id:")): v for k, v in t.items()}
                    for t in choice["logprobs"]["top_logprobs"]],
            "prompt_lps": choice["prompt_logprobs"]}


def sglang(prompt: str | list[str], **kw) -> dict:
    return {"text": prompt, "return_logprob": True, "top_logprobs_num": 2,
            "logprob_start_len": 0, "sampling_params": {"max_new_tokens": N, "temperature": 0,
                                                        "ignore_eos": True}, **kw}


def check_same(answer: dict, truth: dict) -> None:
    meta = answer["meta_info"]
    assert META <= set(meta), sorted(META - set(meta))
    assert answer["output_ids"] == truth["ids"]
    assert meta["prompt_tokens"] == len(truth["prompt"]) and meta["completion_tokens"] == N
    assert meta["finish_reason"] == {"type": "length", "length": N}
    assert [e[1] for e in meta["output_token_logprobs"]] == truth["ids"]
    assert [e[0] for e in meta["output_token_logprobs"]] == pytest.approx(truth["lps"], abs=1e-5)
    for top, want in zip(meta["output_top_logprobs"], truth["top"], strict=True):
        assert {e[1]: e[0] for e in top} == pytest.approx(want, abs=1e-5)
    inputs = meta["input_token_logprobs"]
    assert [e[1] for e in inputs] == truth["prompt"] and inputs[0][0] is None
    for entry, want, tid in zip(inputs[1:], truth["prompt_lps"][1:], truth["prompt"][1:],
                                strict=True):
        assert entry[0] == pytest.approx(want[str(tid)]["logprob"], abs=1e-5)


def test_generate_by_text_is_the_fleets_own(vllm_fleet):
    truth = fleet_truth(vllm_fleet, PROMPTS[0])
    check_same(post(vllm_fleet, "/generate", sglang(PROMPTS[0])), truth)
    by_ids = post(vllm_fleet, "/generate", {**sglang(PROMPTS[0]), "text": None,
                                            "input_ids": truth["prompt"]})
    check_same(by_ids, truth)


def test_a_batch_is_each_prompts_own(vllm_fleet):
    answers = post(vllm_fleet, "/generate", sglang(PROMPTS, rid="batch"))
    assert [a["meta_info"]["id"] for a in answers] == ["batch_0", "batch_1"]
    for answer, prompt in zip(answers, PROMPTS, strict=True):
        check_same(answer, fleet_truth(vllm_fleet, prompt))


def test_cached_tokens_are_the_engines(vllm_fleet):
    """cached_tokens: the prompt tokens vLLM found in its prefix cache (3 sends on 2
    workers: at least one lands where the prompt is cached; 600 tokens fill whole KV
    blocks whatever the backend's block size)."""
    body = {"input_ids": list(range(1000, 1600)), "sampling_params": {
        "max_new_tokens": 1, "temperature": 0}}
    seen = [post(vllm_fleet, "/generate", body)["meta_info"]["cached_tokens"] for _ in range(3)]
    assert all(0 <= n < 600 for n in seen) and max(seen[1:]) >= 256, seen


def test_server_info_reports_the_engine(vllm_fleet, tiny_model):
    cfg = httpx.get(f"{vllm_fleet.url}/server_info", params={"config_format": "json"},
                    timeout=30).json()["vllm_config"]
    # what TRL reads: the worker runs vLLM with rlfleet's default --logprobs-mode
    assert cfg["model_config"]["logprobs_mode"] == "processed_logprobs"
    assert cfg["model_config"]["max_model_len"] == 2048
    info = httpx.get(f"{vllm_fleet.url}/model_info", timeout=30).json()
    assert info["model_path"] == str(tiny_model.resolve())
    r = httpx.get(f"{vllm_fleet.url}/health_generate", timeout=60)
    assert r.status_code == 200, r.text
