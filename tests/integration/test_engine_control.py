"""The engine-control interface under the admin, in process: installing tensors staged in
host memory (what the weight-staging routes call) on the real vLLM engine and on the mocker.
The HTTP routes over the same admin are tested in test_control_plane.py (vLLM) and
test_mocker_admin.py (mocker)."""

from __future__ import annotations

import shutil
from typing import Any

import msgspec
import pytest
import torch

from rlfleet.mocker.engine import SEED_TENSOR, MockEngine
from rlfleet.refresh.probe import reference_probe
from rlfleet.vllm.args import parse_args
from rlfleet.vllm.engine import VllmEngine
from rlfleet.weights.digest import checkpoint_digest, iter_checkpoint_tensors
from rlfleet.worker.admin import EngineAdmin
from tests.engines import PROMPT, greedy
from tests.fleets import VLLM_FLAGS

pytestmark = pytest.mark.engine


async def installed(admin: EngineAdmin, *args: Any, **kw: Any) -> dict:
    """install_tensors' reply as JSON."""
    return msgspec.to_builtins(await admin.install_tensors(*args, **kw))


async def test_vllm_installs_staged_tensors(tmp_path, tiny_model, tiny_model_b) -> None:
    a = shutil.copytree(tiny_model, tmp_path / "A")
    engine = VllmEngine(parse_args(["--model", str(a), *VLLM_FLAGS, "--no-warmup"]))
    await engine.start()
    admin = EngineAdmin(engine)
    try:
        before = await greedy(engine)
        staged = dict(iter_checkpoint_tensors(tiny_model_b))
        out = await installed(admin, staged, "B")
        assert out == {"status": "error",
                       "message": "generation is not paused: call pause_generation first"}
        await engine.pause("wait")
        wrong = {**staged, "model.norm.weight": torch.ones(3)}
        out = await installed(admin, wrong, "B")
        assert out["status"] == "error" and "do not fit the served model" in out["message"]
        assert "still serving" in out["message"]
        assert engine.applied().policy.digest == checkpoint_digest(a)  # nothing changed

        out = await installed(admin, staged, "B", step=7)
        assert out == {"status": "ok", "version": "B", "version_declared": True,
                       "weight_digest": checkpoint_digest(tiny_model_b), "step": 7}
        assert engine.serving_policy().stamped() == {"weight_version": "B", "weight_step": 7,
                                            "weight_digest": checkpoint_digest(tiny_model_b)}
        await engine.resume()
        ref = reference_probe(tiny_model_b, PROMPT, 8)
        ids, lps = await greedy(engine)
        assert ids == ref.token_ids and ids != before[0]
        assert max(abs(x - y) for x, y in zip(lps, ref.logprobs, strict=True)) < 1e-4
        # weights from memory cannot be re-read; a checkpoint on disk can be loaded again
        assert engine.weights_path is None
        await engine.pause("wait")
        assert await engine.load_path(a) == checkpoint_digest(a)
        await engine.resume()
        assert await greedy(engine) == before
    finally:
        await engine.shutdown()


async def test_mocker_installs_staged_tensors() -> None:
    engine = MockEngine(seed=1)
    admin = EngineAdmin(engine)
    await engine.pause("wait")
    out = await installed(admin, {"w": torch.zeros(2)}, "v")
    assert out["status"] == "error" and SEED_TENSOR in out["message"]
    assert await installed(admin, {SEED_TENSOR: torch.tensor([5])}, "v5") == {
        "status": "ok", "version": "v5", "version_declared": True, "weight_digest": "mock:5",
        "step": None}
    assert engine.serving_policy().stamped() == {"weight_version": "v5", "weight_digest": "mock:5",
                                        "weight_step": None}
