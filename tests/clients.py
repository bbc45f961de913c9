"""RL frameworks' own client code, installed by scripts/setup.sh into <venv>/clients/<name>
(pip --no-deps --target: outside site-packages, so no worker or engine ever imports it), and
loaded here for the compatibility tests (tests/integration/test_clients_*.py):

* `skyrl()`: SkyRL 0.3.0's RemoteInferenceClient module; `skyrl04()`: SkyRL 0.4.0's, with
  its trainer-side weight-sync client and its packed-payload codecs (the two versions are
  the same package, kept apart in sys.modules);
* `areal()`: AReaL 1.0.4's remote engines (RemoteSGLangEngine, RemotevLLMEngine) and the
  request, config and weight-update types they take;
* `smg_rl()`: SMG 1.13.0's RL control-plane client (`smg.rl`);
* `sglang_api()`: SGLang 0.5.23's HTTP API types and their strict decoders;
* `sglang_router(...)`: sglang-router 0.3.2's router (`python -m sglang_router.launch_router`)
  as a process on a free 127.0.0.1 port in front of given worker URLs.

A client that is not installed, or fails to import, makes its test skip with the reason (the
missing folder or the import error), never fail. Each client's folder is on sys.path only while
its modules are imported; the modules stay usable afterwards. The folders go at the END of
sys.path: where a client ships a module the venv also has, the venv's copy is used."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import importlib
import logging
import os
import sys
import time
import types
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from rlfleet.models import make_adapter
from rlfleet.runtime.launch import Proc, free_port, spawn, stop_all
from rlfleet.testing.fleet import LocalFleet, http_server
from tests.fleets import (
    MODEL_NAME,
    RL_PROBE_ENV,
    VLLM_FLEET_LEASE,
    local_fleet,
    unit_server,
    vllm_worker_args,
    wait_for_workers,
)

#: where scripts/setup.sh installs them ($RLFLEET_CLIENTS_DIR: another folder of such folders)
CLIENTS_DIR = Path(os.environ.get("RLFLEET_CLIENTS_DIR") or Path(sys.prefix) / "clients")

#: what scripts/setup.sh installs, by folder: the package and version tested
VERSIONS = {"skyrl": "skyrl==0.3.0", "skyrl04": "skyrl==0.4.0", "areal": "areal==1.0.4",
            "sglang-router": "sglang-router==0.3.2", "smg": "smg==1.13.0",
            "sglang": "sglang==0.5.23"}


def client_dir(name: str) -> Path:
    """<venv>/clients/<name>; the test skips when setup did not install it there."""
    where = CLIENTS_DIR / name
    if not (where / ".installed").exists():
        pytest.skip(f"{VERSIONS[name]} is not installed in {where}: run scripts/setup.sh "
                    f"(pip install --no-deps --target {where} {VERSIONS[name]})")
    return where


@contextlib.contextmanager
def on_path(name: str) -> Iterator[Path]:
    """The client's folder on sys.path (at the end) while the block runs."""
    where = str(client_dir(name))
    sys.path.append(where)
    try:
        yield Path(where)
    finally:
        sys.path.remove(where)


@contextlib.contextmanager
def logging_kept() -> Iterator[None]:
    """This process's logging as it was before the block, whatever the block did to it: the
    root logger (`logging.root`, `Logger.root`), the manager (`Logger.manager`) and its
    `disable`, the root's level, handlers and filters, every existing logger's level,
    propagate, disabled, handlers and filters, the handler registry, the logger class and
    record factory. A client's import (and AReaL's `getLogger`, which installs a new root
    and manager on every call, then `dictConfig`s them) must not leave later tests (or
    rlfleet's own loggers, created before) logging into a root nobody configured."""
    mod_root, cls_root, manager = logging.root, logging.Logger.root, logging.Logger.manager
    disable = manager.disable
    loggers = [(lg, lg.level, lg.propagate, lg.disabled, list(lg.handlers), list(lg.filters))
               for lg in [mod_root, *list(manager.loggerDict.values())]
               if isinstance(lg, logging.Logger)]
    registry = dict(logging._handlers)  # type: ignore[attr-defined]
    handler_list = list(logging._handlerList)  # type: ignore[attr-defined]
    logger_class, record_factory = logging.getLoggerClass(), logging.getLogRecordFactory()
    try:
        yield
    finally:
        with logging._lock:  # type: ignore[attr-defined]
            logging.root, logging.Logger.root, logging.Logger.manager = \
                mod_root, cls_root, manager
            manager.root = cls_root
            manager.disable = disable
            for lg, level, propagate, disabled, handlers, filters in loggers:
                lg.level, lg.propagate, lg.disabled = level, propagate, disabled
                lg.handlers[:], lg.filters[:] = handlers, filters
            logging._handlers.clear()  # type: ignore[attr-defined]
            logging._handlers.update(registry)  # type: ignore[attr-defined]
            logging._handlerList[:] = handler_list  # type: ignore[attr-defined]
            logging.setLoggerClass(logger_class)
            logging.setLogRecordFactory(record_factory)
            manager._clear_cache()


