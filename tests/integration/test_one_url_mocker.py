"""One URL, one fleet, on two mocker workers (the declared simulator: what is checked here is
the fleet's lifecycle, not an engine's numbers): a frontend started with --fleet-control
forwards vLLM's and SGLang's control routes to the fleet control service (`rlfleet control`),
and a client written for one server drives the whole fleet through the frontend's URL.
Pause keeps, aborts and holds requests as a single server does; an update from disk moves
every worker or, when one fails, none (rolled back, in the dialect's error shape, recorded
in the journal); a service SIGKILLed with the fleet paused recovers it from the journal when
it starts again; the admin token guards the routes that change the fleet."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import threading
import time

import httpx
import pytest

from rlfleet.journal import SqliteJournal
from rlfleet.mocker.engine import write_mock_checkpoint
from rlfleet.models import make_adapter
from rlfleet.runtime.launch import Proc, spawn
from tests import clients
from tests.clients import wait_in_flight
from tests.fleets import RL_MOCK_MODEL as MODEL
from tests.fleets import RL_PROBE_ENV, fault, listening_port, mock_args, weight_versions

PROMPT = [1, 2, 3, 4]
LORA_FLAGS = ("--enable-lora", "--max-loras", "4", "--max-lora-rank", "16")


@pytest.fixture(scope="module")
def one(start_module_fleet, tmp_path_factory):
    """Two mocker workers, a frontend forwarding control calls to the service on `port`,
    the service (restartable: `one.start()`), mock checkpoints A and B."""
    tmp = tmp_path_factory.mktemp("one-url")
    root = tmp / "weights"
    ckpts = {"A": write_mock_checkpoint(root / "A", 11), "B": write_mock_checkpoint(root / "B", 12),
             "lora": make_adapter(root / "lora", rank=4, seed=1)}
    port = listening_port()
    args = mock_args(root, *LORA_FLAGS, "--token-delay", "0.01")
    fleet = start_module_fleet([args] * 2, model=MODEL,
                               enable_rl=True, frontend_env=RL_PROBE_ENV,
                               frontend=("--fleet-control", f"http://127.0.0.1:{port}"))
    fleet.ckpts, fleet.journal, fleet.port, fleet.service = ckpts, tmp / "journal.sqlite", port, None
    fleet.worker_args = args

    def start(*extra: str) -> Proc:
        p = spawn("control", [sys.executable, "-m", "rlfleet.cli", "control", "--rl-url",
                              fleet.rl_url, "--model", MODEL, "--journal", str(fleet.journal),
                              "--port", str(port), *extra], fleet.workdir / "logs")
        fleet.procs.append(p)
        p.wait_ready(60)
        fleet.service = p
        return p
    fleet.start = start
    start()
    return fleet


@pytest.fixture
def service(one):
    """The service, running and with the fleet open (a test that stops it starts it again)."""
    if one.service is None or one.service.popen.poll() is not None:
        one.start()
    yield one.service
    alive = one.service is not None and one.service.popen.poll() is None
    if alive and httpx.get(f"{one.url}/is_paused").json()["is_paused"]:
        httpx.post(f"{one.url}/resume", timeout=60)


def complete(one, max_tokens: int = 8, **kw) -> httpx.Response:
    return httpx.post(f"{one.url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, **kw})


def in_thread(fn, *args, **kw) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        out["r"] = fn(*args, **kw)
    t = threading.Thread(target=run)
    t.start()
    return t, out


def last_record(one) -> dict:
    with SqliteJournal(one.journal) as j:
        return j.recent(1)[0]


def test_vllm_dialect_world_size_pause_keep_resume_reset(one, service):
    url = one.url
    assert httpx.get(f"{url}/get_world_size").json() == {"world_size": 2}
    assert httpx.get(f"{url}/is_paused").json() == {"is_paused": False}
    running, got = in_thread(complete, one, 300)
    wait_for(lambda: any(w["inflight"] for w in httpx.get(f"{url}/health").json()["workers"]))
    assert httpx.post(f"{url}/pause", params={"mode": "keep"}).json() == {"status": "paused"}
    # a second pause is idempotent
    assert httpx.post(f"{url}/pause", params={"mode": "keep"}).json() == {"status": "paused"}
    assert httpx.get(f"{url}/is_paused").json() == {"is_paused": True}
    waiting, late = in_thread(complete, one, 4)  # arrives while paused: waits, not fails
    assert httpx.post(f"{url}/resume", timeout=60).json() == {"status": "resumed"}
    for t in (running, waiting):
        t.join(120)
    for r, n in ((got["r"], 300), (late["r"], 4)):
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length", choice  # the kept request finished
        assert r.json()["usage"]["completion_tokens"] == n
    assert httpx.get(f"{url}/is_paused").json() == {"is_paused": False}
    assert httpx.post(f"{url}/reset_prefix_cache").json() == {"success": True}
    rec = last_record(one)
    assert (rec["kind"], rec["decision"], rec["state"]) == ("control", "reopened", "reopened")
    assert sorted(rec["verified_workers"]) == sorted(int(p.ready["instance_id"])
                                                     for p in one.workers)


def test_a_kept_request_spans_the_update_made_while_it_was_frozen(one, service):
    """pause(keep), update from disk, continue: the request in flight finishes after the
    resume, and its tokens name the policy each span was generated under."""
    running, got = in_thread(complete, one, 300,
                             nvext={"extra_fields": ["weight_versions"]})
    wait_for(lambda: any(w["inflight"] for w in httpx.get(f"{one.url}/health").json()["workers"]))
    assert httpx.post(f"{one.url}/pause_generation", json={"mode": "in_place"}).json()[
        "status"] == "ok"
    target = "B" if weight_versions(one)[0][0] != "B" else "A"
    r = httpx.post(f"{one.url}/update_weights_from_disk", timeout=120, json={
        "model_path": str(one.ckpts[target]), "weight_version": target})
    assert r.status_code == 200, r.text
    assert httpx.post(f"{one.url}/continue_generation").json()["status"] == "ok"
    running.join(120)
    r = got["r"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    spans = r.json()["nvext"]["weight_versions"]
    assert len(spans) >= 2 and spans[-1]["version"] == target, spans
    assert spans[0]["start"] == 0 and spans[-1]["end"] == 300, spans


def test_pause_abort_ends_requests_with_their_partial_output(one, service):
    running, got = in_thread(complete, one, 400)
    wait_for(lambda: any(w["inflight"] for w in httpx.get(f"{one.url}/health").json()["workers"]))
    assert httpx.post(f"{one.url}/pause", params={"mode": "abort"}).json() == {"status": "paused"}
    running.join(60)
    r = got["r"]
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "abort", choice
    assert 0 < r.json()["usage"]["completion_tokens"] < 400
    assert httpx.post(f"{one.url}/resume", timeout=60).json() == {"status": "resumed"}
    assert complete(one).status_code == 200


def test_sglang_update_from_disk_moves_every_worker(one, service):
    r = httpx.post(f"{one.url}/update_weights_from_disk", timeout=120, json={
        "model_path": str(one.ckpts["A"]), "weight_version": "A", "flush_cache": True})
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True
    assert weight_versions(one) == [("A", "mock:11")] * 2
    assert httpx.get(f"{one.url}/get_weight_version").json()["weight_version"] == "A"
    assert httpx.get(f"{one.url}/is_paused").json() == {"is_paused": False}
    assert complete(one).status_code == 200
    rec = last_record(one)
    assert rec["decision"] == "reopened" and rec.served.version == "A"
    assert rec["served_path"] == str(one.ckpts["A"])
    assert [step["name"] for step in rec["steps"]] == ["pause", "apply", "verify", "resume"]


def test_sglang_pause_update_continue(one, service):
    """AReaL's order: pause, update, continue; the fleet stays paused until continue."""
    base = one.url
    assert httpx.post(f"{base}/pause_generation", json={"mode": "abort"}).json()["status"] == "ok"
    r = httpx.post(f"{base}/update_weights_from_disk", timeout=120, json={
        "model_path": str(one.ckpts["B"]), "weight_version": "B", "abort_all_requests": True})
    assert r.json()["success"] is True, r.text
    assert httpx.get(f"{base}/is_paused").json() == {"is_paused": True}
    assert weight_versions(one) == [("B", "mock:12")] * 2
    assert httpx.post(f"{base}/continue_generation").json()["status"] == "ok"
    assert httpx.get(f"{base}/is_paused").json() == {"is_paused": False}
    assert complete(one).status_code == 200


