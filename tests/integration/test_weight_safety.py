"""Weight swaps on the real engine never leave a poisoned or dead worker open to rollouts
(issue 10 findings 2 and 3): the admin routes over one vLLM engine in this process, its
admission published in a real discovery store, generation checked against a transformers
forward pass.

- non-finite weights are refused before the model is touched (from disk, staged tensors);
- finite weights that produce NaN fail the worker's own self-check: the worker holds itself
  closed (discovery, liveness, set_admission), and restoring the good checkpoint restores
  its greedy output exactly (the KV cache memory the bad weights wrote is cleared);
- a load that fails half-way when the previous weights cannot be re-read leaves a worker
  whose liveness says it cannot serve and that stays closed until a load succeeds.
"""

from __future__ import annotations

import asyncio
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio
from safetensors.torch import save_file

from rlfleet.protocol.admin import ROUTES, read_request
from rlfleet.protocol.admin_vllm import AdmissionRequest
from rlfleet.refresh.probe import reference_probe
from rlfleet.runtime.discovery import FileDiscovery
from rlfleet.vllm.args import parse_args
from rlfleet.vllm.engine import VllmEngine
from rlfleet.weights.digest import checkpoint_digest, iter_checkpoint_tensors
from rlfleet.weights.stage_transfer import StageState
from rlfleet.weights.staging import StagingArea
from rlfleet.worker.admin import EngineAdmin
from rlfleet.worker.admission import FIELDS as ADMISSION_FIELDS
from tests.engines import PROMPT, greedy
from tests.fleets import VLLM_FLAGS


async def served(admin: EngineAdmin, route: str, body: dict | None = None) -> dict:
    """Run the route's handler on `body` as the system server does; the reply as JSON."""
    request = read_request(ROUTES[route], body or {})
    return msgspec.to_builtins(await getattr(admin, route)(request))

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="module")]


def variant(src: Path, dst: Path, edit) -> Path:
    """A copy of checkpoint `src` at `dst` with its tensors edited in place by `edit`."""
    shutil.copytree(src, dst)
    tensors = {k: v.clone() for k, v in iter_checkpoint_tensors(src)}
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def with_nan(t: dict) -> None:
    t["model.layers.0.mlp.down_proj.weight"][0, 0] = float("nan")


def overflowing(t: dict) -> None:
    """Finite, but V overflows to infinity: attention turns it into NaN, in the KV cache."""
    t["model.layers.0.self_attn.v_proj.weight"][0, :] = 3e38


@dataclass
class Worker:
    engine: VllmEngine
    admin: EngineAdmin
    discovery: FileDiscovery
    root: Path

    async def entry(self) -> dict:
        (e,) = await self.discovery.list()
        return e

    async def admission_open(self) -> dict:
        """What a coordinator's set_admission(open) gets."""
        return msgspec.to_builtins(
            await self.admin.admission.set_admission(AdmissionRequest(open=True)))

    async def paused(self, route: str, body: dict) -> dict:
        await self.engine.pause("wait")
        return await served(self.admin, route, body)

    async def greedy_matches(self, checkpoint: Path) -> None:
        ref = reference_probe(checkpoint, PROMPT, 8)
        ids, lps = await greedy(self.engine)
        assert ids == ref.token_ids
        assert max(abs(a - b) for a, b in zip(lps, ref.logprobs, strict=True)) < 1e-4


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def worker(tmp_path_factory, tiny_model, tiny_model_b):
    root = tmp_path_factory.mktemp("safety-weights")
    a = shutil.copytree(tiny_model, root / "A")
    shutil.copytree(tiny_model_b, root / "B")
    variant(tiny_model, root / "nan", with_nan)
    variant(tiny_model, root / "overflow", overflowing)
    engine = VllmEngine(parse_args(["--model", str(a), *VLLM_FLAGS, "--no-warmup",
                                    "--worker-extension-cls",
                                    "tests.faulty_extension.FaultyExtension"]))
    await engine.start()
    discovery = FileDiscovery(str(tmp_path_factory.mktemp("safety-discovery")))
    try:
        admin = EngineAdmin(engine, [str(root)])
        reg = await discovery.register({"namespace": "t", "component": "backend",
                                        "endpoint": "generate", "instance_id": 1}, ttl=60)
        async def publish() -> None:  # as the worker does: its entry from the current state
            await reg.update({**{k: v for k, v in reg.entry.items()
                                 if k not in ADMISSION_FIELDS}, **admin.admission.fields()})
        await admin.admission.attach(publish)
        yield Worker(engine, admin, discovery, root)
    finally:
        await discovery.close()
        await engine.shutdown()


