"""Shared fixtures: locally made test models, real servers (etcd, S3, a Ray head) and
fleets (the session's vLLM fleet; the `start_fleet` / `start_module_fleet` factories for a
fleet with a module's own settings). The start-up code is in tests/fleets.py."""

from __future__ import annotations

import contextlib
import functools
import multiprocessing.process
import os
import re
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

# One OpenMP thread per process, and no spinning after a parallel region (set before torch is
# imported here or in any process a test starts): the suite runs three test processes on two
# cores, each starting engines, trainers and servers of its own, and the defaults (a thread
# per core; Intel OpenMP, which the CPU engine preloads, spins 200 ms after each region) keep
# every engine's second thread busy-waiting on a core another process needs
# (bench/engine_threads.py: a tiny vLLM worker's start 0.82 of the default's CPU, its
# requests 0.53, wall alike). A test that sets its own keeps it; bench/ does not read this.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("KMP_BLOCKTIME", "0")
# torch.compile off: every vLLM engine process compiles one sampler op with inductor (the
# logprobs' rank count; the worker's warm-up request pays for it), ~3 CPU-s of its ~20 s
# start, and the suite starts engines by the dozen. Eager computes the same integers; the
# models run eager anyway (--enforce-eager). bench/engine_threads.py measures it.
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

from rlfleet.testing.ray import LOOPBACK_ENV  # noqa: E402

# Ray reads these when it is first imported (vLLM imports it too): set them before anything
# else, so that drivers find the test's Ray head on 127.0.0.1
os.environ.update(LOOPBACK_ENV)

from rlfleet.models import make_model  # noqa: E402
from rlfleet.runtime import launch, preload  # noqa: E402
from rlfleet.runtime.discovery import EtcdDiscovery  # noqa: E402
from rlfleet.runtime.launch import Proc  # noqa: E402
from rlfleet.testing.etcd import etcd_clients, run_etcd  # noqa: E402
from rlfleet.testing.fleet import LocalFleet  # noqa: E402
from rlfleet.testing.s3 import S3Server  # noqa: E402
from tests.clients import session_lora_vllm_fleet  # noqa: E402, F401 - the clients' LoRA worker
from tests.compare import vllm_reference  # noqa: E402, F401 - the differential tests' vLLM
from tests.fleets import (  # noqa: E402
    MODEL_NAME,
    RL_PROBE_ENV,
    UNIT_SERVERS,
    VLLM_FLEET_LEASE,
    local_fleet,
    replace_dead_workers,
    unit_server,
    vllm_worker_args,
)


@pytest.fixture(scope="session", autouse=True)
def preloaded(request, tmp_path_factory) -> Iterator[None]:
    """The fleets' processes (`python -m rlfleet.{vllm,mocker,frontend}`) forked from a
    process that imported vLLM, torch and rlfleet once (rlfleet.runtime.preload): a tiny
    vLLM worker's start ~8 CPU-s instead of ~24, a mocker's or a frontend's ~0.3 instead of
    ~2.5, and the suite starts hundreds (BENCHMARKS.md, "The test suite"). RLFLEET_TEST_PRELOAD=0
    turns it off: every process is exec'd."""
    if (os.environ.get("RLFLEET_TEST_PRELOAD", "1") == "0"
            or all(UNIT_TESTS in Path(item.path).parents for item in request.session.items)):
        yield  # (unit tests start no process)
        return
    with launch.preload_server(tmp_path_factory.mktemp("preload")) as path:
        # its imports cost what one worker's would: the first fleets wait for them
        preload.wait_ready(path, timeout=120)
        launch.PRELOADED = path
        try:
            yield
        finally:
            launch.PRELOADED = None


def read_at_import() -> dict[str, str]:
    """The variables of os.environ that the processes a test starts read at their import
    (rlfleet.runtime.preload.IMPORT_TIME, less what is read later)."""
    return {k: v for k, v in os.environ.items()
            if k.startswith(preload.IMPORT_TIME) and k not in preload.LATER}