@pytest.mark.parametrize("dialect", ["sglang", "vllm"])
def test_one_worker_failing_the_update_rolls_the_fleet_back(one, service, dialect):
    # the fleet on A, verified (what a rollback returns to)
    r = httpx.post(f"{one.url}/update_weights_from_disk", timeout=120,
                   json={"model_path": str(one.ckpts["A"]), "weight_version": "A"})
    assert r.status_code == 200, r.text
    bad = one.workers[1]
    fault(bad, "update_weights_from_disk")
    if dialect == "sglang":
        r = httpx.post(f"{one.url}/update_weights_from_disk", timeout=120,
                       json={"model_path": str(one.ckpts["B"]), "weight_version": "B"})
        assert r.status_code == 400, r.text
        body, message = r.json(), r.json()["message"]
        assert body["success"] is False
    else:
        r = httpx.post(f"{one.url}/collective_rpc", timeout=120, json={
            "method": "reload_weights", "kwargs": {"weights_path": str(one.ckpts["B"])}})
        assert r.status_code == 500, r.text
        body, message = r.json(), r.json()["error"]
    assert f"worker {bad.ready['instance_id']}" in message, message
    assert "rolled back" in message, message
    assert body["rolled_back"], body
    # the fleet serves the previous policy only, and is open
    assert weight_versions(one) == [("A", "mock:11")] * 2
    assert httpx.get(f"{one.url}/is_paused").json() == {"is_paused": False}
    assert complete(one).status_code == 200
    rec = last_record(one)
    assert rec["decision"] == "rolled_back", rec
    assert rec.served.version == "A" and "rolled back" in rec["reason"]


