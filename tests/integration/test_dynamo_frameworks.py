"""The RL frameworks that ship a Dynamo backend, call by call as their code makes them, against
a mocker fleet and the session's vLLM fleet: NeMo RL's managed Dynamo generation (readiness,
completions, the refit channel), verl-recipe's Dynamo rollout server (readiness, completions
read from `nvext.engine_data`) and slime's external rollouts through Dynamo's example
(discovery by each worker's system-port `/health`, SGLang's control paths under `/engine`,
rollouts on the frontend's `/generate`). Token IDs and logprobs each framework reads equal the
fleet's own answer to the same request; the calls that need NCCL are refused by name.

None of the three is a package on the registry (`nemo-rl` 0.0.0 is an empty placeholder; the
verl recipe and slime's Dynamo glue are source trees), so the sequences, bodies and the way
each answer is judged are pinned here from their source, read at these commits (nothing is
fetched at run time):
- NVIDIA-NeMo/RL 7ea279abfbeb698b092856d0dab61e7cf39bc909 (PR #3391's backend),
  nemo_rl/models/generation/dynamo/: managed_runtime.py `_wait_for_frontend` (GET /health:
  `instances[]` of the namespace with component `backend`, the `generate` and `rl`
  instance-ID sets equal and of the expected size; then the model in /v1/models);
  dynamo_generation.py `_build_completion_request` and `_parse_dynamo_completion_response`
  (`nvext.completion_token_ids`, `choice.logprobs.token_logprobs`); refit.py
  `DynamoRefitChannel` (`init_collective`: init_weights_update_group with `engine_rpc`
  init_weight_transfer_engine and NCCL `init_info`; `update_weights`: three
  update_weights_from_distributed calls with `allow_unpaused` and no cache reset;
  `flush_cache`: pause_generation `{mode: wait, clear_cache: true}`, then resume_generation);
  http_client.py (an answer counts only with HTTP 2xx and `"status": "ok"`).
- verl-project/verl-recipe 48ea0a797fa29867ea0ad92aff7d284eec7d4be3, dynamo/
  dynamo_async_server.py: `_healthcheck_frontend` (HTTP 200 and enough `instances[]` with
  endpoint `generate`), `_build_frontend_completion_payload`, `_frontend_post` (X-Request-Id),
  `_extract_completion_token_ids` and `_extract_completion_log_probs` (in their order of
  candidates: `nvext.engine_data` before `choice.logprobs`).
- ai-dynamo/dynamo examples/rl/slime/: dynamo_discovery.py
  84babe1529e7e1c65feaf57b3e252c3bc90aa612 (a worker counts when its system port's `/health`
  says `"status": "ready"`; its control base is `http://host:port/engine`) and README.md
  5fe862cb841fd425e97e59aca3597306fbea1aef (the SGLang names under `/engine`); with
  THUDM/slime 624b824a898ab0ec1fcb4d373004c7f3852bf515: backends/sglang_utils/external.py
  `get_server_info` (`/server_info`, then `/get_server_info`), sglang_engine.py (the bodies;
  `flush_cache` is a GET retried until HTTP 200; every call is judged by
  `raise_for_status`), backends/megatron_utils/update_weight/update_weight_from_distributed.py
  (pause, flush, the group's init, the update, continue) and rollout/sglang_streaming_rollout.py
  (`/generate` with `return_logprob`, streamed; tokens and logprobs from
  `meta_info.output_token_logprobs`)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.clients import LOGPROB_TOL, fleet_answer
from tests.fleets import MODEL_NAME, RL_MOCK_MODEL, RL_PROBE_ENV, mock_args

PROMPT = "The capital of France is"
MAX_TOKENS = 12
TIMEOUT = 120.0


@dataclass
class Target:
    kind: str
    url: str  # the frontend
    namespace: str
    model: str
    system_urls: list[str]  # each worker's system port


@pytest.fixture(scope="module")
def mock_fleet(tmp_path_factory, start_module_fleet) -> Target:
    root = tmp_path_factory.mktemp("dynamo-frameworks")
    f = start_module_fleet([mock_args(root)] * 2, model=RL_MOCK_MODEL, enable_rl=True,
                           frontend_env=RL_PROBE_ENV)
    return Target("mocker", f.url, f.namespace, RL_MOCK_MODEL,
                  [w.ready["system_url"] for w in f.workers])


@pytest.fixture(scope="module", params=["mocker", pytest.param("vllm", marks=pytest.mark.engine)])
def target(request) -> Target:
    if request.param == "mocker":
        return request.getfixturevalue("mock_fleet")
    f = request.getfixturevalue("vllm_fleet")
    return Target("vllm", f.url, f.namespace, MODEL_NAME,
                  [w.ready["system_url"] for w in f.workers if w.popen.poll() is None])


@pytest.fixture(scope="module")
def prompt_ids(target: Target) -> list[int]:
    r = httpx.post(f"{target.url}/tokenize", json={"model": target.model, "prompt": PROMPT},
                   timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def same(got_ids: list[int], got_lps: list[float], ref_ids: list[int], ref_lps: list[float]
         ) -> None:
    assert got_ids == ref_ids
    assert got_lps == pytest.approx(ref_lps, abs=LOGPROB_TOL)


# ---------------------------------------------------------------- readiness


def nemo_rl_ready(target: Target, expected: int) -> bool:
    """NeMo RL's `_wait_for_frontend`, one poll."""
    payload = httpx.get(f"{target.url}/health", timeout=5).json()
    generate_ids, rl_ids = set(), set()
    for instance in payload.get("instances", []):
        if not isinstance(instance, dict) or instance.get("namespace") != target.namespace \
                or instance.get("component") != "backend" or instance.get("instance_id") is None:
            continue
        if instance.get("endpoint") == "generate":
            generate_ids.add(str(instance["instance_id"]))
        elif instance.get("endpoint") == "rl":
            rl_ids.add(str(instance["instance_id"]))
    if (len(generate_ids), len(rl_ids)) != (expected, expected) or generate_ids != rl_ids:
        return False
    models = httpx.get(f"{target.url}/v1/models", timeout=5).json()
    return target.model in {str(m["id"]) for m in models.get("data", [])}


