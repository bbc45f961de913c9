"""The post-update probe's judgement (rlfleet.refresh.probe) and the coordinator's transfer
settings, without a fleet."""

from __future__ import annotations

import pytest

from rlfleet.refresh.control import address_toward
from rlfleet.refresh.coordinator import PolicyRefresh
from rlfleet.refresh.probe import (
    DEFAULT_TOLERANCE,
    Answer,
    Probe,
    check_expected,
    disagreement,
    tolerance,
)


def answer(worker: int, tokens: list[int], lps: list[float] | None = None,
           tol: float = 1e-3, prompt: list[int] = (5, 6)) -> Answer:
    lps = lps or [-1.0] * len(tokens)
    return Answer(worker, list(prompt), [(t, 1, lp) for t, lp in zip(tokens, lps, strict=True)],
                  tol)


def test_tolerance_follows_the_serving_dtype_and_can_be_set() -> None:
    assert tolerance("float32") == 1e-3
    assert tolerance("bfloat16") == 5e-2 and tolerance("torch.bfloat16") == 5e-2
    assert tolerance("float16") == 2e-2
    assert tolerance(None) == tolerance("int8") == DEFAULT_TOLERANCE
    assert tolerance("bfloat16", 1e-4) == 1e-4


def test_expected_probe_names_the_token() -> None:
    p = Probe([1, 2], [7, 8, 9], [-0.5, -0.25, -1.0])
    assert check_expected(answer(1, [7, 8, 9], [-0.5, -0.25, -1.0]), p) is None
    assert check_expected(answer(1, [7, 8, 9], [-0.5, -0.2, -1.0], tol=0.1), p) is None
    why = check_expected(answer(1, [7, 8, 9], [-0.5, -0.2, -1.0]), p)
    assert "max logprob diff 5.00e-02 > 0.001 (token 1: 8)" in why
    why = check_expected(answer(1, [7, 4, 9]), p)
    assert "token 1 is 4 (rank 1), expected 8" in why
    assert "does not reproduce" in check_expected(answer(1, [7, 8]), p)


def test_agreeing_workers_pass() -> None:
    assert disagreement([answer(1, [3, 4])]) is None
    assert disagreement([answer(1, [3, 4], [-1.0, -2.0]),
                         answer(2, [3, 4], [-1.0004, -2.0])]) is None


def test_disagreement_names_the_odd_worker_and_the_token() -> None:
    why = disagreement([answer(1, [3, 4, 5]), answer(2, [3, 4, 5]), answer(3, [3, 9, 5])])
    assert why == ("workers disagree on the post-update probe: worker 3 puts token 9 first at "
                   "position 1 where worker 1 puts 4")
    # two workers, two answers: each is named against the other (the lower ID is the reference)
    assert "worker 2 puts token 8 first at position 0 where worker 1 puts 3" in \
        disagreement([answer(2, [8]), answer(1, [3])])
    why = disagreement([answer(1, [3, 4], [-1.0, -2.0]), answer(2, [3, 4], [-1.0, -2.5])])
    assert "worker 2 gives token 4 at position 1 logprob -2.500000, worker 1 -2.000000" in why
    why = disagreement([answer(1, [3]), answer(2, [3], prompt=(5, 7))])
    assert "worker 2 tokenised the probe prompt as [5, 7]" in why


def test_transfer_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="transfer backend must be gloo or nccl"):
        PolicyRefresh("http://127.0.0.1:1", path="vllm-distributed", transfer_backend="mpi")
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="nccl needs a CUDA device on the coordinator"):
            PolicyRefresh("http://127.0.0.1:1", path="vllm-distributed",
                          transfer_backend="nccl")
    assert address_toward("http://127.0.0.1:8081") == "127.0.0.1"


def test_refresh_config_is_checked_in_one_place_and_read_from_the_cli() -> None:
    import dataclasses

    from rlfleet.cli import build_parser
    from rlfleet.refresh.config import OnFailure, PauseMode, RefreshConfig, RefreshMode, UpdatePath

    args = build_parser().parse_args(
        ["refresh", "--checkpoint", "/tmp/c", "--version", "v", "--rl-url", "http://x:1",
         "--mode", "rolling", "--max-lag", "2", "--wave-size", "1", "--pause-mode", "keep",
         "--journal", ":memory:"])
    c = RefreshConfig.from_args(args)
    assert (c.rl_url, c.mode, c.max_lag, c.wave_size, c.pause_mode, c.path) == (
        "http://x:1", RefreshMode.ROLLING, 2, 1, PauseMode.KEEP, UpdatePath.VLLM_STAGED)
    assert c.probe_after_reopen  # rlfleet refresh: stage first, probe after the reopen
    assert c.on_failure is OnFailure.HOLD and c.journal == ":memory:"
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.max_lag = 3  # type: ignore[misc]
    assert c.replace(min_serving=2).min_serving == 2
    with pytest.raises(ValueError, match="does not roll back"):
        c.replace(on_failure="rollback")
    with pytest.raises(ValueError, match="pause_mode must be one of keep, wait, abort"):
        RefreshConfig(rl_url="http://x:1", pause_mode="drain")
    with pytest.raises(ValueError, match="need rl_url"):
        RefreshConfig()
    with pytest.raises(ValueError, match="min_serving must be at least 1"):
        RefreshConfig(rl_url="http://x:1", min_serving=0)
    # PolicyRefresh takes a config, or RefreshConfig's fields as keywords (the same thing)
    for r in (PolicyRefresh(config=c),
              PolicyRefresh("http://x:1", mode="rolling", max_lag=2, wave_size=1,
                            pause_mode="keep", path="vllm-staged", probe_after_reopen=True)):
        assert r.config == c and r.mode is RefreshMode.ROLLING
        r.close()