def _import(name: str, modules: Sequence[str]) -> list[types.ModuleType]:
    with on_path(name) as where, logging_kept():
        try:
            return [importlib.import_module(m) for m in modules]
        except Exception as e:  # noqa: BLE001 - any import failure is a reason to skip
            pytest.skip(f"{VERSIONS[name]} in {where} cannot be imported here: "
                        f"{type(e).__name__}: {e}")


def _bare_package(dotted: str, where: Path) -> None:
    """Register package `dotted` (under `where`) without running its __init__.py."""
    if dotted in sys.modules:
        return
    pkg = types.ModuleType(dotted)
    pkg.__path__ = [str(where / dotted.replace(".", "/"))]
    pkg.__package__ = dotted
    sys.modules[dotted] = pkg


#: each installed version's `skyrl` modules, kept apart (both are the package `skyrl`)
_SKYRL_MODULES: dict[str, dict[str, types.ModuleType]] = {}


@contextlib.contextmanager
def _skyrl_modules(name: str) -> Iterator[None]:
    """sys.modules holds the `skyrl` modules of folder `name` (imported ones kept) while the
    block runs; those of another version are put back after it. Imported modules keep
    working after: their own imports are done at import time."""
    def taken() -> dict[str, types.ModuleType]:
        return {k: sys.modules.pop(k) for k in list(sys.modules)
                if k == "skyrl" or k.startswith("skyrl.")}
    before = taken()
    sys.modules.update(_SKYRL_MODULES.get(name, {}))
    try:
        yield
    finally:
        _SKYRL_MODULES[name] = taken()
        sys.modules.update(before)


def _skyrl(name: str, modules: list[str]) -> list[types.ModuleType]:
    """`modules` of SkyRL's folder `name`. `skyrl/backends/__init__.py` imports the Tinker
    backend, whose pydantic models use typing.TypedDict, which pydantic refuses on Python <
    3.12; the HTTP clients need none of it, so that one package is registered without its
    __init__."""
    with _skyrl_modules(name):
        with on_path(name) as where:
            _bare_package("skyrl.backends", where)
        return _import(name, modules)


def skyrl() -> types.ModuleType:
    """skyrl.backends.skyrl_train.inference_servers.remote_inference_client (SkyRL 0.3.0):
    RemoteInferenceClient, PauseMode."""
    (mod,) = _skyrl("skyrl", ["skyrl.backends.skyrl_train.inference_servers."
                              "remote_inference_client"])
    return mod


def skyrl04() -> types.SimpleNamespace:
    """SkyRL 0.4.0 (its wheel asks for Python >= 3.12; the client runs on 3.11): `client`,
    the RemoteInferenceClient module (PauseMode too); `control_plane`, the trainer-side
    SkyrlWeightSyncClient's; `wire`, /skyrl/v1/generate's packed payloads."""
    base = "skyrl.backends.skyrl_train."
    client, control_plane, wire = _skyrl("skyrl04", [
        f"{base}inference_servers.remote_inference_client", f"{base}weight_sync.control_plane",
        f"{base}inference_servers.generate_wire"])
    return types.SimpleNamespace(client=client, control_plane=control_plane, wire=wire)