@pytest.fixture(autouse=True)
def _imports_leave_the_environment() -> Iterator[None]:
    """What a test's imports set among those variables ends with the test (TRL sets
    VLLM_LOGGING_LEVEL=ERROR when imported, trl/_compat.py): a vLLM worker a later test
    starts logs as if the test had not run, and the preload server forks it (it refuses a
    process whose import-time variables differ from its own)."""
    before = read_at_import()
    yield
    after = read_at_import()
    for key in after.keys() - before.keys():
        del os.environ[key]
    os.environ.update({k: v for k, v in before.items() if after.get(k) != v})


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


@pytest.fixture
def ns() -> str:
    """A discovery namespace of its own per test (the store, a shared etcd, stays shared)."""
    return f"test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def etcd_pair(etcd_url: str) -> AsyncIterator[tuple[EtcdDiscovery, EtcdDiscovery]]:
    """Two separate etcd discovery clients of `etcd_url` (the module's own server where a
    module overrides it): one registers, the other reads or interferes."""
    async with etcd_clients(etcd_url) as clients:
        yield clients


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 server (SeaweedFS) on 127.0.0.1; tests may kill() and start() it again."""
    with S3Server() as server:
        yield server


@pytest.fixture(scope="session")
def ray_head():
    """One local Ray head (127.0.0.1) for the whole session; drivers and `rlfleet` processes
    find it at the address yielded."""
    pytest.importorskip("ray", reason="ray is not installed (pip install ray)")
    from ray._private import ray_constants

    from rlfleet.testing.ray import run_ray_head

    if ray_constants.ENABLE_RAY_CLUSTER:  # a driver would look for the head elsewhere, forever
        pytest.fail("ray was imported before tests/conftest.py set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    with run_ray_head() as address:
        yield address


# ---------------------------------------------------------------- fleets


@pytest.fixture(scope="session")
def _session_vllm_fleet(request, tmp_path_factory, tiny_model, etcd_url) -> LocalFleet:
    return unit_server(request, local_fleet(
        tmp_path_factory.mktemp("fleet"), [vllm_worker_args(tiny_model)] * 2, kind="vllm",
        model=MODEL_NAME, lease_ttl=VLLM_FLEET_LEASE, discovery=etcd_url, enable_rl=True,
        frontend_env=RL_PROBE_ENV))


@pytest.fixture(scope="module")
def vllm_fleet(request, tiny_model) -> LocalFleet:
    """Frontend (with the RL listener, probing workers with a 2 s timeout) + 2 real vLLM
    workers serving `tiny` with fault injection, over etcd: one per test process, whole
    at the start of every module (a worker a test killed is replaced)."""
    fleet = _in_unit(request, "_session_vllm_fleet")
    replace_dead_workers(fleet, vllm_worker_args(tiny_model), MODEL_NAME)
    return fleet


@pytest.fixture(scope="module")
def lora_vllm_fleet(request) -> LocalFleet:
    """The clients' LoRA vLLM worker (tests.clients.session_lora_vllm_fleet)."""
    return _in_unit(request, "session_lora_vllm_fleet")


@pytest.fixture
def session_vllm_worker(request, tiny_model) -> Proc:
    """A live worker of the session vLLM fleet, for a test that kills it: its module is
    marked kills_session_worker, so it runs after the other modules on that fleet."""
    fleet = _in_unit(request, "_session_vllm_fleet")
    live = [p for p in fleet.workers if p.popen.poll() is None]
    if not live:
        replace_dead_workers(fleet, vllm_worker_args(tiny_model), MODEL_NAME)
        live = list(fleet.workers)
    return live[-1]


StartFleet = Callable[..., LocalFleet]


@contextlib.contextmanager
def _fleet_factory(tmp_path_factory) -> Iterator[StartFleet]:
    with contextlib.ExitStack() as fleets:
        def start(workers, *, name: str = "fleet", **settings) -> LocalFleet:
            """`workers`: one argument list per worker; settings: tests.fleets.local_fleet's."""
            return fleets.enter_context(local_fleet(tmp_path_factory.mktemp(name), workers,
                                                    **settings))
        yield start


@pytest.fixture
def start_fleet(tmp_path_factory) -> Iterator[StartFleet]:
    """Start fleets for one test (tests.fleets.local_fleet's parameters); stopped after it."""
    with _fleet_factory(tmp_path_factory) as start:
        yield start


