"""How the vLLM engine gathers one request's prompt logprobs from vLLM's outputs (vLLM's
own Logprob entries; no engine started): once whole, handed out once."""

from __future__ import annotations

import pytest
from vllm.logprobs import Logprob

from rlfleet.protocol.engine import PromptLogprob
from rlfleet.vllm.engine import _PromptLogprobs

IDS = [5, 6, 7]


def entry(tid: int, lp: float) -> dict:
    return {tid: Logprob(logprob=lp, rank=1, decoded_token=f"t{tid}")}


def test_delta_outputs_give_them_once_then_empty_lists_add_nothing():
    p = _PromptLogprobs(IDS)
    p.add([None, entry(6, -1.0), entry(7, -2.0)])  # the first token's output
    p.add([])  # every output after it (vLLM's DELTA)
    got = p.take()
    assert got == [None, {"6": PromptLogprob(logprob=-1.0, rank=1, decoded_token="t6")},
                   {"7": PromptLogprob(logprob=-2.0, rank=1, decoded_token="t7")}]
    assert p.take() is None  # the Done after the first event carries none (not [])


def test_parts_over_several_outputs_are_joined_and_ready_only_when_whole():
    p = _PromptLogprobs(IDS)
    p.add([None, entry(6, -1.0)])
    assert p.ready is None and p.take() is None
    p.add([entry(7, -2.0)])
    assert [None if e is None else e[str(t)].logprob for t, e in zip(IDS, p.take(),
                                                                         strict=True)] \
        == [None, -1.0, -2.0]


def test_none_asked_none_given_and_too_many_is_an_error():
    p = _PromptLogprobs(IDS)
    p.add(None)
    assert p.take() is None
    p = _PromptLogprobs(IDS)
    with pytest.raises(RuntimeError, match="4 prompt logprobs for a prompt of 3"):
        p.add([None, entry(6, -1.0), entry(7, -2.0), entry(8, -3.0)])
