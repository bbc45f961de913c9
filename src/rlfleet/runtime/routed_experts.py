"""The numpy side of `RoutedExperts` (rlfleet.protocol.engine): the expert IDs as an array,
a struct from an array (in the smallest dtype that holds it), vLLM's encoding (base64 of
the array's .npy bytes) both ways, and two runs of rows joined."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np

from rlfleet.protocol.engine import RoutedExperts


def as_array(r: RoutedExperts) -> Any:
    """As a numpy array (tokens, layers, top-k)."""
    return np.frombuffer(r.data, dtype=np.dtype(r.dtype).newbyteorder("<")).reshape(r.shape)


def from_array(arr: Any, start: int = 0) -> RoutedExperts:
    """From a numpy array of expert IDs (tokens, layers, top-k), in the smallest dtype
    that holds them."""
    top = int(arr.max()) if arr.size else 0
    dtype = "uint8" if top < 1 << 8 else "uint16" if top < 1 << 16 else "int32"
    a = np.ascontiguousarray(arr, dtype=np.dtype(dtype).newbyteorder("<"))
    return RoutedExperts(data=a.tobytes(), dtype=dtype, shape=tuple(a.shape), start=start)


def to_npy_b64(r: RoutedExperts) -> str:
    """vLLM's encoding: base64 of the .npy file of the array."""
    buf = io.BytesIO()
    np.save(buf, as_array(r), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def from_npy_b64(s: str, start: int = 0) -> RoutedExperts:
    """The inverse of to_npy_b64; ValueError if `s` is not such an array."""
    try:
        arr = np.load(io.BytesIO(base64.b64decode(s, validate=True)), allow_pickle=False)
    except Exception as e:
        raise ValueError(f"routed_experts is not base64 of a .npy array: {e}") from e
    if arr.ndim != 3 or arr.dtype.kind not in "iu":
        raise ValueError(f"routed_experts must be an integer array (tokens, layers, "
                         f"top-k), got {arr.dtype} of shape {arr.shape}")
    return from_array(arr, start)


def concat(r: RoutedExperts, other: RoutedExperts) -> RoutedExperts:
    """`other`'s rows after `r`'s (it must start where they end, same layers, top-k)."""
    if other.start != r.start + r.tokens or other.shape[1:] != r.shape[1:]:
        raise ValueError(f"routed experts from position {other.start} {other.shape} do not "
                         f"follow {r.tokens} rows from {r.start} {r.shape}")
    return from_array(np.concatenate([as_array(r), as_array(other)]), r.start)
