"""prime-rl's weight updates, call by call as its clients make them, against a mocker worker
and a vLLM worker (one of the session fleet's, tests/conftest.py; the fleet is refreshed back
to the session's model afterwards): each filesystem update moves the worker to the new checkpoint (its digest)
and label, get_weight_version answers `weight_version`, the flat /engine/is_paused answers,
and the calls of prime-rl's NCCL path that an rlfleet worker cannot run are refused by name.

The sequences and bodies are pinned here from prime-rl's source (github.com/PrimeIntellect-ai/
prime-rl), read at these commits (nothing is fetched at run time):
- PR #2773, head 3c41ee3a1bc6ffa138bbeb0cc5cea8932cc96feb, src/prime_rl/utils/client.py
  (DynamoAdminAPI: `_post_engine` to `/engine/<method>`, the answer refused on an HTTP error
  or `"status": "error"`; `update_weights` for the filesystem broadcast: pause_generation,
  update_weights_from_disk with `engine_rpc` (default reload_weights) and the directory's
  name as `weight_version`, resume_generation);
- commit 7c1a61d1b35e9fd553497e7efa1baea14c181aa2 (in PRs #2964, #2965, #3071),
  src/prime_rl/inference/dynamo_admin.py (DynamoAdminAPI: an answer is accepted only with
  `"status": "ok"`; `update_weights`: pause, the NCCL_READY marker touched in the directory,
  update_weights_from_disk with `engine_rpc` update_weights_from_path and `str(step)`, resume
  in a `finally`; `initialize_nccl`: init_weights_update_group with `engine_rpc`
  init_broadcaster, then update_weights_from_distributed with `weight_dir`);
- PR #3176, head 828ddc7dab61cb6cc985273afca13278b953a893, src/prime_rl/utils/dynamo.py
  (DynamoInferencePool: the workers' `admin_base_url` as admin clients) over
  src/prime_rl/utils/client.py `update_weights` (`/pause?mode=keep&clear_cache=false`, the
  marker, `/update_weights {"weight_dir"}`, `/resume`, HTTP errors refused);
- PR #3296, head 73164c32295c49eafc7d7668b3613064a92ef630, src/prime_rl/utils/dynamo.py
  (DynamoInferencePool.update_weights, filesystem: control/pause_generation,
  control/is_paused, `{admin_base_url}/collective_rpc` reload_weights,
  update/update_weight_version, control/get_weight_version polled until it answers the
  step, control/resume_generation).
A worker's system_url is its admin_base_url (rlfleet serves both surfaces on one server)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from rlfleet.mocker.engine import write_mock_checkpoint
from rlfleet.weights.digest import checkpoint_digest
from tests.fleets import local_fleet, refresh_back

NCCL_READY_MARKER = "NCCL_READY"  # prime-rl's marker (prime_rl/utils/client.py)
TIMEOUT = 300.0  # prime-rl's wait_for_ready_timeout stands in for its weight-update timeout

# ---------------------------------------------------------------- the pinned calls

# placeholders in a body, filled per update: the checkpoint directory (resolved), its name,
# the policy step
DIR, NAME, STEP = "$DIR", "$NAME", "$STEP"


@dataclass(frozen=True)
class Call:
    """One call of a client. `accept`: how that client judges the answer: "dynamo" (HTTP
    2xx and no `"status": "error"`), "ok" (HTTP 2xx and `"status": "ok"`), "http" (HTTP 2xx);
    "poll_version": repeated until `weight_version` is the step (#3296's loop);
    "all_paused": `is_paused` must be true (#3296). `touch`: prime-rl writes its NCCL_READY
    marker into the directory instead of calling."""

    path: str = ""
    body: dict[str, Any] | None = field(default=None)
    params: dict[str, str] | None = None
    accept: str = "dynamo"
    touch: bool = False


KEEP = {"mode": "keep", "clear_cache": False}
MARKER = Call(touch=True)

FLOWS: dict[str, tuple[list[Call], str | None]] = {
    # flow: its calls, and the label the worker reports after (None: the label before)
    "pr2773-dynamo-admin-api": ([
        Call("/engine/pause_generation", KEEP),
        Call("/engine/update_weights_from_disk",
             {"model_path": DIR, "weight_version": NAME, "engine_rpc": "reload_weights"}),
        Call("/engine/resume_generation", {}),
    ], NAME),
    "7c1a61d-dynamo-admin-filesystem": ([
        Call("/engine/pause_generation", KEEP, accept="ok"),
        MARKER,
        Call("/engine/update_weights_from_disk",
             {"model_path": DIR, "weight_version": STEP,
              "engine_rpc": "update_weights_from_path"}, accept="ok"),
        Call("/engine/resume_generation", {}, accept="ok"),
    ], STEP),
    "pr3176-pool-admin-base-url": ([
        Call("/pause", None, {"mode": "keep", "clear_cache": "false"}, accept="http"),
        MARKER,
        Call("/update_weights", {"weight_dir": DIR}, accept="http"),
        Call("/resume", None, accept="http"),
    ], None),
    "pr3296-pool-filesystem": ([
        Call("/engine/control/pause_generation", KEEP),
        Call("/engine/control/is_paused", {}, accept="all_paused"),
        Call("/collective_rpc", {"method": "reload_weights", "timeout": TIMEOUT, "args": [],
                                 "kwargs": {"weights_path": DIR}}),
        Call("/engine/update/update_weight_version", {"new_version": STEP}),
        Call("/engine/control/get_weight_version", {}, accept="poll_version"),
        Call("/engine/control/resume_generation", {}),
    ], STEP),
}

# prime-rl's NCCL path (7c1a61d's DynamoAdminAPI.initialize_nccl and update_weights):
# prime-rl's own broadcast receiver, which an rlfleet worker does not run
NCCL_CALLS = [
    Call("/engine/init_weights_update_group",
         {"host": "127.0.0.1", "port": 29511, "rank_offset": 0, "inference_world_size": 1,
          "timeout": 60, "quantize_in_weight_transfer": False, "engine_rpc": "init_broadcaster"},
         accept="ok"),
    Call("/engine/update_weights_from_distributed",
         {"weight_version": STEP, "weight_dir": DIR, "engine_rpc": "update_weights_from_path"},
         accept="ok"),
]


class Refused(Exception):
    def __init__(self, call: Call, resp: httpx.Response) -> None:
        super().__init__(f"{call.path}: HTTP {resp.status_code} {resp.text}")
        self.status = resp.status_code
        self.body = resp.json()


def filled(x: Any, ckpt: Path, step: int) -> Any:
    subst = {DIR: ckpt.resolve().as_posix(), NAME: ckpt.name, STEP: str(step)}
    if isinstance(x, dict):
        return {k: filled(v, ckpt, step) for k, v in x.items()}
    return subst.get(x, x) if isinstance(x, str) else x


def run(http: httpx.Client, calls: list[Call], ckpt: Path, step: int) -> None:
    """The calls, judged as the client judges them (Refused where it would raise)."""
    for call in calls:
        if call.touch:
            (ckpt / NCCL_READY_MARKER).touch()
            continue
        deadline = time.monotonic() + TIMEOUT
        while True:
            resp = http.post(call.path, json=filled(call.body, ckpt, step), params=call.params)
            payload = resp.json()
            if not resp.is_success or not isinstance(payload, dict):
                raise Refused(call, resp)
            if (call.accept == "ok" and payload.get("status") != "ok") or \
                    (call.accept in ("dynamo", "all_paused", "poll_version")
                     and payload.get("status") == "error") or \
                    (call.accept == "all_paused" and payload.get("is_paused") is not True):
                raise Refused(call, resp)
            if call.accept != "poll_version" or payload.get("weight_version") == str(step):
                break
            assert time.monotonic() < deadline, f"the worker never answered step {step}"
            time.sleep(0.1)


# ---------------------------------------------------------------- the workers


@dataclass
class Target:
    url: str  # the worker's system_url: its admin_base_url too
    checkpoint: Callable[[int], Path]  # the policy of step n, in a directory step_<n>
    digest: Callable[[Path], str]


@pytest.fixture(scope="module", params=["mocker", pytest.param("vllm", marks=pytest.mark.engine)])
def target(request, tmp_path_factory) -> Iterator[Target]:
    root = tmp_path_factory.mktemp("prime-rl-weights")
    if request.param == "mocker":
        args = ("--served-model-name", "mock-prime", "--system-port", "0",
                "--allowed-weights-root", str(root), "--token-delay", "0.002")
        with local_fleet(tmp_path_factory.mktemp("prime-rl-mocker"), [args], kind="mocker",
                         frontend=None) as fleet:
            yield Target(fleet.workers[0].ready["system_url"],
                         lambda n: write_mock_checkpoint(root / f"step_{n}", n),
                         lambda ckpt: f"mock:{int(ckpt.name.removeprefix('step_'))}")
        return
    tiny, tiny_b = (request.getfixturevalue(f) for f in ("tiny_model", "tiny_model_b"))
    fleet = request.getfixturevalue("vllm_fleet")

    def checkpoint(n: int) -> Path:  # the two policies in turn, as a trainer's steps
        return Path(shutil.copytree(tiny_b if n % 2 else tiny, root / f"step_{n}"))

    yield Target(fleet.workers[0].ready["system_url"], checkpoint, checkpoint_digest)
    refresh_back(fleet, tiny, tmp_path_factory.mktemp("prime-rl-back") / "j.sqlite")


def identity(url: str) -> dict[str, Any]:
    said = httpx.post(f"{url}/engine/get_weight_version", json={}, timeout=30).json()
    assert said["status"] == "ok", said
    return said


def test_prime_rls_filesystem_updates_move_the_worker(target: Target) -> None:
    with httpx.Client(base_url=target.url, timeout=TIMEOUT) as http:
        for step, (name, (calls, label)) in enumerate(FLOWS.items(), start=1):
            before = identity(target.url)
            ckpt = target.checkpoint(step)
            run(http, calls, ckpt, step)
            said = identity(target.url)
            want = before["weight_version"] if label is None else filled(label, ckpt, step)
            assert said["weight_version"] == said["version"] == want, (name, said)
            assert said["weight_digest"] == target.digest(ckpt) != before["weight_digest"], \
                (name, said)
            assert http.post("/engine/is_paused", json={}).json() == \
                {"status": "ok", "is_paused": False}, name
            probe = http.post("/engine/liveness_probe", json={}).json()
            assert probe["status"] == "ok" and "self_check" not in probe, (name, probe)


def test_flat_is_paused_follows_the_pause(target: Target) -> None:
    with httpx.Client(base_url=target.url, timeout=60) as http:
        assert http.post("/engine/is_paused").json()["is_paused"] is False
        http.post("/engine/pause_generation", json=KEEP)
        try:
            assert http.post("/engine/is_paused", json={}).json() == \
                {"status": "ok", "is_paused": True}
            assert http.post("/engine/control/is_paused").json()["is_paused"] is True
        finally:
            http.post("/engine/resume_generation", json={})
        assert http.post("/engine/is_paused").json()["is_paused"] is False


def test_prime_rls_nccl_path_is_refused_by_name(target: Target) -> None:
    """What prime-rl's client would raise on: HTTP 400, naming the method; the worker keeps
    its weights."""
    before = identity(target.url)
    ckpt = target.checkpoint(99)
    with httpx.Client(base_url=target.url, timeout=60) as http:
        http.post("/engine/pause_generation", json=KEEP)
        try:
            for call, words in zip(NCCL_CALLS, ("'init_broadcaster'", "NCCL receive"),
                                   strict=True):
                with pytest.raises(Refused) as refused:
                    run(http, [call], ckpt, 99)
                assert refused.value.status == 400, refused.value
                assert words in refused.value.body["message"], refused.value
        finally:
            http.post("/engine/resume_generation", json={})
    after = identity(target.url)
    assert (after["weight_digest"], after["weight_version"]) == \
        (before["weight_digest"], before["weight_version"])
