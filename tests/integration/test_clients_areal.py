"""AReaL 1.0.4's remote engines (`RemoteSGLangEngine`, `RemotevLLMEngine`; installed by
scripts/setup.sh, loaded by tests/clients.py) rolling out on an rlfleet fleet as AReaL does on
its own servers: the engine is initialized with the frontend's address as its one server
(`addr`), generates with `agenerate`, and sends its LoRA loads to the same address.

What each engine sends is AReaL's: the SGLang engine posts `/generate` with `input_ids`,
`sampling_params`, `return_logprob` (and `lora_path` = the versioned adapter name when LoRA
is on) and reads `meta_info.output_token_logprobs` / `finish_reason.type`; the vLLM engine
posts `/v1/completions` with the prompt's token IDs, `return_tokens_as_token_ids` and
`logprobs: 0` (and `model` = the adapter name). When an answer ends with `abort`, both
resubmit the prompt plus the tokens so far for what is left (abort-and-resubmit). A LoRA
update from disk sends `/load_lora_adapter {lora_name, lora_path}` (SGLang) or
`/v1/load_lora_adapter` (vLLM) to every address: the requests are built by AReaL's own
backend (`build_disk_weight_update_requests`) and sent with its `arequest_with_retry`; what
is left out is AReaL's trainer-side handshake (a name-resolve record the trainer writes
when the checkpoint is saved), which involves no server.

The frontend here forwards control routes to a fleet control service (tests/clients.one_url),
so a load at the one address is a load on every worker. Token IDs and logprobs through
each engine equal the fleet's own (`/v1/completions`, greedy, same frontend). Fleets: two
mocker workers (always), the session's two vLLM workers (marker `engine`; the LoRA calls on
one vLLM worker started with LoRA enabled, tests.clients.lora_vllm_fleet)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from rlfleet.mocker.engine import write_mock_checkpoint
from rlfleet.models import make_adapter
from tests import clients
from tests.clients import LOGPROB_TOL, LORA_FLAGS, fleet_answer, one_url, wait_in_flight
from tests.fleets import MODEL_NAME, RL_MOCK_MODEL, RL_PROBE_ENV, mock_args

PROMPTS = ["The capital of France is", "Once upon a time"]
BACKENDS = ("sglang", "vllm")


@dataclass
class Target:
    kind: str
    url: str  # the one URL AReaL generates on and loads adapters through
    model: str
    long: int  # max_new_tokens of a request that is surely in flight when the abort lands
    adapter: Path | None
    policies: tuple[Path, Path] | None = None  # another policy, and the one it starts on


@pytest.fixture(scope="module")
def mock_fleet(tmp_path_factory, start_module_fleet):
    root = tmp_path_factory.mktemp("areal-mock")
    fleet = start_module_fleet([mock_args(root, *LORA_FLAGS, "--token-delay", "0.01")] * 2,
                               model=RL_MOCK_MODEL, enable_rl=True, frontend_env=RL_PROBE_ENV)
    fleet.adapter = make_adapter(root / "a1", rank=4, seed=1)
    fleet.policies = (write_mock_checkpoint(root / "seed-2", 2),
                      write_mock_checkpoint(root / "seed-1", 1))  # the policy it starts on
    return fleet


@pytest.fixture(scope="module", params=["mocker", pytest.param("vllm", marks=pytest.mark.engine)])
def target(request, tmp_path_factory) -> Iterator[Target]:
    if request.param == "mocker":
        fleet, model, long = request.getfixturevalue("mock_fleet"), RL_MOCK_MODEL, 400
        adapter, policies = fleet.adapter, fleet.policies
    else:
        fleet, model, long, adapter = request.getfixturevalue("vllm_fleet"), MODEL_NAME, 1500, None
        policies = (request.getfixturevalue("tiny_model_b"), request.getfixturevalue("tiny_model"))
    with one_url(fleet, model, tmp_path_factory.mktemp(f"areal-{request.param}")) as one:
        yield Target(request.param, one.url, model, long, adapter, policies)


@pytest.fixture(scope="module")
def lora_target(request, target: Target, tmp_path_factory) -> Iterator[Target]:
    """`target` where its workers take adapters; for vLLM, the one URL in front of a worker
    with LoRA enabled (tests.clients.lora_vllm_fleet)."""
    if target.adapter is not None:
        yield target
        return
    fleet = request.getfixturevalue("lora_vllm_fleet")
    with one_url(fleet, MODEL_NAME, tmp_path_factory.mktemp("areal-lora-vllm")) as one:
        yield Target("vllm", one.url, MODEL_NAME, 0, fleet.adapter)


@pytest.fixture(scope="module")
def areal():
    return clients.areal()


def engine(areal, target: Target, backend: str, use_lora: bool = False):
    """An AReaL remote engine of `backend` with the frontend as its one server, set up as
    AReaL's own launcher does (`<backend>:d1` allocation; its health wait at initialize)."""
    cls = areal.RemoteSGLangEngine if backend == "sglang" else areal.RemotevLLMEngine
    cfg = areal.InferenceEngineConfig(backend=f"{backend}:d1", experiment_name="rlfleet",
                                      trial_name="clients", setup_timeout=60,
                                      request_timeout=300, request_retries=1, use_lora=use_lora)
    eng = cls(cfg)
    eng.initialize(addr=[target.url.removeprefix("http://")])
    return eng