def test_transfer_steps_refused_by_every_worker_name_them(one, service):
    """TRL's NCCL init (rank 0 the trainer, the workers offset by one): the mocker has no
    weight-transfer backend, every worker refuses it, and the client gets a 4xx naming
    them; nothing was paused."""
    info = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
            "world_size": 3}
    r = httpx.post(f"{one.url}/init_weight_transfer_engine", json={"init_info": info})
    assert r.status_code == 400, r.text
    for p in one.workers:
        assert f"worker {p.ready['instance_id']}" in r.json()["error"]
    assert httpx.get(f"{one.url}/is_paused").json() == {"is_paused": False}
    r = httpx.post(f"{one.url}/update_weights", json={"update_info": {}})
    # out of order: 409, as vLLM's RL state machine answers (issue 43; it was a 500)
    assert r.status_code == 409 and "start_weight_update" in r.json()["error"], r.text


def test_bad_requests_say_what_to_send(one, service):
    r = httpx.post(f"{one.url}/pause", params={"mode": "later"})
    assert r.status_code == 400 and "keep, wait, abort" in r.json()["error"], r.text
    r = httpx.post(f"{one.url}/update_weights_from_disk", json={})
    assert r.status_code == 400 and "model_path is required" in r.json()["message"], r.text
    r = httpx.post(f"{one.url}/collective_rpc", json={"method": "sleep"})
    assert r.status_code == 400 and "reload_weights" in r.json()["error"], r.text


def test_service_killed_while_paused_recovers_the_fleet_at_restart(one, service):
    assert httpx.post(f"{one.url}/pause", params={"mode": "keep"}).json() == {"status": "paused"}
    paused_by = last_record(one)["id"]
    service.signal(signal.SIGKILL)
    service.popen.wait(10)
    r = httpx.post(f"{one.url}/resume", timeout=30)
    assert r.status_code == 503 and "cannot be reached" in r.json()["error"], r.text
    one.start()
    with SqliteJournal(one.journal) as j:
        interrupted = j.get(paused_by)
        recovery = j.recent(1)[0]
    assert interrupted["decision"] == "recovered", interrupted
    assert recovery["kind"] == "recovery" and recovery["decision"] == "reopened", recovery
    assert httpx.get(f"{one.url}/is_paused").json() == {"is_paused": False}
    assert complete(one).status_code == 200


def test_admin_token_guards_the_routes_that_change_the_fleet(one, service, tmp_path):
    service.stop()
    one.start("--admin-token", "s3cret")
    try:
        assert httpx.get(f"{one.url}/get_world_size").json() == {"world_size": 2}
        r = httpx.post(f"{one.url}/pause")
        assert r.status_code == 401 and "admin token" in r.json()["error"], r.text
        auth = {"Authorization": "Bearer s3cret"}
        assert httpx.post(f"{one.url}/pause", headers=auth).json() == {"status": "paused"}
        assert httpx.post(f"{one.url}/resume", headers=auth, timeout=60).json() == {
            "status": "resumed"}
    finally:
        one.service.stop()
        one.service = None