def sglang_api() -> types.ModuleType:
    """sglang.api.v1.api_types (SGLang 0.5.23): its HTTP API's msgspec types with the
    decoders its Rust server uses (`X.from_json_value`, JsonContractError). `sglang/__init__.py`
    imports the engine (torch, ...): the package is registered without it."""
    with on_path("sglang") as where:
        _bare_package("sglang", where)
    (mod,) = _import("sglang", ["sglang.api.v1.api_types"])
    return mod


def smg_rl() -> types.ModuleType:
    """smg.rl (smg 1.13.0): SMG's RL control-plane client (RL, paused, FanoutError)."""
    (mod,) = _import("smg", ["smg.rl"])
    return mod


def areal() -> types.SimpleNamespace:
    """AReaL 1.0.4's remote engines and what they take: RemoteSGLangEngine, RemotevLLMEngine,
    InferenceEngineConfig, ModelRequest, GenerationHyperparameters, WeightUpdateMeta, and the
    HTTP call its weight updates are sent with (arequest_with_retry)."""
    sgl, vll, api, cli, http, alog = _import("areal", [
        "areal.engine.sglang_remote", "areal.engine.vllm_remote", "areal.api",
        "areal.api.cli_args", "areal.infra.utils.http", "areal.utils.logging"])
    _keep_logging_around(alog)
    return types.SimpleNamespace(
        RemoteSGLangEngine=sgl.RemoteSGLangEngine, RemotevLLMEngine=vll.RemotevLLMEngine,
        InferenceEngineConfig=cli.InferenceEngineConfig, ModelRequest=api.ModelRequest,
        GenerationHyperparameters=cli.GenerationHyperparameters,
        WeightUpdateMeta=api.WeightUpdateMeta, arequest_with_retry=http.arequest_with_retry)


def _keep_logging_around(alog: types.ModuleType) -> None:
    """AReaL's `areal.utils.logging.getLogger` (called again whenever an engine is made)
    replaces the process's root logger and manager: run it inside `logging_kept`, so its
    logger keeps AReaL's handler while this process's logging stays as it was."""
    original = alog.getLogger
    if getattr(original, "_logging_kept", False):
        return

    @functools.wraps(original)
    def getLogger(*args: Any, **kwargs: Any) -> logging.Logger:  # noqa: N802 - AReaL's name
        with logging_kept():
            return original(*args, **kwargs)

    getLogger._logging_kept = True  # type: ignore[attr-defined]
    alog.getLogger = getLogger


ROUTER_START_TIMEOUT = 60.0


@contextlib.contextmanager
def sglang_router(worker_urls: Sequence[str], log_dir: Path, *flags: str,
                  timeout: float = ROUTER_START_TIMEOUT) -> Iterator[str]:
    """sglang-router 0.3.2 (its Rust router, `python -m sglang_router.launch_router`) on a
    free 127.0.0.1 port with `worker_urls` as its workers and `flags` added: its URL once it
    answers /liveness (registering the workers goes on in the router's background: see
    `router_workers`). Its output is <log_dir>/sglang-router-<port>.log; it is stopped (its
    process group) on exit, also when it fails to start."""
    where = client_dir("sglang-router")
    port = free_port()
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
            "--port", str(port), "--worker-urls", *worker_urls, "--log-level", "info", *flags]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (os.environ.get("PYTHONPATH"), str(where)) if p)}
    with http_server(f"sglang-router-{port}", argv, port, "/liveness", log_dir, env, timeout,
                     stop_timeout=10) as url:
        yield url


def router_workers(url: str, count: int, timeout: float = 30.0) -> list[dict]:
    """The router's `GET /workers` list once it holds `count` workers; TimeoutError (with
    the last answer) otherwise."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            r = httpx.get(f"{url}/workers", timeout=5)
            last = r.json()
            workers = last.get("workers", []) if isinstance(last, dict) else []
            if r.status_code == 200 and len(workers) >= count:
                return workers
        if time.monotonic() > deadline:
            raise TimeoutError(f"sglang-router at {url} lists {last!r}, expected {count} workers")
        time.sleep(0.3)


# ---------------------------------------------------------------- the fleet's own answers


@dataclasses.dataclass
class FleetAnswer:
    """What the fleet itself generates for a prompt (greedy, `/v1/completions` on its
    frontend): the reference every client's output is compared with."""

    prompt_ids: list[int]
    ids: list[int]  # nvext.completion_token_ids
    logprobs: list[float]  # choices[0].logprobs.token_logprobs
    text: str
    finish_reason: str