def request(areal, ids: list[int], max_new_tokens: int, lora_name: str = ""):
    return areal.ModelRequest(input_ids=list(ids), gconfig=areal.GenerationHyperparameters(
        max_new_tokens=max_new_tokens, greedy=True, ignore_eos=True, lora_name=lora_name))


def spy(eng) -> list:
    """Every answer the engine parses (AReaL's HttpGenerationResult: stop reason, output
    tokens, logprobs), in order: AReaL's own parsing runs unchanged, this only records what
    it returned."""
    seen: list = []
    backend = eng._engine.backend
    parse = backend.parse_generation_response

    def recorded(response):
        out = parse(response)
        seen.append(out)
        return out

    backend.parse_generation_response = recorded
    return seen


@pytest.mark.parametrize("backend", BACKENDS)
def test_agenerate_equals_the_fleets(areal, target: Target, backend: str) -> None:
    eng = engine(areal, target, backend)
    try:
        for prompt in PROMPTS:
            ids = fleet_answer(target.url, target.model, prompt, 1).prompt_ids
            ref = fleet_answer(target.url, target.model, ids, 12)
            out = asyncio.run(eng.agenerate(request(areal, ids, 12)))
            assert out.output_tokens == ref.ids
            assert out.output_logprobs == pytest.approx(ref.logprobs, abs=LOGPROB_TOL)
            assert out.stop_reason == "length"
            assert out.input_tokens == ids
    finally:
        eng.destroy()


def abort_sglang(target: Target, task: asyncio.Task, seen: list) -> None:
    """SGLang's POST /abort_request {"abort_all": true} (what slime and Miles send to each
    engine), repeated until it aborts a request: the frontend counts a request in flight
    from its first byte, a moment before its run can be aborted."""
    deadline = time.monotonic() + 30
    while True:
        r = httpx.post(f"{target.url}/abort_request", json={"abort_all": True}, timeout=30)
        assert r.status_code == 200, r.text
        if r.json()["aborted"] >= 1:
            return
        assert not task.done() and time.monotonic() < deadline, \
            f"/abort_request (abort_all) never aborted the request in flight: {r.text}"
        time.sleep(0.1)