def wait_for(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.05)



def test_trls_vllm_client_drives_the_fleet_through_one_url(one, service):
    """TRL 1.16's VLLMClient, pointed at the frontend as at one vLLM server: generation,
    the fleet's world size, the server info GRPOTrainer reads, the cache reset; its NCCL
    weight transfer is refused before it starts (no transfer engine on this fleet)."""
    from trl.generation.vllm_client import VLLMClient

    client = VLLMClient(base_url=one.url, connection_timeout=30)
    assert client.model == MODEL
    assert client.get_world_size() == 2
    info = client.get_server_info()
    assert "logprobs_mode" in info["model_config"], info
    client.reset_prefix_cache()
    out = client.generate([PROMPT, PROMPT[:2]], max_tokens=5, temperature=1.0,
                          generation_kwargs={"ignore_eos": True})
    assert [len(c) for c in out["completion_ids"]] == [5, 5]
    assert out["prompt_ids"] == [PROMPT, PROMPT[:2]]
    with pytest.raises((RuntimeError, NotImplementedError)):
        client.init_communicator(device="cpu")
    assert httpx.get(f"{one.url}/is_paused").json() == {"is_paused": False}


def test_skyrls_one_server_mode(one, service):
    """SkyRL 0.3's RemoteInferenceClient with `server_urls = [proxy]`: its world size, pause
    (keep) with a request in flight, resume, reset and LoRA calls all go to the one URL and
    each moves the whole fleet."""
    mod = clients.skyrl()
    client = mod.RemoteInferenceClient(proxy_url=one.url, server_urls=[one.url],
                                       data_parallel_size=1, model_name=MODEL)
    sampling = {"max_tokens": 400, "temperature": 0.0, "ignore_eos": True, "logprobs": 0}

    async def flow() -> dict:
        try:
            world = await client.get_world_size()
            task = asyncio.create_task(client.generate(
                {"prompt_token_ids": [PROMPT], "sampling_params": sampling}))
            await asyncio.to_thread(wait_in_flight, one.url)
            paused = await client.pause(mode=mod.PauseMode.KEEP)
            states = await client._call_all_servers("/is_paused", method="GET")
            resumed = await client.resume()
            out = await asyncio.wait_for(task, 300)
            reset = await client.reset_prefix_cache()
            loaded = await client.load_lora_adapter("skyrl-lora", str(one.ckpts["lora"]))
            lora_out = await client.generate({"prompt_token_ids": [PROMPT], "sampling_params": {
                **sampling, "max_tokens": 4}}, model="skyrl-lora")
            unloaded = await client.unload_lora_adapter("skyrl-lora")
            return {"world": world, "paused": paused, "states": states, "resumed": resumed,
                    "out": out, "reset": reset, "loaded": loaded, "lora_out": lora_out,
                    "unloaded": unloaded}
        finally:
            await client.teardown()

    r = asyncio.run(flow())
    assert r["world"][0] == 2  # the fleet's world size
    assert r["paused"][one.url]["status"] == 200
    assert r["states"][one.url]["body"] == {"is_paused": True}
    assert r["resumed"][one.url]["status"] == 200
    assert r["out"]["stop_reasons"] == ["length"]  # kept through the pause, whole
    assert len(r["out"]["response_ids"][0]) == 400
    assert r["reset"][one.url]["status"] == 200
    assert r["loaded"][one.url]["status"] == 200
    assert len(r["lora_out"]["response_ids"][0]) == 4
    assert r["unloaded"][one.url]["status"] == 200
    for p in one.workers:  # every worker loaded it, and unloaded it again
        listed = httpx.post(f"{p.ready['system_url']}/engine/list_lora_adapters", json={}).json()
        assert "skyrl-lora" not in [a["lora_name"] for a in listed["adapters"]], listed
    assert httpx.get(f"{one.url}/is_paused").json() == {"is_paused": False}