def fleet_answer(url: str, model: str, prompt: str | list[int], max_tokens: int,
                 **extra: Any) -> FleetAnswer:
    """The fleet's greedy completion of `prompt` (text or token IDs), EOS ignored."""
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "logprobs": 0, **extra,
        "nvext": {"extra_fields": ["completion_token_ids", "prompt_token_ids"]}})
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    return FleetAnswer(prompt_ids=out["nvext"]["prompt_token_ids"],
                       ids=out["nvext"]["completion_token_ids"],
                       logprobs=choice["logprobs"]["token_logprobs"], text=choice["text"],
                       finish_reason=choice["finish_reason"])


#: logprobs of one engine for one request, compared across two requests: exact on the mocker;
#: on vLLM's CPU build float32 sums may differ in the last bits with what else is batched
LOGPROB_TOL = 1e-4


def admin_urls(rl_url: str) -> list[str]:
    """Each worker's `admin_base_url`, as the frontend's RL listener lists them
    (`GET /v1/rl/workers`): where a framework sends its per-server control calls."""
    r = httpx.get(f"{rl_url}/v1/rl/workers", timeout=30)
    assert r.status_code == 200, r.text
    urls = [w.get("admin_base_url") for w in r.json()["workers"]]
    assert urls and all(urls), f"a worker without admin_base_url in {r.text}"
    return sorted(urls)


def frontend_in_flight(url: str) -> float:
    """Requests in flight on the frontend (its rlfleet_frontend_inflight_requests gauge,
    every route)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("rlfleet_frontend_inflight_requests{"))


def wait_in_flight(url: str, count: int = 1, timeout: float = 60.0) -> None:
    """Block until the frontend has `count` requests in flight."""
    deadline = time.monotonic() + timeout
    while frontend_in_flight(url) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the frontend at {url} never had {count} requests in flight")
        time.sleep(0.05)


SKYRL_PROMPT = "The capital of France is"
SKYRL_MESSAGES = [{"role": "user", "content": "Say something about Paris."}]


@dataclasses.dataclass
class SkyrlTarget:
    """A fleet as SkyRL's client (0.3.0 and 0.4.0 alike) is pointed at it."""

    kind: str  # "mocker" | "vllm"
    url: str  # the frontend: SkyRL's proxy_url
    rl_url: str
    model: str
    long: int  # max_tokens of a request that is surely in flight when the pause lands
    adapter: Path | None  # a LoRA adapter the workers can load (None: LoRA not enabled)