def verl_ready(target: Target, expected: int) -> bool:
    """verl-recipe's `_healthcheck_frontend`, one poll."""
    resp = httpx.get(f"{target.url}/health", timeout=5)
    if resp.status_code != 200:
        return False
    instances = resp.json().get("instances") or []
    return sum(1 for i in instances if i.get("endpoint") == "generate") >= expected


def test_the_frontends_health_passes_nemo_rls_and_verls_readiness_checks(target: Target
                                                                         ) -> None:
    workers = len(target.system_urls)
    assert nemo_rl_ready(target, workers) and verl_ready(target, workers)
    assert not nemo_rl_ready(target, workers + 1) and not verl_ready(target, workers + 1)
    health = httpx.get(f"{target.url}/health", timeout=5).json()
    assert health["status"] == "healthy" and len(health["workers"]) == workers  # as before
    assert health["endpoints"] == [f"dyn://{target.namespace}.backend.generate",
                                   f"dyn://{target.namespace}.backend.rl"]
    for i in health["instances"]:
        assert set(i) == {"namespace", "component", "endpoint", "instance_id", "transport"}
        assert i["transport"]["http"].startswith("http://")
    live = httpx.get(f"{target.url}/live", timeout=5)
    assert (live.status_code, live.json()["status"]) == (200, "live")


# ---------------------------------------------------------------- generation


