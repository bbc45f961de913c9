"""Dynamo's LoRA management routes, as a Dynamo worker's system server serves them (with
`DYN_LORA_ENABLED=true`; Dynamo's `lib/runtime/src/system_status_server.rs`, handlers in
`components/src/dynamo/vllm/lora_handler.py`), and as every rlfleet worker that serves
adapters (--enable-lora) serves them at its system server's root, over the same handlers as
/engine/load_lora_adapter and /engine/unload_lora_adapter:

- ``POST /v1/loras`` ``{"lora_name", "source": {"uri"}}``: load (``file://`` URIs here);
  a name already loaded is left as it is unless ``DYN_LORA_HOTSWAP_ENABLED`` is true, then
  the new version replaces it;
- ``GET /v1/loras``: ``{"status": "success", "loras": {name: lora_id}, "count": n}``;
- ``DELETE /v1/loras/{lora_name}``: unload.

Every reply is Dynamo's `LoraResponse` (``status`` "success" or "error", then the fields it
has) with HTTP 200, an error included, as Dynamo answers; a body that is not JSON is HTTP
400, one without the fields HTTP 422. `lora_id` is Dynamo's id of the name
(`lora_name_to_id`). Structs and routes only: the ids, URIs and Dynamo's switches are
read by rlfleet.worker.dynamo_lora."""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from rlfleet.protocol.vllm_rl import NativeRoute

LORAS = NativeRoute("/v1/loras", "POST")  # load
LIST_LORAS = NativeRoute("/v1/loras", "GET", mutating=False)
UNLOAD_LORA = NativeRoute("/v1/loras/{lora_name:path}", "DELETE")
ROUTES = (LORAS, LIST_LORAS, UNLOAD_LORA)



class LoraSource(msgspec.Struct, forbid_unknown_fields=False):
    uri: str


class LoadLoraRequest(msgspec.Struct, forbid_unknown_fields=False):
    lora_name: str
    source: LoraSource


class LoraResponse(msgspec.Struct, omit_defaults=True):
    status: str
    message: str | UnsetType = UNSET
    lora_name: str | UnsetType = UNSET
    lora_id: int | UnsetType = UNSET
    loras: dict[str, int] | UnsetType = UNSET
    count: int | UnsetType = UNSET

    def body(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)
