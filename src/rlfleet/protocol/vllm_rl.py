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
LORA_ROUTES = (LOAD_LORA_ADAPTER, UNLOAD_LORA_ADAPTER)

#: the weight-transfer steps, by route: what the engine is asked to do (EngineControl)
TRANSFER_STEPS = {INIT_WEIGHT_TRANSFER_ENGINE: "init", SHUTDOWN_WEIGHT_TRANSFER_ENGINE: "shutdown",
                  START_WEIGHT_UPDATE: "start", UPDATE_WEIGHTS: "update",
                  FINISH_WEIGHT_UPDATE: "finish"}
#: their replies, as vLLM words them
TRANSFER_MESSAGES = {"init": "Weight transfer initialized", "shutdown": "Weight transfer shut down",
                     "start": "Weight update started", "update": "Weights updated",
                     "finish": "Weight update finished"}