def abort_vllm(target: Target, task: asyncio.Task, seen: list) -> None:
    """vLLM's way to end the requests in flight with their partial output: POST
    /pause?mode=abort (at the one URL: the whole fleet), then /resume once AReaL has seen
    the abort (its resubmission waits at the closed gate meanwhile). AReaL's own vLLM server
    extension's pause: test_vllm_engines_own_pause_aborts_and_its_continue_resumes."""
    r = httpx.post(f"{target.url}/pause", params={"mode": "abort"}, timeout=120)
    assert r.status_code == 200, r.text
    try:
        deadline = time.monotonic() + 60
        while not seen:
            assert time.monotonic() < deadline, "AReaL never saw the aborted answer"
            time.sleep(0.05)
    finally:
        r = httpx.post(f"{target.url}/resume", timeout=300)
    assert r.status_code == 200, r.text


ABORTS = {"sglang": abort_sglang, "vllm": abort_vllm}


async def _aborted_midway(eng, areal, target: Target, ids: list[int], backend: str, seen: list):
    task = asyncio.create_task(eng.agenerate(request(areal, ids, target.long)))
    await asyncio.to_thread(wait_in_flight, target.url)
    await asyncio.to_thread(ABORTS[backend], target, task, seen)
    return await asyncio.wait_for(task, 600)


@pytest.mark.parametrize("backend", BACKENDS)
def test_abort_then_resubmit_ends_whole(areal, target: Target, backend: str) -> None:
    """The request in flight ends with finish reason `abort` and its partial output (sglang:
    SGLang's /abort_request; vllm: vLLM's /pause?mode=abort then /resume); AReaL resubmits
    prompt + output so far for the rest until it has all its tokens. Each answer AReaL got
    is the fleet's own answer to that prompt, and the whole is their concatenation."""
    eng = engine(areal, target, backend)
    seen = spy(eng)
    try:
        ids = fleet_answer(target.url, target.model, PROMPTS[0], 1).prompt_ids
        out = asyncio.run(_aborted_midway(eng, areal, target, ids, backend, seen))
    finally:
        eng.destroy()
    ends_whole(target, ids, seen, out)


def ends_whole(target: Target, ids: list[int], seen: list, out) -> None:
    """The first answer AReaL got was aborted, the last ran to its length; each is the
    fleet's own answer to its prompt (the prompt and the tokens before it), and AReaL's
    result is their concatenation."""
    reasons = [a.stop_reason for a in seen]
    assert reasons[0] == "abort" and reasons[-1] == "length", reasons
    assert len(out.output_tokens) == target.long and out.stop_reason == "length"
    prefix, tokens, logprobs = list(ids), [], []
    for answer in seen:
        if answer.output_tokens:  # greedy: the first n tokens of any longer answer
            ref = fleet_answer(target.url, target.model, prefix, len(answer.output_tokens))
            assert answer.output_tokens == ref.ids
            assert answer.output_logprobs == pytest.approx(ref.logprobs, abs=LOGPROB_TOL)
        prefix += answer.output_tokens
        tokens += answer.output_tokens
        logprobs += answer.output_logprobs
    assert out.output_tokens == tokens and out.output_logprobs == logprobs


async def _send_all(areal, target: Target, requests) -> list:
    """AReaL's weight-update requests, each to every address (here: the one URL)."""
    import aiohttp

    out = []
    async with aiohttp.ClientSession() as session:
        for req in requests.requests:
            out.append(await areal.arequest_with_retry(
                session=session, addr=target.url.removeprefix("http://"), endpoint=req.endpoint,
                payload=req.payload, method=req.method, max_retries=1, timeout=120))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_lora_load_from_disk_then_generate(areal, lora_target: Target, backend: str) -> None:
    target = lora_target
    version = 1 if backend == "sglang" else 2
    eng = engine(areal, target, backend, use_lora=True)
    try:
        eng.set_version(version)
        meta = areal.WeightUpdateMeta(type="disk", path=str(target.adapter), use_lora=True,
                                      lora_name="areal-lora", version=version)
        reqs = eng._engine.backend.build_disk_weight_update_requests(meta)
        asyncio.run(_send_all(areal, target, reqs))
        name = f"areal-lora-v{version}"  # AReaL's versioned adapter name
        ids = fleet_answer(target.url, target.model, PROMPTS[0], 1).prompt_ids
        ref = fleet_answer(target.url, name, ids, 10)
        assert ref.ids != fleet_answer(target.url, target.model, ids, 10).ids
        out = asyncio.run(eng.agenerate(request(areal, ids, 10, lora_name="areal-lora")))
        assert out.output_tokens == ref.ids
        assert out.output_logprobs == pytest.approx(ref.logprobs, abs=LOGPROB_TOL)
    finally:
        eng.destroy()


