"""vLLM 0.32's native RL routes (`vllm/entrypoints/rl/online/api_router.py` and
`entrypoints/serve/dev/rpc/api_router.py`, served by `VLLM_SERVER_DEV_MODE=1 vllm serve`), as
every rlfleet worker serves them at its `admin_base_url` (its system server): the paths,
their methods, which ones change the worker, and the shapes of their replies. vLLM's own
client for them is `vllm.distributed.weight_transfer.clients.HTTPVLLMWeightSyncClient`.

Bodies are vLLM's: a route's fields are embedded in a JSON object (`{"init_info": {...}}`,
`{"new_version": "v2"}`); a body that does not fit is FastAPI's HTTP 422 `{"detail": [...]}`,
a refused call `{"error": "..."}` (or `{"detail": "..."}` where vLLM raises) with a 4xx."""

from __future__ import annotations

import dataclasses
from typing import Literal

#: how /pause treats requests in flight (vLLM's PauseMode); vLLM's default is abort
PauseMode = Literal["abort", "wait", "keep"]

#: the only collective_rpc method an rlfleet worker runs: a reload from disk, through the
#: checks of update_weights_from_disk (digest, self-check, hold)
RELOAD_WEIGHTS = "reload_weights"
RELOAD_KWARGS = ("weights_path", "is_checkpoint_format")
#: prime-rl's worker-extension method (`FileSystemWeightUpdateWorker.update_weights_from_path`
#: in prime_rl/inference/vllm/worker/filesystem.py): a load of the checkpoint at `weight_path`
UPDATE_WEIGHTS_FROM_PATH = "update_weights_from_path"
#: the engine methods Dynamo's `engine_rpc` field may name (its vLLM handlers run
#: `collective_rpc(engine_rpc, kwargs=...)`) that an rlfleet worker runs, each as a load from
#: disk through update_weights_from_disk's checks, with the keyword that names the directory
#: (Dynamo's disk handler: `weights_path` for reload_weights, else `weight_path`)
DISK_ENGINE_RPCS = {RELOAD_WEIGHTS: "weights_path", UPDATE_WEIGHTS_FROM_PATH: "weight_path"}
#: vLLM's weight-transfer methods as Dynamo's `engine_rpc` names them (NeMo RL's Dynamo refit
#: sends them to init_weights_update_group and update_weights_from_distributed), by the step
#: of rlfleet.worker.weight_transfer each one runs
TRANSFER_ENGINE_RPCS = {"init_weight_transfer_engine": "init", "start_weight_update": "start",
                        "update_weights": "update", "finish_weight_update": "finish",
                        "shutdown_weight_transfer_engine": "shutdown"}

#: what an unversioned engine reports as its weight version (vLLM's EngineCore default)
DEFAULT_WEIGHT_VERSION = "default"

#: the weight-transfer backend discovery names for an engine that has none (the mocker: its
#: weight-transfer steps are refused; a client that needs a backend refuses it at discovery)
NO_TRANSFER_BACKEND = "none"

#: the error a mutating native call gets (HTTP 409) while an rlfleet refresh holds the worker
REFRESH_HOLDS = "Refresh in progress"


@dataclasses.dataclass(frozen=True)
class NativeRoute:
    path: str  # at the root of the worker's admin_base_url
    method: Literal["GET", "POST", "DELETE"]
    mutating: bool = True  # needs the admin token; refused while a refresh holds the worker


PAUSE = NativeRoute("/pause", "POST")
RESUME = NativeRoute("/resume", "POST")
IS_PAUSED = NativeRoute("/is_paused", "GET", mutating=False)
ABORT_REQUESTS = NativeRoute("/abort_requests", "POST")
INIT_WEIGHT_TRANSFER_ENGINE = NativeRoute("/init_weight_transfer_engine", "POST")
SHUTDOWN_WEIGHT_TRANSFER_ENGINE = NativeRoute("/shutdown_weight_transfer_engine", "POST")
START_WEIGHT_UPDATE = NativeRoute("/start_weight_update", "POST")
UPDATE_WEIGHTS = NativeRoute("/update_weights", "POST")
FINISH_WEIGHT_UPDATE = NativeRoute("/finish_weight_update", "POST")
UPDATE_WEIGHT_VERSION = NativeRoute("/update_weight_version", "POST")
WEIGHT_INFO = NativeRoute("/weight_info", "GET", mutating=False)
GET_WORLD_SIZE = NativeRoute("/get_world_size", "GET", mutating=False)
COLLECTIVE_RPC = NativeRoute("/collective_rpc", "POST")

ROUTES = (PAUSE, RESUME, IS_PAUSED, ABORT_REQUESTS, INIT_WEIGHT_TRANSFER_ENGINE,
          SHUTDOWN_WEIGHT_TRANSFER_ENGINE, START_WEIGHT_UPDATE, UPDATE_WEIGHTS,
          FINISH_WEIGHT_UPDATE, UPDATE_WEIGHT_VERSION, WEIGHT_INFO, GET_WORLD_SIZE,
          COLLECTIVE_RPC)

# vLLM's runtime LoRA routes (`VLLM_ALLOW_RUNTIME_LORA_UPDATING`): {lora_name, lora_path}
# and {lora_name}; a plain-text success, vLLM's ErrorResponse (400, 404) otherwise
LOAD_LORA_ADAPTER = NativeRoute("/v1/load_lora_adapter", "POST")
UNLOAD_LORA_ADAPTER = NativeRoute("/v1/unload_lora_adapter", "POST")