async def test_non_finite_weights_are_refused_before_install(worker):
    a = worker.root / "A"
    digest = worker.engine.applied().policy.digest
    try:
        out = await worker.paused("update_weights_from_disk",
                                  {"model_path": str(worker.root / "nan"), "weight_version": "x"})
        assert out["status"] == "error", out
        assert "NaN" in out["message"] and "nothing was changed" in out["message"], out
        staged = dict(iter_checkpoint_tensors(a))
        staged["model.norm.weight"] = staged["model.norm.weight"].clone()
        staged["model.norm.weight"][3] = math.inf
        out = msgspec.to_builtins(await worker.admin.install_tensors(staged, "y"))
        assert out["status"] == "error" and "infinite" in out["message"], out
    finally:
        assert (await served(worker.admin, "resume_generation"))["status"] == "ok"
    assert worker.engine.applied().policy.digest == digest == checkpoint_digest(a)
    assert (await worker.entry())["gated"] is False
    await worker.greedy_matches(a)


async def test_weights_that_produce_nan_close_the_worker_and_restoring_restores(worker):
    a = worker.root / "A"
    out = await worker.paused("update_weights_from_disk",
                              {"model_path": str(worker.root / "overflow"), "weight_version": "o"})
    assert out["status"] == "ok", out  # finite: nothing to refuse before the install
    assert (await worker.entry())["gated"] is True  # closed until the self-check passes
    out = await served(worker.admin, "resume_generation")
    assert out["status"] == "error" and "self-check" in out["message"], out
    entry = await worker.entry()
    assert entry["gated"] is True and "non-finite" in entry["weights_uncertain"], entry
    live = await served(worker.admin, "liveness_probe")
    assert live["status"] == "error" and "non-finite" in live["weights_uncertain"], live
    refused = await worker.admission_open()
    assert refused["status"] == "error" and "holds itself closed" in refused["message"]

    out = await worker.paused("update_weights_from_disk",
                              {"model_path": str(a), "weight_version": "A"})
    assert out["status"] == "ok" and out["weight_digest"] == checkpoint_digest(a), out
    assert (await served(worker.admin, "resume_generation"))["status"] == "ok"
    assert (await worker.entry())["gated"] is False
    assert await served(worker.admin, "liveness_probe") == {"status": "ok", "alive": True}
    await worker.greedy_matches(a)  # what the restored digest certifies is what is served


async def test_a_half_done_load_without_the_previous_weights_keeps_the_worker_closed(worker):
    a, b = worker.root / "A", shutil.copytree(worker.root / "B", worker.root / "B-gone")
    out = await worker.paused("update_weights_from_disk", {"model_path": str(b)})
    assert out["status"] == "ok", out
    assert (await served(worker.admin, "resume_generation"))["status"] == "ok"
    await worker.greedy_matches(b)
    shutil.rmtree(b)  # the previous checkpoint is gone: a failed load cannot be undone

    await worker.engine.pause("wait")
    await worker.engine._rpc("fault_fail_next_load", 30, 5)
    out = await served(worker.admin, "update_weights_from_disk", {"model_path": str(a)})
    assert out["status"] == "error" and "replace this worker" in out["message"], out
    entry = await worker.entry()
    assert entry["gated"] is True and "weights uncertain" in entry["weights_uncertain"], entry
    # no identity for weights that are part of each (it reported b's digest: issue 43)
    said = await served(worker.admin, "get_weight_version")
    assert said.get("weight_digest") is None and said.get("version") is None, said
    assert entry.get("weight_digest") is None, entry
    live = await served(worker.admin, "liveness_probe")
    assert live["status"] == "error" and live["alive"] is False, live  # it cannot serve
    assert "hold no data" in live["message"], live
    assert (await worker.admission_open())["status"] == "error"

    out = await served(worker.admin, "update_weights_from_disk", {"model_path": str(a)})
    assert out["status"] == "ok", out
    assert (await served(worker.admin, "resume_generation"))["status"] == "ok"
    assert (await worker.entry())["gated"] is False
    await worker.greedy_matches(a)


