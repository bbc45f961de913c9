"""The serving plane against real vLLM on the tiny model: token authority end to end."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.fleets import MODEL_NAME

pytestmark = pytest.mark.engine

LITERAL = {"model": MODEL_NAME, "prompt": [151644, 8948, 198], "max_tokens": 32,
           "temperature": 0, "logprobs": 0, "ignore_eos": True,
           "nvext": {"extra_fields": ["completion_token_ids"]}}


def post(fleet, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{fleet.url}{path}", json=body, timeout=120, **kw)


def complete(fleet, body: dict) -> dict:
    r = post(fleet, "/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def test_contract_literal_example(vllm_fleet):
    out = complete(vllm_fleet, {**LITERAL, "return_tokens_as_token_ids": True})
    ids = out["nvext"]["completion_token_ids"]
    lp = out["choices"][0]["logprobs"]
    assert len(ids) == 32
    assert [int(t.removeprefix("token_id:")) for t in lp["tokens"]] == ids
    assert len(lp["token_logprobs"]) == len(ids)
    assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"])
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 32, "total_tokens": 35}
    # the plain literal request (decoded tokens) gives the same IDs at temperature 0
    plain = complete(vllm_fleet, LITERAL)
    assert plain["nvext"]["completion_token_ids"] == ids
    assert plain["choices"][0]["finish_reason"] == "length"


def test_text_prompt_and_its_token_ids_agree(vllm_fleet):
    fields = ["completion_token_ids", "prompt_token_ids", "prompt_logprobs"]
    base = {"model": MODEL_NAME, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "prompt_logprobs": 1, "nvext": {"extra_fields": fields}}
    text = complete(vllm_fleet, {**base, "prompt": "Hello world, the answer is 42."})
    prompt_ids = text["nvext"]["prompt_token_ids"]
    assert text["usage"]["prompt_tokens"] == len(prompt_ids) > 3
    ids = complete(vllm_fleet, {**base, "prompt": prompt_ids})
    assert ids["nvext"]["completion_token_ids"] == text["nvext"]["completion_token_ids"]
    plps = ids["nvext"]["prompt_logprobs"]
    assert len(plps) == len(prompt_ids) and plps[0] is None
    for pos, tid in enumerate(prompt_ids[1:], start=1):
        assert str(tid) in plps[pos]
        assert set(plps[pos][str(tid)]) == {"logprob", "rank", "decoded_token"}


def test_logprobs_match_a_transformers_forward_pass(vllm_fleet, tiny_model):
    from transformers import AutoModelForCausalLM

    prompt = [151644, 8948, 198, 40, 1079, 264]
    out = complete(vllm_fleet, {
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 24, "temperature": 1.0, "seed": 7,
        "logprobs": 0, "prompt_logprobs": 0, "ignore_eos": True,
        "nvext": {"extra_fields": ["completion_token_ids", "prompt_logprobs"]}})
    gen = out["nvext"]["completion_token_ids"]
    engine_lps = out["choices"][0]["logprobs"]["token_logprobs"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + gen])).logits[0].float()
    lsm = torch.log_softmax(logits, dim=-1)
    seq = prompt + gen
    ref = [lsm[i - 1, seq[i]].item() for i in range(len(prompt), len(seq))]
    assert max(abs(a - b) for a, b in zip(ref, engine_lps, strict=True)) < 1e-4
    ref_prompt = [lsm[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    got_prompt = [e[str(prompt[i])]["logprob"]
                  for i, e in enumerate(out["nvext"]["prompt_logprobs"]) if i > 0]
    assert max(abs(a - b) for a, b in zip(ref_prompt, got_prompt, strict=True)) < 1e-4


def test_official_openai_client(vllm_fleet):
    client = openai.OpenAI(base_url=f"{vllm_fleet.url}/v1", api_key="unused", timeout=60)
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    extra = {"ignore_eos": True, "nvext": {"extra_fields": ["completion_token_ids"]}}
    c = client.completions.create(model=MODEL_NAME, prompt=[151644, 8948, 198], max_tokens=8,
                                  temperature=0, logprobs=0, extra_body=extra)
    ids = c.model_extra["nvext"]["completion_token_ids"]
    assert len(ids) == 8 and len(c.choices[0].logprobs.token_logprobs) == 8
    streamed: list[int] = []
    text = ""
    for chunk in client.completions.create(model=MODEL_NAME, prompt=[151644, 8948, 198],
                                           max_tokens=8, temperature=0, stream=True,
                                           extra_body=extra):
        streamed += (chunk.model_extra.get("nvext") or {}).get("completion_token_ids", [])
        text += "".join(ch.text for ch in chunk.choices)
    assert streamed == ids
    assert text == c.choices[0].text
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Say hi"}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=2, extra_body=extra)
    assert len(chat.choices[0].logprobs.content) == 6
    assert all(len(t.top_logprobs) == 2 for t in chat.choices[0].logprobs.content)
    pieces = [ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Say hi"}], max_tokens=6,
        temperature=0, stream=True, extra_body=extra) if ch.choices]
    assert "".join(pieces) == chat.choices[0].message.content


def test_requests_land_on_both_workers(vllm_fleet):
    seen = set()
    for _ in range(8):
        out = complete(vllm_fleet, {"model": MODEL_NAME, "prompt": [1, 2, 3], "max_tokens": 2,
                                    "nvext": {"extra_fields": ["worker_id"]}})
        seen.add(out["nvext"]["worker_id"]["decode_worker_id"])
    expected = {int(p.ready["instance_id"]) for p in vllm_fleet.workers}
    assert seen == expected


def test_sampling_controls(vllm_fleet):
    base = {"model": MODEL_NAME, "prompt": [151644, 8948, 198], "max_tokens": 10,
            "nvext": {"extra_fields": ["completion_token_ids", "detailed_finish_reason"]}}
    a = complete(vllm_fleet, {**base, "n": 3, "seed": 11, "temperature": 1.0})
    b = complete(vllm_fleet, {**base, "n": 3, "seed": 11, "temperature": 1.0})
    assert len(a["choices"]) == 3
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
    assert len(a["nvext"]["choices"]) == 3
    greedy = complete(vllm_fleet, {**base, "temperature": 0, "ignore_eos": True})
    ids = greedy["nvext"]["completion_token_ids"]
    stop_id = ids[4]
    first = ids.index(stop_id)
    stopped = complete(vllm_fleet, {**base, "temperature": 0, "ignore_eos": True,
                                    "stop_token_ids": [stop_id]})
    ch = stopped["choices"][0]
    assert ch["finish_reason"] == "stop" and ch["stop_reason"] == stop_id
    assert stopped["nvext"]["detailed_finish_reason"] == "stop"
    assert stopped["nvext"]["completion_token_ids"] == ids[:first + 1]
    # min_tokens holds a stop token back until the minimum is reached
    held = complete(vllm_fleet, {**base, "temperature": 0, "ignore_eos": True,
                                 "stop_token_ids": [ids[0]], "min_tokens": 3})
    assert len(held["nvext"]["completion_token_ids"]) >= 3
    # a stop string ends the text before it
    text = greedy["choices"][0]["text"]
    cut = complete(vllm_fleet, {**base, "temperature": 0, "ignore_eos": True,
                                "stop": [text[5:9]]})
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert text[5:9] not in cut["choices"][0]["text"]


def test_engine_data_carries_the_engines_tokens_for_a_chat_rollout(vllm_fleet):
    """A Dynamo token client asks only for engine_data: the engine's IDs and sampled
    logprobs, unary and streamed, and turn 2 as nvext.token_data is prompted with them."""
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Say hi"}],
            "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "nvext": {"extra_fields": ["engine_data"]}}
    ref = post(vllm_fleet, "/v1/chat/completions", {
        **chat, "logprobs": True, "top_logprobs": 0, "return_tokens_as_token_ids": True,
        "nvext": {"extra_fields": ["completion_token_ids", "prompt_token_ids"]}}).json()
    content = ref["choices"][0]["logprobs"]["content"]
    ids = ref["nvext"]["completion_token_ids"]
    assert [int(e["token"].removeprefix("token_id:")) for e in content] == ids
    unary = post(vllm_fleet, "/v1/chat/completions", chat).json()["nvext"]["engine_data"]
    with httpx.stream("POST", f"{vllm_fleet.url}/v1/chat/completions",
                      json={**chat, "stream": True}, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    streamed = [e["nvext"]["engine_data"] for e in events
                if any(c.get("finish_reason") for c in e["choices"])]
    for data in (unary, *streamed):
        assert data["completion_token_ids"] == ids and data["finished"] is True
        assert data["prompt_token_ids"] == ref["nvext"]["prompt_token_ids"]
        assert data["completion_logprobs"] == pytest.approx([e["logprob"] for e in content],
                                                            abs=1e-4)
    turn = unary["prompt_token_ids"] + unary["completion_token_ids"] + [198]
    again = post(vllm_fleet, "/v1/chat/completions", {
        "model": MODEL_NAME, "max_tokens": 2, "nvext": {
            "token_data": turn, "extra_fields": ["engine_data"]}}).json()
    assert again["nvext"]["engine_data"]["prompt_token_ids"] == turn


def test_streaming_matches_unary(vllm_fleet):
    body = {"model": MODEL_NAME, "prompt": [151644, 8948, 198], "max_tokens": 12,
            "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "nvext": {"extra_fields": ["completion_token_ids", "prompt_token_ids"]}}
    unary = complete(vllm_fleet, body)
    chunks = []
    with httpx.stream("POST", f"{vllm_fleet.url}/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    events = [json.loads(c) for c in chunks[:-1]]
    ids = [t for e in events for t in e.get("nvext", {}).get("completion_token_ids", [])]
    assert ids == unary["nvext"]["completion_token_ids"]
    assert events[-1]["nvext"]["completion_token_ids"] == []
    assert events[-1]["nvext"]["prompt_token_ids"] == [151644, 8948, 198]
    lps = [x for e in events for c in e["choices"] if c["logprobs"]
           for x in c["logprobs"]["token_logprobs"]]
    assert lps == pytest.approx(unary["choices"][0]["logprobs"]["token_logprobs"], abs=1e-6)


def test_sglang_generate(vllm_fleet):
    body = {"input_ids": [151644, 8948, 198], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    unary = post(vllm_fleet, "/generate", body).json()
    assert len(unary["output_ids"]) == 8
    assert [x[1] for x in unary["meta_info"]["output_token_logprobs"]] == unary["output_ids"]
    assert unary["meta_info"]["finish_reason"]["type"] == "length"
    events = []
    with httpx.stream("POST", f"{vllm_fleet.url}/generate", json={**body, "stream": True},
                      timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    final = json.loads(events[-2])
    assert final["output_ids"] == unary["output_ids"]
    assert [x[1] for x in final["meta_info"]["output_token_logprobs"]] == final["output_ids"]
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    # streamed with input logprobs: the last event adds them, first position undefined
    with httpx.stream("POST", f"{vllm_fleet.url}/generate", timeout=60, json={
            **body, "stream": True, "logprob_start_len": 0}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    last = json.loads(events[-2])["meta_info"]
    assert [x[1] for x in last["input_token_logprobs"]] == [151644, 8948, 198]
    assert last["input_token_logprobs"][0][0] is None
    bad = post(vllm_fleet, "/generate", {"input_ids": []})
    assert bad.status_code == 400 and "input_ids" in bad.json()["error"]["message"]
    n2 = post(vllm_fleet, "/generate", {**body, "sampling_params": {"n": 2}})
    assert n2.status_code == 400


def test_input_tokens_estimate(vllm_fleet):
    r = post(vllm_fleet, "/v1/responses/input_tokens",
             {"model": MODEL_NAME, "input": "Hello there", "instructions": "Be brief."})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "response.input_tokens" and body["input_tokens"] > 4


BAD = [
    # numeric strings ("8") are accepted, as vLLM accepts them (issue 9, finding 3)
    ({"model": MODEL_NAME, "prompt": [1, 2], "max_tokens": "eight"}, 400, "max_tokens"),
    ({"model": MODEL_NAME, "prompt": ""}, 400, "empty"),
    ({"model": MODEL_NAME, "prompt": []}, 400, "at least one prompt"),
    ({"model": MODEL_NAME, "prompt": [151936]}, 400, "outside the vocabulary"),
    ({"model": MODEL_NAME, "prompt": [-1]}, 400, "greater than or equal to 0"),
    ({"model": MODEL_NAME, "prompt": [1], "max_tokens": 0}, 400, "max_tokens"),
    # as vLLM: a budget beyond the room the prompt leaves is lowered to it; beyond the
    # context length it is refused
    ({"model": MODEL_NAME, "prompt": [1], "max_tokens": 2049}, 400, "max_tokens"),
    ({"model": MODEL_NAME, "prompt": [1] * 2048, "max_tokens": 1}, 400, "context"),
    ({"model": "no-such-model", "prompt": [1]}, 404, "not served"),
    ({"model": MODEL_NAME, "prompt": [1], "logprobs": 99}, 400, "logprobs"),
    ({"model": MODEL_NAME, "prompt": [1], "nvext": {"extra_fields": ["bogus"]}}, 400, "bogus"),
    # no `model` is accepted with one served model, as vLLM serves it (issue 9, finding 3;
    # test_differential_vllm.py::test_missing_model_with_one_served)
    ({"model": MODEL_NAME, "prompt": [1], "n": 2, "temperature": 0}, 400, "greedy"),
]


@pytest.mark.parametrize("body,status,words", BAD)
def test_bad_input_gets_a_clear_error(vllm_fleet, body, status, words):
    r = post(vllm_fleet, "/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"]


def test_malformed_bodies_and_service_continues(vllm_fleet):
    for raw in (b"{not json", b"[1, 2]", b""):
        r = httpx.post(f"{vllm_fleet.url}/v1/completions", content=raw, timeout=10,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"]
    chat = post(vllm_fleet, "/v1/chat/completions", {"model": MODEL_NAME, "messages": []})
    assert chat.status_code == 400
    ok = complete(vllm_fleet, {"model": MODEL_NAME, "prompt": [1, 2, 3], "max_tokens": 2})
    assert ok["usage"]["completion_tokens"] == 2


def test_metrics_and_health(vllm_fleet):
    text = httpx.get(f"{vllm_fleet.url}/metrics", timeout=10).text
    assert "rlfleet_frontend_requests_total" in text
    assert f'rlfleet_frontend_workers{{model="{MODEL_NAME}"}} 2.0' in text
    assert "rlfleet_worker_" not in text  # the frontend exports its own series only
    for p in vllm_fleet.workers:  # vLLM's own series, and the worker's, on both its ports
        for url in (p.ready["url"], p.ready["system_url"]):
            text = httpx.get(f"{url}/metrics", timeout=10).text
            assert re.search(r"^vllm:num_requests_running\{.*\} \d", text, re.M), text[:2000]
            assert re.search(r"^vllm:generation_tokens_total\{", text, re.M)
            assert f'rlfleet_worker_requests_total{{model="{MODEL_NAME}",outcome="ok"}}' in text
            assert re.search(r'^rlfleet_worker_policy_info{digest="blake3:[0-9a-f]+",'
                             rf'model="{MODEL_NAME}",version="[^"]*"}} 1\.0$', text, re.M)
            assert "rlfleet_frontend_" not in text
    assert httpx.get(f"{vllm_fleet.url}/health", timeout=10).json()["status"] == "healthy"


def exported_names(text: str) -> set[str]:
    """Every series name a /metrics exposition can carry (a histogram's _bucket, _sum and
    _count, a counter's _total, an info metric's _info), families without samples included."""
    from prometheus_client.parser import text_string_to_metric_families

    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count"),
                "summary": ("_sum", "_count"), "info": ("_info",)}
    out = set()
    for fam in text_string_to_metric_families(text):
        out.add(fam.name)
        out.update(fam.name + s for s in suffixes.get(fam.type, ()))
        out.update(s.name for s in fam.samples)
    return out


def test_grafana_dashboard_queries_name_exported_metrics(vllm_fleet):
    """deploy/grafana/rlfleet.json: every query names only series that this fleet exports
    (frontend, real vLLM workers, and the trainer process's rollout and refresh series)."""
    from prometheus_client import REGISTRY, generate_latest

    import rlfleet.refresh.coordinator  # noqa: F401
    import rlfleet.rollout.client  # noqa: F401  the trainer side's series

    dash = json.loads((Path(__file__).parents[2] / "deploy/grafana/rlfleet.json").read_text())
    exported = exported_names(httpx.get(f"{vllm_fleet.url}/metrics", timeout=10).text)
    exported |= exported_names(generate_latest(REGISTRY).decode())
    for p in vllm_fleet.workers:
        exported |= exported_names(httpx.get(f"{p.ready['system_url']}/metrics", timeout=10).text)
    queries = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    queries += [v["definition"] for v in dash["templating"]["list"] if v.get("definition")]
    assert len(queries) >= 20
    named = set()
    for q in queries:
        names = set(re.findall(r"\b(?:rlfleet_|vllm:)[A-Za-z0-9_:]+", q))
        assert names, f"query names no rlfleet or vLLM metric: {q}"
        named |= names
    missing = sorted(named - exported)
    assert not missing, f"the dashboard queries series nobody exports: {missing}"
    assert any(n.startswith("vllm:") for n in named)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