# vLLM's dev-mode cache and sleep routes (`entrypoints/serve/dev/cache/api_router.py`,
# `entrypoints/serve/dev/sleep/api_router.py`). On vLLM's CPU build sleep mode is not
# available (`--enable-sleep-mode` is refused at start; `CPUWorker.sleep` and `wake_up` log
# "sleep mode is not supported on CPU, ignore it."): /sleep pauses the scheduler and marks
# the executor asleep while the weights and KV cache stay resident, /wake_up clears the mark
# and resumes; an rlfleet worker answers so on every build.
RESET_PREFIX_CACHE = NativeRoute("/reset_prefix_cache", "POST")
SLEEP = NativeRoute("/sleep", "POST")
WAKE_UP = NativeRoute("/wake_up", "POST")
IS_SLEEPING = NativeRoute("/is_sleeping", "GET", mutating=False)
#: the memory pools vLLM's executor puts to sleep at level >= 1 (vllm/v1/executor/abstract.py)
SLEEP_TAGS = frozenset(("weights", "kv_cache"))
#: the wake_up tag that only resumes scheduling (a level-0 sleep)
SCHEDULING_TAG = "scheduling"
#: what the CPU build logs for sleep and wake_up (its worker ignores both)
SLEEP_UNSUPPORTED = "sleep mode is not supported on CPU, ignore it."

# prime-rl's own server routes (prime_rl/inference/vllm/server.py) where they do not collide
# with vLLM's: `POST /update_weights {"weight_dir"}` (vLLM's route of that path takes
# `update_info`; the body tells them apart) runs `update_weights_from_path` and answers
# `{"status": "ok"}`; `GET /liveness` answers `{"status": "ok"}`; `POST /init_broadcaster`
# starts prime-rl's own NCCL receiver, which an rlfleet worker does not run (HTTP 400).
PRIME_RL_LIVENESS = NativeRoute("/liveness", "GET", mutating=False)
PRIME_RL_INIT_BROADCASTER = NativeRoute("/init_broadcaster", "POST")
#: ... and, on a worker started with LoRA, its `/load_lora_adapter` (vLLM's body, always in
#: place, `{"status": "ok"}`; vLLM's own is /v1/load_lora_adapter)
PRIME_RL_LOAD_LORA_ADAPTER = NativeRoute("/load_lora_adapter", "POST")

# SkyRL 0.3's own server route (skyrl/backends/skyrl_train/inference_servers/
# vllm_server_actor.py), on a worker started with LoRA: `{"lora_name", "lora_path"}` (both
# required), vLLM's load with `load_inplace=True`; `{"status": "ok", "lora_name"}` (SkyRL's
# RemoteInferenceClient reads a 2xx body as text, a 4xx's JSON `error.message`)
SKYRL_LOAD_LORA_ADAPTER = NativeRoute("/skyrl/v1/load_lora_adapter", "POST")
SKYRL_LOAD_FIELDS = ("lora_name", "lora_path")

# vLLM's newest dev-mode RL routes (vllm/entrypoints/serve/dev/rlhf/api_router.py): a draft
# model's weight update (speculative decoding; an rlfleet worker serves none) and the weight
# checker (`{"action": "checksum" | "reset" | "compare", "baseline", "checksums"}`,
# rlfleet.protocol.vllm_rl.WEIGHT_CHECKER_ACTIONS; weight_checker.py)
START_DRAFT_WEIGHT_UPDATE = NativeRoute("/start_draft_weight_update", "POST")
# reads the weights only here (its `reset` is refused): not held back by a refresh
WEIGHT_CHECKER = NativeRoute("/weight_checker", "POST", mutating=False)
WEIGHT_CHECKER_ACTIONS = ("checksum", "reset", "compare")
DRAFT_REFUSED = ("start_draft_weight_update updates a speculative-decoding draft model's "
                 "weights, and this worker serves none (no --speculative-config): update the "
                 "model's own weights with start_weight_update, update_weights and "
                 "finish_weight_update")

# SkyRL 0.4's own route on its vLLM server (its checkpoint-delta backend), refused by name
# with what to call instead (rlfleet.protocol.skyrl.FETCH_WEIGHTS_REFUSED)
SKYRL_FETCH_WEIGHTS = NativeRoute("/fetch_weights", "POST")

#: vLLM's RL state machine (rl_state_machine.py): a step that would break the order of a
#: weight update (start, update*, finish) is refused with HTTP 409 `{"detail"}` before it
#: runs, by whether an update is open
_ORDER = {
    "start": (True, "start_weight_update called while a weight update is already in "
                    "progress.  Call POST /finish_weight_update first."),
    "update": (False, "update_weights requires a preceding start_weight_update. Call POST "
                      "/start_weight_update first."),
    "finish": (False, "finish_weight_update called without a preceding start_weight_update. "
                      "Call POST /start_weight_update first."),
}


def out_of_order(step: str, updating: bool) -> str | None:
    """Why vLLM's RL state machine refuses `step` (HTTP 409) while an update is, or is
    not, open (`updating`); None: in order (init and shutdown are not ordered by it)."""
    refused_when, why = _ORDER.get(step, (None, ""))
    return why if refused_when is updating else None


#: the weight-transfer steps, by route: what the engine is asked to do (EngineControl)
TRANSFER_STEPS = {INIT_WEIGHT_TRANSFER_ENGINE: "init", SHUTDOWN_WEIGHT_TRANSFER_ENGINE: "shutdown",
                  START_WEIGHT_UPDATE: "start", UPDATE_WEIGHTS: "update",
                  FINISH_WEIGHT_UPDATE: "finish"}
#: their replies, as vLLM words them
TRANSFER_MESSAGES = {"init": "Weight transfer initialized", "shutdown": "Weight transfer shut down",
                     "start": "Weight update started", "update": "Weights updated",
                     "finish": "Weight update finished"}