def _wait_seen(seen: list) -> None:
    deadline = time.monotonic() + 60
    while not seen:
        assert time.monotonic() < deadline, "AReaL never saw the aborted answer"
        time.sleep(0.05)


async def _paused_by_areal(eng, areal, target: Target, ids: list[int], seen: list):
    """AReaL's own pause (its vLLM backend's /areal_pause_generation: at the one URL the
    fleet's pause, aborting the requests in flight) while a request runs, then its continue
    (/areal_continue_generation) once it has seen the abort."""
    task = asyncio.create_task(eng.agenerate(request(areal, ids, target.long)))
    await asyncio.to_thread(wait_in_flight, target.url)
    await asyncio.to_thread(eng.pause_generation)
    try:
        await asyncio.to_thread(_wait_seen, seen)
        assert httpx.get(f"{target.url}/is_paused", timeout=30).json()["is_paused"] is True
    finally:
        await asyncio.to_thread(eng.continue_generation)
    return await asyncio.wait_for(task, 600)


def test_vllm_engines_own_pause_aborts_and_its_continue_resumes(areal, target: Target) -> None:
    eng = engine(areal, target, "vllm")
    seen = spy(eng)
    try:
        ids = fleet_answer(target.url, target.model, PROMPTS[0], 1).prompt_ids
        out = asyncio.run(_paused_by_areal(eng, areal, target, ids, seen))
    finally:
        eng.destroy()
    ends_whole(target, ids, seen, out)
    assert httpx.get(f"{target.url}/is_paused", timeout=30).json()["is_paused"] is False


def test_vllm_engines_update_from_disk_moves_the_whole_fleet(areal, target: Target) -> None:
    """AReaL's full-weight update from disk on its vLLM backend (`/areal_update_weights
    {model_path}`, built by its backend, sent by its `arequest_with_retry`): every worker
    moves to the checkpoint, and the fleet's answers follow it; then back."""
    assert target.policies is not None
    other, start = target.policies
    eng = engine(areal, target, "vllm")
    try:
        ids = fleet_answer(target.url, target.model, PROMPTS[1], 1).prompt_ids
        before = fleet_answer(target.url, target.model, ids, 8)
        backend = eng._engine.backend
        for path in (other, start):
            meta = areal.WeightUpdateMeta(type="disk", path=str(path), use_lora=False)
            reqs = backend.build_disk_weight_update_requests(meta)
            assert [r.endpoint for r in reqs.requests] == ["/areal_update_weights"]
            [said] = asyncio.run(_send_all(areal, target, reqs))
            assert said["success"] is True, said
            out = asyncio.run(eng.agenerate(request(areal, ids, 8)))
            ref = fleet_answer(target.url, target.model, ids, 8)
            assert out.output_tokens == ref.ids
            assert out.output_logprobs == pytest.approx(ref.logprobs, abs=LOGPROB_TOL)
            assert (ref.ids != before.ids) == (path == other)
    finally:
        eng.destroy()
    bad = httpx.post(f"{target.url}/areal_update_weights", json={"model_path": "/no/such"},
                     timeout=120)
    assert bad.status_code == 400 and bad.json()["success"] is False
