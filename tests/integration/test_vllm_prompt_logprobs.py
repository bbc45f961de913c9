"""Prompt logprobs from a real vLLM worker reach the caller once, whole, wherever the
events are read together.

vLLM (0.32, DELTA outputs) sends a request's prompt logprobs in the output of its first
token and an empty list in every output after it. The worker must hand them out once: in
the first event with echo and stream (the worker moves them into the Head), else in the
Done. A Done with `[]` after the Head had them made the frontend replace the Head's list
with the empty one whenever it folded the Done before rendering the echo: a streamed
replay of a kept run (all its events at once), or a live stream on a loaded machine where
the last events arrive together (the flaky
test_differential_vllm::test_completions_streamed[echo_logprobs]).

The session's vLLM fleet serves these (no extra worker start)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.fleets import MODEL_NAME

pytestmark = pytest.mark.engine

PROMPT_IDS = [100, 200, 300, 400, 500, 600, 700]
TOL = 1e-4
# enough tokens that vLLM's engine answers in several outputs (a collector that lags merges
# outputs, so a short request could come as one)
TOKENS = 24


def _worker_events(url: str, rid: str, *, echo: bool, stream: bool) -> list[dict]:
    body = {"request_id": rid, "prompt_token_ids": PROMPT_IDS, "echo": echo, "stream": stream,
            "sampling": {"max_tokens": TOKENS, "ignore_eos": True, "temperature": 0,
                         "logprobs": 1, "prompt_logprobs": 2}}
    r = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return [json.loads(line) for line in r.text.splitlines() if line]


def _chosen(plps: list) -> list[float | None]:
    """The prompt token's logprob per position (position 0: None)."""
    assert len(plps) == len(PROMPT_IDS), plps
    return [None if e is None else e[str(t)]["logprob"] for t, e in zip(PROMPT_IDS, plps,
                                                                        strict=True)]


def _close(a: list[float | None], b: list[float | None]) -> None:
    assert len(a) == len(b), (a, b)
    assert a[0] is None and b[0] is None, (a, b)
    for x, y in zip(a[1:], b[1:], strict=True):
        assert x is not None and y is not None and abs(x - y) <= TOL, (a, b)


def test_a_worker_sends_prompt_logprobs_once_and_whole(vllm_fleet):
    url = vllm_fleet.workers[0].ready["url"]
    unary = _worker_events(url, "plp-unary", echo=False, stream=False)
    assert "done" in unary[-1] and unary[-1]["prompt_logprobs"], unary[-1]
    want = _chosen(unary[-1]["prompt_logprobs"])

    echoed = _worker_events(url, "plp-echo-stream", echo=True, stream=True)
    head, steps, done = echoed[0], echoed[1:-1], echoed[-1]
    assert len(steps) > 1, echoed  # several engine outputs: the case that went wrong
    _close(_chosen(head["prompt_logprobs"]), want)
    assert done["done"] is True and done["prompt_logprobs"] is None, done  # not again, not []
    assert not any("prompt_logprobs" in s for s in steps), steps

    streamed = _worker_events(url, "plp-stream", echo=False, stream=True)
    assert "prompt_logprobs" not in streamed[0], streamed[0]
    assert len(streamed) > 3, streamed
    _close(_chosen(streamed[-1]["prompt_logprobs"]), want)


def _echo_logprobs(url: str, headers: dict[str, str] | None = None, stream: bool = True
                   ) -> list[float | None]:
    """The prompt part of a completion's echoed token_logprobs."""
    body = {"model": MODEL_NAME, "prompt": PROMPT_IDS, "max_tokens": TOKENS, "ignore_eos": True,
            "temperature": 0, "echo": True, "logprobs": 2, "stream": stream}
    if not stream:
        r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["token_logprobs"][:len(PROMPT_IDS)]
    lps: list[float | None] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers,
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    lps += (c.get("logprobs") or {}).get("token_logprobs") or []
    return lps[:len(PROMPT_IDS)]


def test_a_replayed_streamed_echo_keeps_its_prompt_logprobs(vllm_fleet):
    """A retry with the X-Request-Id of a finished stream gets the kept run's events all at
    once (the Head, then every Step and the Done in one read): its echo must still carry the
    prompt logprobs, as the first answer and a unary one do."""
    want = _echo_logprobs(vllm_fleet.url, stream=False)
    assert want[0] is None and all(x is not None for x in want[1:]), want
    headers = {"X-Request-Id": "plp-replayed-echo"}
    _close(_echo_logprobs(vllm_fleet.url, headers), want)
    _close(_echo_logprobs(vllm_fleet.url, headers), want)  # the replay
