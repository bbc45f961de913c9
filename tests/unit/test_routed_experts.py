"""RoutedExperts: the compact encoding (request plane) and vLLM's (.npy in base64)."""

from __future__ import annotations

import base64
import io

import msgspec
import numpy as np
import pytest

from rlfleet.protocol.engine import Delta, GenerateRequest, InvalidParam, RoutedExperts
from rlfleet.protocol.openai import CompletionRequest
from rlfleet.runtime.request_checks import check_request
from rlfleet.runtime.routed_experts import as_array, concat, from_array, from_npy_b64, to_npy_b64


def test_smallest_dtype_and_round_trips() -> None:
    arr = np.arange(24).reshape(4, 3, 2)
    r = from_array(arr, start=7)
    assert r.dtype == "uint8" and len(r.data) == 24 and r.shape == (4, 3, 2)
    assert from_array(arr * 1000).dtype == "uint16"
    back = from_npy_b64(to_npy_b64(r), start=7)
    assert back == r and np.array_equal(as_array(back), arr)
    d = Delta(index=0, token_ids=[1, 2, 3, 4], finish_reason="stop", routed_experts=r)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(d), type=Delta)
    assert wire.routed_experts == r  # raw bytes on the stream plane, not JSON lists


def test_bad_arrays_are_refused() -> None:
    with pytest.raises(ValueError, match="do not hold"):
        RoutedExperts(data=b"\x00" * 5, dtype="uint8", shape=(2, 1, 2))
    with pytest.raises(ValueError, match="not base64"):
        from_npy_b64("not-an-array")
    buf = io.BytesIO()
    np.save(buf, np.zeros((1, 1, 1), dtype=np.float32))
    with pytest.raises(ValueError, match="integer array"):
        from_npy_b64(base64.b64encode(buf.getvalue()).decode())


def test_concat_follows_positions() -> None:
    a = from_array(np.ones((3, 2, 2), dtype=np.int64), start=4)
    b = from_array(np.zeros((2, 2, 2), dtype=np.int64), start=7)
    ab = concat(a, b)
    assert ab.start == 4 and ab.tokens == 5
    with pytest.raises(ValueError, match="do not follow"):
        concat(b, a)


def test_what_the_openai_request_asks_the_engine() -> None:
    assert CompletionRequest(prompt=[1]).routed_experts_start is None
    asked = CompletionRequest(prompt=[1], nvext={"extra_fields": ["routed_experts"]})
    assert asked.routed_experts_start == -1  # one row per completion token
    assert CompletionRequest(prompt=[1], routed_experts_prompt_start=0).routed_experts_start == 0
    with pytest.raises(ValueError):
        CompletionRequest(prompt=[1], routed_experts_prompt_start=-2)
    with pytest.raises(InvalidParam):
        check_request(GenerateRequest(request_id="r", prompt_token_ids=[1], routed_experts_start=-5))
