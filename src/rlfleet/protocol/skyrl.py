"""SkyRL 0.4's own server routes (its `VLLMServerActor`, skyrl/backends/skyrl_train/
inference_servers/), as rlfleet answers them: `/skyrl/v1/generate` (the frontend: vLLM's
`/inference/v1/generate` with its side channels packed, `generate_wire.py`) and
`/fetch_weights` (each worker, and the one URL: refused by name, `FETCH_WEIGHTS_REFUSED`).
Data only."""

from __future__ import annotations

from typing import Any

GENERATE_PATH = "/skyrl/v1/generate"
FETCH_WEIGHTS_PATH = "/fetch_weights"

#: a packed array (generate_wire.PackedArrayKey): `data` first (SkyRL's reader scans for it)
ENVELOPE_KEYS = ("data", "shape", "dtype")

#: the canonical dtype of routed expert IDs by the largest ID (SkyRL's
#: compact_routed_expert_indices: its reader refuses any other)
ROUTED_EXPERT_DTYPES = (((1 << 8) - 1, "uint8"), ((1 << 15) - 1, "int16"),
                        ((1 << 31) - 1, "int32"))

SAMPLE_SUPPORT_REFUSED = ("return_sample_support: the sampler's per-token support set (SkyRL's "
                          "vLLM sampler extension) is not recorded by rlfleet's workers; "
                          "leave it out (or false)")
STREAM_REFUSED = ("stream: /skyrl/v1/generate answers whole (its packed side channels are one "
                  "body); stream with /inference/v1/generate")

FETCH_WEIGHTS_REFUSED = (
    "fetch_weights applies a checkpoint delta in SkyRL's own format (its delta weight-transfer "
    "engine: manifest.json and compressed payloads), which an rlfleet worker does not read. "
    "Stage the checkpoint while serving instead: POST {admin}/engine/stage_weights "
    '{"version": V, "source": {"kind": "disk", "path": DIR}} (or "s3"; an XOR delta that '
    "`rlfleet publish --base` wrote), then pause and apply it (/engine/apply_staged_weights, "
    "or the whole of it in one call: /engine/commit_policy); or, without staging, reload a "
    'checkpoint while paused: POST /collective_rpc {"method": "reload_weights", "kwargs": '
    '{"weights_path": DIR}}')


def routed_expert_dtype(top: int) -> str:
    """The dtype SkyRL's reader takes for routed expert IDs up to `top`."""
    for limit, name in ROUTED_EXPERT_DTYPES:
        if top <= limit:
            return name
    raise ValueError(f"routed expert index exceeds signed int32: {top}")


def envelope(data: str, shape: list[int], dtype: str) -> dict[str, Any]:
    """A packed array: base64 `data` of a C-order array, its `shape` and `dtype`."""
    return dict(zip(ENVELOPE_KEYS, (data, shape, dtype), strict=True))
