"""RoutedExperts: the compact encoding (request plane) and vLLM's (.npy in base64)."""

from __future__ import annotations

import base64
import io

import msgspec
import numpy as np
import pytest

from rlfleet.protocol.engine import Delta, GenerateRequest, InvalidParam, RoutedExperts
from rlfleet.protocol.openai import CompletionRequest


def test_smallest_dtype_and_round_trips() -> None:
    arr = np.arange(24).reshape(4, 3, 2)
    r = RoutedExperts.of(arr, start=7)
    assert r.dtype == "uint8" and len(r.data) == 24 and r.shape == (4, 3, 2)
    assert RoutedExperts.of(arr * 1000).dtype == "uint16"
    back = RoutedExperts.from_npy_b64(r.to_npy_b64(), start=7)
    assert back == r and np.array_equal(back.array(), arr)
    d = Delta(index=0, token_ids=[1, 2, 3, 4], finish_reason="stop", routed_experts=r)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(d), type=Delta)
    assert wire.routed_experts == r  # raw bytes on the stream plane, not JSON lists


def test_bad_arrays_are_refused() -> None:
    with pytest.raises(ValueError, match="do not hold"):
        RoutedExperts(data=b"\x00" * 5, dtype="uint8", shape=(2, 1, 2))
    with pytest.raises(ValueError, match="not base64"):
        RoutedExperts.from_npy_b64("not-an-array")
    buf = io.BytesIO()
    np.save(buf, np.zeros((1, 1, 1), dtype=np.float32))
    with pytest.raises(ValueError, match="integer array"):
        RoutedExperts.from_npy_b64(base64.b64encode(buf.getvalue()).decode())


def test_concat_follows_positions() -> None:
    a = RoutedExperts.of(np.ones((3, 2, 2), dtype=np.int64), start=4)
    b = RoutedExperts.of(np.zeros((2, 2, 2), dtype=np.int64), start=7)
    ab = a.concat(b)
    assert ab.start == 4 and ab.tokens == 5
    with pytest.raises(ValueError, match="do not follow"):
        b.concat(a)


def test_what_the_openai_request_asks_the_engine() -> None:
    assert CompletionRequest(prompt=[1]).routed_experts_start is None
    asked = CompletionRequest(prompt=[1], nvext={"extra_fields": ["routed_experts"]})
    assert asked.routed_experts_start == -1  # one row per completion token
    assert CompletionRequest(prompt=[1], routed_experts_prompt_start=0).routed_experts_start == 0
    with pytest.raises(ValueError):
        CompletionRequest(prompt=[1], routed_experts_prompt_start=-2)
    with pytest.raises(InvalidParam):
        GenerateRequest(request_id="r", prompt_token_ids=[1], routed_experts_start=-5)