@pytest.fixture(scope="module")
def start_module_fleet(tmp_path_factory) -> Iterator[StartFleet]:
    """Start fleets for a module (tests.fleets.local_fleet's parameters); stopped after it."""
    with _fleet_factory(tmp_path_factory) as start:
        yield start


# ---------------------------------------------------------------- test processes

UNIT_TESTS = Path(__file__).parent / "unit"


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request, monkeypatch) -> None:
    """A test under tests/unit that starts a process (a server, a worker, a command) fails
    and says where it belongs."""
    if UNIT_TESTS not in Path(request.path).parents:
        return

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} starts a process: unit tests start none; "
                             "it belongs in tests/integration")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    monkeypatch.setattr(os, "fork", refuse)


SESSION_FLEET_SCOPE = "modules on the session vLLM fleet"
#: the names through which a module reaches the session fleet's servers (UNIT_SERVERS)
SESSION_FLEET_FIXTURES = re.compile(
    r"\b(vllm_fleet|session_vllm_worker|lora_vllm_fleet|reference_and_fleet)\b")


@functools.cache
def takes_session_fleet(module: Path) -> bool:
    """Whether a test module uses the session's vLLM fleet (names one of its fixtures, also
    through request.getfixturevalue)."""
    try:
        return SESSION_FLEET_FIXTURES.search(module.read_text(errors="replace")) is not None
    except OSError:
        return False


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, when it is installed
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadfile` (make test) with one change: every module on the session's vLLM fleet
    runs in the same process, so that the fleet starts once, not once per process."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SessionFleetScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return SESSION_FLEET_SCOPE if takes_session_fleet(config.rootpath / module) else module

    return SessionFleetScheduling(config, log)


def _in_unit(request: pytest.FixtureRequest, server: str):
    """The session fixture `server`, for a module of the session fleet's unit. Fails, before
    starting anything, a module that reaches it under a name the scheduler does not know:
    it could run in another process and start the servers all again there."""
    module = Path(request.path)
    if not takes_session_fleet(module):
        pytest.fail(f"{module.name} reaches the session vLLM fleet's servers under a name "
                    "tests/conftest.py's scheduler does not know, so another test process "
                    "could start them again: name one of the fixtures of "
                    f"SESSION_FLEET_FIXTURES ({SESSION_FLEET_FIXTURES.pattern}) in it",
                    pytrace=False)
    if _unit_ended:
        pytest.fail(f"{module.name} runs after the session fleet's modules ended and their "
                    "servers stopped: tests/conftest.py orders and schedules them together",
                    pytrace=False)
    return request.getfixturevalue(server)


_unit_ended = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The session fleet's modules first and together (so that its servers, started once,
    stop when the last of them ends); among them, those that kill a worker of the fleet
    last (the fleet replaces the worker for the next module: that way it never has to).
    Then the modules on the real engine (the longest) before the rest, so that the test
    processes end together, on short modules, not one of them on a long one."""
    on_engine = {item.path for item in items if item.get_closest_marker("engine") is not None}
    items.sort(key=lambda item: (not takes_session_fleet(Path(item.path)),
                                 item.get_closest_marker("kills_session_worker") is not None,
                                 item.path not in on_engine))


TIMELINE = os.environ.get("RLFLEET_TEST_TIMELINE")  # a file: one line per test, appended


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """With RLFLEET_TEST_TIMELINE=<file>: the test process, the test and its start and end
    (wall clock, set-up and teardown included), to see how the processes shared the run."""
    start = time.time()
    yield
    if TIMELINE:
        with open(TIMELINE, "a") as f:
            f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')} {start:.2f} "
                    f"{time.time():.2f} {item.nodeid}\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """Once the last of the session fleet's modules has ended (its module fixtures torn
    down), stop the servers only those modules use, instead of keeping ~11 GB and ~10
    processes to the end of the session. Only where the modules run together (one process
    or `--dist loadfile`); elsewhere at the end of the session."""
    global _unit_ended
    yield
    if (takes_session_fleet(Path(item.path))
            and (nextitem is None or not takes_session_fleet(Path(nextitem.path)))
            and getattr(item.config.option, "dist", "no") in ("no", "loadfile")):
        _unit_ended = True
        UNIT_SERVERS.close()