async def skyrl_pause_keep(client, keep: Any, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """A SkyRL client's `generate(body)` in flight at frontend `url`; its pause (`keep`, its
    PauseMode.KEEP) on every server; whether the request stayed frozen while every server
    said it was paused; its resume; the request's output. SkyRL 0.3.0's and 0.4.0's clients
    alike."""
    task = asyncio.create_task(client.generate(body))
    await asyncio.to_thread(wait_in_flight, url)
    paused = await client.pause(mode=keep)
    try:
        states = await client._call_all_servers("/is_paused", method="GET")
        await asyncio.sleep(1.0)  # a frozen request does not finish while paused
        frozen = not task.done()
    finally:
        resumed = await client.resume()
    return {"paused": paused, "states": states, "frozen": frozen, "resumed": resumed,
            "out": await asyncio.wait_for(task, 300)}


# ---------------------------------------------------------------- one URL for a whole fleet


@dataclasses.dataclass
class OneUrl:
    """A frontend of its own on a fleet's discovery, forwarding vLLM's and SGLang's control
    routes (--fleet-control) to a fleet control service (`rlfleet control`): the one URL a
    single-server client both generates on and controls the fleet through."""

    url: str
    rl_url: str
    control_url: str


@contextlib.contextmanager
def one_url(fleet: LocalFleet, model: str, log_dir: Path,
            timeout: float = 60.0) -> Iterator[OneUrl]:
    """A frontend (RL listener on) and the control service it forwards to, both on 127.0.0.1,
    in front of `fleet`'s workers (already running: the frontend routes to all of them before
    this yields); both stopped on exit. Starting one more frontend is cheap, so a module can
    put it in front of the session's vLLM fleet without restarting its engines.

    The service starts first on a port of its own choosing (it reads the RL listener only
    when called), told the RL port the frontend will take; a port picked free can be taken by
    another process's connection before the frontend binds it, so that start is retried."""
    procs: list[Proc] = []
    try:
        for attempt in range(3):
            rl_port = free_port()
            ctl = spawn(f"control-{rl_port}", [
                sys.executable, "-m", "rlfleet.cli", "control", "--rl-url",
                f"http://127.0.0.1:{rl_port}", "--model", model, "--journal",
                str(log_dir / f"journal-{rl_port}.sqlite"), "--port", "0"], log_dir)
            procs.append(ctl)
            ctl.wait_ready(timeout)
            fe = spawn(f"frontend-one-url-{rl_port}", [
                sys.executable, "-m", "rlfleet.frontend", "--http-port", "0", "--discovery",
                fleet.discovery, "--namespace", fleet.namespace, "--enable-rl", "--rl-port",
                str(rl_port), "--fleet-control", ctl.ready["url"],
                # a request arriving while the fleet is paused waits for the resume (verify,
                # probe, reopen), which on a loaded small machine can outlast the 60 s default
                "--gated-hold", "300"], log_dir,
                env={**os.environ, **RL_PROBE_ENV})
            procs.append(fe)
            try:
                fe.wait_ready(timeout)
                break
            except RuntimeError:
                if attempt == 2 or "in use" not in fe.tail():
                    raise
                stop_all(list(reversed(procs)))
                procs.clear()
        wait_for_workers(fe.ready["url"], model, len(fleet.workers))
        yield OneUrl(fe.ready["url"], fe.ready["rl_url"], ctl.ready["url"])
    finally:
        stop_all(list(reversed(procs)))


def mock_one_url(start_module_fleet, tmp_path_factory, name: str, model: str,
                 worker_args: Sequence[str], workers: int = 2) -> Iterator[OneUrl]:
    """`workers` mocker workers (`worker_args`, serving `model`) behind the one URL, for a
    module fixture to yield from; the URL carries the fleet (`.fleet`)."""
    fleet = start_module_fleet([worker_args] * workers, model=model, enable_rl=True,
                               frontend_env=RL_PROBE_ENV)
    with one_url(fleet, model, tmp_path_factory.mktemp(f"{name}-logs")) as u:
        u.fleet = fleet
        yield u


# ---------------------------------------------------------------- a vLLM worker with LoRA

LORA_FLAGS = ("--enable-lora", "--max-loras", "4", "--max-lora-rank", "16")


@pytest.fixture(scope="session")
def session_lora_vllm_fleet(request, tmp_path_factory, tiny_model) -> LocalFleet:
    """One vLLM worker serving `tiny` with LoRA enabled and adapters allowed from the
    directory of `fleet.adapter` (an adapter made for `tiny`), behind a frontend with the
    RL listener: the clients' LoRA calls on a real engine (the session's vLLM fleet runs
    without LoRA). tests/conftest.py imports it, so that every module shares one; modules
    reach it as `lora_vllm_fleet`; it stops with the session fleet's other servers."""
    root = tmp_path_factory.mktemp("clients-adapters")
    adapter = make_adapter(root / "a1", rank=8, seed=1)
    args = vllm_worker_args(tiny_model, MODEL_NAME, *LORA_FLAGS, "--allowed-weights-root",
                            str(root))
    fleet = unit_server(request, local_fleet(
        tmp_path_factory.mktemp("clients-lora-fleet"), [args], kind="vllm", model=MODEL_NAME,
        lease_ttl=VLLM_FLEET_LEASE, enable_rl=True, frontend_env=RL_PROBE_ENV))
    fleet.adapter = adapter
    return fleet