def test_lora_load_and_unload_on_every_worker(one, service):
    """SGLang's and vLLM's LoRA routes at the one URL load and unload an adapter on every
    worker; unloading one no worker has is vLLM's 404."""
    path = str(one.ckpts["lora"])
    r = httpx.post(f"{one.url}/load_lora_adapter", json={"lora_name": "l1", "lora_path": path})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    for p in one.workers:
        listed = httpx.post(f"{p.ready['system_url']}/engine/list_lora_adapters", json={}).json()
        assert "l1" in [a["lora_name"] for a in listed["adapters"]], listed
    r = httpx.post(f"{one.url}/v1/unload_lora_adapter", json={"lora_name": "l1"})
    assert r.status_code == 200 and "removed" in r.text, r.text
    for p in one.workers:
        listed = httpx.post(f"{p.ready['system_url']}/engine/list_lora_adapters", json={}).json()
        assert "l1" not in [a["lora_name"] for a in listed["adapters"]], listed
    r = httpx.post(f"{one.url}/v1/unload_lora_adapter", json={"lora_name": "l1"})
    assert r.status_code == 404 and "l1" in r.json()["error"], r.text


def adapter_on_each_worker(one, name: str) -> list[tuple[str | None, bool] | None]:
    """(digest, open) of adapter `name` on each worker (None: not loaded there)."""
    out = []
    for p in one.workers:
        listed = httpx.post(f"{p.ready['system_url']}/engine/list_lora_adapters", json={},
                            timeout=10).json()["adapters"]
        a = next((a for a in listed if a["lora_name"] == name), None)
        out.append(None if a is None else (a["weight_digest"], a["open"]))
    return out


