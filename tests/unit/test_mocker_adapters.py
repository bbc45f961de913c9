"""The mocker's simulated LoRA adapters (rlfleet.mocker.adapters) in one process: tokens
through an adapter differ from the base and from another version, the same on every engine;
a request finishes on the version it started on; bad adapters and flags are refused by
name with nothing changed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rlfleet.mocker.adapters import parse_lora_modules
from rlfleet.mocker.engine import MockEngine
from rlfleet.models import make_adapter
from rlfleet.protocol.engine import GenerateRequest, SamplingOptions, Step
from rlfleet.weights.digest import checkpoint_digest
from rlfleet.worker.engine import BadRequest, UnknownAdapter


@pytest.fixture(scope="module")
def ads(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mock-adapters")
    return {"a1": make_adapter(root / "a1", rank=4, seed=1),
            "a2": make_adapter(root / "a2", rank=4, seed=2),
            "r32": make_adapter(root / "r32", rank=32, seed=3)}


def request(rid: str, adapter: str | None = None, n: int = 8) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_token_ids=[1000, 1001, 1002],
                           adapter=adapter, sampling=SamplingOptions(
                               max_tokens=n, ignore_eos=True, seed=3))


async def generate(e: MockEngine, req: GenerateRequest) -> tuple[list[int], list[dict]]:
    ids, spans = [], []
    async for ev in e.generate(req, list(req.prompt_token_ids)):
        for c in ev.choices if type(ev) is Step else ():
            ids += c.token_ids
            # as the frame carries them
            spans = [s.to_dict() for s in c.weight_versions or ()] or spans
    return ids, spans


def test_adapter_tokens_depend_on_its_digest_only(ads):
    async def main():
        one = MockEngine(enable_lora=True, lora_modules=[f"x={ads['a1']}"])
        two = MockEngine(enable_lora=True, max_loras=2)
        await one.start()
        await two.load_adapter("x", ads["a1"], "v1", 1)
        base, _ = await generate(one, request("b"))
        x1, spans = await generate(one, request("x", "x"))
        assert x1 != base and (await generate(two, request("x", "x")))[0] == x1
        assert spans == [{"version": None, "digest": checkpoint_digest(ads["a1"]),
                          "step": None, "adapter": "x", "start": 0, "end": 8}]
        policy, replaced = await one.load_adapter("x", ads["a2"], "v2", 2,
                                                  checkpoint_digest(ads["a2"]))
        assert (policy.adapter, policy.version, policy.step, replaced) == ("x", "v2", 2, None)
        x2, _ = await generate(one, request("x2", "x"))
        assert x2 not in (x1, base)
        assert (await generate(one, request("b2")))[0] == base  # the base never moved
    asyncio.run(main())


def test_a_request_finishes_on_the_version_it_started_on(ads):
    async def main():
        e = MockEngine(enable_lora=True, token_delay=0.01)
        await e.load_adapter("x", ads["a1"], "v1", 1)
        running = asyncio.ensure_future(generate(e, request("r", "x", n=30)))
        await asyncio.sleep(0.05)
        assert e.request_policy(request("r", "x")).version == "v1"
        await e.load_adapter("x", ads["a2"], "v2", 2)
        assert e.request_policy(request("new", "x")).version == "v2"
        _, spans = await running
        assert {s["version"] for s in spans} == {"v1"}
    asyncio.run(main())


def test_bad_adapters_and_flags_are_refused_by_name(ads, tmp_path):
    async def main():
        e = MockEngine(enable_lora=True, max_loras=1, served_model_name="base")
        await e.load_adapter("x", ads["a1"], "v1", 1)
        with pytest.raises(BadRequest, match="--max-lora-rank 16"):
            await e.load_adapter("x", ads["r32"], "v9", 9)
        with pytest.raises(BadRequest, match="not blake3:nope as expected"):
            await e.load_adapter("x", ads["a2"], "v9", 9, "blake3:nope")
        with pytest.raises(BadRequest, match="--max-loras"):
            await e.load_adapter("y", ads["a2"], "v1", 1)
        with pytest.raises(BadRequest, match="is not a LoRA adapter"):
            await e.load_adapter("x", tmp_path, "v9", 9)
        with pytest.raises(BadRequest, match="base model's name"):
            await e.load_adapter("base", ads["a2"], "v1", 1)
        assert [(s.policy.adapter, s.policy.version) for s in e.adapters()] == [("x", "v1")]
        with pytest.raises(UnknownAdapter, match="no LoRA adapter 'nope'"):
            await generate(e, request("n", "nope"))
        with pytest.raises(UnknownAdapter, match="--enable-lora"):
            await generate(MockEngine(), request("n", "x"))
        with pytest.raises(BadRequest, match="--enable-lora"):
            await MockEngine().load_adapter("x", ads["a1"], "v1", 1)
    asyncio.run(main())
    with pytest.raises(ValueError, match="needs --enable-lora"):
        MockEngine(lora_modules=[f"x={ads['a1']}"])
    with pytest.raises(ValueError, match=f"--lora-modules x={tmp_path}/no: lora_path"):
        MockEngine(enable_lora=True, lora_modules=[f"x={tmp_path}/no"])
    assert parse_lora_modules(["a=/p", '{"name": "b", "path": "/q"}']) == [("a", "/p"),
                                                                            ("b", "/q")]
    for bad in ("a", "=p", '{"name": "b"}', "{nope"):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules([bad])