async def test_staged_versions_are_swapped_in_between_in_place_loads(worker, tmp_path):
    """A staged version is reloaded into a shadow of the model while the engine serves and
    swapped in when applied (rlfleet.vllm.shadow); in-place loads before and after it leave
    both paths exact (vLLM's per-layer reload state is the shadow's own)."""
    a, b = worker.root / "A", worker.root / "B"
    area = StagingArea(tmp_path / "staging", allowed_roots=[str(worker.root)], engine=worker.engine)
    admin = EngineAdmin(worker.engine, [str(worker.root)], staging=area)

    async def staged(path: Path) -> None:
        out = await served(admin, "stage_weights", {"version": path.name,
                                                    "source": {"kind": "disk", "path": str(path)}})
        h = area.get(out["handle"])
        await asyncio.wait_for(h.done.wait(), 120)
        assert h.state is StageState.READY and h.prepared == "swap", h.summary()
        await worker.engine.pause("wait")
        out = await served(admin, "apply_staged_weights", {"handle": h.handle})
        assert out["status"] == "ok" and out["weight_digest"] == checkpoint_digest(path), out
        assert (await served(admin, "resume_generation"))["status"] == "ok"
        await worker.greedy_matches(path)

    try:
        await staged(b)
        out = await worker.paused("update_weights_from_disk", {"model_path": str(a)})
        assert out["status"] == "ok", out
        assert (await served(worker.admin, "resume_generation"))["status"] == "ok"
        await worker.greedy_matches(a)
        await staged(b)
    finally:
        await area.close()
        if worker.engine.applied().policy.digest != checkpoint_digest(a):
            await worker.paused("update_weights_from_disk", {"model_path": str(a)})
        await served(worker.admin, "resume_generation")


async def test_a_checkpoint_staged_straight_into_the_engine_is_checked_as_it_loads(worker,
                                                                                   tmp_path):
    """A checkpoint on the worker's disk is read once, straight into the engine's shadow,
    each tensor checked as the loader takes it: one holding a NaN fails its staging (nothing
    copied into the staging area, the live weights untouched). The engine says whether a
    shadow fits beside the live model (a petabyte does not)."""
    a = worker.root / "A"
    area = StagingArea(tmp_path / "staging", allowed_roots=[str(worker.root)], engine=worker.engine)
    admin = EngineAdmin(worker.engine, [str(worker.root)], staging=area)
    try:
        out = await served(admin, "stage_weights", {
            "version": "nan", "source": {"kind": "disk", "path": str(worker.root / "nan")}})
        h = area.get(out["handle"])
        await asyncio.wait_for(h.done.wait(), 120)
        assert h.state is StageState.FAILED and "NaN" in h.error, h.summary()
        assert list(area.root.iterdir()) == []  # read in place, never copied
        assert worker.engine.applied().policy.digest == checkpoint_digest(a)
        await worker.greedy_matches(a)
        assert await worker.engine._rpc("rlfleet_shadow_room", 30, 1) is None
        why = await worker.engine._rpc("rlfleet_shadow_room", 30, 10**15)
        assert "shadow copy of the weights needs" in why, why
    finally:
        await area.close()