def test_a_lora_load_with_the_fleet_open_is_an_adapter_refresh(one, service):
    """With the fleet open, a LoRA load at the one URL is the adapter's refresh, journaled
    under the adapter's own fleet key, every worker verified on the version's digest. A new
    version of the same name that one worker fails to load rolls every worker back to the
    previous version, open; one that fails its probe on one worker holds the adapter closed
    on every worker; each time the client gets the dialect's error naming the worker."""
    v1 = str(one.ckpts["lora"])
    v2 = str(make_adapter(one.ckpts["lora"].parent / "lora-v2", rank=4, seed=2))
    bad = one.workers[1]
    for _ in range(2):  # the workers' fleet epoch ahead of the adapter's own (which starts
        # at 1): the adapter's refresh is fenced by its own epochs only
        assert httpx.post(f"{one.url}/pause?mode=keep", timeout=60).status_code == 200
        assert httpx.post(f"{one.url}/resume", timeout=120).status_code == 200
    try:
        r = httpx.post(f"{one.url}/v1/load_lora_adapter", timeout=120,
                       json={"lora_name": "rl", "lora_path": v1})
        assert r.status_code == 200 and "added" in r.text, r.text
        first = last_record(one)
        assert first["fleet"].endswith("#lora=rl") and first["decision"] == "reopened", first
        assert adapter_on_each_worker(one, "rl") == [(first.served.digest, True)] * 2
        # the load fails on one worker: every worker back on the previous version, open
        fault(bad, "load_lora_adapter")
        r = httpx.post(f"{one.url}/load_lora_adapter", timeout=120,  # SGLang's dialect
                       json={"lora_name": "rl", "lora_path": v2})
        assert r.status_code == 400 and r.json()["success"] is False, r.text
        assert bad.ready["instance_id"] in r.json()["error_message"], r.text
        assert "previous version" in r.json()["error_message"] and r.json()["rolled_back"]
        rec = last_record(one)
        assert rec["fleet"].endswith("#lora=rl") and rec["decision"] == "rolled_back", rec
        assert adapter_on_each_worker(one, "rl") == [(first.served.digest, True)] * 2
        r = httpx.post(f"{one.url}/v1/completions", timeout=60, json={
            "model": "rl", "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200, r.text
        # its probe fails on one worker: held, the adapter closed on every worker
        fault(bad, "generate")
        r = httpx.post(f"{one.url}/v1/load_lora_adapter", timeout=120,  # vLLM's dialect
                       json={"lora_name": "rl", "lora_path": v2})
        assert r.status_code == 400, r.text
        message = r.json()["error"]
        assert f"worker {bad.ready['instance_id']}" in message and "closed" in message, message
        assert last_record(one)["decision"] == "held"
        assert [a is not None and a[1] for a in adapter_on_each_worker(one, "rl")] == [False] * 2
        # the same version with every worker well: every worker moves, open
        r = httpx.post(f"{one.url}/load_lora_adapter", timeout=120,
                       json={"lora_name": "rl", "lora_path": v2})
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        moved = last_record(one).served.digest
        assert moved != first.served.digest
        assert adapter_on_each_worker(one, "rl") == [(moved, True)] * 2
    finally:
        fault(bad, "load_lora_adapter", times=0)
        fault(bad, "generate", times=0)
        httpx.post(f"{one.url}/v1/unload_lora_adapter", json={"lora_name": "rl"}, timeout=60)


def test_sglang_router_flushes_the_fleet_through_the_frontend(one, service, tmp_path):
    """sglang-router 0.3.2 with the frontend registered as its one worker fans /flush_cache
    out to it: every worker of the fleet flushes."""
    # two full blocks of the mocker's 16-token blocks and one token more: as vLLM counts, the
    # block of a prompt's last token is always computed, so both full blocks can hit
    cached = list(range(2000, 2033))
    for w in one.workers:
        direct_generate(w, cached)  # computed and stored
        hits = cache_hits(w)
        direct_generate(w, cached)
        assert cache_hits(w) - hits == 32, "the prompt was not cached to begin with"
    with clients.sglang_router([one.url], tmp_path) as router:
        clients.router_workers(router, 1)
        r = httpx.post(f"{router}/flush_cache", timeout=60)
        assert r.status_code == 200, r.text
    for w in one.workers:  # every worker's cache is empty: the prompt is computed again
        hits = cache_hits(w)
        direct_generate(w, cached)
        assert cache_hits(w) == hits, f"worker {w.ready['instance_id']} did not flush"


def direct_generate(worker: Proc, prompt: list[int]) -> None:
    """One request on the worker's own request plane (`POST /generate`), not through the
    frontend: it lands on that worker."""
    r = httpx.post(f"{worker.ready['url']}/generate", timeout=60, json={
        "request_id": f"direct-{time.monotonic_ns()}", "prompt_token_ids": prompt,
        "stream": False, "sampling": {"max_tokens": 1}})
    assert r.status_code == 200, r.text


def cache_hits(worker: Proc) -> float:
    """Prompt tokens the worker's simulated prefix cache held, all requests so far."""
    text = httpx.get(f"{worker.ready['system_url']}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("rlfleet_mocker_prefix_cache_hits_total{"))


def test_areals_remote_sglang_engine_drives_the_fleet(one, service, tmp_path):
    """AReaL 1.0's RemoteSGLangEngine with the frontend as its one server: pause_generation
    and continue_generation hold and reopen the whole fleet; its disk update (posted once
    the trainer's checkpoint is announced in name_resolve) moves every worker; its LoRA
    update loads the versioned adapter on every worker."""
    areal = clients.areal()
    with clients.on_path("areal"):
        from areal.api.cli_args import NameResolveConfig
        from areal.utils import name_resolve, names
    name_resolve.reconfigure(NameResolveConfig(type="nfs",
                                               nfs_record_root=str(tmp_path / "names")))
    cfg = areal.InferenceEngineConfig(experiment_name="one-url", trial_name="t",
                                      backend="sglang:d1", pause_grace_period=0.0,
                                      request_timeout=120)
    engine = areal.RemoteSGLangEngine(cfg)
    engine.initialize(addr=[one.url.removeprefix("http://")])
    try:
        engine.pause_generation()
        assert httpx.get(f"{one.url}/is_paused").json() == {"is_paused": True}
        engine.continue_generation()
        assert httpx.get(f"{one.url}/is_paused").json() == {"is_paused": False}

        def announce() -> None:  # what AReaL's trainer does once the checkpoint is saved
            name_resolve.add(names.update_weights_from_disk("one-url", "t", engine.get_version()),
                             str(time.time()), replace=True)
        announce()
        engine.update_weights_from_disk(areal.WeightUpdateMeta(
            type="disk", path=str(one.ckpts["B"]), clear_checkpoint_after_load=False)).result(300)
        assert [d for _, d in weight_versions(one)] == ["mock:12"] * 2
        assert httpx.get(f"{one.url}/is_paused").json() == {"is_paused": False}
        announce()
        engine.update_weights_from_disk(areal.WeightUpdateMeta(
            type="disk", path=str(one.ckpts["lora"]), use_lora=True, lora_name="areal",
            version=1, clear_checkpoint_after_load=False)).result(300)
        for p in one.workers:
            listed = httpx.post(f"{p.ready['system_url']}/engine/list_lora_adapters",
                                json={}).json()
            assert any(a["lora_name"].startswith("areal") for a in listed["adapters"]), listed
    finally:
        engine.destroy()


def test_a_worker_joining_a_held_fleet_stays_gated_until_verified(one, service):
    """A worker that registers while the fleet is paused is closed and paused too; at the
    resume it reopens only if it holds the fleet's policy (here it does not: it stays
    gated); the next update takes it in with the others."""
    r = httpx.post(f"{one.url}/update_weights_from_disk", timeout=120,
                   json={"model_path": str(one.ckpts["A"]), "weight_version": "A"})
    assert r.status_code == 200, r.text
    assert httpx.post(f"{one.url}/pause", params={"mode": "keep"}).json() == {"status": "paused"}
    p = one.start_worker(*one.worker_args, kind="mocker")
    try:
        system = p.ready["system_url"]
        wait_for(lambda: httpx.get(f"{system}/is_paused").json()["is_paused"])
        assert httpx.post(f"{one.url}/resume", timeout=60).json() == {"status": "resumed"}
        assert httpx.get(f"{system}/is_paused").json()["is_paused"] is True  # still gated
        usable = {w["instance_id"]: w["usable"]
                  for w in httpx.get(f"{one.url}/health").json()["workers"]}
        assert usable.get(int(p.ready["instance_id"])) is not True, usable
        r = httpx.post(f"{one.url}/update_weights_from_disk", timeout=120,
                       json={"model_path": str(one.ckpts["B"]), "weight_version": "B"})
        assert r.status_code == 200, r.text
        assert weight_versions(one) == [("B", "mock:12")] * 3
        assert httpx.get(f"{one.url}/get_world_size").json() == {"world_size": 3}
        assert httpx.get(f"{system}/is_paused").json()["is_paused"] is False
    finally:
        p.stop()
        one.workers.remove(p)
        one.procs.remove(p)
        wait_for(lambda: len(httpx.get(f"{one.url}/health").json()["workers"]) == 2)


def test_service_killed_mid_update_recovers_the_fleet_on_one_policy(one, service):
    """SIGKILL while an update has moved one worker and another is still applying it: the
    fleet stays gated; the restarted service rolls it back to the last verified policy from
    the journal and reopens it on that one policy."""
    r = httpx.post(f"{one.url}/update_weights_from_disk", timeout=120,
                   json={"model_path": str(one.ckpts["A"]), "weight_version": "A"})
    assert r.status_code == 200, r.text
    slow, fast = one.workers[1], one.workers[0]
    fault(slow, "update_weights_from_disk", mode="hang", hang_seconds=15)
    updating, _ = in_thread(lambda: httpx.post(
        f"{one.url}/update_weights_from_disk", timeout=120,
        json={"model_path": str(one.ckpts["B"]), "weight_version": "B"}))

    def fast_moved() -> bool:
        v = httpx.post(f"{fast.ready['system_url']}/engine/get_weight_version", json={},
                       timeout=10).json()
        return v["version"] == "B"
    wait_for(fast_moved)
    interrupted = last_record(one)["id"]
    service.signal(signal.SIGKILL)
    service.popen.wait(10)
    updating.join(60)
    one.start()  # recovers at start, before it answers
    with SqliteJournal(one.journal) as j:
        assert j.get(interrupted)["decision"] == "recovered"
        recovery = j.recent(1)[0]
    assert recovery["kind"] == "recovery" and recovery["decision"] == "reopened", dict(recovery)
    assert "rolled back" in recovery["reason"], recovery["reason"]
    assert weight_versions(one) == [("A", "mock:11")] * 2
    assert httpx.get(f"{one.url}/is_paused").json() == {"is_paused": False}
    assert complete(one).status_code == 200


# ---------------------------------------------------------------- mutation fuzz (issue 43)

DEEP = '{"a": ' * 2000 + "null" + "}" * 2000  # JSON nested 2,000 deep
BAD_VALUES = [True, 7, 2.5, "s", [1], {"a": 1}, "\ud800", "<DEEP>"]
BAD_BODIES = [b"{", b"[1, 2]", b'"x"', b"null", b"[" * 2000 + b"]" * 2000,
              b'{"mode": "\\ud800"}', b"\xff\xfe", b'{"a": NaN}']


def _bases(one) -> dict[str, dict]:
    """A body each control route takes (the mocker has no weight-transfer engine and no
    adapter at these paths: those calls are refused by every worker); a route not named
    here (one added since) is fuzzed from an empty body."""
    ckpt = str(one.ckpts["A"])
    lora = {"lora_name": "fuzzed", "lora_path": str(one.ckpts["A"] / "nothing")}
    return {
        "/init_weight_transfer_engine": {"init_info": {
            "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
            "world_size": 3}},
        "/update_weights": {"update_info": {}}, "/finish_weight_update": {"weight_version": "v"},
        "/collective_rpc": {"method": "reload_weights", "kwargs": {"weights_path": ckpt}},
        "/v1/load_lora_adapter": lora, "/skyrl/v1/load_lora_adapter": lora,
        "/v1/unload_lora_adapter": {"lora_name": "fuzzed"}, "/load_lora_adapter": lora,
        "/unload_lora_adapter": {"lora_name": "x"}, "/pause_generation": {"mode": "abort"},
        "/update_weights_from_disk": {"model_path": ckpt, "weight_version": "A"},
        "/areal_update_weights": {"model_path": ckpt},
        "/update_weight_version": {"new_version": "A"}, "/abort_requests": {"request_ids": ["x"]},
        "/weight_checker": {"action": "checksum"},
    }


def _mutations(body: dict) -> list[bytes]:
    def encoded(d: dict) -> bytes:
        return json.dumps(d).replace('"<DEEP>"', DEEP).encode()
    out = list(BAD_BODIES)
    for field in body:
        out.append(encoded({k: v for k, v in body.items() if k != field}))
        out += [encoded({**body, field: bad}) for bad in BAD_VALUES]
    out.append(encoded({**body, "unknown_field": "<DEEP>"}))
    return out


def test_no_control_route_answers_a_mutated_request_with_a_5xx(one, service):
    """The reliability rerun's findings: deep JSON, a mode that is an object, a transfer step
    out of order, a fleet without a weight-transfer engine; each mutated body of each
    control route, through the frontend, is answered below 500 (4xx naming the field,
    409 out of order, 400 for a capability the fleet lacks), and the fleet serves after."""
    from rlfleet.protocol import smg
    from rlfleet.protocol.fleet_control import FORWARDED

    bases, fivexx = _bases(one), []
    with httpx.Client(timeout=120) as http:
        for route in FORWARDED:
            path, params = route.path, {}
            if "{" in path:  # SMG's fan-out: an engine route on the workers a selector names
                path, params = path.split("{")[0] + "liveness_probe", {
                    "selector": f"engine={smg.ENGINE}"}
            for method in route.methods:
                for raw in _mutations(bases.get(route.path, {})):
                    r = http.request(method, f"{one.url}{path}", content=raw, params=params,
                                     headers={"content-type": "application/json"})
                    if r.status_code >= 500:
                        fivexx.append((method, path, raw[:120], r.status_code, r.text[:300]))
        for query in ({"mode": "sideways"}, {"mode": ""}, {"clear_cache": "maybe"}):
            r = http.post(f"{one.url}/pause", params=query)
            assert r.status_code == 400, (query, r.text)
        r = http.get(f"{one.url}/get_world_size", params={"include_dp": "perhaps"})
        assert r.status_code == 400, r.text
        # the named findings, each its own status
        r = http.post(f"{one.url}/pause_generation", json={"mode": {"a": 1}})
        assert r.status_code == 400 and "field mode" in r.json()["error"]["message"], r.text
        r = http.post(f"{one.url}/finish_weight_update", json={})
        assert r.status_code == 409 and "no weight update is open" in r.json()["error"], r.text
        r = http.post(f"{one.url}/start_weight_update")
        assert r.status_code == 400 and "no weight-transfer engine" in r.json()["error"], r.text
        r = http.post(f"{one.url}/collective_rpc", content=f'{{"kwargs": {DEEP}}}'.encode())
        assert r.status_code == 400 and "nested too deeply" in r.json()["error"], r.text
        if http.get(f"{one.url}/is_paused").json()["is_paused"]:
            assert http.post(f"{one.url}/resume").status_code == 200
    assert not fivexx, fivexx
    assert one.service.popen.poll() is None
    assert complete(one).status_code == 200