def test_nemo_rls_completion_request_reads_the_fleets_tokens_and_logprobs(
        target: Target, prompt_ids: list[int]) -> None:
    """NeMo RL's greedy request (`top_k` 1, `include_stop_str_in_output`), parsed as it
    parses it."""
    payload = {"model": target.model, "prompt": prompt_ids, "max_tokens": MAX_TOKENS,
               "temperature": 0.0, "top_p": 1.0, "top_k": 1, "n": 1, "logprobs": 0,
               "include_stop_str_in_output": True,
               "nvext": {"extra_fields": ["completion_token_ids"]}}
    r = httpx.post(f"{target.url}/v1/completions", json=payload, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    body = r.json()
    ids = [int(t) for t in body["nvext"]["completion_token_ids"]]
    lps = body["choices"][0]["logprobs"]["token_logprobs"]
    assert len(lps) == len(ids) and all(isinstance(x, float) for x in lps)
    ref = fleet_answer(target.url, target.model, prompt_ids, MAX_TOKENS, ignore_eos=False,
                       top_k=1, top_p=1.0, include_stop_str_in_output=True)
    same(ids, lps, ref.ids, ref.logprobs)


def verl_token_ids(choice: dict[str, Any], response: dict[str, Any]) -> list[int] | None:
    """verl-recipe's `_extract_completion_token_ids`: the first present candidate."""
    nvext, choice_nvext = response.get("nvext") or {}, choice.get("nvext") or {}
    candidates = [choice.get("token_ids"), choice.get("output_token_ids"),
                  choice.get("completion_token_ids")]
    for holder in (nvext, nvext.get("engine_data") or {}, choice_nvext,
                   choice_nvext.get("engine_data") or {}):
        candidates += [holder.get(k) for k in ("completion_token_ids", "output_token_ids",
                                               "generated_token_ids")]
    candidates.append(choice_nvext.get("token_ids"))
    logprobs = choice.get("logprobs") or {}
    candidates += [logprobs.get(k) for k in ("token_ids", "output_token_ids",
                                             "completion_token_ids")]
    return next(([int(t) for t in c] for c in candidates if c is not None), None)


def verl_log_probs(choice: dict[str, Any], count: int, response: dict[str, Any]
                   ) -> list[float] | None:
    """verl-recipe's `_extract_completion_log_probs`: engine_data first."""
    for nvext in (response.get("nvext"), choice.get("nvext")):
        values = ((nvext or {}).get("engine_data") or {}).get("completion_logprobs")
        if isinstance(values, list):
            return [0.0 if v is None else float(v) for v in values[:count]]
    values = (choice.get("logprobs") or {}).get("token_logprobs")
    return None if values is None else [0.0 if v is None else float(v) for v in values[:count]]


def test_verls_completion_reads_tokens_and_logprobs_from_engine_data(
        target: Target, prompt_ids: list[int]) -> None:
    """verl-recipe's payload (`request_engine_data` on, logprobs asked), with its
    X-Request-Id; the IDs and logprobs it extracts come from `nvext.engine_data`."""
    sampling = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0}
    payload = {"model": target.model, "prompt": prompt_ids, "max_tokens": MAX_TOKENS,
               "stream": False, "nvext": {"extra_fields": ["engine_data"]}, "logprobs": 0,
               **sampling}
    r = httpx.post(f"{target.url}/v1/completions", json=payload, timeout=TIMEOUT,
                   headers={"X-Request-Id": f"verl-{uuid.uuid4().hex}"})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert "completion_token_ids" not in (body.get("nvext") or {})  # not asked: engine_data
    ids = verl_token_ids(choice, body)
    assert ids == body["nvext"]["engine_data"]["completion_token_ids"]
    lps = verl_log_probs(choice, len(ids), body)
    assert lps == body["nvext"]["engine_data"]["completion_logprobs"]
    ref = fleet_answer(target.url, target.model, prompt_ids, MAX_TOKENS, ignore_eos=False,
                       **sampling)
    same(ids, lps, ref.ids, ref.logprobs)
    assert choice["finish_reason"] in ("stop", "length")  # verl: "completed"


def test_slimes_streamed_generate_reads_the_fleets_tokens_and_logprobs(
        target: Target, prompt_ids: list[int]) -> None:
    """slime's streaming rollout on the frontend's `/generate` (the Dynamo example's rollout
    URL): SGLang's cumulative events, read as slime reads each one."""
    payload = {"sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0.0,
                                   "top_p": 1.0, "top_k": -1},
               "return_logprob": True, "stream": True, "input_ids": prompt_ids}
    tokens: list[int] = []
    lps: list[float] = []
    meta: dict[str, Any] = {}
    with httpx.stream("POST", f"{target.url}/generate", json=payload, timeout=TIMEOUT) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line[5:].strip() in ("", "[DONE]"):
                continue
            chunk = json.loads(line[5:].strip())
            meta = chunk.get("meta_info") or {}
            if "output_token_logprobs" in meta:
                tokens = [item[1] for item in meta["output_token_logprobs"]]
                lps = [item[0] for item in meta["output_token_logprobs"]]
    assert meta.get("finish_reason")
    ref = fleet_answer(target.url, target.model, prompt_ids, MAX_TOKENS, ignore_eos=False,
                       top_k=-1, top_p=1.0)
    same(tokens, lps, ref.ids, ref.logprobs)


# ---------------------------------------------------------------- control


class Refused(Exception):
    pass


def nemo_rl_post(system_url: str, route: str, payload: dict[str, Any]) -> dict[str, Any]:
    """NeMo RL's `_post_worker_route` / `_update_worker_weights` judgement of one call."""
    r = httpx.post(f"{system_url}/engine/{route}", json=payload, timeout=TIMEOUT)
    said = r.json() if r.is_success else {"status": "error", "http_status": r.status_code,
                                          "raw": r.text}
    if said.get("status") != "ok":
        raise Refused(f"Dynamo worker {system_url} route {route} failed: {said}")
    return said


def test_nemo_rls_refit_channel_flushes_and_its_nccl_steps_are_refused_by_name(
        target: Target, prompt_ids: list[int]) -> None:
    before = fleet_answer(target.url, target.model, prompt_ids, MAX_TOKENS)
    workers, train_world_size, engine_world_size = target.system_urls, 1, 1
    world_size = train_world_size + len(workers) * engine_world_size
    for index, url in enumerate(workers):  # init_collective
        with pytest.raises(Refused) as refused:
            nemo_rl_post(url, "init_weights_update_group", {
                "engine_rpc": "init_weight_transfer_engine",
                "init_info": {"master_address": "127.0.0.1", "master_port": 29577,
                              "rank_offset": train_world_size + index * engine_world_size,
                              "world_size": world_size}})
        assert "init_weights_update_group" in str(refused.value)
        if target.kind == "vllm":
            assert "need a GPU" in str(refused.value)
    update_info = {"names": ["model.embed_tokens.weight"], "dtype_names": ["float32"],
                   "shapes": [[1]], "packed": True}
    common = {"allow_unpaused": True, "reset_prefix_cache": False}
    for url in workers:  # update_weights: its first step stops it
        with pytest.raises(Refused):
            for rpc, kwargs in (("start_weight_update", {"is_checkpoint_format": True}),
                                ("update_weights", {"update_info": update_info}),
                                ("finish_weight_update", {})):
                nemo_rl_post(url, "update_weights_from_distributed",
                             {"engine_rpc": rpc, **common, **kwargs})
    for url in workers:  # flush_cache: every worker drained, cleared and resumed
        nemo_rl_post(url, "pause_generation", {"mode": "wait", "clear_cache": True})
    for url in workers:
        nemo_rl_post(url, "resume_generation", {})
        assert httpx.post(f"{url}/engine/is_paused", json={}, timeout=5).json()["is_paused"] \
            is False
    after = fleet_answer(target.url, target.model, prompt_ids, MAX_TOKENS)
    same(after.ids, after.logprobs, before.ids, before.logprobs)


def slime_control_urls(target: Target) -> list[str]:
    """The Dynamo example's discovery: the ready workers' `/engine` bases."""
    urls = []
    for system_url in target.system_urls:
        payload = httpx.get(f"{system_url}/health", timeout=5).json()
        if isinstance(payload, dict) and payload.get("status") == "ready":
            urls.append(f"{system_url}/engine")
    return urls


@pytest.fixture
def resumed(target: Target) -> Iterator[None]:
    """Every worker resumed after the test, whatever it left."""
    yield
    for url in target.system_urls:
        httpx.post(f"{url}/engine/resume_generation", json={}, timeout=TIMEOUT)


def test_slimes_control_calls_reach_each_worker_under_its_engine_base(
        target: Target, resumed: None) -> None:
    bases = slime_control_urls(target)
    assert len(bases) == len(target.system_urls)
    for base in bases:
        info = httpx.get(f"{base}/server_info", timeout=30)  # get_server_info's first try
        info.raise_for_status()
        server_info = info.json()
        assert server_info["served_model_name"] == target.model
        assert (server_info["tp_size"], server_info["pp_size"], server_info["dp_size"]) == \
            (1, 1, 1)
        assert server_info["disaggregation_mode"] == "null"  # slime: a "regular" worker
        assert httpx.get(f"{base}/get_server_info", timeout=30).json() == server_info
    # update_weight_from_distributed.py: pause, flush, the group (NCCL), ..., continue
    for base in bases:
        httpx.post(f"{base}/pause_generation", json={}, timeout=TIMEOUT).raise_for_status()
        assert httpx.post(f"{base}/is_paused", json={}, timeout=5).json()["is_paused"] is True
    for base in bases:
        assert httpx.get(f"{base}/flush_cache", timeout=TIMEOUT).status_code == 200
    group = {"master_address": "127.0.0.1", "master_port": 29578, "world_size": 3,
             "group_name": "slime-pp_0", "backend": "nccl"}
    for rank, base in enumerate(bases, start=1):
        r = httpx.post(f"{base}/init_weights_update_group", json={**group, "rank_offset": rank},
                       timeout=TIMEOUT)
        assert r.status_code == 400 and "NCCL" in r.json()["message"], r.text  # slime raises
        r = httpx.post(f"{base}/destroy_weights_update_group",
                       json={"group_name": group["group_name"]}, timeout=TIMEOUT)
        r.raise_for_status()
    for base in bases:
        r = httpx.post(f"{base}/continue_generation", json={}, timeout=TIMEOUT)
        r.raise_for_status()
        assert r.json()["status"] == "ok"
        assert httpx.post(f"{base}/is_paused", json={}, timeout=5).json()["is_paused"] is False


def test_sglangs_pause_modes_under_engine(target: Target, resumed: None) -> None:
    """SGLang's `retract` and `in_place` keep the requests in flight, `abort` ends them; a
    mode neither server has is refused by name."""
    base = f"{target.system_urls[0]}/engine"
    for mode in ("retract", "in_place", "abort"):
        r = httpx.post(f"{base}/pause_generation", json={"mode": mode}, timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["status"] == "ok", r.text
        httpx.post(f"{base}/continue_generation", json={"torch_empty_cache": True},
                   timeout=TIMEOUT).raise_for_status()
    r = httpx.post(f"{base}/pause_generation", json={"mode": "freeze"}, timeout=TIMEOUT)
    assert r.json()["status"] == "error" and "Invalid mode 'freeze'" in r.json()["message"]
